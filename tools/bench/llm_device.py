"""The LLM engine in this process on this machine's accelerator: what it does on a GPU node.

`bench llm` measures the engine behind tritonserver. A GPU node may not have the kit's server
installed (a node lent for a benchmark has torch and transformers, and no tritonserver), and
the engine's figures on the GPU are what a fleet sizes by. This runs the same engine
(`LLMEngine`: the kit's scheduler, paged KV cache and attention over transformers' model
definition) in process, with the limits gen-config derives for that GPU (`gpu_limits`: the KV
budget from its memory, max_num_seqs from the chat workload's mean context) and measures:

  saturated_tokens_per_s  closed loop: `concurrency` requests in flight (default max_num_seqs),
                          each replaced by the next of one fixed list of the workload's chats
                          when it finishes; output tokens per second after a warm-up, and the
                          requests' time to first token (p50, p95) and per output token (p95).
  light_load              one request at a time: time to first token and per output token of
                          a lone request (the floor under any batching).
  decode_limit_tokens_per_s  the forward alone at max_num_seqs decode entries of the
                          workload's mean decode context, as `bench llm` measures it.

The weights are the model folder's (`--model-dir`), or random ones in its architecture
(`--random-weights`: the folder then needs only config.json and the tokenizer; the figures
are the architecture's, and every answer runs to its output budget, as no stop token comes).
On a CPU the limits are the spec's, as the engine serves them there.

Entry point `python -m tools.bench.llm_device` (not a `python -m tools` verb: the kit's command
line imports every client and server module, and this needs only torch, transformers, pydantic,
PyJWT and cryptography beside the kit's engine). I/O: the runs; pure: `saturated_figures`,
`percentile`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.paths import CHAT_WORKLOAD, DEFAULT_MODEL_REPOSITORY
from tools.planning.llm_limits import (
    LLMCost,
    chat_shapes_of,
    decode_block_tables,
    gpu_limits,
    mean_context_tokens,
    mean_decode_context,
)
from tools.spec.workload import ChatWorkload, draw_chat, load_chat_workload

SEED = 20261127
NUM_CHATS = 1000  # the closed loop's list, cycled


@dataclass(frozen=True)
class DeviceOptions:
    """How long and how hard the run measures."""

    concurrency: int | None = None  # closed-loop requests in flight; None: max_num_seqs
    saturate_warmup_s: float = 20.0
    saturate_s: float = 60.0
    light_requests: int = 8
    limit_steps: int = 10

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.saturate_warmup_s < 0 or self.saturate_s <= 0:
            raise ValueError("the warm-up must be >= 0 s and the measured window > 0 s")
        if self.light_requests < 1 or self.limit_steps < 1:
            raise ValueError("need at least one light-load request and one decode-limit step")


@dataclass
class Finished:
    """A request of the closed loop, once it has finished."""

    added_s: float
    ttft_s: float | None
    tpot_s: float | None
    num_output_tokens: int


@dataclass
class LoopRecord:
    """What a closed loop saw: tokens counted at each step's end, and the finished requests."""

    steps: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens generated so far)
    finished: list[Finished] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by nearest rank; None for no values. Not
    `tools.bench.loadgen.percentile`: loadgen imports the kit's HTTP and gRPC clients, which a
    bare GPU node does not have, and this module must import without them."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def saturated_figures(record: LoopRecord, start_s: float, end_s: float) -> dict[str, Any]:
    """Output tokens/s between `start_s` and `end_s` (from the token counts at the steps around
    them), and the latencies of the requests added in that window."""
    before = [tokens for at, tokens in record.steps if at <= start_s]
    upto = [tokens for at, tokens in record.steps if at <= end_s]
    if not before or not upto or end_s <= start_s:
        raise ValueError("the loop has no step at the window's start or end")
    judged = [f for f in record.finished if start_s <= f.added_s < end_s]
    ttfts = [f.ttft_s for f in judged if f.ttft_s is not None]
    tpots = [f.tpot_s for f in judged if f.tpot_s is not None]
    return {"saturated_tokens_per_s": round((upto[-1] - before[-1]) / (end_s - start_s), 1),
            "requests_judged": len(judged),
            "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p95_ms": _ms(percentile(ttfts, 95)),
            "tpot_p95_ms": _ms(percentile(tpots, 95)),
            "completion_tokens_mean": round(statistics.fmean(f.num_output_tokens for f in judged), 1)
            if judged else None}


