"""Any `transformers` decoder over a paged KV cache, for the continuous-batching engine.

The model computation is `transformers`' own: its model definitions (Llama 3.x with rope
scaling, Qwen 2/3, Mistral, Gemma 2/3, and whatever else `AutoModelForCausalLM` loads) run
with an attention function the kit registers (`paged_attention`). It is the only part of the
forward pass the kit provides: each attention layer hands it the step's queries, keys and
values (after the model's own projections, norms and rotary embedding); it writes the keys
and values into the layer's fixed-size cache blocks and attends each sequence's queries to its
cached context through the sequence's block table, honouring the layer's scaling, sliding
window and logit soft-capping as the model passes them.

One call computes one engine step: the prefill chunks and decode tokens of every scheduled
sequence, flattened into a single token axis for the dense layers (no padding compute where
one sequence prefills 100 tokens and the others decode one), with each token's own position
id. Attention runs the decoding sequences in one call of the native kernel on CPU in bfloat16
(`cpu_attention`), elsewhere in a few padded calls of similar context lengths; each prefill
chunk in a call of its own. Logits are computed only for the tokens that sample. On CPU the
float32 or bfloat16 linear layers are packed once for oneDNN's GEMM where this torch build has
it (`PackedLinear`), and the projections that read the same input (query/key/value, gate/up)
run as one GEMM (`fuse_projections`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from python_backends.llm import cpu_attention
from python_backends.llm.kv_blocks import blocks_for_tokens

ATTENTION = "kit_paged"  # the name the kit's attention function is registered under in transformers
STEP_KWARG = "kit_paged_step"  # the forward keyword that carries a step's plan down to each attention call
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know of a decoder before it loads: its KV cache and context."""

    num_layers: int  # transformer blocks
    num_kv_heads: int  # key/value heads (grouped-query attention when fewer than the query heads)
    head_dim: int  # width of one head
    vocab_size: int  # output logits
    max_position_embeddings: int  # longest context the model was trained for
    model_type: str  # transformers' name of the architecture

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a `transformers` config (the text part of a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = int(text.num_attention_heads)
        return cls(
            num_layers=int(text.num_hidden_layers),
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // num_heads),
            vocab_size=int(text.vocab_size),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 2048),
            model_type=str(text.model_type),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelShape:
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(str(model_dir)))


@dataclass(frozen=True)
class StepSequence:
    """The tokens one sequence computes in a step, and where its cache lives."""

    token_ids: Sequence[int]  # the tokens computed this step (a prefill chunk, or one decode token)
    start: int  # position of the first of them; positions [0, start) are already cached
    block_table: Sequence[int]  # the sequence's KV blocks in token order, covering start + len(token_ids)
    samples: bool  # whether the step returns logits for its last token


@dataclass
class _AttentionGroup:
    """Sequences whose attention runs in one call."""

    rows: torch.Tensor  # their query rows in the step's flat token axis
    blocks: torch.Tensor  # [sequences, blocks]: cache blocks of each sequence's context in order (padded)
    num_keys: int  # key positions each sequence attends over: blocks x block size
    query_positions: torch.Tensor  # [sequences, queries]: the position of each query
    num_queries: int  # queries per sequence: 1 for decodes, the chunk length for a prefill
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by sliding window
    lengths: torch.Tensor | None = None  # [sequences] int64: each decode's context, for the CPU kernel

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[sequences, 1, queries, keys]: True where a query may attend. Keys are in position
        order, so key j is at position j: causal (and past padding) is j <= the query's
        position; a sliding window of W also needs j > position - W, as in transformers."""
        if sliding_window not in self.masks:
            keys = torch.arange(self.num_keys, device=self.blocks.device)[None, None, :]
            positions = self.query_positions[:, :, None]
            allowed = keys <= positions
            if sliding_window is not None:
                allowed &= keys > positions - sliding_window
            self.masks[sliding_window] = allowed[:, None]
        return self.masks[sliding_window]


@dataclass
class _StepPlan:
    """What every layer's attention call shares in one step."""

    slot_index: torch.Tensor  # [tokens]: the cache slot each computed token's key and value go to
    groups: list[_AttentionGroup]
    cache: PagedCache
    kernel: cpu_attention.DecodeKernel | None = None  # attends the groups with `lengths` (decodes)


