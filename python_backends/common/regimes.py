"""Which model a router sends a lingering bucket's rows to: the bucket model near peak, the
express model at light load.

A bucket model lingers (`max_queue_delay_microseconds`) so that peak traffic fills the batch
the device needs; at light load the batch never fills and every request waits the linger out.
Triton's batcher has one delay per model, so a model that lingers has a twin without one: the
express model (`<prefix>express`: the same graph and versions, the variable axis free, no
linger, no preferred size; requests that come while its instances are busy still batch). A
router runs this state machine over its arrival rate and, in the light regime, sends the rows
of every lingering bucket to the express model, padded as for their bucket.

The rate is each router instance's own arrivals times `instances`: Triton spreads a model's
requests over its instances, not evenly at light load (an idle instance takes the next
request), so one instance may see more than its share. The hysteresis absorbs that error: the
switch up is at half the rate the device carries unbatched, the switch down at under a third
held `hold_s`, and every instance decides for itself (an instance that switches early sends its
requests to the other path, both of which serve them). The switch down reads the rate over
`window_s`; the switch up also reads the last `RECENT_SLOTS` slots (one second), so that
traffic jumping from idle to peak leaves the express model within a second: with the 5 s
window alone, 96 req/s after an idle spell sent 171 to 177 rows (about 2 s) to the express
model unbatched, and those 20 s steps met the SLO for 2 to 5 points fewer requests than the
same steps through a router without regimes, on the same server (2 vCPU).

Pure: the clock is passed in (`now`, seconds, monotonic). The router's config carries
`LingerRegimes` as the JSON parameter `linger_regimes`; `tools.planning.regimes` derives it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import PlainSerializer, PlainValidator

REGIMES_PARAMETER = "linger_regimes"  # the router config parameter holding `LingerRegimes.to_json()`
RATE_WINDOW_S = 5.0  # the arrival rate is measured over this window
RATE_SLOTS = 10  # ... counted in this many slots
RECENT_SLOTS = 2  # the switch up also reads the rate over the last this many slots (1 s of 5)
EXPRESS_SUFFIX = "express"  # the express model is <prefix>express: a bucket's suffix is a length (or "fixed")


def express_model_name(prefix: str) -> str:
    """The express model of the bucket models `<prefix><length>`: never one of theirs names."""
    return f"{prefix}{EXPRESS_SUFFIX}"


class Regime(StrEnum):
    LIGHT = "light"  # the lingering buckets' rows go to the express model
    PEAK = "peak"  # every row goes to its bucket model, which lingers as derived


@dataclass(frozen=True)
class LingerRegimes:
    """When a router sends which rows to the express model."""

    up_rps: float  # model requests/s at which the bucket models take the rows back (peak)
    down_rps: float  # model requests/s under which, held for hold_s, the express model takes them (light)
    hold_s: float  # how long the rate must stay under down_rps before the switch down
    instances: int  # router instances: each measures its own arrivals and scales them by this
    express: str  # the express model: the lingering buckets' graph, no linger, any bucket length
    peak_us: Mapping[str, int]  # bucket model -> its linger (config.pbtxt); the buckets whose rows go express
    window_s: float = RATE_WINDOW_S  # the arrival rate is measured over this window

    def __post_init__(self) -> None:
        if not 0 < self.down_rps < self.up_rps:
            raise ValueError(f"need 0 < down_rps < up_rps, got {self.down_rps} and {self.up_rps}")
        if self.hold_s < 0 or self.window_s <= 0:
            raise ValueError(f"need hold_s >= 0 and window_s > 0, got {self.hold_s} and {self.window_s}")
        if self.instances < 1:
            raise ValueError(f"need instances >= 1, got {self.instances}")
        if not self.express:
            raise ValueError("the express model needs a name")
        if not self.peak_us or any(us <= 0 for us in self.peak_us.values()):
            raise ValueError(f"peak_us must name the lingering bucket models, each with a linger > 0, got "
                             f"{dict(self.peak_us)}")
        if self.express in self.peak_us:
            raise ValueError(f"the express model {self.express!r} cannot also be a bucket model")

    def target(self, model_name: str, regime: Regime) -> str:
        """The model that serves the rows bound for bucket model `model_name` in `regime`."""
        if regime is Regime.LIGHT and model_name in self.peak_us:
            return self.express
        return model_name

    def to_json(self) -> str:
        return json.dumps({"up_rps": round(self.up_rps, 2), "down_rps": round(self.down_rps, 2),
                           "hold_s": self.hold_s, "window_s": self.window_s, "instances": self.instances,
                           "express": self.express, "peak_us": dict(sorted(self.peak_us.items()))},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LingerRegimes:
        """Parse the router's parameter; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
            return cls(up_rps=float(data["up_rps"]), down_rps=float(data["down_rps"]), hold_s=float(data["hold_s"]),
                       window_s=float(data.get("window_s", RATE_WINDOW_S)), instances=int(data["instances"]),
                       express=str(data["express"]), peak_us={str(k): int(v) for k, v in data["peak_us"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{REGIMES_PARAMETER}: {err!r} in {text[:200]!r}") from None


def _parse_regimes(value: object) -> LingerRegimes | None:
    if value is None or isinstance(value, LingerRegimes):
        return value
    return LingerRegimes.from_json(str(value)) if value else None


# The router parameter: `LingerRegimes` as JSON; absent or empty: no bucket lingers, no express model.
RegimesParameter = Annotated[LingerRegimes | None, PlainValidator(_parse_regimes),
                             PlainSerializer(lambda regimes: regimes.to_json() if regimes else "", return_type=str)]


@dataclass(frozen=True)
class RegimeState:
    regime: Regime
    below_since: float | None = None  # when the rate last went under down_rps (peak only)


def next_state(state: RegimeState, rate_rps: float, now: float, regimes: LingerRegimes,
               recent_rps: float = 0.0) -> RegimeState:
    """The regime after the rates measured at `now` (seconds, monotonic): `rate_rps` over the
    window, `recent_rps` over its last second (which only hastens the switch up)."""
    if max(rate_rps, recent_rps) >= regimes.up_rps:
        return RegimeState(Regime.PEAK)
    if state.regime is Regime.LIGHT:
        return state
    if rate_rps >= regimes.down_rps:
        return RegimeState(Regime.PEAK)
    below_since = state.below_since if state.below_since is not None else now
    if now - below_since >= regimes.hold_s:
        return RegimeState(Regime.LIGHT)
    return RegimeState(Regime.PEAK, below_since)


class ArrivalRate:
    """Arrivals per second over the last `window_s`, counted in `num_slots` slots of equal
    length (O(1) per arrival): the full slots before the current one, and the current one for
    as long as it has run. Slots before the first arrival count as empty, so the rate starts
    low and reaches the true one after a window."""

    def __init__(self, window_s: float = RATE_WINDOW_S, num_slots: int = RATE_SLOTS):
        if window_s <= 0 or num_slots < 2:
            raise ValueError(f"need window_s > 0 and num_slots >= 2, got {window_s} and {num_slots}")
        self.slot_s = window_s / num_slots
        self.counts = [0] * num_slots
        self.slot: int | None = None  # the current slot: floor(now / slot_s) at the last advance

    def slot_of(self, now: float) -> int:
        return math.floor(now / self.slot_s)

    def advance(self, now: float) -> None:
        """Move to the slot of `now`, emptying those passed (a clock that went back stays put)."""
        current = self.slot_of(now)
        if self.slot is None:
            self.slot = current
            return
        for passed in range(self.slot + 1, min(current, self.slot + len(self.counts)) + 1):
            self.counts[passed % len(self.counts)] = 0
        self.slot = max(self.slot, current)

    def add(self, now: float, count: int = 1) -> None:
        self.advance(now)
        self.counts[self.slot % len(self.counts)] += count

    def rate(self, now: float, num_slots: int | None = None) -> float:
        """Arrivals per second over the last `num_slots` slots (all by default): the full ones
        before the current slot and the current one as far as it has run."""
        self.advance(now)
        num_slots = len(self.counts) if num_slots is None else min(max(num_slots, 1), len(self.counts))
        elapsed_in_slot = min(max(now - self.slot * self.slot_s, 0.0), self.slot_s)
        counted = sum(self.counts[(self.slot - back) % len(self.counts)] for back in range(num_slots))
        span = (num_slots - 1) * self.slot_s + elapsed_in_slot
        return counted / span if span > 0 else 0.0


class RegimeTracker:
    """One router instance's regime: its arrivals in, the regime out (`observe`).

    Between two arrivals the rate only falls, one slot at a time: `observe` first walks the
    slot boundaries since the last arrival, so that after a quiet spell the hold counts from
    when the rate went under `down_rps`, not from the next request."""

    def __init__(self, regimes: LingerRegimes, num_slots: int = RATE_SLOTS):
        self.regimes = regimes
        self.rate = ArrivalRate(regimes.window_s, num_slots)
        self.state = RegimeState(Regime.LIGHT)  # a server starts idle
        self.last: float | None = None

    @property
    def regime(self) -> Regime:
        return self.state.regime

    def model_rate(self, now: float, num_slots: int | None = None) -> float:
        """The model's arrival rate as this instance estimates it (its own, times the instances),
        over the window or its last `num_slots` slots."""
        return self.rate.rate(now, num_slots) * self.regimes.instances

    def _step(self, now: float) -> None:
        self.state = next_state(self.state, self.model_rate(now), now, self.regimes,
                                self.model_rate(now, RECENT_SLOTS))

    def observe(self, now: float, arrivals: int = 1) -> Regime:
        """Count `arrivals` requests at `now` and return the regime they are served in."""
        if self.last is not None:
            first = self.rate.slot_of(self.last) + 1
            last = min(self.rate.slot_of(now), first + len(self.rate.counts))  # empty from there on
            for slot in range(first, last + 1):
                self._step(slot * self.rate.slot_s)
        self.last = now if self.last is None else max(self.last, now)
        self.rate.add(now, arrivals)
        self._step(now)
        return self.state.regime
