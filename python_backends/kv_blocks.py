"""The KV-cache block manager: the admission constraint of the LLM engine.

The cache is a fixed pool of blocks of `block_size` token slots each, sized from the
memory the engine may use. A sequence holds `ceil(tokens / block_size)` blocks; it grows
one block at a time as it decodes and returns every block when it finishes, is cancelled
or is preempted. Allocation is all-or-nothing and returns `None` when the pool is short:
what to do then (wait, or preempt someone) is the scheduler's decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """Bytes one token's keys and values take in every layer, and the block size."""

    num_layers: int  # transformer layers, each with its own K and V
    num_kv_heads: int  # key/value heads (fewer than query heads under grouped-query attention)
    head_dim: int  # size of one head
    dtype_bytes: int = 4  # bytes per element: 4 for float32, 2 for float16/bfloat16
    block_size: int = 16  # token slots per block

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # 2: keys and values

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def num_blocks_for_budget(spec: KVCacheSpec, memory_budget_bytes: int) -> int:
    """How many whole blocks fit in the memory the engine may spend on the cache."""
    if memory_budget_bytes < spec.bytes_per_block:
        raise ValueError(
            f"a KV-cache budget of {memory_budget_bytes} bytes holds no block of {spec.block_size} tokens "
            f"({spec.bytes_per_block} bytes); raise the budget"
        )
    return memory_budget_bytes // spec.bytes_per_block


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` token slots."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return math.ceil(num_tokens / block_size)


class BlockManager:
    """Hands out block ids from a fixed pool and tracks which sequence holds which."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Lowest ids first, so a fresh pool hands out 0, 1, 2, ... (readable in tests and logs).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}  # seq_id -> its block ids, in token order

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def block_table(self, seq_id: str) -> list[int]:
        """The blocks a sequence holds, in token order (empty if it holds none)."""
        return list(self._tables.get(seq_id, ()))

    def can_hold(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the sequence could grow to `num_tokens` slots from the free pool."""
        return self._missing(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Grow the sequence's table to hold `num_tokens` slots.

        Returns the newly added block ids (empty when it already has room), or `None` with
        nothing allocated when the free pool is too small.
        """
        missing = self._missing(seq_id, num_tokens)
        if missing > len(self._free):
            return None
        added = [self._free.pop() for _ in range(missing)]
        if added or seq_id in self._tables:
            self._tables.setdefault(seq_id, []).extend(added)
        return added

    def free(self, seq_id: str) -> int:
        """Return every block the sequence holds to the pool; the number returned."""
        blocks = self._tables.pop(seq_id, [])
        self._free.extend(reversed(blocks))
        return len(blocks)

    def _missing(self, seq_id: str, num_tokens: int) -> int:
        held = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - held)
