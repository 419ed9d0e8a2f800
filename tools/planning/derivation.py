"""Batching knobs derived from a latency SLO and a measured latency curve.

For one bucket model with p95 SLO `S`, fixed overhead `o` (network, router, measured) and
compute time `c(b)` per execution at batch size `b` (measured by `python -m tools profile`):

- `max_batch_size`: the largest `b` with `o + 2·c(b) <= S` (a request that arrives just
  after a batch started waits for it, then runs in the next one: two executions), and no
  larger than the measured size after the knee of the throughput curve (`past_knee`): a
  larger batch buys under `knee_gain` more rows/s, and holds a lane the longer, which every
  bucket sharing the device waits on.
- `preferred_batch_size`: the knee of the throughput curve `b / c(b)`, the first measured
  size where doubling buys less than `knee_gain` (10%) more throughput; at most
  `max_batch_size`. Beyond the knee a batch costs latency and buys little.
- `max_queue_delay_microseconds` (linger): what the budget leaves, `S - o - 2·c(b_pref)`,
  and no longer than peak traffic takes to fill the batch it needs. Buckets on one device
  share it, so the needed batches are planned together (`plan_shared_batches`): the
  smallest batches that keep the summed utilisation under target at peak. If single rows
  keep up, the linger is zero: waiting would only add latency.
- queue policy: every admitted request brings its deadline from the router (the time left
  before its answer is due, less c(max_batch_size): at most `S - o - c(max_batch_size)`), and
  one still queued after that cannot finish inside the SLO even in the next batch, so it is
  rejected (REJECT, retryable UNAVAILABLE) rather than served late; the queue's own
  `default_timeout_microseconds` is only the ceiling those deadlines shorten.
  `max_queue_size` by Little's law: the rate the queue drains at x the budget after
  overhead (`S - o`), at least one full batch; more would only delay the rejection, fewer
  would turn away bursts that could still be served (the SLO is a p95: the tail may be
  late, which beats being rejected).
- the router's inline limits (`derive_inline`): how long a lone request served on the
  router's own thread may take before its bucket counts as lingering, and which buckets are
  too slow to serve that way at all.
- instance count: enough instances to carry the peak rate at `b_pref` throughput under a
  target utilisation, and at least one per lane of the device (a CPU core per
  single-threaded instance), so a burst on one bucket runs on every lane the other buckets
  leave free instead of queueing behind its own batch; capped by the spec.

A p95 SLO concerns 95% of requests, so a bucket that cannot meet `o + 2·c(1) <= S` does not
sink the model (`plan_slo_fit`): a bucket *at risk* (`o + c(1) <= S < o + 2·c(1)`: a request
that waits for the one in flight misses) or *infeasible* (`o + c(1) > S`: it misses even
alone) is served without batching, with a warning naming its traffic share. Only when the
infeasible buckets carry more than the 5% of traffic a p95 lets miss is the SLO refused.

Everything here is pure: plain data in, plain data out, every knob with its reasoning.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from python_backends.embed.admission import AdmissionPolicy
from python_backends.embed.inline import InlinePolicy
from tools.spec.profile import LatencyCurve


class InfeasibleSLO(ValueError):
    """No batching configuration can meet the SLO for this model; the message says why."""


SLO_PERCENTILE = 0.95  # the spec's SLOs are p95s: 95% of requests within `slo_p95_ms`

# Float noise in summed traffic shares (0.04 + 0.01 is 0.05000000000000001): a mix at
# exactly the allowance is within it.
_SHARE_TOLERANCE = 1e-9

# A bucket queue's own timeout where requests bring their deadlines: Triton takes a request's
# timeout only when it is shorter than its queue's, so the queue needs one; this long, it
# never turns away a request that brings none.
QUEUE_TIMEOUT_CEILING_US = 3_600_000_000


def slo_miss_allowance(percentile: float = SLO_PERCENTILE) -> float:
    """The share of requests a percentile SLO lets miss it: 1 - 0.95 = 5% for a p95."""
    if not 0.0 < percentile < 1.0:
        raise ValueError(f"an SLO percentile is between 0 and 1, got {percentile}")
    return 1.0 - percentile


def slo_out_of_reach(infeasible_share: float, percentile: float = SLO_PERCENTILE) -> bool:
    """Whether no configuration can meet the SLO: the requests that miss it whatever the
    batching (those of buckets whose o + c(1) > S) are more than the percentile lets miss."""
    return infeasible_share > slo_miss_allowance(percentile) + _SHARE_TOLERANCE


class SloFit(enum.Enum):
    """How one bucket stands against the SLO before any batching."""

    MEETS = "meets"  # o + 2·c(1) <= S: a request can wait for the execution in flight and still make it
    AT_RISK = "at risk"  # o + c(1) <= S < o + 2·c(1): one that waits for the execution in flight misses
    INFEASIBLE = "infeasible"  # S < o + c(1): a request misses even alone


@dataclass(frozen=True)
class BucketFit:
    """One bucket's unbatched latency against the SLO, with the share of traffic it carries."""

    model_name: str  # the bucket model, named in warnings and errors
    share: float  # fraction of the model's rows that land in this bucket (0..1, from the workload)
    slo_p95_ms: float  # S
    overhead_ms: float  # o
    single_ms: float  # c(1): one row's execution

    @property
    def alone_ms(self) -> float:
        """o + c(1): a request that finds the bucket idle."""
        return self.overhead_ms + self.single_ms

    @property
    def behind_one_ms(self) -> float:
        """o + 2·c(1): a request that waits for the execution in flight, then runs alone."""
        return self.overhead_ms + 2 * self.single_ms

    @property
    def fit(self) -> SloFit:
        if self.alone_ms > self.slo_p95_ms:
            return SloFit.INFEASIBLE
        if self.behind_one_ms > self.slo_p95_ms:
            return SloFit.AT_RISK
        return SloFit.MEETS

    def numbers(self) -> str:
        return (f"o + c(1) = {self.overhead_ms:.1f} + {self.single_ms:.1f} = {self.alone_ms:.1f} ms, "
                f"o + 2·c(1) = {self.behind_one_ms:.1f} ms")


