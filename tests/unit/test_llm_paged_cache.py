"""The paged KV cache: writes land in their slots, and a gather returns the slots of the
asked blocks in their order, head by head, in a buffer reused from one gather of a kind to
the next."""

from __future__ import annotations

import torch

from python_backends.llm.model import ModelShape, PagedCache

SHAPE = ModelShape(num_layers=2, num_kv_heads=3, head_dim=4, vocab_size=10, max_position_embeddings=64,
                   model_type="llama")
BLOCK = 4


def filled_cache() -> PagedCache:
    cache = PagedCache(SHAPE, num_blocks=4, block_size=BLOCK, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    return cache


def slots_of(blocks: list[int]) -> torch.Tensor:
    return torch.tensor([block * BLOCK + offset for block in blocks for offset in range(BLOCK)])


def test_a_gather_returns_the_slots_of_its_blocks_in_their_order_for_every_head():
    cache = filled_cache()
    blocks = [1, 0, 3, 1]
    expected_k = cache.k[1].index_select(1, slots_of(blocks))  # [kv_heads, slots, head_dim]
    expected_v = cache.v[0].index_select(1, slots_of(blocks))
    torch.testing.assert_close(cache.gather("k", 1, torch.tensor(blocks)), expected_k, rtol=0, atol=0)
    torch.testing.assert_close(cache.gather("v", 0, torch.tensor(blocks)), expected_v, rtol=0, atol=0)


def test_gathers_reuse_one_buffer_per_kind_growing_it_when_a_larger_one_comes():
    cache = filled_cache()
    large = cache.gather("k", 0, torch.arange(3))
    small = cache.gather("k", 1, torch.tensor([2]))
    assert small.data_ptr() == large.data_ptr()  # the same memory, not a new tensor
    torch.testing.assert_close(small, cache.k[1, :, 8:12], rtol=0, atol=0)
    values = cache.gather("v", 0, torch.tensor([1]))
    assert values.data_ptr() != small.data_ptr()  # keys and values never overwrite each other
    larger = cache.gather("k", 0, torch.arange(4))
    torch.testing.assert_close(larger, cache.k[0], rtol=0, atol=0)


def test_a_write_stores_each_token_s_keys_and_values_at_its_slot_and_nowhere_else():
    cache = filled_cache()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    slots = torch.tensor([13, 2])
    keys = torch.randn(SHAPE.num_kv_heads, 2, SHAPE.head_dim)
    values = torch.randn(SHAPE.num_kv_heads, 2, SHAPE.head_dim)
    cache.write(1, slots, keys, values)
    torch.testing.assert_close(cache.k[1][:, slots], keys, rtol=0, atol=0)
    torch.testing.assert_close(cache.v[1][:, slots], values, rtol=0, atol=0)
    untouched = torch.ones(cache.k.shape, dtype=torch.bool)
    untouched[1, :, slots] = False
    assert torch.equal(cache.k[untouched], before_k[untouched]) and torch.equal(cache.v[untouched], before_v[untouched])
