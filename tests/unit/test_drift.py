"""Per-row drift between a candidate's and a baseline's outputs: cosine, top-1 agreement, differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from python_backends.common.drift import (
    DIFF_BUCKETS,
    MEASURE_SERIES,
    SHADOW_HISTOGRAMS,
    DriftMeasure,
    drift_rows,
)


def test_cosine_of_each_row_pair_matches_the_routers():
    rng = np.random.default_rng(0)
    served = rng.standard_normal((6, 384)).astype(np.float32)
    other = served + rng.normal(0, 0.1, served.shape).astype(np.float32)
    rows = drift_rows(DriftMeasure.COSINE, served, other)
    assert list(rows) == ["cosine"]
    assert rows["cosine"].dtype == np.float64 and rows["cosine"].shape == (6,)
    expected = [a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in zip(served, other, strict=True)]
    np.testing.assert_allclose(rows["cosine"], expected, rtol=1e-5)
    np.testing.assert_allclose(drift_rows("cosine", served, 3 * served)["cosine"], np.ones(6), rtol=1e-5)
    assert drift_rows("cosine", np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[1.0, 1.0], [0.0, -3.0]]))[
        "cosine"] == pytest.approx([math.sqrt(0.5), -1.0])


def test_cosine_of_identical_rows_is_one_and_never_past_it():
    rows = np.array([[0.1, 0.2, 0.3], [1e-3, 7.0, -2.5]], dtype=np.float32)
    assert np.all(drift_rows("cosine", rows, rows.copy())["cosine"] == 1.0)  # 1.0 is the last bucket edge


def test_zero_embeddings():
    zero, one = np.zeros((1, 4)), np.ones((1, 4))
    assert drift_rows("cosine", zero, zero)["cosine"].tolist() == [1.0]  # the same output
    assert drift_rows("cosine", zero, one)["cosine"].tolist() == [0.0]
    assert drift_rows("cosine", one, zero)["cosine"].tolist() == [0.0]


def test_top1_agreement_and_largest_logit_difference_per_row():
    served = np.array([[2.0, 1.0, 0.0], [0.1, 0.3, 0.2], [5.0, -1.0, 4.9]])
    other = np.array([[1.5, 1.0, 0.2], [0.3, 0.1, 0.2], [4.8, -1.0, 5.0]])
    rows = drift_rows(DriftMeasure.TOP1, served, other)
    assert list(rows) == ["top1_agreement", "max_logit_diff"] == list(MEASURE_SERIES[DriftMeasure.TOP1])
    assert rows["top1_agreement"].tolist() == [1.0, 0.0, 0.0]
    assert rows["max_logit_diff"] == pytest.approx([0.5, 0.2, 0.2])


@pytest.mark.parametrize("shape", [(4,), (4, 1)])
def test_one_score_per_row_is_a_binary_classifier_whose_class_is_the_sign(shape):
    served = np.array([0.3, -0.1, 2.0, -4.0]).reshape(shape)
    other = np.array([0.1, 0.2, 2.5, -3.0]).reshape(shape)
    rows = drift_rows("top1", served, other)
    assert rows["top1_agreement"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert rows["max_logit_diff"] == pytest.approx([0.2, 0.3, 0.5, 1.0])


def test_abs_diff_is_the_largest_difference_over_every_output_of_a_row():
    served = np.zeros((2, 3, 4), dtype=np.float16)
    other = served.copy()
    other[0, 2, 3] = -0.25
    other[1, 0, 0], other[1, 1, 1] = 0.5, 2.0
    rows = drift_rows(DriftMeasure.ABS_DIFF, served, other)
    assert list(rows) == ["max_abs_diff"]
    assert rows["max_abs_diff"].tolist() == [0.25, 2.0]


def test_integer_outputs_do_not_wrap():
    served, other = np.array([[0], [200]], dtype=np.uint8), np.array([[255], [10]], dtype=np.uint8)
    assert drift_rows("abs_diff", served, other)["max_abs_diff"].tolist() == [255.0, 190.0]


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("served", "other", "cosine", "agreement", "diff"),
    [
        ([NAN, 1.0], [NAN, 1.0], 1.0, 1.0, 0.0),  # the same, NaN in the same place
        ([NAN, 1.0], [0.0, 1.0], -1.0, 0.0, INF),  # a NaN on one side: the worst of every series
        ([0.0, 1.0], [NAN, NAN], -1.0, 0.0, INF),
        ([INF, 0.0], [INF, 0.0], 1.0, 1.0, 0.0),  # the same infinity
        ([INF, 0.0], [INF, 1.0], -1.0, 1.0, 1.0),  # infinities have an order
        ([INF, 0.0], [-INF, 0.0], -1.0, 0.0, INF),
        ([1.0, 0.0], [INF, 0.0], -1.0, 1.0, INF),
    ],
)
def test_non_finite_outputs(served, other, cosine, agreement, diff):
    a, b = np.array([served]), np.array([other])
    assert drift_rows("cosine", a, b)["cosine"].tolist() == [cosine]
    top1 = drift_rows("top1", a, b)
    assert top1["top1_agreement"].tolist() == [agreement]
    assert top1["max_logit_diff"].tolist() == [diff]
    assert drift_rows("abs_diff", a, b)["max_abs_diff"].tolist() == [diff]


def test_no_rows_give_empty_series():
    for measure in DriftMeasure:
        rows = drift_rows(measure, np.zeros((0, 3)), np.zeros((0, 3)))
        assert list(rows) == list(MEASURE_SERIES[measure])
        assert all(values.shape == (0,) for values in rows.values())


@pytest.mark.parametrize(
    ("served", "other", "message"),
    [
        (np.zeros((2, 384)), np.zeros((2, 256)), r"output shapes differ: served \(2, 384\), baseline \(2, 256\)"),
        (np.zeros((3, 4)), np.zeros((2, 4)), r"served \(3, 4\), baseline \(2, 4\)"),
        (np.float32(1.0), np.float32(1.0), "outputs need a row axis, got scalars"),
        (np.zeros((2, 0)), np.zeros((2, 0)), r"outputs of shape \(2, 0\) have no values per row"),
    ],
)
def test_bad_outputs_are_refused(served, other, message):
    with pytest.raises(ValueError, match=message):
        drift_rows(DriftMeasure.COSINE, served, other)


def test_an_unknown_measure_is_refused():
    with pytest.raises(ValueError, match="'l2' is not a valid DriftMeasure"):
        drift_rows("l2", np.zeros((1, 2)), np.zeros((1, 2)))


def test_every_series_has_one_histogram_named_for_the_router():
    series = [name for names in MEASURE_SERIES.values() for name in names]
    assert sorted(series) == sorted(SHADOW_HISTOGRAMS)
    for name, (metric, help_text, edges) in SHADOW_HISTOGRAMS.items():
        assert metric == f"embed_shadow_{name}" and help_text
        assert list(edges) == sorted(set(edges))
    # The cosine series is the router's existing one, with its edges.
    assert SHADOW_HISTOGRAMS["cosine"][0] == "embed_shadow_cosine"
    assert SHADOW_HISTOGRAMS["cosine"][2] == (0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)
    assert SHADOW_HISTOGRAMS["top1_agreement"][2] == (0.5, 1.0)
    assert (DIFF_BUCKETS[0], DIFF_BUCKETS[-1]) == (1e-4, 10.0)
    ratios = np.diff(np.log10(DIFF_BUCKETS))
    assert ratios.min() > 0.2 and ratios.max() < 0.45  # log-spaced: 1, 2.5, 5 per decade