@dataclass(frozen=True)
class SloFitPlan:
    """Which buckets batch, which run best effort, and the buckets the admission budget is taken over."""

    best_effort: frozenset[int]  # buckets served without batching (at risk or infeasible)
    budget_buckets: tuple[int, ...]  # buckets W = S - o - c_slowest(1) is taken over
    warnings: dict[int, str] = field(default_factory=dict)  # bucket -> its warning


def plan_slo_fit(model_name: str, fits: Mapping[int, BucketFit], percentile: float = SLO_PERCENTILE) -> SloFitPlan:
    """Refuse only an SLO no configuration can meet; otherwise say which buckets run best effort.

    A p95 SLO lets 5% of requests miss. Requests of an infeasible bucket miss whatever the
    batching, so when those buckets carry more than 5% of the traffic the SLO is out of
    reach: InfeasibleSLO names each with its share and numbers. Otherwise every bucket that
    cannot meet o + 2·c(1) <= S runs without batching (at risk: only a request that waits
    for the one in flight misses) and gets a warning: the SLO holds for the mix only while
    those buckets carry under 5% of its traffic. The admission budget is taken over the
    buckets that meet the SLO (over the at-risk ones when none does): a slow bucket that
    misses anyway must not shrink what every other bucket may wait.
    """
    allowance = slo_miss_allowance(percentile)
    by_fit = {kind: sorted(b for b, f in fits.items() if f.fit is kind) for kind in SloFit}
    infeasible, at_risk = by_fit[SloFit.INFEASIBLE], by_fit[SloFit.AT_RISK]
    infeasible_share = sum(fits[b].share for b in infeasible)
    if slo_out_of_reach(infeasible_share, percentile):
        slo = fits[infeasible[0]].slo_p95_ms
        named = "; ".join(f"{fits[b].model_name} ({fits[b].share:.1%} of traffic: {fits[b].numbers()})"
                          for b in infeasible)
        raise InfeasibleSLO(
            f"{model_name}: no configuration puts {percentile:.0%} of requests within the {slo:.0f} ms p95 SLO: "
            f"buckets whose single request alone takes over {slo:.0f} ms carry {infeasible_share:.1%} of the "
            f"traffic, over the {allowance:.0%} the SLO lets miss: {named}; raise the SLO, use faster hardware, "
            "or split those buckets so that less traffic needs them"
        )
    risky = sorted(infeasible + at_risk)
    risky_share = sum(fits[b].share for b in risky)
    over = " (more, so the p95 holds only while their requests seldom queue)"
    together = (f"the SLO holds for the mix only while {', '.join(fits[b].model_name for b in risky)} "
                f"carr{'ies' if len(risky) == 1 else 'y'} under {allowance:.0%} of its traffic: "
                f"{risky_share:.1%} in the workload" + (over if slo_out_of_reach(risky_share, percentile) else ""))
    warnings = {}
    for bucket in risky:
        fit = fits[bucket]
        what = (f"cannot meet the {fit.slo_p95_ms:.0f} ms p95 SLO: a request misses it even alone"
                if fit.fit is SloFit.INFEASIBLE else
                f"at risk of missing the {fit.slo_p95_ms:.0f} ms p95 SLO: a request that waits for the one in "
                "flight misses it")
        warnings[bucket] = (f"{fit.model_name}: {what} ({fit.numbers()}); it carries {fit.share:.1%} of the "
                            f"traffic and runs without batching; {together}")
    return SloFitPlan(
        best_effort=frozenset(risky),
        budget_buckets=tuple(by_fit[SloFit.MEETS] or at_risk),
        warnings=warnings,
    )


