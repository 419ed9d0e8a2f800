"""A Llama forward pass over a paged KV cache, for the continuous-batching engine.

One call computes one engine step: the prefill chunks and decode tokens of every scheduled
sequence, flattened into a single token axis for the dense layers (no padding compute where
one sequence prefills 100 tokens and the others decode one). Attention reads each
sequence's cached keys and values from fixed-size blocks through its block table: the
decoding sequences in a few padded calls of similar context lengths, each prefill chunk in
its own. Logits are computed only for the tokens that sample. The weight matrices are
packed once for oneDNN's GEMM where this torch build has it (`DenseWeight`).

The arithmetic follows `transformers`' Llama (RMSNorm in float32, rotate-half RoPE, grouped-
query attention, SwiGLU), so greedy output matches its `generate` for the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaDims:
    """Shape of a Llama model, read from its `config.json`."""

    num_layers: int  # transformer blocks
    hidden_size: int  # model width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when fewer than num_heads)
    head_dim: int  # width of one head
    vocab_size: int  # output logits
    rope_theta: float  # RoPE base
    rms_norm_eps: float  # RMSNorm epsilon
    max_position_embeddings: int  # longest context the model was trained for
    tie_word_embeddings: bool  # lm_head shares the input embedding

    @classmethod
    def from_config(cls, config: Mapping) -> LlamaDims:
        if config.get("model_type") != "llama":
            raise ValueError(f"expected a llama model config, got model_type={config.get('model_type')!r}")
        if config.get("rope_scaling"):
            raise ValueError(f"rope_scaling {config['rope_scaling']!r} is not supported")
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> LlamaDims:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))


@dataclass(frozen=True)
class StepSequence:
    """The tokens one sequence computes in a step, and where its cache lives."""

    token_ids: Sequence[int]  # the tokens computed this step (a prefill chunk, or one decode token)
    start: int  # position of the first of them; positions [0, start) are already cached
    block_table: Sequence[int]  # the sequence's KV blocks in token order, covering start + len(token_ids)
    samples: bool  # whether the step returns logits for its last token


@dataclass(frozen=True)
class _AttentionGroup:
    """Sequences whose attention runs in one call."""

    rows: torch.Tensor  # their query rows in the step's flat token axis
    slots: torch.Tensor  # [sequences, keys]: cache slots of each sequence's context (padded)
    mask: torch.Tensor  # [sequences, 1, queries, keys]: True where a query may attend
    num_queries: int  # queries per sequence: 1 for decodes, the chunk length for a prefill


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# The batch oneDNN lays a packed weight out for; any batch runs on it. Laid out for 64, it
# ran faster than laid out for 1 at every batch from 1 to 300 rows.
PACK_BATCH_HINT = 64


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class DenseWeight:
    """One weight matrix of a linear layer (no bias): `y = x @ weight.T`.

    Packed for oneDNN's float32 GEMM when `pack` is set: on 2 AMD EPYC vCPUs it ran 2-4x
    faster than `F.linear` (MKL) for every batch from 1 to 300 rows, and the output layer
    (49,152 x 576) 4x at 24 rows. Unpacked, it is `F.linear`.
    """

    __slots__ = ("packed", "weight")

    def __init__(self, weight: torch.Tensor, pack: bool):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) if pack else None
        self.weight = None if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


# A decode group costs a few more tensor ops in every layer; a padded key slot costs its
# gather and attention in every layer. Measured on 2 cores, 24 decoding sequences with
# contexts of 50 to 420 tokens: a step took 123 ms in one padded group, 98-103 ms split at
# 256 slots, 104-118 ms at 512, 103 ms at 128 and at 1024.
GROUP_SPLIT_SLOTS = 256


def group_by_length(lengths: Sequence[int], split_slots: int = GROUP_SPLIT_SLOTS) -> list[list[int]]:
    """Decoding sequences (by context length) in attention groups, as lists of indices.

    Every member of a group is padded to its longest context. Taken shortest first, a
    sequence starts a new group when joining the current one would pad its members by more
    than `split_slots` key slots in all; otherwise it joins. One group when the lengths are
    close, a short-chat group and an essay group when they are far apart.
    """
    if split_slots < 0:
        raise ValueError(f"split_slots must be >= 0, got {split_slots}")
    groups: list[list[int]] = []
    longest = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]
        if groups and (length - longest) * len(groups[-1]) <= split_slots:
            groups[-1].append(index)
        else:
            groups.append([index])
        longest = length
    return groups


class PagedLlama:
    """Llama weights plus a block-paged KV cache; `step()` runs one batched forward."""

    def __init__(self, dims: LlamaDims, weights: Mapping[str, torch.Tensor], num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, packed: bool | None = None):
        self.dims = dims
        # None: pack the float32 weights for oneDNN where this torch has it
        self.packed = (dtype == torch.float32 and onednn_available()) if packed is None else packed
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.group_split_slots = GROUP_SPLIT_SLOTS  # decode attention groups (group_by_length)

        def weight(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the model weights have no tensor {name!r}")
            return weights[name].to(dtype).contiguous()

        def dense(*names: str) -> DenseWeight:
            # Several matrices on one input are stacked into one: fewer, larger GEMMs per step.
            return DenseWeight(torch.cat([weight(name) for name in names]), self.packed)

        self.embed = weight("model.embed_tokens.weight")
        self.lm_head = dense("model.embed_tokens.weight" if dims.tie_word_embeddings else "lm_head.weight")
        self.final_norm = weight("model.norm.weight")
        self.layers = []
        for i in range(dims.num_layers):
            p = f"model.layers.{i}."
            self.layers.append((
                weight(p + "input_layernorm.weight"),
                dense(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                dense(p + "self_attn.o_proj.weight"),
                weight(p + "post_attention_layernorm.weight"),
                dense(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                dense(p + "mlp.down_proj.weight"),
            ))
        self.inv_freq = 1.0 / (dims.rope_theta ** (
            torch.arange(0, dims.head_dim, 2, dtype=torch.int64).float() / dims.head_dim))
        # [layer, slot, kv_head, head_dim]; slot = block * block_size + offset in the block
        shape = (dims.num_layers, num_blocks * block_size, dims.num_kv_heads, dims.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)

    @classmethod
    def from_dir(cls, model_dir: Path, num_blocks: int, block_size: int) -> PagedLlama:
        from safetensors.torch import load_file

        dims = LlamaDims.from_dir(model_dir)
        return cls(dims, load_file(str(Path(model_dir) / "model.safetensors")), num_blocks, block_size)

    @property
    def kv_bytes_per_token(self) -> int:
        d = self.dims
        return 2 * d.num_layers * d.num_kv_heads * d.head_dim * self.k_cache.element_size()

    def _slots(self, block_table: Sequence[int], positions: range) -> list[int]:
        bs = self.block_size
        try:
            return [block_table[p // bs] * bs + p % bs for p in positions]
        except IndexError:
            raise ValueError(f"the block table ({len(block_table)} blocks of {bs}) does not cover "
                             f"position {positions[-1]}") from None

    def _plan_attention(self, batch: Sequence[StepSequence], contexts: Sequence[list[int]]) -> list[_AttentionGroup]:
        """Group the step's sequences for attention: decoding sequences (one query each) in
        padded calls of similar context lengths (`group_by_length`), each prefill chunk in a
        call of its own, so no sequence pays for another's query length, and a short chat
        little for a long essay's context."""
        groups: list[_AttentionGroup] = []
        decode_rows, decode_slots, decode_lens = [], [], []
        row = 0
        for seq, slots in zip(batch, contexts, strict=True):
            n = len(seq.token_ids)
            end = seq.start + n
            if n == 1:
                decode_rows.append(row)
                decode_slots.append(slots)
                decode_lens.append(end)
            else:
                # Query j (at position start + j) sees the keys at positions <= start + j.
                causal = torch.arange(end)[None, :] <= (seq.start + torch.arange(n))[:, None]
                groups.append(_AttentionGroup(rows=torch.arange(row, row + n), slots=torch.tensor([slots]),
                                              mask=causal[None, None], num_queries=n))
            row += n
        for members in group_by_length(decode_lens, self.group_split_slots):
            width = max(decode_lens[i] for i in members)
            padded = [decode_slots[i] + [0] * (width - decode_lens[i]) for i in members]  # padding keys are masked
            mask = torch.arange(width)[None, :] < torch.tensor([decode_lens[i] for i in members])[:, None]
            groups.append(_AttentionGroup(rows=torch.tensor([decode_rows[i] for i in members]),
                                          slots=torch.tensor(padded), mask=mask[:, None, None, :], num_queries=1))
        return groups

    @torch.inference_mode()
    def step(self, batch: Sequence[StepSequence]) -> torch.Tensor:
        """Compute one step; returns float32 logits [number of sampling sequences, vocab], in batch order."""
        d = self.dims
        if not batch:
            return torch.empty((0, d.vocab_size))
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        contexts: list[list[int]] = []  # per sequence: the cache slots of positions [0, start + n)
        for seq in batch:
            n = len(seq.token_ids)
            if n == 0:
                raise ValueError("a scheduled sequence computes no tokens")
            contexts.append(self._slots(seq.block_table, range(seq.start + n)))
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start, seq.start + n))
            slots.extend(contexts[-1][seq.start:])
            if seq.samples:
                sample_rows.append(len(token_ids) - 1)
        groups = self._plan_attention(batch, contexts)

        pos = torch.tensor(positions, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(self.dtype)[:, None, :]
        sin = emb.sin().to(self.dtype)[:, None, :]
        slot_index = torch.tensor(slots, dtype=torch.long)
        gqa = d.num_kv_heads != d.num_heads

        q_width = d.num_heads * d.head_dim
        kv_width = d.num_kv_heads * d.head_dim
        hidden = self.embed[torch.tensor(token_ids, dtype=torch.long)]
        for layer, (norm1, qkv_w, o_w, norm2, gate_up_w, down_w) in enumerate(self.layers):
            h = _rms_norm(hidden, norm1, d.rms_norm_eps)
            q, k, v = qkv_w(h).split((q_width, kv_width, kv_width), dim=-1)
            q = q.view(-1, d.num_heads, d.head_dim)
            k = k.view(-1, d.num_kv_heads, d.head_dim)
            v = v.view(-1, d.num_kv_heads, d.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
            k_cache[slot_index] = k
            v_cache[slot_index] = v
            attn = torch.empty_like(q)
            for group in groups:
                # One index_select over the flat slot list per tensor: cheaper than advanced
                # indexing with the 2-D slot index, and the same rows.
                context = (*group.slots.shape, d.num_kv_heads, d.head_dim)
                flat = group.slots.view(-1)
                keys = k_cache.index_select(0, flat).view(context).transpose(1, 2)  # [seqs, kv_heads, keys, head_dim]
                values = v_cache.index_select(0, flat).view(context).transpose(1, 2)
                # [seqs, heads, queries, head_dim]: decodes are one query per sequence; a prefill chunk is one sequence
                queries = q[group.rows].view(-1, group.num_queries, d.num_heads, d.head_dim).transpose(1, 2)
                out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, enable_gqa=gqa)
                attn[group.rows] = out.transpose(1, 2).reshape(-1, d.num_heads, d.head_dim)
            hidden = hidden + o_w(attn.view(-1, q_width))
            h = _rms_norm(hidden, norm2, d.rms_norm_eps)
            gate, up = gate_up_w(h).chunk(2, dim=-1)
            hidden = hidden + down_w(F.silu(gate) * up)

        last = _rms_norm(hidden[torch.tensor(sample_rows, dtype=torch.long)], self.final_norm, d.rms_norm_eps)
        return self.lm_head(last).float()
