"""The LLM engine's limits on the hardware a latency profile describes.

On a CPU the spec's values stand: the engine runs in bfloat16 where the CPU multiplies it in
hardware (AVX-512 BF16, AMX), else in float32 (`python_backends.llm.model.default_dtype`), on
oneDNN's packed GEMM, with the KV budget the spec gives it in host memory, and its step
limits were measured on that CPU (serving.toml's comments say how).

On a GPU the engine runs in bfloat16 (unless the spec names a dtype) and the KV cache is
what the GPU's memory holds beside the weights, planned the way vLLM plans it: of the
memory, GPU_MEMORY_UTILIZATION may be used; the weights at the serving dtype and
ACTIVATION_RESERVE of the memory (the step's activations, the CUDA context) come off first;
the rest is the KV budget. With it:

- `max_num_seqs`: the sequences whose whole context (prompt plus output, the workload's mean)
  fits the budget at once, so a full batch is not preempted on average; at most
  GPU_MAX_NUM_SEQS (a decode step's cost stops being flat in the batch well before this on
  models the size of those the kit serves).
- `max_num_batched_tokens`: GPU_STEP_TOKENS (a GPU runs a 2048-token prefill chunk in about
  the time of a few decode steps, so chunks this long keep TTFT low without stalling the
  decodes; vLLM's chunked-prefill default), and at least max_num_seqs so every running
  sequence decodes each step.

Refused: a budget that cannot hold one sequence of `max_model_len` tokens. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tools.spec.workload import ChatWorkload

GPU_MEMORY_UTILIZATION = 0.90  # of the GPU's memory, as vLLM's gpu_memory_utilization default
ACTIVATION_RESERVE = 0.05  # of the GPU's memory: activations of a step, the CUDA context
GPU_MAX_NUM_SEQS = 256
GPU_STEP_TOKENS = 2048
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKENS_PER_WORD = 1.4  # English text in the BPE tokenizers of chat models (SmolLM2: 1.3-1.5)
TEMPLATE_TOKENS = 32  # a chat template's system turn and role markers around the question


class LLMLimitsError(ValueError):
    """The model does not fit the hardware as the spec asks; the message says by how much."""


@dataclass(frozen=True)
class LLMCost:
    """What one model costs in memory, from its config and weights."""

    num_parameters: int  # weights, counted (the memory they take depends on the dtype)
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def weights_bytes(self, dtype: str) -> int:
        return self.num_parameters * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class LLMLimits:
    """The engine's device, dtype and limits, with the reason for each."""

    device: str
    dtype: str
    kv_cache_mb: float
    max_num_seqs: int
    max_num_batched_tokens: int
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class ChatShape:
    """One kind of chat request, as far as its context length goes."""

    share: float  # of requests
    prompt_words: float  # mean words of its prompt (question plus pasted context)
    max_tokens: tuple[int, int]  # output budget, drawn log-uniformly between the bounds


def chat_shapes_of(workload: ChatWorkload) -> list[ChatShape]:
    """A chat workload's kinds, as far as their context lengths go."""
    shapes = []
    for kind in workload.kinds:
        words = sum(len(prompt.split()) for prompt in kind.prompts) / len(kind.prompts)
        if kind.context_words:
            words += sum(kind.context_words) / 2
        shapes.append(ChatShape(share=kind.share, prompt_words=words, max_tokens=tuple(kind.max_tokens)))
    return shapes


def mean_log_uniform(low: float, high: float) -> float:
    """Mean of a log-uniform draw in [low, high]."""
    return low if high <= low else (high - low) / math.log(high / low)