@dataclass(frozen=True)
class BucketDemand:
    """What one bucket model must deliver: its SLO, overhead and traffic."""

    model_name: str  # the Triton model, named in errors and explanations
    slo_p95_ms: float  # end-to-end p95 latency target of a request
    overhead_ms: float  # fixed time outside this model's compute (network, router, BLS)
    expected_rps: float  # rows per second reaching this bucket in normal traffic
    peak_rps: float  # rows per second at peak
    max_instances: int = 1  # most instances the spec allows for one bucket model
    lanes: int = 1  # executions the device runs side by side at full speed (HardwareLimits.lanes)
    knee_gain: float = 0.10  # doubling the batch must buy at least this much more throughput
    max_utilization: float = 0.8  # plan instances to run at most this busy at peak
    queue_timeout: bool = True  # write the queue-policy timeout; False leaves the early rejection to the queue bound
    shared_batch: int = 0  # batch this bucket needs at peak when it shares the device (plan_shared_batches); 0: alone
    latency_target_ms: float = 0.0  # latency the router's admission steers answers to (admission_target_ms); 0: S - o
    best_effort: bool = False  # plan_slo_fit let it miss o + 2·c(1) <= S: no batching instead of refusing


@dataclass(frozen=True)
class BatchingKnobs:
    """The derived settings of one bucket model, each with the numbers that set it."""

    model_name: str  # the Triton model
    max_batch_size: int  # Triton max_batch_size
    preferred_batch_size: int  # dynamic_batching.preferred_batch_size
    max_queue_delay_us: int  # dynamic_batching.max_queue_delay_microseconds
    default_timeout_us: int  # default_queue_policy.default_timeout_microseconds (REJECT)
    max_queue_size: int  # default_queue_policy.max_queue_size
    instance_count: int  # instance_group count
    reasons: dict[str, str] = field(default_factory=dict)  # knob -> why, with numbers
    warnings: tuple[str, ...] = ()  # capacity shortfalls and other things to act on


@dataclass(frozen=True)
class RouterPlan:
    """How many router instances, and how many requests each serves at once."""

    instance_count: int
    max_concurrent_requests: int  # worker threads per instance
    reasons: dict[str, str] = field(default_factory=dict)  # knob -> why


def derive_router(peak_rps: float, slo_p95_ms: float, host_cores: int, max_instances: int,
                  admission: AdmissionPolicy) -> RouterPlan:
    """Router instances and their worker threads.

    An instance does not hold a request: it checks and admits it and hands it to a worker
    thread, which waits on the buckets and answers. Instances are only for the Python work
    (a process runs Python on one core at a time): one per host core. Workers are what
    waits: enough across the instances for every request admission can let in at once (its
    upper bound of work over the cheapest row's cost), and at least Little's law at peak,
    so that admission, never a missing thread, decides who waits on the cores.
    """
    instances = max(1, min(host_cores, max_instances))
    little = max(1, math.ceil(peak_rps * slo_p95_ms / 1000.0))
    if admission.max_work_ms > 0:
        cheapest_ms = min(admission.row_cost_ms.values())
        admissible = math.ceil(admission.max_limit_ms * admission.lanes / cheapest_ms)
        admissible_text = (f"admission lets in at most {admission.max_limit_ms:.1f} ms x {admission.lanes} lanes "
                           f"/ {cheapest_ms:.2f} ms (the cheapest row) = {admissible} requests")
    else:
        admissible, admissible_text = 0, "admission is off"
    in_flight = max(little, admissible)
    per_instance = math.ceil(in_flight / instances)
    return RouterPlan(
        instance_count=instances,
        max_concurrent_requests=per_instance,
        reasons={
            "instance_count": (f"one per host core ({host_cores}), for the Python work of checking, tokenizing and "
                               f"admitting; an instance holds no request" +
                               (f"; capped at {max_instances} by the spec" if instances < host_cores else "")),
            "max_concurrent_requests": (f"worker threads per instance: max(Little's law at peak {peak_rps:.1f} req/s "
                                        f"x {slo_p95_ms:.0f} ms = {little}; {admissible_text}) = {in_flight} in "
                                        f"flight over {instances} instance(s) = {per_instance}"),
        },
    )


INLINE_SLO_SHARE = 0.10  # an inline call may hold a router instance for at most this share of the SLO
INLINE_MARGIN = 2.0  # a call over this many times its target's c(1) (plus o) counts as lingering


def derive_inline(call_ms: Mapping[str, float], overhead_ms: float, slo_p95_ms: float) -> tuple[InlinePolicy, str]:
    """The router's limit on an inline call to each target (`python_backends.embed.inline`),
    from `call_ms`: the target's c(1), a lone row's compute.

    A lone call takes about c(1) plus the router path's overhead `o`; a target that lingers
    takes its queue delay on top. The limit is `2·c(1) + o` (twice the compute, so jitter
    of another process on the cores is not taken for a linger; the router also waits for
    two slow calls in a row), and at most `INLINE_SLO_SHARE` of the SLO, since a request
    that reaches a router whose instances are all busy inline waits behind such a call with
    nothing counting it. A target whose lone call `c(1) + o` alone is over that share is
    never served inline (limit 0): the quarter millisecond the worker handoff costs is
    nothing beside it.
    """
    cap_ms = INLINE_SLO_SHARE * slo_p95_ms
    limits = {target: round(min(INLINE_MARGIN * c1 + overhead_ms, cap_ms), 3) if c1 + overhead_ms <= cap_ms else 0.0
              for target, c1 in call_ms.items()}
    served = [f"{target} {limits[target]:.1f}" for target in sorted(limits) if limits[target] > 0]
    never = [target for target in sorted(limits) if limits[target] == 0]
    reason = (f"a lone request of an idle instance is served on its own thread while its call takes at most "
              f"min({INLINE_MARGIN:g}·c(1) + o, {INLINE_SLO_SHARE:.0%} of the {slo_p95_ms:.0f} ms SLO) "
              f"(o = {overhead_ms:.1f} ms; two calls over it in a row are a linger, and the target goes to the workers "
              f"for a while): "
              + (", ".join(served) + " ms" if served else "none")
              + (f"; never for {', '.join(never)} (c(1) + o over {cap_ms:.1f} ms)" if never else ""))
    return InlinePolicy(max_ms_by_target=limits), reason


