"""The engine's linear layers: weights packed for oneDNN give what `F.linear` gives, at any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from python_backends.llm.model import PACK_BATCH_HINT, DenseWeight, onednn_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(96, 40, generator=torch.Generator().manual_seed(0)) * 0.1


def test_unpacked_is_f_linear(weight):
    x = torch.randn(5, 40)
    assert torch.equal(DenseWeight(weight, pack=False)(x), F.linear(x, weight))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, PACK_BATCH_HINT, 3 * PACK_BATCH_HINT + 1])
def test_packed_matches_f_linear_at_any_batch(weight, rows):
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows))
    dense = DenseWeight(weight, pack=True)
    assert dense.weight is None  # the packed copy is the only one kept
    torch.testing.assert_close(dense(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_takes_a_non_contiguous_input(weight):
    x = torch.randn(40, 6).t()  # a transposed view
    torch.testing.assert_close(DenseWeight(weight, pack=True)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
