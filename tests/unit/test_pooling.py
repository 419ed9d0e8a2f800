"""Pooling a per-token output into one vector per row, checked against torch on the same data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_backends.embed.pooling import Pooling, l2_normalise, pad_axis, pool

RNG = np.random.default_rng(7)
HIDDEN = RNG.standard_normal((3, 5, 4)).astype(np.float32)
RIGHT_PADDED = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
LEFT_PADDED = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])


def test_mean_pooling_is_sentence_transformers_mean_over_real_tokens():
    hidden, mask = torch.from_numpy(HIDDEN), torch.from_numpy(RIGHT_PADDED).unsqueeze(-1).float()
    expected = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    np.testing.assert_allclose(pool(HIDDEN, RIGHT_PADDED, Pooling.MEAN), expected.numpy(), rtol=1e-6)


def test_cls_pooling_takes_the_first_token():
    np.testing.assert_array_equal(pool(HIDDEN, RIGHT_PADDED, Pooling.CLS), HIDDEN[:, 0, :])


@pytest.mark.parametrize("mask", [RIGHT_PADDED, LEFT_PADDED], ids=["right-padded", "left-padded"])
def test_last_pooling_takes_the_last_real_token_on_either_padding_side(mask):
    last = [max(i for i, real in enumerate(row) if real) for row in mask]
    np.testing.assert_array_equal(pool(HIDDEN, mask, Pooling.LAST), HIDDEN[np.arange(3), last, :])


def test_none_passes_a_pooled_output_through():
    pooled = HIDDEN[:, 0, :]
    np.testing.assert_array_equal(pool(pooled, RIGHT_PADDED, Pooling.NONE), pooled)


def test_l2_normalise_matches_torch_and_keeps_a_zero_row_zero():
    vectors = np.vstack([HIDDEN[:, 0, :], np.zeros((1, 4), np.float32)])
    expected = torch.nn.functional.normalize(torch.from_numpy(vectors), dim=1).numpy()
    np.testing.assert_allclose(l2_normalise(vectors), expected, rtol=1e-6)
    assert not l2_normalise(vectors)[-1].any()


def test_shapes_that_do_not_fit_the_pooling_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match=r"pooling .none. needs a pooled output .* got shape \[3, 5, 4\]"):
        pool(HIDDEN, RIGHT_PADDED, Pooling.NONE)
    with pytest.raises(ValueError, match=r"pooling 'mean' needs a per-token output .* got shape \[3, 4\]"):
        pool(HIDDEN[:, 0, :], RIGHT_PADDED, Pooling.MEAN)
    with pytest.raises(ValueError, match=r"attention mask \[3, 4\] does not match .* \[3, 5\]"):
        pool(HIDDEN, RIGHT_PADDED[:, :4], Pooling.MEAN)



def test_a_row_without_real_tokens_pools_like_sentence_transformers():
    """Only a warm-up batch sends one: the mean is a zero vector, `last` the last position."""
    empty = np.zeros((3, 5), int)
    np.testing.assert_array_equal(pool(HIDDEN, empty, Pooling.MEAN), np.zeros((3, HIDDEN.shape[2]), np.float32))
    np.testing.assert_array_equal(pool(HIDDEN, empty, Pooling.LAST), HIDDEN[:, -1, :])


def test_an_unknown_pooling_name_lists_the_known_ones():
    assert Pooling.parse("cls") is Pooling.CLS
    with pytest.raises(ValueError, match=r"unknown pooling 'max'; one of: none, mean, cls, last"):
        Pooling.parse("max")


def test_pad_axis_pads_the_variable_axis_with_the_declared_value_only():
    frames = RNG.standard_normal((2, 80, 37)).astype(np.float32)
    padded = pad_axis(frames, axis=2, length=64, pad_value=-1.0)
    assert padded.shape == (2, 80, 64)
    np.testing.assert_array_equal(padded[:, :, :37], frames)
    assert (padded[:, :, 37:] == -1.0).all()
    assert pad_axis(frames, axis=2, length=37, pad_value=0) is frames
    with pytest.raises(ValueError, match="axis 2 has length 37, over the bucket's 32"):
        pad_axis(frames, axis=2, length=32, pad_value=0)