@dataclass(frozen=True)
class SharedLoad:
    """One bucket model's peak load on a device it shares with the other buckets."""

    model_name: str  # the bucket model
    peak_rps: float  # rows per second at peak
    curve: LatencyCurve  # its measured compute curve (measured alone)
    max_batch: int  # largest batch worth waiting for (its preferred size)


def plan_shared_batches(loads: list[SharedLoad], max_utilization: float, lanes: int = 1,
                        base_utilization: float = 0.0) -> tuple[dict[str, int], float]:
    """Batch sizes that keep a shared device under `max_utilization` at peak, waiting as little as possible.

    Bucket models on one device split its time: a bucket's utilisation is its rate over its
    throughput at its batch size (in lanes: one execution at a time at its measured speed),
    and they add up; the device holds `lanes` of them. `base_utilization` is the share of the
    device that other work takes at peak (on a CPU: the router path and the server itself).
    The utilisation of the whole device (0..1) must stay under `max_utilization`. Starting
    from no batching, repeatedly grow the batch of the bucket that frees the most device
    time per millisecond of extra waiting (one more row takes 1/rate to arrive), until the
    total fits or no bucket can grow. Returns the sizes and the total utilisation they reach.
    """
    if lanes < 1:
        raise ValueError(f"a device has at least one lane, got {lanes}")
    if base_utilization < 0:
        raise ValueError(f"base utilisation must be >= 0, got {base_utilization}")
    sizes = {load.model_name: 1 for load in loads}

    def utilization(load: SharedLoad, batch: int) -> float:
        return load.peak_rps / load.curve.throughput_rps(batch) / lanes

    total = base_utilization + sum(utilization(load, 1) for load in loads)
    while total > max_utilization:
        best: tuple[float, SharedLoad] | None = None
        for load in loads:
            batch = sizes[load.model_name]
            if load.peak_rps <= 0 or batch >= min(load.max_batch, load.curve.max_measured):
                continue
            freed = utilization(load, batch) - utilization(load, batch + 1)
            score = freed * load.peak_rps  # freed utilisation per second of added wait
            if best is None or score > best[0]:
                best = (score, load)
        if best is None:
            break  # over capacity even at the largest useful batches: instances or replicas must grow
        load = best[1]
        batch = sizes[load.model_name]
        total -= utilization(load, batch) - utilization(load, batch + 1)
        sizes[load.model_name] = batch + 1
    return sizes, total


def find_knee(curve: LatencyCurve, knee_gain: float = 0.10) -> int:
    """First measured batch size where the next measured size adds less than `knee_gain` throughput."""
    sizes = curve.sizes
    for smaller, larger in itertools.pairwise(sizes):
        if curve.throughput_rps(larger) < curve.throughput_rps(smaller) * (1.0 + knee_gain):
            return smaller
    return sizes[-1]


def max_batch_within_slo(demand: BucketDemand, curve: LatencyCurve) -> int:
    """The largest b with o + 2·c(b) <= S; raise InfeasibleSLO naming the bucket if not even b = 1 fits
    (1 for a best-effort bucket, which plan_slo_fit lets miss it)."""
    name, slo, overhead = demand.model_name, demand.slo_p95_ms, demand.overhead_ms
    if slo <= 0 or overhead < 0 or demand.expected_rps < 0 or demand.peak_rps < demand.expected_rps:
        raise ValueError(
            f"{name}: need slo > 0, overhead >= 0, 0 <= expected_rps <= peak_rps "
            f"(got slo {slo}, overhead {overhead}, expected {demand.expected_rps}, peak {demand.peak_rps})"
        )
    c1 = curve.at(1)
    if demand.best_effort and overhead + 2 * c1 > slo:
        return 1
    if overhead + c1 > slo:
        raise InfeasibleSLO(
            f"{name}: a single request alone takes o + c(1) = {overhead:.1f} + {c1:.1f} = {overhead + c1:.1f} ms, "
            f"over the {slo:.0f} ms p95 SLO; raise the SLO, use faster hardware, or split the bucket"
        )
    if overhead + 2 * c1 > slo:
        raise InfeasibleSLO(
            f"{name}: even unbatched, a request that waits for the one in flight takes o + 2·c(1) = "
            f"{overhead:.1f} + 2·{c1:.1f} = {overhead + 2 * c1:.1f} ms, over the {slo:.0f} ms p95 SLO; "
            "raise the SLO, use faster hardware, or split the bucket"
        )
    return max(b for b in range(1, curve.max_measured + 1) if overhead + 2 * curve.at(b) <= slo)


