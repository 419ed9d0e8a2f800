"""How far a candidate version's outputs are from the baseline's on the same rows, per model kind.

During a canary rollout the router repeats a sample of the candidate's rows on the baseline
("shadowing") and observes, per row, how far apart the two answers are. What "far" means
depends on what the model returns, so the measure is chosen by the model's kind:

- `cosine` (text encoders): the cosine of the two embeddings of a row.
- `top1` (classifiers): whether the two agree on the row's class (1.0 or 0.0), and the largest
  absolute difference between their logits. A row of one logit is a binary classifier's: its
  class is `logit > 0`, so a score model is judged on the side of zero its score falls and on
  how far the score moved.
- `abs_diff` (tensor models): the largest absolute difference over all the row's outputs.

`drift_rows` gives the per-row values by series name; each series is one router histogram
(`SHADOW_HISTOGRAMS`: metric name, help text, bucket edges), which `tools.planning.rollout`
reads back to judge the candidate. Rows are the first axis; any further axes are flattened.

Non-finite outputs: two elements are the same when they are equal, both NaN, or the same
infinity. A row pair that differs where either side is NaN or infinite scores the worst value
of every series: cosine -1, agreement 0, difference +inf (counted in the histogram's +Inf
bucket, past every finite edge, so a tolerance gate fails). A row pair that is the same
everywhere scores the best (cosine 1, agreement 1, difference 0), NaNs included, and so does a
pair of identical all-zero embeddings, whose cosine is otherwise undefined. An all-zero
embedding against a non-zero one has cosine 0.

Numpy only, no Triton imports, no I/O.
"""

from __future__ import annotations

import math
from enum import StrEnum

import numpy as np


class DriftMeasure(StrEnum):
    """What the drift gate compares, chosen by the model's kind."""

    COSINE = "cosine"  # embeddings
    TOP1 = "top1"  # classifier logits (or one score per row)
    ABS_DIFF = "abs_diff"  # any tensor outputs


# The router's histograms of shadowed rows (labels model, baseline, candidate), by series name:
# (metric name, help text, finite bucket upper edges).
COSINE_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)  # fine near 1
AGREEMENT_BUCKETS = (0.5, 1.0)  # rows are 0 or 1: the first bucket counts disagreements
# Log-spaced, 1-2.5-5 per decade from 1e-4 to 10. The gate reads a largest difference as the
# upper edge of the highest non-empty bucket, so a limit is judged at the edge at or below it.
DIFF_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SHADOW_HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "cosine": ("embed_shadow_cosine",
               "Cosine between the candidate's and the baseline's embedding of shadowed rows", COSINE_BUCKETS),
    "top1_agreement": ("embed_shadow_top1_agreement",
                       "Whether the candidate's and the baseline's top class of a shadowed row agree (1) or not (0)",
                       AGREEMENT_BUCKETS),
    "max_logit_diff": ("embed_shadow_max_logit_diff",
                       "Largest absolute difference between the candidate's and the baseline's logits of a "
                       "shadowed row", DIFF_BUCKETS),
    "max_abs_diff": ("embed_shadow_max_abs_diff",
                     "Largest absolute difference between the candidate's and the baseline's outputs of a "
                     "shadowed row", DIFF_BUCKETS),
}
# The series each measure observes, in the order `drift_rows` returns them.
MEASURE_SERIES: dict[DriftMeasure, tuple[str, ...]] = {
    DriftMeasure.COSINE: ("cosine",),
    DriftMeasure.TOP1: ("top1_agreement", "max_logit_diff"),
    DriftMeasure.ABS_DIFF: ("max_abs_diff",),
}


def drift_rows(measure: DriftMeasure, served: np.ndarray, other: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row drift between the outputs `served` (the candidate's) and `other` (the baseline's)
    of the same rows: series name -> float64 array of one value per row. The shapes must match,
    with rows on the first axis."""
    served, other = np.asarray(served), np.asarray(other)
    if served.shape != other.shape:
        raise ValueError(f"output shapes differ: served {served.shape}, baseline {other.shape}")
    if served.ndim == 0:
        raise ValueError("outputs need a row axis, got scalars")
    per_row = math.prod(served.shape[1:])
    if not per_row:
        raise ValueError(f"outputs of shape {served.shape} have no values per row")
    a = served.reshape(len(served), per_row).astype(np.float64)
    b = other.reshape(len(other), per_row).astype(np.float64)
    measure = DriftMeasure(measure)
    if measure is DriftMeasure.COSINE:
        return {"cosine": _cosines(a, b)}
    if measure is DriftMeasure.TOP1:
        return {"top1_agreement": _agreement(a, b), "max_logit_diff": _max_diff(a, b)}
    return {"max_abs_diff": _max_diff(a, b)}


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise: equal, both NaN, or the same infinity."""
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _max_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    diff = np.where(_same(a, b), 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)  # differs where a side is NaN, or opposite infinities
    return diff.max(axis=1, initial=0.0)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    finite = np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1)
    a0, b0 = np.where(finite[:, None], a, 0.0), np.where(finite[:, None], b, 0.0)
    norms = np.linalg.norm(a0, axis=1) * np.linalg.norm(b0, axis=1)
    dots = np.sum(a0 * b0, axis=1)
    cosines = np.clip(np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0), -1.0, 1.0)
    cosines = np.where(finite, cosines, -1.0)
    return np.where(_same(a, b).all(axis=1), 1.0, cosines)


def _agreement(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape[1] == 1:  # one logit: a binary classifier's, class = logit > 0
        top_a, top_b = a[:, 0] > 0, b[:, 0] > 0
    else:
        top_a, top_b = a.argmax(axis=1), b.argmax(axis=1)
    agree = top_a == top_b
    # NaN has no order: a row with one agrees only when the two rows are the same.
    has_nan = np.isnan(a).any(axis=1) | np.isnan(b).any(axis=1)
    agree = np.where(has_nan, _same(a, b).all(axis=1), agree)
    return agree.astype(np.float64)
