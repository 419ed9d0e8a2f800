"""The paged KV cache's gathers: the rows of the asked slots, in a buffer reused from one
gather of a kind to the next."""

from __future__ import annotations

import torch

from python_backends.llm.model import ModelShape, PagedCache

SHAPE = ModelShape(num_layers=2, num_kv_heads=3, head_dim=4, vocab_size=10, max_position_embeddings=64,
                   model_type="llama")


def filled_cache() -> PagedCache:
    cache = PagedCache(SHAPE, num_blocks=4, block_size=4, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    return cache


def test_a_gather_returns_the_rows_of_its_slots_in_their_order():
    cache = filled_cache()
    slots = torch.tensor([5, 0, 15, 5])
    torch.testing.assert_close(cache.gather("k", 1, slots), cache.k[1].index_select(0, slots), rtol=0, atol=0)
    torch.testing.assert_close(cache.gather("v", 0, slots), cache.v[0].index_select(0, slots), rtol=0, atol=0)


def test_gathers_reuse_one_buffer_per_kind_growing_it_when_a_larger_one_comes():
    cache = filled_cache()
    large = cache.gather("k", 0, torch.arange(12))
    small = cache.gather("k", 1, torch.tensor([3, 2]))
    assert small.data_ptr() == large.data_ptr()  # the same memory, not a new tensor
    torch.testing.assert_close(small, cache.k[1, [3, 2]], rtol=0, atol=0)
    values = cache.gather("v", 0, torch.tensor([1]))
    assert values.data_ptr() != small.data_ptr()  # keys and values never overwrite each other
    larger = cache.gather("k", 0, torch.arange(16))
    torch.testing.assert_close(larger, cache.k[0], rtol=0, atol=0)