def mean_context_tokens(kinds: Sequence[ChatShape]) -> float:
    """A request's mean context at its end (prompt plus output), in tokens: prompt words at
    TOKENS_PER_WORD plus the template's TEMPLATE_TOKENS, plus the mean output budget."""
    total = sum(kind.share for kind in kinds)
    if not kinds or total <= 0:
        raise ValueError("a workload needs at least one kind with a share > 0")
    return sum(kind.share / total * (kind.prompt_words * TOKENS_PER_WORD + TEMPLATE_TOKENS
                                      + mean_log_uniform(*kind.max_tokens)) for kind in kinds)


def gpu_limits(cost: LLMCost, gpu_memory_bytes: int, mean_context: float, max_model_len: int,
               dtype: str = "auto") -> LLMLimits:
    """The engine's limits on a GPU of `gpu_memory_bytes` (see the module's docstring)."""
    dtype = "bfloat16" if dtype == "auto" else dtype
    weights = cost.weights_bytes(dtype)
    per_token = cost.kv_bytes_per_token(dtype)
    usable = gpu_memory_bytes * GPU_MEMORY_UTILIZATION
    reserve = gpu_memory_bytes * ACTIVATION_RESERVE
    budget = usable - weights - reserve
    gib = 1 << 30
    if budget < max_model_len * per_token:
        raise LLMLimitsError(
            f"{gpu_memory_bytes / gib:.1f} GiB of GPU memory leaves {max(budget, 0) / gib:.2f} GiB for the KV cache "
            f"after {weights / gib:.2f} GiB of weights in {dtype}: not one sequence of max_model_len "
            f"{max_model_len} ({max_model_len * per_token / gib:.2f} GiB); use a larger GPU or a shorter max_model_len")
    kv_tokens = int(budget // per_token)
    by_memory = max(1, int(kv_tokens // max(mean_context, 1.0)))
    max_num_seqs = min(GPU_MAX_NUM_SEQS, by_memory)
    step_tokens = max(GPU_STEP_TOKENS, max_num_seqs)
    reasons = (
        f"dtype {dtype}: the GPU default (float32 only where the spec asks)",
        f"kv_cache_mb {budget / MIB:.0f}: {GPU_MEMORY_UTILIZATION:.0%} of {gpu_memory_bytes / gib:.1f} GiB less "
        f"{weights / gib:.2f} GiB of weights and a {ACTIVATION_RESERVE:.0%} reserve: {kv_tokens} tokens at "
        f"{per_token / 1024:.0f} KiB each",
        f"max_num_seqs {max_num_seqs}: "
        + (f"{by_memory} sequences of the workload's mean context ({mean_context:.0f} tokens) fit the KV budget"
           if by_memory <= GPU_MAX_NUM_SEQS else
           f"the cap ({GPU_MAX_NUM_SEQS}); the KV budget holds {by_memory} of the workload's mean context"),
        f"max_num_batched_tokens {step_tokens}: prefill chunks of {GPU_STEP_TOKENS} tokens, and every running "
        "sequence's decode, in each step",
    )
    return LLMLimits(device="cuda", dtype=dtype, kv_cache_mb=math.floor(budget / MIB), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=step_tokens, reasons=reasons)


def mean_decode_context(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """The mean context of a decode step's token over the requests' outputs. A request's first
    output token comes from its prefill; its k-th after that (k = 1 .. n - 1) decodes with
    prompt + k tokens of context. Weighted by tokens: a long answer counts for every step it
    decodes."""
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompts but {len(output_lens)} output lengths")
    steps = sum(max(0, n - 1) for n in output_lens)
    if steps == 0:
        raise ValueError("no decode steps: every output is at most one token")
    total = sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(prompt_lens, output_lens, strict=True) if n > 1)
    return total / steps


def decode_block_tables(num_seqs: int, context: int, block_size: int) -> list[list[int]]:
    """Disjoint block tables for `num_seqs` sequences of `context` tokens each."""
    if num_seqs < 1 or context < 1 or block_size < 1:
        raise ValueError(f"need >= 1 sequences, context and block size, got {num_seqs}, {context}, {block_size}")
    per_seq = math.ceil(context / block_size)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
