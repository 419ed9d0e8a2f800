"""Desired replicas from leading signals, with hysteresis and a cool-down fit for GPU pods.

p95 moves last: by the time it crosses the SLO, the queues have been growing for a while.
So the decision reads ratios, each 1.0 at its target, and acts on the largest:
  queue        = bucket queue time / (linger budget + one batch of compute)   (> 1: waiting for an instance)
  pending      = requests pending at the bucket models / (replicas x pending target)
  utilization  = share of the device the batches keep busy / 0.8 (gen-config plans for 80% at peak)
  demand       = (served + turned away as "server busy") / served   (only while admission refuses some)
  latency      = end-to-end p95 / (0.8 x SLO)
desired = ceil(replicas x pressure) when pressure > 1.1 (at most doubling per step), the
HorizontalPodAutoscaler's rule. A scale-down needs the load-proportional ratios (pending,
utilization, demand) under 0.5 for a whole window (5 min), with queue and latency under 1,
and removes at most half: latency does not fall with load (at low traffic a request still
waits for its batch timer), so it may veto a scale-down but never drives one.
After a scale-up nothing more is added for the start-up time (60 s): a GPU pod takes tens
of seconds to start and load its models, and until it serves, the signals still show the
old fleet's pressure; adding again would overshoot.

The fragmentation trap: when traffic is split over more queues than the configs were made
for (two versions of a bucket during a rollout, many thin buckets), batches stay thin,
requests wait out the linger timer and p99 rises while the device is mostly idle. More
replicas split the traffic further and make it worse. So when most requests wait out a
timer in split queues and latency is the only ratio over the band (queue, pending,
utilization and demand all say capacity is enough), the decision holds and says why;
`python -m tools explain` names the knob.

  python -m tools autoscale embed                      # live: a decision every 10 s
  python -m tools autoscale embed --replay tests/data/metrics/overload.jsonl.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tools.observe.explain import (
    QueueKnobs,
    ServiceWindow,
    Thresholds,
    knobs_from_repository,
    knobs_from_server,
    service_layout,
    service_window,
    split_lingering_share,
)
from tools.observe.metrics import Snapshot, Window, read_recording, take_snapshot, windows
from tools.paths import REPO_ROOT

# Ratios that fall in proportion to the load per replica: the ones a scale-down may trust.
LOAD_RATIOS = ("pending", "utilization", "demand")


@dataclass(frozen=True)
class Signals:
    """What one window says about a service, normalised per measured replica."""

    at_s: float  # end of the window
    replicas: int  # replicas that produced these numbers
    queue_ms: float  # mean bucket queue time per request
    linger_ms: float  # mean linger budget (max_queue_delay) of the queues requests went to
    compute_ms: float  # mean compute time of the batch a request ran in
    pending: float  # requests queued or running at the bucket models, all measured replicas
    p95_ms: float | None  # end-to-end
    busy_share: float  # share of the device the batches kept busy
    fragmented: bool  # most requests wait out linger timers in queues split beyond the plan (explain)
    num_served: float = 0.0  # client requests answered in the window
    num_busy: float = 0.0  # client requests admission turned away ("server busy"; quota refusals excluded)

    @property
    def queue_ratio(self) -> float:
        return self.queue_ms / max(self.linger_ms + self.compute_ms, 1e-3)


@dataclass(frozen=True)
class AutoscalePolicy:
    """Targets and damping of the decision; see the module docstring."""

    slo_p95_ms: float  # end-to-end p95 target
    pending_per_replica: float  # requests in flight one replica holds at its target
    min_replicas: int = 1
    max_replicas: int = 32
    slo_share: float = 0.8  # keep p95 under this share of the SLO
    target_utilization: float = 0.8  # device busy share per replica at target (gen-config plans for 80% at peak)
    scale_up_above: float = 1.1  # pressure that adds replicas (a band, not a point: no flapping)
    scale_down_below: float = 0.5  # pressure that, held for scale_down_window_s, removes some
    max_step_up: float = 2.0  # at most this factor per scale-up
    startup_s: float = 60.0  # a new GPU pod's time to start and load models: no second scale-up before
    scale_down_window_s: float = 300.0  # low pressure must last this long; also the wait after any change

    def __post_init__(self) -> None:
        if not (self.slo_p95_ms > 0 and self.pending_per_replica > 0):
            raise ValueError(f"slo_p95_ms and pending_per_replica must be > 0, got {self.slo_p95_ms} "
                             f"and {self.pending_per_replica}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if not 0 < self.scale_down_below < 1 < self.scale_up_above:
            raise ValueError(f"need 0 < scale_down_below < 1 < scale_up_above, got {self.scale_down_below} and "
                             f"{self.scale_up_above}")
        if not (0 < self.slo_share <= 1 and 0 < self.target_utilization <= 1 and self.max_step_up > 1):
            raise ValueError(f"need 0 < slo_share <= 1, 0 < target_utilization <= 1 and max_step_up > 1, got "
                             f"{self.slo_share}, {self.target_utilization}, {self.max_step_up}")
        if self.startup_s < 0 or self.scale_down_window_s < 0:
            raise ValueError("startup_s and scale_down_window_s must be >= 0")


@dataclass(frozen=True)
class AutoscaleState:
    """What the decision remembers between windows."""

    desired: int  # the last decision
    last_scale_up_s: float | None = None
    last_change_s: float | None = None
    low_since_s: float | None = None  # when pressure last went below scale_down_below


@dataclass(frozen=True)
class Decision:
    at_s: float
    desired: int
    pressure: float  # the largest ratio
    ratios: Mapping[str, float]  # queue, pending, latency
    reason: str
    state: AutoscaleState


def ratios(signals: Signals, policy: AutoscalePolicy) -> dict[str, float]:
    out = {"queue": signals.queue_ratio,
           "pending": signals.pending / (max(signals.replicas, 1) * policy.pending_per_replica),
           "utilization": signals.busy_share / policy.target_utilization}
    if signals.p95_ms is not None:
        out["latency"] = signals.p95_ms / (policy.slo_share * policy.slo_p95_ms)
    if signals.num_busy > 0 and signals.num_served > 0:
        # Admission keeps the admitted requests on time, so latency alone under-reads an
        # overload: what was asked over what was served is the capacity missing.
        out["demand"] = (signals.num_served + signals.num_busy) / signals.num_served
    return out


def decide(signals: Signals, state: AutoscaleState, policy: AutoscalePolicy) -> Decision:
    """The next desired replica count (pure: the clock is the window's end)."""
    now = signals.at_s
    measured = ratios(signals, policy)
    leader = max(measured, key=measured.get)
    pressure = measured[leader]
    current = min(max(state.desired, policy.min_replicas), policy.max_replicas)
    numbers = ", ".join(f"{name} {value:.2f}" for name, value in measured.items())

    def hold(reason: str, low_since: float | None = state.low_since_s) -> Decision:
        new_state = dataclasses.replace(state, desired=current, low_since_s=low_since)
        return Decision(now, current, pressure, measured, reason, new_state)

    if pressure > policy.scale_up_above:
        if signals.fragmented and all(value <= policy.scale_up_above
                                      for name, value in measured.items() if name != "latency"):
            return hold(f"hold at {current}: pressure {pressure:.2f} ({numbers}) comes from fragmented traffic: "
                        f"thin batches lingering on the timer with the device {signals.busy_share:.0%} busy; more "
                        "replicas would split it further (python -m tools explain names the knob)", None)
        if state.last_scale_up_s is not None and now - state.last_scale_up_s < policy.startup_s:
            waited = now - state.last_scale_up_s
            return hold(f"hold at {current}: pressure {pressure:.2f} ({numbers}), but the last scale-up was "
                        f"{waited:.0f} s ago and new pods need {policy.startup_s:.0f} s to start serving", None)
        # From the replicas that produced the numbers (the HPA's rule), not from the last
        # decision: pods asked for but not yet serving carry none of this load.
        factor = min(pressure, policy.max_step_up)
        desired = min(policy.max_replicas, max(signals.replicas + 1, math.ceil(signals.replicas * factor)))
        if desired <= current:
            limit = f"max_replicas is {policy.max_replicas}" if current >= policy.max_replicas else (
                f"{current} are already asked for ({signals.replicas} serving)")
            return hold(f"hold at {current}: pressure {pressure:.2f} ({numbers}) but {limit}", None)
        new_state = AutoscaleState(desired=desired, last_scale_up_s=now, last_change_s=now, low_since_s=None)
        return Decision(now, desired, pressure, measured, f"scale up {current} -> {desired}: {leader} pressure "
                        f"{pressure:.2f} ({numbers})", new_state)

    load = max(measured.get(name, 0.0) for name in LOAD_RATIOS)
    if (load < policy.scale_down_below and measured["queue"] < 1.0 and measured.get("latency", 0.0) < 1.0
            and current > policy.min_replicas):
        low_since = state.low_since_s if state.low_since_s is not None else now
        since_change = now - state.last_change_s if state.last_change_s is not None else math.inf
        if now - low_since >= policy.scale_down_window_s and since_change >= policy.scale_down_window_s:
            # Remove at most half at once: the pressure of fewer replicas is a guess until measured.
            desired = max(policy.min_replicas, math.ceil(current / 2), math.ceil(signals.replicas * load))
            desired = min(desired, current - 1)
            new_state = AutoscaleState(desired=desired, last_scale_up_s=state.last_scale_up_s, last_change_s=now,
                                       low_since_s=None)
            return Decision(now, desired, pressure, measured, f"scale down {current} -> {desired}: load "
                            f"{load:.2f} ({numbers}) below {policy.scale_down_below} for "
                            f"{now - low_since:.0f} s", new_state)
        return hold(f"hold at {current}: load {load:.2f} ({numbers}) is low; scaling down after "
                    f"{policy.scale_down_window_s:.0f} s of it ({now - low_since:.0f} s so far)", low_since)
    return hold(f"hold at {current}: pressure {pressure:.2f} ({numbers}) is within the band "
                f"{policy.scale_down_below}..{policy.scale_up_above}", None)


def signals_from(view: ServiceWindow, replicas: int, at_s: float) -> Signals:
    total = sum(q.num_requests for q in view.queues)
    linger = (sum(view.knobs[q.model].max_queue_delay_ms * q.num_requests for q in view.queues if q.model in view.knobs)
              / total if total else 0.0)
    return Signals(at_s=at_s, replicas=replicas, queue_ms=view.queue_ms, linger_ms=linger,
                   compute_ms=view.compute_ms, pending=sum(q.pending for q in view.queues), p95_ms=view.p95_ms,
                   busy_share=view.busy_share,
                   fragmented=split_lingering_share(view) >= Thresholds().lingering_share,
                   num_served=view.num_served, num_busy=view.num_busy)


def default_pending_per_replica(knobs: Mapping[str, QueueKnobs]) -> float:
    """One preferred batch waiting per instance, summed over the bucket models: past that,
    a request queues behind a full batch instead of joining one."""
    return float(sum(k.instances * max(1, k.preferred_batch) for k in knobs.values())) or 1.0


def replay(snapshots: list[Snapshot], view_of: Callable[[Window, Window | None], ServiceWindow],
           policy: AutoscalePolicy, span_s: float, replicas: int = 1) -> Iterator[Decision]:
    """Decisions over a recording, one per sliding window (what a live loop would have said)."""
    state = AutoscaleState(desired=replicas)
    by_end: dict[float, Window] = {}
    for window in windows(snapshots, span_s):
        view = view_of(window, by_end.get(window.start.at_s))  # the window just before, to see p99 rise
        by_end[window.end.at_s] = window
        decision = decide(signals_from(view, replicas, window.end.at_s), state, policy)
        state = decision.state
        yield decision


# --- CLI -------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the served model to scale (the router: embed)")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="the server's metrics endpoint")
    parser.add_argument("--http-url", default="localhost:8000", help="the server's HTTP endpoint (host:port)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="replicas whose traffic the metrics show (default 1: this server)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds per window and decision (default 10)")
    parser.add_argument("--count", type=int, default=0, help="decisions to make, then exit (default 0: until Ctrl-C)")
    parser.add_argument("--replay", type=Path, default=None,
                        help="decide over a recording (from `python -m tools top --record`) instead of a server")
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository",
                        help="model repository whose configs give the knobs in --replay mode")
    parser.add_argument("--spec", type=Path, default=None, help="serving spec (default serving.toml): the SLO")
    parser.add_argument("--min-replicas", type=int, default=1, help="never fewer (default 1)")
    parser.add_argument("--max-replicas", type=int, default=32, help="never more (default 32)")
    parser.add_argument("--startup-s", type=float, default=60.0,
                        help="seconds a new pod takes to serve: no second scale-up before (default 60)")
    parser.add_argument("--scale-down-window-s", type=float, default=300.0,
                        help="seconds of low pressure before scaling down (default 300)")
    parser.add_argument("--pending-per-replica", type=float, default=None,
                        help="requests pending at the bucket models per replica at target (default: one "
                             "preferred batch per bucket-model instance, from the served configs)")
    parser.add_argument("--json", action="store_true", help="one JSON object per decision")


def _print(decision: Decision, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"at_s": decision.at_s, "desired_replicas": decision.desired,
                          "pressure": round(decision.pressure, 3),
                          "ratios": {k: round(v, 3) for k, v in decision.ratios.items()}, "reason": decision.reason}),
              flush=True)
    else:
        print(f"{time.strftime('%H:%M:%S', time.localtime(decision.at_s))}  desired {decision.desired}  "
              f"{decision.reason}", flush=True)