def past_knee(curve: LatencyCurve, knee_gain: float = 0.10) -> int:
    """The measured size after the knee (the knee itself when it is the largest measured): the
    largest batch worth forming. Past it a batch adds under `knee_gain` throughput per doubling,
    while it keeps a lane of the device for c(b), longer the larger it is.

    Measured on 2 vCPU (`bench derivation`, embed): with the cap at o + 2·c(b) <= S alone,
    encoder_16 (knee 4) batched up to 22 rows, 84 ms a batch, and the derived configuration
    served 94% of the search's best; capped past the knee, 108%."""
    knee = find_knee(curve, knee_gain)
    later = [size for size in curve.sizes if size > knee]
    return later[0] if later else knee


def preferred_batch(demand: BucketDemand, curve: LatencyCurve) -> int:
    """The knee of the throughput curve, capped by the largest batch the SLO allows."""
    return min(find_knee(curve, demand.knee_gain), max_batch_within_slo(demand, curve))


def derive_knobs(demand: BucketDemand, curve: LatencyCurve) -> BatchingKnobs:
    """Derive the batching knobs of one bucket model; raise InfeasibleSLO naming it if none work."""
    name, slo, overhead = demand.model_name, demand.slo_p95_ms, demand.overhead_ms
    within_slo = max_batch_within_slo(demand, curve)
    worth = past_knee(curve, demand.knee_gain)
    max_batch = min(within_slo, worth)
    reasons: dict[str, str] = {}
    warnings: list[str] = []

    c1 = curve.at(1)
    unbatched = demand.best_effort and overhead + 2 * c1 > slo
    if unbatched:
        reasons["max_batch_size"] = (
            f"1, best effort: even unbatched o + 2·c(1) = {overhead:.1f} + 2·{c1:.1f} = {overhead + 2 * c1:.1f} "
            f"> {slo:.0f} ms; the p95 SLO is judged over the whole mix (see the warning)"
        )
    elif worth < within_slo:
        reasons["max_batch_size"] = (
            f"the measured size after the throughput knee ({find_knee(curve, demand.knee_gain)}): a larger batch "
            f"adds under {demand.knee_gain:.0%} rows/s per doubling and holds a lane longer; the SLO would allow "
            f"{within_slo} (o + 2·c(b) = {overhead:.1f} + 2·{curve.at(within_slo):.1f} = "
            f"{overhead + 2 * curve.at(within_slo):.1f} <= {slo:.0f} ms)"
        )
    else:
        reasons["max_batch_size"] = (
            f"largest b with o + 2·c(b) <= S: {overhead:.1f} + 2·{curve.at(max_batch):.1f} = "
            f"{overhead + 2 * curve.at(max_batch):.1f} <= {slo:.0f} ms"
            + (f" (b = {max_batch + 1} gives {overhead + 2 * curve.at(max_batch + 1):.1f} ms)"
               if max_batch < curve.max_measured else f" (largest measured size is {curve.max_measured})")
        )

    knee = find_knee(curve, demand.knee_gain)
    preferred = min(knee, max_batch)
    reasons["preferred_batch_size"] = (
        f"throughput knee at b = {knee} ({curve.throughput_rps(knee):.0f} rows/s; doubling adds < "
        f"{demand.knee_gain:.0%})" + (f", capped by max_batch_size {max_batch}" if preferred < knee else "")
        + (" (best effort: no batching)" if unbatched else "")
    )

    # Linger only as long as it pays: wait for the batch the peak traffic needs (never past
    # the knee), filled at the peak rate. When one row at a time keeps up, waiting buys
    # nothing (the hardware would idle anyway) and the linger is zero. Below peak, batches
    # dispatch part-full when the linger runs out, still inside the budget. The budget is
    # what is left of the latency the router's admission steers to (S - o without it) after
    # a batch ahead and the request's own: a longer linger would make answers late at any
    # load, and admission, which can only cure lateness that load causes, would refuse
    # traffic the cores have room for.
    c_pref = curve.at(preferred)
    if demand.latency_target_ms:
        target_ms, target_name, target_text = demand.latency_target_ms, "T", f"{demand.latency_target_ms:.1f}"
    else:
        target_ms, target_name, target_text = slo - overhead, "S - o", f"{slo:.0f} - {overhead:.1f}"
    linger_budget_ms = max(0.0, target_ms - 2 * c_pref)
    if demand.shared_batch:
        needed_batch = min(demand.shared_batch, preferred)
        need_text = "with the other buckets on this device"
    else:
        needed_batch = next(
            (b for b in range(1, preferred + 1)
             if curve.throughput_rps(b) * demand.max_utilization >= demand.peak_rps),
            preferred,
        )
        need_text = "alone on this device"
    if demand.peak_rps > 0 and needed_batch > 1:
        fill_ms = (needed_batch - 1) / demand.peak_rps * 1000.0
        delay_ms = min(linger_budget_ms, fill_ms)
        fill_text = (f"peak {demand.peak_rps:.1f} rows/s needs batches of {needed_batch} {need_text} "
                     f"(at {demand.max_utilization:.0%} utilisation) and fills one in {fill_ms:.1f} ms")
    else:
        delay_ms = 0.0
        fill_text = (f"peak {demand.peak_rps:.1f} rows/s is carried without batching {need_text}, "
                     "so waiting buys nothing")
    delay_us = int(delay_ms * 1000)
    reasons["max_queue_delay_microseconds"] = (
        f"min(budget {target_name} - 2·c(b_pref) = {target_text} - 2·{c_pref:.1f} = {linger_budget_ms:.1f} ms"
        f"{', T = the latency admission steers answers to' if demand.latency_target_ms else ''}; "
        f"{fill_text}) = {delay_ms:.1f} ms"
    )

    c_max = curve.at(max_batch)
    timeout_ms = slo - overhead - c_max
    if timeout_ms <= 0:  # a best-effort bucket whose single row misses the SLO: late beats rejected
        timeout_us = 0
        reasons["default_timeout_microseconds"] = (
            f"not set: S - o - c(1) = {slo:.0f} - {overhead:.1f} - {c_max:.1f} = {timeout_ms:.1f} ms leaves no "
            "time to wait, so a request of this bucket that queues misses the SLO anyway: served late, not rejected"
        )
    elif demand.queue_timeout:
        timeout_us = QUEUE_TIMEOUT_CEILING_US
        reasons["default_timeout_microseconds"] = (
            f"{QUEUE_TIMEOUT_CEILING_US / 1e6:.0f} s, only the ceiling each request's own deadline shortens "
            f"(Triton honours a request's timeout only below its queue's): the router sends every admitted "
            f"request with the time left before its answer is due, at most S - o - c(max_batch) = {slo:.0f} - "
            f"{overhead:.1f} - {c_max:.1f} = {timeout_ms:.1f} ms, and REJECTs what would be late; a request "
            f"without a deadline (too large to meet the SLO even alone: served late, not rejected) is not "
            f"turned away for its time here"
        )
    else:
        timeout_us = 0
        reasons["default_timeout_microseconds"] = (
            f"not set (queue timeouts off in the spec); the queue bound below keeps the wait near "
            f"S - o - c(max_batch) = {timeout_ms:.1f} ms instead"
        )

    per_instance = curve.throughput_rps(preferred) * demand.max_utilization
    needed = max(1, math.ceil(demand.peak_rps / per_instance)) if demand.peak_rps > 0 else 1
    wanted = max(needed, demand.lanes)
    instances = min(wanted, demand.max_instances)
    reasons["instance_count"] = (
        f"max(peak {demand.peak_rps:.1f} rows/s / ({curve.throughput_rps(preferred):.0f} rows/s at b = {preferred} "
        f"x {demand.max_utilization:.0%} utilisation) = {needed}, one per lane of the device = {demand.lanes}) "
        f"= {wanted}"
        + (f", capped at {demand.max_instances} by the spec" if instances < wanted else "")
    )
    if instances < needed:
        warnings.append(
            f"{name}: peak {demand.peak_rps:.1f} rows/s needs {needed} instances at {demand.max_utilization:.0%} "
            f"utilisation but the spec allows {demand.max_instances}; add replicas"
        )

    # Little's law at the rate the queue drains (full batches on every instance), not at the
    # peak arrival rate, over the budget left after the overhead: a queue longer than that
    # only delays the rejection, a shorter one turns away bursts that could still be served.
    # The wait is the whole S - o rather than the timeout: the SLO is a p95, so the tail may
    # run late, and a late answer is worth more than a rejection the client has to retry.
    wait_ms = slo - overhead
    drain_rps = curve.throughput_rps(max_batch) * instances
    little = math.ceil(drain_rps * wait_ms / 1000.0)
    queue_size = max(max_batch, little)
    reasons["max_queue_size"] = (
        f"Little's law at the drain rate: {drain_rps:.1f} rows/s x (S - o = {wait_ms:.1f} ms) = {little}"
        + (f", raised to one full batch ({max_batch})" if queue_size > little else "")
        + f"; peak arrivals {demand.peak_rps:.1f} rows/s"
    )

    if unbatched:  # no linger either: a row that waits for company only gets later
        delay_us = 0
        reasons["max_queue_delay_microseconds"] = "0, best effort: no batching, so nothing to wait for"

    return BatchingKnobs(
        model_name=name,
        max_batch_size=max_batch,
        preferred_batch_size=preferred,
        max_queue_delay_us=delay_us,
        default_timeout_us=timeout_us,
        max_queue_size=queue_size,
        instance_count=instances,
        reasons=reasons,
        warnings=tuple(warnings),
    )