def chats_of(workload: ChatWorkload, num: int, seed: int = SEED) -> list[tuple[tuple[dict[str, str], ...], int]]:
    """`num` chats of the workload: (messages, output budget)."""
    rng = random.Random(seed)
    return [(chat.messages, chat.max_tokens) for chat in (draw_chat(workload, rng) for _ in range(num))]


# --- the engine on this machine -------------------------------------------------------------------


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores)"


def engine_limits(model, device: str, dtype: str, workload: ChatWorkload, max_model_len: int,
                  spec_limits: dict[str, Any] | None) -> dict[str, Any]:
    """max_num_seqs, max_num_batched_tokens and the KV budget: on a GPU `gpu_limits` for its
    memory (what gen-config writes for a GPU profile), on a CPU the spec's."""
    import torch

    if not device.startswith("cuda"):
        if spec_limits is None:
            raise ValueError("on a CPU the limits are the spec's: give --kv-cache-mb, --max-num-seqs and "
                             "--max-num-batched-tokens")
        return {**spec_limits, "reasons": ["the spec's CPU limits"]}
    shape = model.shape
    cost = LLMCost(num_parameters=sum(p.numel() for p in model.model.parameters()), num_layers=shape.num_layers,
                   num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    limits = gpu_limits(cost, memory, mean_context_tokens(chat_shapes_of(workload)), max_model_len, dtype)
    return {"kv_cache_mb": limits.kv_cache_mb, "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens, "reasons": list(limits.reasons)}


def load_model(model_dir: Path, device: str, dtype: str, random_weights: bool):
    """The model (transformers' definition with the kit's attention), with a cache of one block
    until the limits are known."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from python_backends.llm.model import ATTENTION, DTYPES, PagedCausalLM, load_causal_lm, register_attention

    if not random_weights:
        return PagedCausalLM(load_causal_lm(model_dir, DTYPES[dtype], device), num_blocks=1, block_size=16)
    register_attention()
    torch.manual_seed(SEED)
    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=ATTENTION)
    return PagedCausalLM(model.to(device).eval(), num_blocks=1, block_size=16)


def make_engine(model, model_dir: Path, limits: dict[str, Any], max_model_len: int, block_size: int):
    """An `LLMEngine` over `model` with a KV pool of the limits' budget."""
    from python_backends.llm.engine import ChatTokenizer, LLMEngine
    from python_backends.llm.kv_blocks import KVCacheSpec, num_blocks_for_budget
    from python_backends.llm.model import PagedCache
    from python_backends.llm.scheduler import Scheduler, SchedulerConfig

    shape = model.shape
    kv = KVCacheSpec(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     dtype_bytes=model.dtype.itemsize, block_size=block_size)
    num_blocks = num_blocks_for_budget(kv, int(limits["kv_cache_mb"] * (1 << 20)))
    model.cache = PagedCache(shape, num_blocks, block_size, model.dtype, model.device)
    config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=limits["max_num_seqs"],
                             max_num_batched_tokens=limits["max_num_batched_tokens"], max_model_len=max_model_len)
    return LLMEngine(model, ChatTokenizer(model_dir), Scheduler(config))


def closed_loop(engine, prompts: Sequence[Sequence[int]], budgets: Sequence[int], concurrency: int,
                duration_s: float, ignore_stop: bool, log) -> LoopRecord:
    """Keep `concurrency` requests in the engine for `duration_s`, each replaced by the next of
    the list when it finishes; step by step, in this thread."""
    from python_backends.llm.scheduler import SamplingParams

    stops = () if ignore_stop else tuple(engine.tokenizer.stop_token_ids)
    record, added = LoopRecord(), {}
    order = iter(range(10 ** 9))

    def add() -> None:
        index = next(order)
        request_id = f"r{index}"
        chat = index % len(prompts)
        engine.add(request_id, list(prompts[chat]), SamplingParams(max_tokens=budgets[chat], stop_token_ids=stops))
        added[request_id] = time.monotonic()

    for _ in range(concurrency):
        add()
    start = time.monotonic()
    record.steps.append((start, engine.num_generated_tokens))
    next_report = start + 15.0
    while (now := time.monotonic()) - start < duration_s:
        for output in engine.step():
            if output.finish_reason is not None:
                record.finished.append(Finished(added.pop(output.request_id), output.ttft_s, output.tpot_s,
                                                output.num_output_tokens))
                add()
        record.steps.append((time.monotonic(), engine.num_generated_tokens))
        if now >= next_report:
            log(f"    {now - start:.0f} s: {engine.num_generated_tokens} tokens, {len(record.finished)} finished")
            next_report += 15.0
    for request_id in list(added):
        engine.abort(request_id)
    return record


def light_load(engine, prompts: Sequence[Sequence[int]], budgets: Sequence[int], num: int) -> dict[str, Any]:
    """Requests one at a time: their TTFT and TPOT medians, after one untimed request (the first
    steps of a process pay for its kernels' and allocator's start)."""
    from python_backends.llm.scheduler import SamplingParams

    ttfts, tpots = [], []
    engine.add("warm-up", list(prompts[0]), SamplingParams(max_tokens=4))
    while engine.has_work:
        engine.step()
    for index in range(num):
        engine.add(f"light{index}", list(prompts[index]),
                   SamplingParams(max_tokens=budgets[index], stop_token_ids=tuple(engine.tokenizer.stop_token_ids)))
        while engine.has_work:
            for output in engine.step():
                if output.finish_reason is not None:
                    ttfts.append(output.ttft_s)
                    if output.tpot_s is not None:
                        tpots.append(output.tpot_s)
    return {"requests": num, "ttft_p50_ms": _ms(statistics.median(ttfts)),
            "tpot_p50_ms": _ms(statistics.median(tpots)) if tpots else None}


def decode_step_times(model, num_seqs: int, context_tokens: int, block_size: int, num_steps: int) -> list[float]:
    """Seconds of each of `num_steps` steps of the forward alone, after two untimed: `num_seqs`
    decode entries of `context_tokens` context. A KV pool too small for them (a CPU's spec
    budget need not hold max_num_seqs such sequences) is replaced by one that holds them, as
    `bench llm` sizes its own: the limit is the batch's, whatever the budget admits."""
    from python_backends.llm.model import PagedCache, StepSequence

    tables = decode_block_tables(num_seqs, context_tokens, block_size)
    needed = len(tables) * len(tables[0])
    if needed > model.cache.num_blocks:
        model.cache = None  # the old pool goes before the new one is made
        model.cache = PagedCache(model.shape, needed, block_size, model.dtype, model.device)
    batch = [StepSequence(token_ids=[1], start=context_tokens - 1, block_table=t, samples=True) for t in tables]
    times = []
    for index in range(2 + num_steps):
        begun = time.perf_counter()
        model.step(batch)  # returns logits on the host: the step has finished
        if index >= 2:
            times.append(time.perf_counter() - begun)
    return times


def decode_limit_summary(num_seqs: int, context_tokens: int, times: Sequence[float]) -> dict[str, Any]:
    """The decode limit from step times: `num_seqs` tokens per median step."""
    median = statistics.median(times)
    return {"decode_limit_tokens_per_s": round(num_seqs / median, 1),
            "decode_limit": {"num_seqs": num_seqs, "context_tokens": context_tokens, "steps": len(times),
                             "step_ms_median": round(median * 1000, 2), "step_ms_min": round(min(times) * 1000, 2)}}


def decode_limit(model, num_seqs: int, context_tokens: int, block_size: int, num_steps: int) -> dict[str, Any]:
    """The forward alone: `num_seqs` decode entries of `context_tokens` context; median of
    `num_steps` steps after two untimed (`decode_step_times`)."""
    times = decode_step_times(model, num_seqs, context_tokens, block_size, num_steps)
    return decode_limit_summary(num_seqs, context_tokens, times)


def run(model_dir: Path, device: str, dtype: str, random_weights: bool, options: DeviceOptions,
        workload_path: Path = CHAT_WORKLOAD, max_model_len: int = 2048, block_size: int = 16,
        spec_limits: dict[str, Any] | None = None, command: str = "", log=print) -> dict[str, Any]:
    """The report of one run (see the module's docstring)."""
    import torch
    import transformers

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no GPU here: torch sees no CUDA device")
    workload = load_chat_workload(workload_path)
    log(f"LLM engine in process on {device_name(device)}: {model_dir} in {dtype}"
        f"{' with random weights' if random_weights else ''}")
    model = load_model(model_dir, device, dtype, random_weights)
    limits = engine_limits(model, device, dtype, workload, max_model_len, spec_limits)
    for reason in limits["reasons"]:
        log(f"  {reason}")
    engine = make_engine(model, model_dir, limits, max_model_len, block_size)
    chats = chats_of(workload, NUM_CHATS)
    from python_backends.llm.engine import GenerationInputs

    prompts = [engine.tokenizer.encode(GenerationInputs(text_input=None, messages=messages, max_tokens=budget))
               for messages, budget in chats]
    budgets = [budget for _, budget in chats]
    report: dict[str, Any] = {
        "command": command, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hardware": {"device": device_name(device), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": {"folder": str(model_dir), "weights": "random" if random_weights else "the folder's",
                  "dtype": dtype, "num_parameters": sum(p.numel() for p in model.model.parameters())},
        "limits": limits, "workload": str(workload_path),
    }
    log(f"  light load: {options.light_requests} requests one at a time ...")
    report["light_load"] = light_load(engine, prompts, budgets, options.light_requests)
    concurrency = options.concurrency or limits["max_num_seqs"]
    total_s = options.saturate_warmup_s + options.saturate_s
    log(f"  closed loop: {concurrency} requests in flight for {total_s:g} s "
        f"(tokens counted after {options.saturate_warmup_s:g} s) ...")
    record = closed_loop(engine, prompts, budgets, concurrency, total_s, random_weights, log)
    start = record.steps[0][0] + options.saturate_warmup_s
    report["saturated"] = {"concurrency": concurrency, "warmup_s": options.saturate_warmup_s,
                           "window_s": options.saturate_s,
                           "answers": "to their output budget (random weights)" if random_weights else "as generated",
                           **saturated_figures(record, start, record.steps[-1][0])}
    context = round(mean_decode_context([len(p) for p in prompts], budgets))
    log(f"  decode limit: {limits['max_num_seqs']} sequences at {context} tokens of context ...")
    del engine
    report.update(decode_limit(model, limits["max_num_seqs"], context, block_size, options.limit_steps))
    saturated = report["saturated"]["saturated_tokens_per_s"]
    report["saturated_vs_decode_limit"] = round(saturated / report["decode_limit_tokens_per_s"], 3)
    log(f"  {saturated} tokens/s saturated (TTFT p95 {report['saturated']['ttft_p95_ms']} ms), decode limit "
        f"{report['decode_limit_tokens_per_s']} tokens/s; alone: TTFT {report['light_load']['ttft_p50_ms']} ms")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tools.bench.llm_device`: the run on a node with torch and transformers alone."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.llm_device", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_REPOSITORY / "llm" / "1",
                        help="model folder: config.json and the tokenizer, and the weights unless --random-weights "
                             "(default: %(default)s)")
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights in the folder's architecture (seeded); answers run to their budget")
    parser.add_argument("--device", default="cuda", help="cuda[:N] (default) or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--workload", type=Path, default=CHAT_WORKLOAD,
                        help="chat workload the requests are drawn from (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed-loop requests in flight (default: the derived max_num_seqs)")
    parser.add_argument("--saturate-seconds", type=float, default=DeviceOptions.saturate_s)
    parser.add_argument("--saturate-warmup", type=float, default=DeviceOptions.saturate_warmup_s)
    parser.add_argument("--light-requests", type=int, default=DeviceOptions.light_requests,
                        help="requests sent one at a time for the light-load figures (default: %(default)s)")
    cpu = parser.add_argument_group("on a CPU: the engine's limits (serving.toml's [llm_models] values)")
    cpu.add_argument("--kv-cache-mb", type=float)
    cpu.add_argument("--max-num-seqs", type=int)
    cpu.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--out", type=Path, required=True, help="the report (JSON)")
    args = parser.parse_args(argv)
    given = {"kv_cache_mb": args.kv_cache_mb, "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens}
    spec_limits = given if all(value is not None for value in given.values()) else None
    try:
        options = DeviceOptions(concurrency=args.concurrency, saturate_s=args.saturate_seconds,
                                saturate_warmup_s=args.saturate_warmup, light_requests=args.light_requests)
        report = run(args.model_dir, args.device, args.dtype, args.random_weights, options, args.workload,
                     max_model_len=args.max_model_len, spec_limits=spec_limits,
                     command="python -m tools.bench.llm_device " + " ".join(sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
