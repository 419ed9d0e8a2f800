"""Lingers by traffic regime: no waiting at light load, the derived lingers near peak.

Triton's dynamic batcher has one `max_queue_delay_microseconds` per model. A linger sized for
peak traffic (the time peak arrivals take to fill the batch the device needs) is waited out in
full when traffic is light, because the batch never fills: measured on 2 vCPU with `embed`
(lingers 60 and 40 ms on its two shortest buckets), 4 req/s of the embed mix had p50 70 ms,
against 13 ms with every linger 0; but every linger 0 at peak cost a fifth of the goodput (96
against 120 req/s in one paired round): below the batch sizes the derivation plans, the short
buckets' single-row executions take the cores the long ones need.

So a bucketed model has two regimes, and the kit switches between them as traffic moves
(`tools.server.lingers` reloads the bucket models with the other linger):
- light: every linger 0, while the device keeps up with every bucket running unbatched, which
  it does up to `unbatched_capacity_rps`: the rate at which single-row executions of the mix,
  plus the router's CPU, fill the lanes to the utilisation the derivation plans for;
- peak: the derived lingers, as config.pbtxt has them (what a server without the switch runs).
The switch up happens as soon as the measured rate reaches `UP_SHARE` of that capacity, well
before it: a reload takes seconds, and until it is done the light regime carries the traffic.
The switch down waits until the rate has stayed under `DOWN_SHARE` for `HOLD_S` seconds, so a
rate near the boundary does not make the models reload back and forth.

Everything here is pure; the router's config carries the regimes as a JSON parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tools.spec.profile import LatencyCurve

REGIMES_PARAMETER = "linger_regimes"  # the router config parameter holding `LingerRegimes.to_json()`
UP_SHARE = 0.5  # switch to the peak lingers at this share of the unbatched capacity
DOWN_SHARE = 0.3  # switch back to no lingers under this share ...
HOLD_S = 30.0  # ... once the rate has stayed under it this long
RATE_WINDOW_S = 5.0  # the arrival rate is measured over this window


class Regime(StrEnum):
    LIGHT = "light"
    PEAK = "peak"


@dataclass(frozen=True)
class LingerRegimes:
    """When to run which lingers, per bucket model (microseconds)."""

    up_rps: float  # model requests/s at which the peak lingers take over
    down_rps: float  # model requests/s under which, held for hold_s, the light lingers take over
    hold_s: float
    peak_us: Mapping[str, int]  # bucket model -> linger at peak (its config.pbtxt); only those that linger
    light_us: Mapping[str, int] = field(default_factory=dict)  # the same bucket models -> linger at light load
    window_s: float = RATE_WINDOW_S

    def __post_init__(self) -> None:
        if not 0 < self.down_rps < self.up_rps:
            raise ValueError(f"need 0 < down_rps < up_rps, got {self.down_rps} and {self.up_rps}")
        if self.hold_s < 0 or self.window_s <= 0:
            raise ValueError(f"need hold_s >= 0 and window_s > 0, got {self.hold_s} and {self.window_s}")
        if set(self.light_us) != set(self.peak_us):
            raise ValueError("light and peak lingers must name the same bucket models")

    def linger_us(self, regime: Regime) -> Mapping[str, int]:
        return self.light_us if regime is Regime.LIGHT else self.peak_us

    def to_json(self) -> str:
        return json.dumps({"up_rps": round(self.up_rps, 2), "down_rps": round(self.down_rps, 2),
                           "hold_s": self.hold_s, "window_s": self.window_s,
                           "peak_us": dict(sorted(self.peak_us.items())),
                           "light_us": dict(sorted(self.light_us.items()))}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LingerRegimes:
        """Parse the router's parameter; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
            return cls(up_rps=float(data["up_rps"]), down_rps=float(data["down_rps"]), hold_s=float(data["hold_s"]),
                       window_s=float(data.get("window_s", RATE_WINDOW_S)),
                       peak_us={str(k): int(v) for k, v in data["peak_us"].items()},
                       light_us={str(k): int(v) for k, v in data["light_us"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{REGIMES_PARAMETER}: {err!r} in {text[:200]!r}") from None


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


def derive_regimes(peak_us: Mapping[str, int], capacity_rps: float, peak_rps: float,
                   up_share: float = UP_SHARE, down_share: float = DOWN_SHARE,
                   hold_s: float = HOLD_S) -> tuple[LingerRegimes | None, str]:
    """The two regimes and the reason, or None (and why) when there is nothing to switch: no
    bucket lingers at peak, or the peak rate itself is light."""
    if not any(peak_us.values()):
        return None, "no bucket lingers at peak, so light traffic waits for nothing"
    peak_us = {name: us for name, us in peak_us.items() if us > 0}  # the others never linger
    up, down = up_share * capacity_rps, down_share * capacity_rps
    if up >= peak_rps:
        return None, (f"the peak rate {peak_rps:.0f} req/s is under {up_share:.0%} of the unbatched capacity "
                      f"({capacity_rps:.0f} req/s): the derived lingers hold at every rate")
    regimes = LingerRegimes(up_rps=up, down_rps=down, hold_s=hold_s, peak_us=dict(peak_us),
                            light_us={name: 0 for name in peak_us})
    lingering = ", ".join(f"{name} {us / 1000:.0f} ms" for name, us in sorted(peak_us.items()) if us)
    return regimes, (f"lingers ({lingering}) only near peak: from {up:.1f} req/s ({up_share:.0%} of the "
                     f"{capacity_rps:.0f} req/s the lanes carry with every bucket unbatched at the planned "
                     f"utilisation); below {down:.1f} req/s ({down_share:.0%}) held {hold_s:.0f} s, every linger "
                     f"is 0 (the lanes are mostly idle, so a request runs at once); `serve` switches them")


@dataclass(frozen=True)
class RegimeState:
    regime: Regime
    below_since: float | None = None  # when the rate last went under down_rps (peak only)


def next_state(state: RegimeState, rate_rps: float, now: float, regimes: LingerRegimes) -> RegimeState:
    """The regime after a rate measured at `now` (seconds, monotonic)."""
    if rate_rps >= regimes.up_rps:
        return RegimeState(Regime.PEAK)
    if state.regime is Regime.LIGHT:
        return state
    if rate_rps >= regimes.down_rps:
        return RegimeState(Regime.PEAK)
    below_since = state.below_since if state.below_since is not None else now
    if now - below_since >= regimes.hold_s:
        return RegimeState(Regime.LIGHT)
    return RegimeState(Regime.PEAK, below_since)


def windowed_rate(samples: Sequence[tuple[float, int]], window_s: float) -> float | None:
    """Requests/s over the last `window_s` of (time, cumulative count) samples, oldest first;
    None until the samples span the window (a counter that went back, a restart, counts afresh)."""
    if len(samples) < 2:
        return None
    now, latest = samples[-1]
    start = next((sample for sample in reversed(samples) if now - sample[0] >= window_s), None)
    if start is None:
        return None
    elapsed, counted = now - start[0], latest - start[1]
    if counted < 0:
        return None
    return counted / elapsed