# Share of the waiting budget W = S - o - c_slowest(1) that admitted work in flight may use;
# the rest is the wait in the router's own queue before admission. Measured on 2 vCPU at 3x
# goodput (288 req/s offered, 60 s, one run each): 60% (router queue 4) held the admitted
# requests' p95 at 197 ms and served 139 req/s; 50% (router queue 5) 178 ms and 138 req/s.
# Runs vary by about 10 ms, so the margin matters more than the last request per second.
ADMISSION_WORK_SHARE = 0.5

# The adaptive bound's floor, as a share of one row of the slowest bucket per lane. With the
# whole row (1.0) the bound sat on the floor through a 10x-goodput flood (bench overload
# overload_10x, 2 vCPU: the bucket models ran at twice their profiled times, the CPU taken by
# the refusals) while the answers kept coming late: admitted p95 245, 270, 188, 211, 211 ms
# against the 200 ms SLO, alternated in one hour with 0.5, where the bound moved between 20
# and 48 ms per lane: 178, 187, 180, 179 ms, and as many requests served within the SLO
# (116-159 req/s against 115-166). Crash recovery held (30 req/s, one instance killed: 12
# failed without retries, 0 with), unlike one preferred batch of the cheapest bucket (9.4 ms
# for embed), from which the bound climbed back too slowly after the answers a crash made
# late: a retrying client saw 66 requests fail where it had seen 3. Below the floor a row of
# the slowest bucket is admitted only with nothing ahead of it.
MIN_WORK_ROW_SHARE = 0.5