def _live(args: argparse.Namespace, view_of, policy: AutoscalePolicy) -> Iterable[Decision]:
    state = AutoscaleState(desired=args.replicas)
    earlier: Window | None = None
    start = take_snapshot(args.metrics_url)
    made = 0
    while args.count == 0 or made < args.count:
        time.sleep(args.interval)
        end = take_snapshot(args.metrics_url)
        window = Window(start, end)
        decision = decide(signals_from(view_of(window, earlier), args.replicas, end.at_s), state, policy)
        state, earlier, start = decision.state, window, end
        made += 1
        yield decision


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1 or args.interval <= 0 or args.count < 0:
        print("error: --replicas must be >= 1, --interval > 0 and --count >= 0", file=sys.stderr)
        return 2
    try:
        layout = service_layout(args.model, args.spec)
        if layout.slo_p95_ms is None:
            print(f"error: the serving spec gives no SLO for {args.model!r}; autoscale a served router "
                  "(e.g. embed)", file=sys.stderr)
            return 2
        if args.replay is not None:
            knobs = knobs_from_repository(layout.bucket_models, args.repository)
        else:
            knobs = knobs_from_server(layout.bucket_models, args.http_url)
        policy = AutoscalePolicy(
            slo_p95_ms=layout.slo_p95_ms,
            pending_per_replica=args.pending_per_replica or default_pending_per_replica(knobs),
            min_replicas=args.min_replicas, max_replicas=args.max_replicas, startup_s=args.startup_s,
            scale_down_window_s=args.scale_down_window_s)

        def view_of(window: Window, earlier: Window | None) -> ServiceWindow:
            return service_window(window, layout, knobs, earlier=earlier)

        if args.replay is not None:
            decisions = replay(read_recording(args.replay), view_of, policy, args.interval, args.replicas)
        else:
            decisions = _live(args, view_of, policy)
        for decision in decisions:
            _print(decision, args.json)
    except KeyboardInterrupt:
        return 0
    except OSError as err:
        print(f"error: cannot read the server: {err}; is it running (python -m tools serve)?", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
