"""The KV-cache block manager: the admission constraint of the LLM engine.

The cache is a fixed pool of blocks of `block_size` token slots each, sized from the
memory the engine may use. A sequence holds `ceil(tokens / block_size)` blocks; it grows
one block at a time as it decodes and returns every block when it finishes, is cancelled
or is preempted. Allocation is all-or-nothing and returns `None` when the pool is short:
what to do then (wait, or preempt someone) is the scheduler's decision.

Prefix caching: a full block whose keys and values are computed is registered under a hash
of its tokens and of every token before it (a chain over the blocks). A new sequence whose
prompt starts with the same tokens takes those blocks instead of recomputing them: every
chat carries the same system turn, and a preempted sequence finds its own blocks again.
Shared blocks are only read (a sequence computes from the first block it did not match),
so they need no copy. A block nobody holds keeps its contents and its hash until the pool
needs it: free, never-registered blocks go first, then registered ones, least recently
released first (and the tail of a sequence before its head, which more prompts share).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
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


def _chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Identity of a full block: its tokens and, through `parent`, every token before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return digest.digest()


class BlockManager:
    """Hands out block ids from a fixed pool, tracks which sequence holds which, and keeps
    computed full blocks findable by their contents (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Lowest ids first, so a fresh pool hands out 0, 1, 2, ... (readable in tests and logs).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never registered (or evicted)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._hash_of: dict[int, bytes] = {}  # block -> chain hash of its (computed, full) contents
        self._block_of: dict[bytes, int] = {}  # chain hash -> block
        self._tables: dict[str, list[int]] = {}  # seq_id -> its block ids, in token order
        self._registered: dict[str, tuple[int, bytes]] = {}  # seq_id -> (blocks registered, last chain hash)
        self.num_hit_tokens = 0  # since start: prompt tokens not computed thanks to the cache

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose contents are registered (held or not)."""
        return len(self._hash_of)

    def block_table(self, seq_id: str) -> list[int]:
        """The blocks a sequence holds, in token order (empty if it holds none)."""
        return list(self._tables.get(seq_id, ()))

    def can_hold(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the sequence could grow to `num_tokens` slots from the free pool."""
        return self._missing(seq_id, num_tokens) <= self.num_free

    def allocate(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Grow the sequence's table to hold `num_tokens` slots.

        Returns the newly added block ids (empty when it already has room), or `None` with
        nothing allocated when the free pool is too small.
        """
        missing = self._missing(seq_id, num_tokens)
        if missing > self.num_free:
            return None
        added = [self._take_block() for _ in range(missing)]
        for block in added:
            self._refs[block] = 1
        if added or seq_id in self._tables:
            self._tables.setdefault(seq_id, []).extend(added)
        return added

    def match_prefix(self, seq_id: str, token_ids: Sequence[int], max_tokens: int) -> int:
        """Give a sequence that holds no blocks the cached blocks its first `max_tokens` tokens
        start with; returns how many tokens they cover (a multiple of the block size). Keep
        `max_tokens` below the prompt so at least one token is computed: it gives the logits."""
        if not self.prefix_caching or self._tables.get(seq_id):
            return 0
        matched: list[int] = []
        parent = b""  # the chain hash of the matched blocks: the next block registered chains from it
        for start in range(0, max_tokens - self.block_size + 1, self.block_size):
            digest = _chain_hash(parent, token_ids[start:start + self.block_size])
            block = self._block_of.get(digest)
            if block is None:
                break
            matched.append(block)
            parent = digest
        for block in matched:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        if matched:
            self._tables[seq_id] = matched
            self._registered[seq_id] = (len(matched), parent)
            self.num_hit_tokens += len(matched) * self.block_size
        return len(matched) * self.block_size

    def register(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Make the sequence's full blocks among its first `num_computed` tokens findable."""
        if not self.prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        done, parent = self._registered.get(seq_id, (0, b""))
        full = min(num_computed // self.block_size, len(table))
        for index in range(done, full):
            parent = _chain_hash(parent, token_ids[index * self.block_size:(index + 1) * self.block_size])
            block = table[index]
            # Another block may already hold these contents (computed by two sequences at
            # once): keep the first one findable; this one is released as a plain block.
            if block not in self._hash_of and parent not in self._block_of:
                self._hash_of[block] = parent
                self._block_of[parent] = block
        if full > done:
            self._registered[seq_id] = (full, parent)

    def free(self, seq_id: str) -> int:
        """Release every block the sequence holds; the number released. Registered blocks keep
        their contents for the next sequence with the same prefix until the pool needs them."""
        blocks = self._tables.pop(seq_id, [])
        self._registered.pop(seq_id, None)
        for block in reversed(blocks):  # the tail is evicted before the head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        return len(blocks)

    def _take_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def _missing(self, seq_id: str, num_tokens: int) -> int:
        held = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - held)