@dataclass(frozen=True)
class Admission:
    """The router's admission knobs, each with the numbers that set it."""

    policy: AdmissionPolicy  # in-flight work bound (the router's `admission` parameter)
    max_queue_size: int  # the router queue's bound (default_queue_policy.max_queue_size)
    reasons: dict[str, str] = field(default_factory=dict)  # knob -> why


def _wait_budget(curves: Mapping[int, LatencyCurve], slo_p95_ms: float, overhead_ms: float,
                 budget_buckets: Collection[int] | None = None) -> tuple[int, float, float]:
    """(slowest bucket, its c(1), W = S - o - c_slowest(1)) over `budget_buckets` (default: every
    bucket; plan_slo_fit leaves out those that miss the SLO anyway); ValueError when W <= 0."""
    candidates = curves.keys() if budget_buckets is None else budget_buckets
    unknown = sorted(set(candidates) - set(curves))
    if unknown or not candidates:
        raise ValueError(f"the admission budget needs buckets with curves, got {sorted(candidates)} "
                         f"of {sorted(curves)}")
    slowest_bucket = max(candidates, key=lambda bucket: curves[bucket].at(1))
    slowest_ms = curves[slowest_bucket].at(1)
    wait_budget_ms = slo_p95_ms - overhead_ms - slowest_ms
    if wait_budget_ms <= 0:
        raise ValueError(f"SLO {slo_p95_ms:.0f} ms leaves no room for queued work: overhead {overhead_ms:.1f} ms "
                         f"plus one row of bucket {slowest_bucket} ({slowest_ms:.1f} ms) already fill it")
    return slowest_bucket, slowest_ms, wait_budget_ms


def admission_target_ms(curves: Mapping[int, LatencyCurve], slo_p95_ms: float, overhead_ms: float,
                        budget_buckets: Collection[int] | None = None) -> float:
    """The latency the router's admission steers its answers to: S - o - 3/4 of the rest of
    W (what the bound on work in flight does not start with). The router's clock starts when
    an instance takes the request; under overload the wait before that (the router's queue,
    the front end on busy cores) grows, and admission cannot see it. The bucket lingers are
    derived inside the target. W is taken over `budget_buckets` (default: every bucket).
    ValueError when S - o - c_slowest(1) <= 0."""
    _, _, wait_budget_ms = _wait_budget(curves, slo_p95_ms, overhead_ms, budget_buckets)
    unseen_wait_ms = wait_budget_ms * (1.0 - ADMISSION_WORK_SHARE)
    # Measured at 288 req/s offered for 60 s (2 vCPU, 1.2x goodput): aiming at S - o let the
    # admitted p95 reach 256 ms; with a router that held each request in an instance, aiming
    # at S - o - qw/2 let it reach 200.4 ms and three quarters held it at 192 ms.
    return slo_p95_ms - overhead_ms - 0.75 * unseen_wait_ms