class PagedCache:
    """Keys and values of every layer in fixed-size blocks: [layer, kv_head, slot, head_dim],
    slot = block * block_size + offset in the block.

    Head-major, so that what a gather returns is already laid out for attention: a head's
    keys of a sequence are contiguous, and the decode matmuls batch over (head, sequence)
    without copying the keys first (slot-major, the keys of a step were copied once more
    for every layer)."""

    def __init__(self, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        size = (shape.num_layers, shape.num_kv_heads, num_blocks * block_size, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self._gathered: dict[str, torch.Tensor] = {}  # the gathers' outputs, reused (see `gather`)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the keys and values [kv_heads, tokens, head_dim] of `layer` at cache `slots`."""
        self.k[layer].index_copy_(1, slots, keys.to(self.k.dtype))
        self.v[layer].index_copy_(1, slots, values.to(self.v.dtype))

    def gather(self, which: str, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """[kv_heads, len(blocks) x block_size, head_dim]: the keys ("k") or values ("v") of
        `layer` in cache `blocks`, in their order, written into a buffer reused by the next
        gather of the same kind.

        Whole blocks, not slots: one row of block_size x head_dim per head and block (2 KiB in
        bfloat16) instead of one per token (a 96-sequence decode step, context 129, 2 vCPU,
        took 3-4% less in the slot-major layout before this one). The gathers are the largest
        tensors of a step (96 sequences of 144 slots: 10.6 MB per layer and kind in float32),
        made and freed twice per attention group and layer. Fresh, they cost the engine's loop
        thread a page fault per 4 KiB: glibc serves a thread other than the main one from an
        arena whose extra heaps it unmaps as soon as they are free. On 2 vCPU, a 96-sequence
        decode step (context 129) spent 132-145 ms in the gathers on such a thread against
        57-60 ms on the main thread; into the reused buffer, 61-68 ms. The buffer holds what
        the last gather of its kind returned: use it before the next."""
        layer_cache = (self.k if which == "k" else self.v)[layer]
        num_kv_heads, _, head_dim = layer_cache.shape
        source = layer_cache.view(num_kv_heads, self.num_blocks, self.block_size * head_dim)
        count = blocks.numel()
        numel = num_kv_heads * count * source.shape[2]
        buffer = self._gathered.get(which)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=source.dtype, device=source.device)
            self._gathered[which] = buffer
        rows = buffer[:numel].view(num_kv_heads, count, source.shape[2])
        for head in range(num_kv_heads):  # a head at a time, along its first axis: 10% less than along the second
            torch.index_select(source[head], 0, blocks, out=rows[head])
        return rows.view(num_kv_heads, count * self.block_size, head_dim)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the paged cache.

    query [1, heads, tokens, head_dim]; key, value [1, kv_heads, tokens, head_dim] for the
    step's flat token axis; returns [1, tokens, heads, head_dim] (and no weights). The mask
    transformers would build is not used (it is None for a registered function): each group's
    mask comes from its sequences' positions.
    """
    plan: _StepPlan | None = kwargs.get(STEP_KWARG)
    if plan is None:
        raise RuntimeError(f"{ATTENTION} attention runs only inside PagedCausalLM.step()")
    layer = module.layer_idx
    cache = plan.cache
    cache.write(layer, plan.slot_index, key[0], value[0])
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key.shape[1]
    scale = head_dim ** -0.5 if scaling is None else scaling
    window = sliding_window if sliding_window else None
    out = torch.empty_like(q)
    for group in plan.groups:
        if plan.kernel is not None and group.lengths is not None and softcap is None:
            out[group.rows] = plan.kernel(q[group.rows], cache.k[layer], cache.v[layer], group.blocks, group.lengths,
                                          cache.block_size, scale, window)
            continue
        # One index_select over the flat block list per tensor: cheaper than advanced
        # indexing with the 2-D block index, and the same rows.
        num_seqs = group.blocks.shape[0]
        flat = group.blocks.view(-1)
        keys = cache.gather("k", layer, flat).view(num_kv_heads, num_seqs, group.num_keys, head_dim)
        values = cache.gather("v", layer, flat).view(num_kv_heads, num_seqs, group.num_keys, head_dim)
        mask = group.mask(window)
        if group.num_queries == 1 and softcap is None:
            # Decodes: the query heads that share a key/value head attend as that head's queries,
            # [kv_heads, seqs, heads per kv head, head_dim], so no key or value is repeated per
            # query head (on 1 core, 96 sequences of 60-160 tokens, 9 heads over 3: 55 ms of
            # attention a step against 135 ms with enable_gqa), in two batched matmuls over
            # (kv head, sequence), not SDPA, whose flash kernel is made for many queries: at 96
            # sequences x 144 keys x 3 x 3 heads in bfloat16 on 2 cores, 0.5-0.7 ms a layer
            # against 1.3-1.8 ms; with the head-major cache, a 96-sequence decode step took 15%
            # less than before (174 against 204 ms at context 129, 267 against 314 at 40-365;
            # medians of 19 alternating steps). The scores are in the model's dtype, as in
            # transformers' eager attention, the softmax in float32: in bfloat16 the logits
            # stay as close to float32's as transformers' own (`test_llm_engine`).
            queries = q[group.rows].view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)
            scores = torch.matmul(queries, keys.transpose(2, 3)) * scale  # [kv_heads, seqs, per kv head, keys]
            scores = scores.masked_fill(~mask.transpose(0, 1), float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
            out[group.rows] = torch.matmul(probs, values).transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
            continue
        # [seqs, heads, queries, head_dim]: a prefill chunk is one sequence
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [seqs, kv_heads, keys, head_dim]
        queries = q[group.rows].view(-1, group.num_queries, num_heads, head_dim).transpose(1, 2)
        if softcap is None:
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                                      enable_gqa=num_kv_heads != num_heads)
        else:  # soft-capped logits (Gemma 2): the arithmetic of transformers' eager attention
            repeat = num_heads // num_kv_heads
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
            scores = torch.tanh(torch.matmul(queries, keys.transpose(2, 3)) * scale / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            attended = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype), values)
        out[group.rows] = attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out[None], None


def register_attention() -> None:
    """Register `paged_attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)


# The batch oneDNN lays a packed weight out for; any batch runs on it. Laid out for 64, it
# ran faster than laid out for 1 at every batch from 1 to 300 rows.
PACK_BATCH_HINT = 64


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PACKABLE = (torch.float32, torch.bfloat16)  # the weight dtypes PackedLinear takes


class PackedLinear(nn.Module):
    """A float32 or bfloat16 linear layer whose weight is packed for oneDNN's GEMM.

    On 2 AMD EPYC vCPUs, in float32 it ran 2-4x faster than `F.linear` (MKL) for every batch
    from 1 to 300 rows, and the output layer (49,152 x 576) 4x at 24 rows; in bfloat16, where
    `F.linear` already runs on oneDNN, 1.06x at 96 x 576 x 1,536 and 1.2x on the output layer.
    The packed copy is the only one kept.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        if weight.dtype not in PACKABLE:
            raise ValueError(f"oneDNN packs float32 or bfloat16 weights, not {weight.dtype}")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class FusedProjections(nn.Module):
    """Several linear layers that read the same input, as one GEMM.

    The model calls each projection in turn on the same tensor: the first call computes all of
    them and keeps the others' slices for their calls (matched by the input's identity), so a
    model definition runs unchanged with fewer, larger GEMMs per layer (on 2 cores the
    query/key/value and gate/up pairs as one call each measured a few percent per step).
    """

    def __init__(self, linears: Sequence[nn.Linear], pack: bool):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else torch.zeros(linear.out_features, dtype=weight.dtype)
                              for b, linear in zip(biases, linears, strict=True)])
        self.linear: nn.Module = PackedLinear(weight, bias) if pack else _linear_from(weight, bias)
        self.widths = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []

    def part(self, index: int) -> _FusedPart:
        return _FusedPart(self, index)

    def compute(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0 or self._input is not x:
            self._outputs = list(self.linear(x).split(self.widths, dim=-1))
            self._input = x
        out = self._outputs[index]
        self._outputs[index] = None  # type: ignore[call-overload]  # each slice is handed out once
        if all(o is None for o in self._outputs):
            self._input, self._outputs = None, []
        return out


class _FusedPart(nn.Module):
    def __init__(self, fused: FusedProjections, index: int):
        super().__init__()
        self.index = index
        object.__setattr__(self, "fused", fused)  # not a child: the fused layer is registered once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.compute(self.index, x)


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                       device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # transformers' names


def fuse_projections(model: nn.Module, pack: bool) -> int:
    """Fuse every group of FUSED_GROUPS found in one module (and pack it when asked); then pack
    the remaining float32 and bfloat16 linear layers when asked. Returns the number of fused groups."""
    fused = 0
    for module in list(model.modules()):
        for names in FUSED_GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                continue
            group = FusedProjections(linears, pack)
            module.add_module("_kit_fused_" + names[0], group)
            for index, name in enumerate(names):
                setattr(module, name, group.part(index))
            fused += 1
    if pack:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and child.weight.dtype in PACKABLE:
                    setattr(module, name, PackedLinear(child.weight, child.bias))
    return fused


# A decode group costs a few more tensor ops in every layer; a padded key slot costs its
# gather and attention in every layer. Measured on 2 cores, 24 decoding sequences with
# contexts of 50 to 420 tokens: a step took 123 ms in one padded group, 98-103 ms split at
# 256 slots, 104-118 ms at 512, 103 ms at 128 and at 1024.
GROUP_SPLIT_SLOTS = 256


# A prefill chunk attends in the decode kernel, each query as a decode at its position, when
# its queries x its context (query-key pairs, at most) are this many or fewer: the kernel
# reads a query's keys once per query, SDPA once per chunk, but a chunk of its own costs SDPA's
# call and gather in every layer. On 2 cores, bfloat16, batches from the saturated closed loop
# (95 decodes): with 1-4 chunks of 4-11 tokens, 143.7 ms a step with SDPA, 135.9 in the
# kernel; with one chunk of 162-165 tokens (context 190-200), 284.3 against 259.0.
KERNEL_CHUNK_PAIRS = 1 << 16


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


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), as torch sees it."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def default_dtype(device: str) -> torch.dtype:
    """bfloat16 on a GPU, and on a CPU that multiplies bfloat16 in hardware; float32 on other CPUs.

    On 2 AMD EPYC vCPUs with AVX-512 BF16, oneDNN's bfloat16 GEMM ran 1.9-2x faster than its
    float32 one at the engine's shapes (96 or 256 rows by 576 into 1,536, 3,072 and the
    49,152-word output layer), and the KV cache holds twice the tokens in the same memory.
    Without those instructions bfloat16 is emulated and slower than float32."""
    if str(device).startswith("cuda") or native_bfloat16_cpu():
        return torch.bfloat16
    return torch.float32


def resolve_device_dtype(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """Where and in which torch dtype the engine computes, from a spec's names: `auto` is
    `default_device()`, and `default_dtype` on that device."""
    resolved = default_device() if device == "auto" else device
    return resolved, default_dtype(resolved) if dtype == "auto" else DTYPES[dtype]


def load_causal_lm(model_dir: Path, dtype: torch.dtype, device: str, gguf_file: str | None = None) -> nn.Module:
    """`AutoModelForCausalLM` from a local directory (or a GGUF file in it), never the hub."""
    from transformers import AutoModelForCausalLM

    register_attention()
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True,
                                                 attn_implementation=ATTENTION, **extra)
    return model.to(device).eval()


class PagedCausalLM:
    """A `transformers` causal LM plus a block-paged KV cache; `step()` runs one batched forward."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, packed: bool | None = None):
        register_attention()
        self.model = model
        self.shape = ModelShape.from_config(model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._set_attention(model.config)
        on_cpu = self.device.type == "cpu"
        # None: pack the float32 or bfloat16 weights for oneDNN where this torch has it
        self.packed = (on_cpu and self.dtype in PACKABLE and onednn_available()) if packed is None else packed
        if on_cpu:
            fuse_projections(model, self.packed)
        self.cache = PagedCache(self.shape, num_blocks, block_size, self.dtype, self.device)
        self.group_split_slots = GROUP_SPLIT_SLOTS  # decode attention groups (group_by_length)
        self.kernel_chunk_pairs = KERNEL_CHUNK_PAIRS  # prefill chunks up to this many attend in the kernel too
        # Decodes attend in one call of the native kernel where it runs (bfloat16 on CPU);
        # `attention_note` says which attention runs, and why not the kernel, for the server log.
        self.decode_kernel: cpu_attention.DecodeKernel | None = None
        self.attention_note = ""
        if on_cpu and self.dtype == torch.bfloat16:
            self.decode_kernel, why_not = self._load_kernel(model.config)
            self.attention_note = ("decodes attend in the native CPU kernel" if self.decode_kernel is not None
                                   else f"decodes attend in torch (no native kernel: {why_not})")

    def _load_kernel(self, config: Any) -> tuple[cpu_attention.DecodeKernel | None, str]:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "attn_logit_softcapping", None):
            return None, "the model soft-caps its attention logits"
        heads, shape = int(text.num_attention_heads), self.shape
        if not cpu_attention.DecodeKernel.supports(heads, shape.num_kv_heads, shape.head_dim):
            return None, f"none built for {heads} heads over {shape.num_kv_heads} of width {shape.head_dim}"
        kernel = cpu_attention.load()
        return kernel, cpu_attention.load_error or ""

    @staticmethod
    def _set_attention(config: Any) -> None:
        for part in {id(c): c for c in (config, config.get_text_config())}.values():
            part._attn_implementation = ATTENTION

    @classmethod
    def from_dir(cls, model_dir: Path, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                 device: str | None = None) -> PagedCausalLM:
        device = device or default_device()
        return cls(load_causal_lm(model_dir, dtype or default_dtype(device), device), num_blocks, block_size)

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.cache.k.element_size()

    def _slots(self, block_table: Sequence[int], positions: range) -> list[int]:
        bs = self.block_size
        try:
            return [block_table[p // bs] * bs + p % bs for p in positions]
        except IndexError:
            raise ValueError(f"the block table ({len(block_table)} blocks of {bs}) does not cover "
                             f"position {positions[-1]}") from None

    def _plan_attention(self, batch: Sequence[StepSequence]) -> list[_AttentionGroup]:
        """Group the step's sequences for attention: decoding sequences (one query each) in
        one group for the native kernel where it runs, else in padded calls of similar context
        lengths (`group_by_length`); each prefill chunk in a call of its own, so no sequence
        pays for another's query length, and a short chat little for a long essay's context."""
        device, bs = self.device, self.block_size
        groups: list[_AttentionGroup] = []
        decode_rows, decode_blocks, decode_lens = [], [], []
        row = 0
        for seq in batch:
            n = len(seq.token_ids)
            end = seq.start + n
            blocks = list(seq.block_table[:blocks_for_tokens(end, bs)])
            if n == 1 or (self.decode_kernel is not None and n * end <= self.kernel_chunk_pairs):
                # a chunk's queries join the decodes, each attending up to its own position
                decode_rows.extend(range(row, row + n))
                decode_blocks.extend([blocks] * n)
                decode_lens.extend(range(seq.start + 1, end + 1))
            else:
                groups.append(_AttentionGroup(rows=torch.arange(row, row + n, device=device),
                                              blocks=torch.tensor([blocks], device=device), num_keys=len(blocks) * bs,
                                              query_positions=torch.arange(seq.start, end, device=device)[None],
                                              num_queries=n))
            row += n
        kernel = self.decode_kernel is not None
        # the kernel takes every decode in one call (it reads no padding); torch, groups of similar lengths
        partition = [list(range(len(decode_lens)))] if kernel and decode_lens else \
            group_by_length(decode_lens, self.group_split_slots)
        for members in partition:
            width = max(len(decode_blocks[i]) for i in members)
            padded = [decode_blocks[i] + [0] * (width - len(decode_blocks[i])) for i in members]  # masked keys
            lengths = torch.tensor([decode_lens[i] for i in members], device=device)
            groups.append(_AttentionGroup(
                rows=torch.tensor([decode_rows[i] for i in members], device=device),
                blocks=torch.tensor(padded, device=device), num_keys=width * bs,
                query_positions=lengths[:, None] - 1, num_queries=1, lengths=lengths if kernel else None))
        return groups

    @torch.inference_mode()
    def step(self, batch: Sequence[StepSequence]) -> torch.Tensor:
        """Compute one step; returns float32 logits [number of sampling sequences, vocab], in batch order."""
        if not batch:
            return torch.empty((0, self.shape.vocab_size))
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for seq in batch:
            n = len(seq.token_ids)
            if n == 0:
                raise ValueError("a scheduled sequence computes no tokens")
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start, seq.start + n))
            slots.extend(self._slots(seq.block_table, range(seq.start, seq.start + n)))
            if seq.samples:
                sample_rows.append(len(token_ids) - 1)
        device = self.device
        plan = _StepPlan(slot_index=torch.tensor(slots, dtype=torch.long, device=device),
                         groups=self._plan_attention(batch), cache=self.cache, kernel=self.decode_kernel)
        out = self.model(input_ids=torch.tensor([token_ids], device=device),
                         position_ids=torch.tensor([positions], device=device), use_cache=False,
                         logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=device),
                         **{STEP_KWARG: plan})
        return out.logits[0].float().cpu()
