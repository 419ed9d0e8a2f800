"""The native decode attention (`python_backends.llm.cpu_attention`): each sequence's query
heads attend to its cached keys and values through its block table, as softmax attention in
float32 over the same bfloat16 inputs gives, within bfloat16's rounding of the output; and
the engine's bfloat16 decode step with it gives the logits of its torch attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_backends.llm import cpu_attention
from python_backends.llm.model import PagedCausalLM, StepSequence

KERNEL = cpu_attention.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"no native kernel here: {cpu_attention.load_error}")
BLOCK = 16


def reference(query, keys, values, tables, lengths, window=None):
    """float32 softmax attention of each sequence over its cached positions."""
    num_kv_heads = keys.shape[0]
    out = []
    for s, length in enumerate(lengths.tolist()):
        positions = torch.arange(length)
        if window:
            positions = positions[positions > length - 1 - window]
        slots = tables[s][positions // BLOCK] * BLOCK + positions % BLOCK
        k, v = keys[:, slots].float(), values[:, slots].float()  # [kv_heads, keys, dim]
        q = query[s].float().view(num_kv_heads, -1, query.shape[-1])  # a kv head's query heads together
        probs = torch.softmax(q @ k.transpose(1, 2) * query.shape[-1] ** -0.5, dim=-1)
        out.append((probs @ v).reshape(query.shape[1:]))
    return torch.stack(out)


def scattered(lengths, num_blocks, seed):
    """Block tables over shuffled pool blocks, each padded with block 0 to the longest."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, taken = [], 0
    for length in lengths:
        need = -(-length // BLOCK)
        tables.append(order[taken:taken + need])
        taken += need
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lengths)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (32, 8, 128)])
@pytest.mark.parametrize("window", [None, 20])
def test_the_kernel_is_softmax_attention_over_each_block_table(heads, kv_heads, dim, window):
    generator = torch.Generator().manual_seed(heads * dim)
    lengths = [1, 15, 16, 17, 40, 129, 300]  # within a block, on its edges, and many blocks
    num_blocks = 64
    keys = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator).bfloat16()
    values = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator).bfloat16()
    query = torch.randn(len(lengths), heads, dim, generator=generator).bfloat16()
    tables, lens = scattered(lengths, num_blocks, seed=dim)
    got = KERNEL(query, keys, values, tables, lens, BLOCK, dim ** -0.5, window)
    expected = reference(query, keys, values, tables, lens, window)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=1.6e-2)  # bfloat16: 8 bits of mantissa


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_compute():
    keys = torch.zeros(2, 4 * BLOCK, 64, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="bfloat16"):
        KERNEL(torch.zeros(1, 4, 64), keys.float(), keys.float(), tables, lens, BLOCK, 0.125, None)
    with pytest.raises(ValueError, match="no kernel for 10 heads"):
        KERNEL(torch.zeros(1, 10, 64, dtype=torch.bfloat16), keys, keys, tables, lens, BLOCK, 0.125, None)
    assert not cpu_attention.DecodeKernel.supports(10, 2, 64) and cpu_attention.DecodeKernel.supports(9, 3, 64)


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats():
    """The process's floating-point state is not the kernel's to change (a library built with
    -ffast-math would flush subnormals to zero for every thread once loaded)."""
    smallest = np.nextafter(np.float32(0), np.float32(1))
    assert smallest * np.float32(1.0) > 0 and float(torch.tensor(1e-45) * 1.0) > 0


@needs_kernel
def test_a_built_kernel_is_reused_from_the_cache():
    first = cpu_attention.build()
    built_at = first.stat().st_mtime_ns
    assert cpu_attention.build() == first and first.stat().st_mtime_ns == built_at


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_loaded", None)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert cpu_attention.load() is None and cpu_attention.DISABLE_ENV in cpu_attention.load_error


@needs_kernel
def test_bfloat16_steps_in_the_kernel_give_the_torch_attentions_logits():
    """A small random-weight Llama (grouped-query attention, head width 64): a prefill of three
    prompts of mixed lengths, then a decode step of each: the kernel's logits are the torch
    path's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    model = PagedCausalLM(LlamaForCausalLM(config).to(torch.bfloat16).eval(), num_blocks=64, block_size=BLOCK)
    assert model.decode_kernel is not None
    lengths = (5, 33, 90)
    tables, start = [], 0
    for length in lengths:
        need = -(-(length + 1) // BLOCK)
        tables.append(list(range(start, start + need)))
        start += need
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    prefills = [StepSequence(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    decodes = [StepSequence([7], n, t, True) for n, t in zip(lengths, tables, strict=True)]
    kernel = model.decode_kernel
    for step in (prefills, decodes):  # the prompts attend in the kernel too (each query at its position)
        model.decode_kernel = kernel
        assert len(model._plan_attention(step)) == 1  # every query in the kernel's one call
        with_kernel = model.step(step)
        model.decode_kernel = None
        with_torch = model.step(step)  # rewrites the same keys and values at the same slots
        torch.testing.assert_close(with_kernel, with_torch, rtol=0, atol=0.1)


@needs_kernel
def test_a_cache_shared_with_another_cpu_builds_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path))
    here = cpu_attention.build()
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: "another CPU\nsse2")
    assert cpu_attention.build() != here and len(list(tmp_path.glob("*.so"))) == 2


def test_the_server_log_says_which_attention_decodes(monkeypatch):
    """The note `serve` logs at load: the kernel where it runs, else why not."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64)

    def note(model, dtype=torch.bfloat16) -> str:
        return PagedCausalLM(model.to(dtype).eval(), num_blocks=4, block_size=BLOCK).attention_note

    if KERNEL is not None:
        assert note(LlamaForCausalLM(LlamaConfig(**small))) == "decodes attend in the native CPU kernel"
    assert "soft-caps" in note(Gemma2ForCausalLM(Gemma2Config(**small, attn_logit_softcapping=5.0)))
    assert note(LlamaForCausalLM(LlamaConfig(**small)), torch.float32) == ""  # float32: torch, by design
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert note(LlamaForCausalLM(LlamaConfig(**small))) == \
        f"decodes attend in torch (no native kernel: {cpu_attention.DISABLE_ENV} is set)"