def derive_admission(curves: Mapping[int, LatencyCurve], preferred: Mapping[int, int], lanes: int,
                     slo_p95_ms: float, overhead_ms: float, peak_rps: float,
                     budget_buckets: Collection[int] | None = None,
                     batch_ms: Mapping[int, float] | None = None) -> Admission:
    """How much the router lets in, so that what it admits still meets the SLO under overload.

    A row of bucket b costs c_b(p_b) / p_b of a lane at its preferred batch p_b. A request
    finishes after about o + (work ahead of it) + its own batch, so the waiting budget is
    W = S - o - max_b c_b(1). The bucket models run side by side on the lanes, so the work
    ahead of a request counts as the lanes share it (`shared_work_ahead_ms`): a row ahead costs
    it at most its own work. The bound on work in flight starts at `ADMISSION_WORK_SHARE`
    of W and adapts to the answers (`admission_target_ms`). The router queue only holds
    requests while an instance hands earlier ones to its workers (or waits for a busy core);
    its bound is what peak traffic brings in over S - o (Little's law), at least one
    request: a request held longer than that is late anyway. W is taken over
    `budget_buckets` (default: every bucket); the rows of the others are still admitted
    and costed. `batch_ms` (bucket -> c(max_batch), for the buckets whose queues take a
    request's timeout) makes every admitted request carry its deadline, S - o after it
    arrived, to those queues.
    """
    row_cost_ms = {bucket: curve.at(preferred[bucket]) / preferred[bucket] for bucket, curve in curves.items()}
    slowest_bucket, slowest_ms, wait_budget_ms = _wait_budget(curves, slo_p95_ms, overhead_ms, budget_buckets)
    max_work_ms = wait_budget_ms * ADMISSION_WORK_SHARE
    hand_off_ms = slo_p95_ms - overhead_ms
    max_queue_size = max(1, math.ceil(peak_rps * hand_off_ms / 1000.0))
    target_ms = admission_target_ms(curves, slo_p95_ms, overhead_ms, budget_buckets)
    # The floor: half a row of the slowest bucket per lane (`MIN_WORK_ROW_SHARE` says why).
    min_work_ms = min(MIN_WORK_ROW_SHARE * slowest_ms / lanes, max_work_ms)
    max_limit_ms = slo_p95_ms - overhead_ms
    costs = ", ".join(f"{b}: {c:.2f}" for b, c in sorted(row_cost_ms.items()))
    budget = (f"W = S - o - c_{slowest_bucket}(1) = {slo_p95_ms:.0f} - {overhead_ms:.1f} - {slowest_ms:.1f} "
              f"= {wait_budget_ms:.1f} ms")
    left_out = sorted(set(curves) - set(budget_buckets if budget_buckets is not None else curves))
    if left_out:
        budget += (f", taken over the buckets that can meet the SLO "
                   f"({', '.join(map(str, sorted(budget_buckets or ())))}): bucket(s) "
                   f"{', '.join(map(str, left_out))} cannot, and their rows are still admitted and costed")
    reasons = {}
    if batch_ms:
        longest = ", ".join(f"{b}: {c:.1f}" for b, c in sorted(batch_ms.items()))
        reasons["deadlines"] = (f"an admitted request's answer is due S - o = {max_limit_ms:.1f} ms after it arrived "
                                f"(its X-Request-Start stamp, else when the router took it); each chunk goes to its "
                                f"bucket with the time left less the bucket's longest execution c(max_batch) "
                                f"({longest} ms) as its timeout, so a chunk that would be answered late is rejected "
                                f"in the bucket's queue (503, retry) before any compute")
    return Admission(
        policy=AdmissionPolicy(row_cost_ms=row_cost_ms, lanes=lanes, max_work_ms=max_work_ms, target_ms=target_ms,
                               min_work_ms=min_work_ms, max_limit_ms=max_limit_ms, shared_lanes=True,
                               probe_ms=slowest_ms,  # one row on each lane: lanes x c(1) / lanes
                               batch_ms=dict(batch_ms or {})),
        max_queue_size=max_queue_size,
        reasons={
            "admission": (f"admit while work in flight <= the bound, which starts at {ADMISSION_WORK_SHARE:.0%} of "
                          f"{budget}: {max_work_ms:.1f} ms per lane ({lanes} lanes), halved for each tenant tier "
                          f"below the default; row cost ms by bucket (c(p)/p): {costs}; the buckets share the "
                          f"lanes at once, so a row ahead counts at most the request's own work (a short request "
                          f"is not kept waiting for the long work ahead of it)"),
            "admission_bound": (f"adapts to the answers so that 5% come back later than S - o - 3/4 of the rest "
                                f"of W (the wait before the router takes a request, which it cannot see) = "
                                f"{target_ms:.1f} ms (-5% per late one, +0.27% per one on time, "
                                f"+2% until the first late one; only answers admitted while half the bound was "
                                f"in use move it; a late answer cuts the bound it was admitted under, so answers "
                                f"admitted together cut it once, and one past S - o by target / latency, to half "
                                f"at most); between {MIN_WORK_ROW_SHARE:g} of a row of bucket {slowest_bucket} "
                                f"({min_work_ms:.1f} ms per lane) and S - o = {max_limit_ms:.1f} ms; until an "
                                f"answer is late after the server drained, a request with no more than one row of "
                                f"bucket {slowest_bucket} on each lane ahead of it ({slowest_ms:.1f} ms per lane) is "
                                f"admitted, as by an idle server"),
            "max_queue_size": (f"the router queue holds requests only while an instance hands earlier ones to "
                               f"its workers, or while busy cores keep the instances waiting for their turn; Little's "
                               f"law at peak over S - o: {peak_rps:.0f} req/s x {hand_off_ms:.1f} ms = "
                               f"{max_queue_size} (a request held longer is late anyway)"),
            **reasons,
        },
    )
