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

Pure: `decide` takes `Signals` and the clock is the window's end. `tools.observe.scaling` turns
a window of /metrics into `Signals`; the `autoscale` command (`tools/cli/autoscale.py`) reads
the server or a recording and prints the decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

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
