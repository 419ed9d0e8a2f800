"""When a bucketed model's express model takes the lingering buckets' rows: the derivation of
the router's `linger_regimes` (`python_backends.common.regimes` holds the state machine the
router runs over it, and parses it).

Triton's dynamic batcher has one `max_queue_delay_microseconds` per model. A linger sized for
peak traffic (the time peak arrivals take to fill the batch the device needs) is waited out in
full when traffic is light, because the batch never fills: measured on 2 vCPU with `embed`
(lingers 60 and 40 ms on its two shortest buckets), 4 req/s of the embed mix had p50 70 ms,
against 13 ms with every linger 0; but every linger 0 at peak cost a fifth of the goodput (96
against 120 req/s in one paired round): below the batch sizes the derivation plans, the short
buckets' single-row executions take the cores the long ones need. Capping the lingers at 10 ms
kept neither (p50 24 ms; goodput 56 against 80 req/s in a noisy paired round).

So a bucketed model whose buckets linger at peak has two regimes:
- light: the rows of the lingering buckets go to the express model (no linger), while the
  device keeps up with every bucket running unbatched, which it does up to
  `unbatched_capacity_rps`: the rate at which single-row executions of the mix, plus the
  router's CPU, fill the lanes to the utilisation the derivation plans for;
- peak: every row goes to its bucket model with the derived linger (config.pbtxt).
Reloading the bucket models with another linger when the traffic moves (Triton's model control
with a config override) was measured first and dropped: each reload took 4 to 8 s on 2 vCPU and
stalled the requests meanwhile (p95 3.4 s at 4 req/s during it). Switching the router's target
costs nothing, so it can happen on every request.

The switch up comes at `UP_SHARE` of that capacity, well before it, since each router instance
estimates the model's rate from its own arrivals (times the instances) and may be early or
late (the last second of its window hastens it: traffic jumping from idle to peak otherwise
stays on the unbatched path for seconds); the switch down waits until the rate has stayed
under `DOWN_SHARE` for `HOLD_S` seconds, so a rate near the boundary does not flap. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from python_backends.common.regimes import LingerRegimes
from tools.planning.derivation import BatchingKnobs
from tools.spec.profile import LatencyCurve

UP_SHARE = 0.5  # the bucket models take the rows back at this share of the unbatched capacity
DOWN_SHARE = 0.3  # the express model takes them under this share ...
HOLD_S = 30.0  # ... once the rate has stayed under it this long


def unbatched_capacity_rps(shares: Mapping[str, float], curves: Mapping[str, LatencyCurve], rows_per_request: int,
                           lanes: int, router_cpu_ms: float, max_utilization: float) -> float:
    """Model requests/s at which single-row executions of every bucket (by its share of the
    rows), plus the router's CPU per request, keep `lanes` lanes `max_utilization` busy."""
    if lanes < 1 or not 0 < max_utilization <= 1 or rows_per_request < 1 or router_cpu_ms < 0:
        raise ValueError(f"need lanes >= 1, 0 < max_utilization <= 1, rows >= 1, router cpu >= 0; got {lanes}, "
                         f"{max_utilization}, {rows_per_request}, {router_cpu_ms}")
    lane_ms_per_request = router_cpu_ms + rows_per_request * sum(
        share * curves[name].at(1) for name, share in shares.items())
    return max_utilization * lanes * 1000.0 / lane_ms_per_request


def derive_regimes(peak_us: Mapping[str, int], capacity_rps: float, peak_rps: float, *, instances: int,
                   express: str, up_share: float = UP_SHARE, down_share: float = DOWN_SHARE,
                   hold_s: float = HOLD_S) -> tuple[LingerRegimes | None, str]:
    """The two regimes and the reason, or None (and why) when there is nothing to switch: no
    bucket lingers at peak, or the peak rate itself is light. `peak_us`: every bucket model's
    derived linger; `instances`: the router's; `express`: the express model's name."""
    if not any(peak_us.values()):
        return None, "no bucket lingers at peak, so light traffic waits for nothing"
    lingering = {name: us for name, us in peak_us.items() if us > 0}  # the others never linger
    up, down = up_share * capacity_rps, down_share * capacity_rps
    if up >= peak_rps:
        return None, (f"the peak rate {peak_rps:.0f} req/s is under {up_share:.0%} of the unbatched capacity "
                      f"({capacity_rps:.0f} req/s): the derived lingers hold at every rate")
    regimes = LingerRegimes(up_rps=up, down_rps=down, hold_s=hold_s, instances=instances, express=express,
                            peak_us=lingering)
    names = ", ".join(f"{name} {us / 1000:.0f} ms" for name, us in sorted(lingering.items()))
    return regimes, (f"lingers ({names}) only near peak: from {up:.1f} req/s ({up_share:.0%} of the "
                     f"{capacity_rps:.0f} req/s the lanes carry with every bucket unbatched at the planned "
                     f"utilisation) their rows go to their bucket models; below {down:.1f} req/s ({down_share:.0%}) "
                     f"held {hold_s:.0f} s, to {express}, which does not linger (the lanes are mostly idle, so a "
                     f"request runs at once); each of the {instances} router instance(s) measures its own arrivals "
                     f"(over {regimes.window_s:.0f} s, and over its last second for the switch up), times "
                     f"{instances}")


def derive_express(name: str, lingering: Mapping[int, BatchingKnobs], lanes: int) -> BatchingKnobs:
    """The express model's knobs, from the knobs of the buckets whose rows it takes at light load
    (bucket length -> knobs): no linger and no preferred size, so a request runs as soon as an
    instance is free (those that come while every instance is busy still batch); a batch as
    large as the largest of theirs, since the router cuts their rows into chunks of their own
    max_batch_size; one instance per lane; their queue bounds added up."""
    if not lingering or lanes < 1:
        raise ValueError(f"need at least one lingering bucket and lanes >= 1, got {sorted(lingering)} and {lanes}")
    largest = max(lingering, key=lambda length: lingering[length].max_batch_size)
    max_batch = lingering[largest].max_batch_size
    timeouts = [knobs.default_timeout_us for knobs in lingering.values()]
    timeout_us = 0 if 0 in timeouts else max(timeouts)
    queue_size = sum(knobs.max_queue_size for knobs in lingering.values())
    buckets = ", ".join(knobs.model_name for _, knobs in sorted(lingering.items()))
    return BatchingKnobs(
        model_name=name, max_batch_size=max_batch, preferred_batch_size=1, max_queue_delay_us=0,
        default_timeout_us=timeout_us, max_queue_size=queue_size, instance_count=lanes,
        reasons={
            "max_batch_size": f"the largest of the buckets it serves at light load ({buckets}): "
                              f"{lingering[largest].model_name}'s {max_batch}; the router cuts each bucket's rows "
                              "into chunks of that bucket's max_batch_size",
            "preferred_batch_size": "none: a batch is whatever waits when an instance is free",
            "max_queue_delay_microseconds": "0: it serves light traffic, whose batches never fill; requests that "
                                            "come while the instances are busy still batch",
            "default_timeout_microseconds": ("not set, as on the buckets it serves" if timeout_us == 0 else
                                             f"the longest of the buckets it serves: {timeout_us / 1e6:g} s "
                                             "(each request's deadline from the router shortens it, as there)"),
            "max_queue_size": f"the bounds of the buckets it serves, added up: {queue_size}",
            "instance_count": f"one per lane of the device: {lanes}",
        })
