"""The engine's linear layers: weights packed for oneDNN (float32 or bfloat16) give what
`F.linear` gives at any batch, and projections fused into one GEMM give each projection's own
output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from python_backends.llm.model import PACK_BATCH_HINT, FusedProjections, PackedLinear, onednn_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(96, 40, generator=torch.Generator().manual_seed(0)) * 0.1


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, PACK_BATCH_HINT, 3 * PACK_BATCH_HINT + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_f_linear_at_any_batch(weight, rows, with_bias):
    bias = torch.randn(96) if with_bias else None
    x = torch.randn(1, rows, 40, generator=torch.Generator().manual_seed(rows))  # transformers' [batch, tokens, width]
    torch.testing.assert_close(PackedLinear(weight, bias)(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3 * PACK_BATCH_HINT + 1])
def test_packed_bfloat16_matches_f_linear_in_bfloat16(weight, rows):
    bias = torch.randn(96)
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).bfloat16()
    packed = PackedLinear(weight.bfloat16(), bias)
    got = packed(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x, weight.bfloat16(), bias.bfloat16()), rtol=1.6e-2, atol=1e-2)


def test_packing_refuses_a_dtype_onednn_does_not_pack(weight):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinear(weight.half(), None)


@needs_onednn
def test_packed_takes_a_non_contiguous_input(weight):
    x = torch.randn(40, 6).t()  # a transposed view
    torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_onednn)])
def test_fused_projections_give_each_projection_its_own_output(pack):
    torch.manual_seed(0)
    # Qwen2's shape: query, key and value with biases; a gate/up pair without
    linears = [nn.Linear(40, 64), nn.Linear(40, 16), nn.Linear(40, 16, bias=False)]
    fused = FusedProjections(linears, pack)
    parts = [fused.part(i) for i in range(3)]
    for rows in (1, 5):
        x = torch.randn(1, rows, 40)
        for part, linear in zip(parts, linears, strict=True):
            torch.testing.assert_close(part(x), linear(x), rtol=1e-5, atol=1e-5)


def test_a_new_input_is_computed_again_not_served_from_the_last():
    torch.manual_seed(1)
    linears = [nn.Linear(8, 4), nn.Linear(8, 4)]
    fused = FusedProjections(linears, pack=False)
    first, second = fused.part(0), fused.part(1)
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    first(a)
    torch.testing.assert_close(second(b), linears[1](b))  # not a's slice
    torch.testing.assert_close(first(b), linears[0](b))
