"""When the router serves a request on the thread Triton called `execute` on, not on a worker.

A router instance hands each admitted request to a worker thread, so that it holds none and
many requests reach the bucket models at once (their batches form from them). The handoff
costs a request about a quarter of a millisecond on 2 vCPU (waking the worker, passing the
GIL, answering through the response sender from another thread): about a quarter of the
router's own work above the BLS hop. When the instance has nothing in flight and `execute`
got one request, no other request is waiting on this instance's handoff, so the request is
served where it arrived and its answer is `execute`'s return value (Triton sends it once the
instance is free again). While it is served, Triton gives the instance no new request: the
router's other instances take them, and a request that waits did so behind one short call.

What bounds that wait is the call's duration, and a bucket model that lingers holds a lone
request for its queue delay: each inline call is timed against its target's limit, which
gen-config derives from the target's measured c(1) (`tools.planning.derivation.derive_inline`,
written as the router parameter `inline_max_ms`; a limit of 0 keeps a target's calls off
the inline path, too long for anyone to wait behind), and a target whose calls took longer
than its limit `strikes` times in a row is served by workers only for `hold_off_s`. One slow
call is jitter (another process on the cores); a lingering target is slow on every call.
A request of several chunks always goes to a worker (its lanes run side by side there).
Free of Triton imports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import PlainSerializer, PlainValidator

INLINE_PARAMETER = "inline_max_ms"  # the router parameter: JSON {target model: limit ms}
DEFAULT_MAX_MS = 15.0  # the limit of a target the parameter does not name (a hand-written config)


@dataclass(frozen=True)
class InlinePolicy:
    """How long an inline call may keep an instance from taking the next request."""

    max_ms_by_target: Mapping[str, float] = field(default_factory=dict)  # target model -> its limit (ms); 0: never
    max_ms: float = DEFAULT_MAX_MS  # the limit of a target not named above
    strikes: int = 2  # calls over the limit in a row that send the target to the workers
    hold_off_s: float = 30.0  # for this long; then one inline call tries the target again

    def __post_init__(self) -> None:
        limits = list(self.max_ms_by_target.values())
        if not (self.max_ms > 0 and all(math.isfinite(limit) and limit >= 0 for limit in limits)
                and self.hold_off_s >= 0):
            raise ValueError(f"max_ms must be > 0, each target's limit >= 0 and hold_off_s >= 0, got {self.max_ms}, "
                             f"{limits}, {self.hold_off_s}")
        if self.strikes < 1:
            raise ValueError(f"strikes must be >= 1, got {self.strikes}")

    def limit_ms(self, target: str) -> float:
        return self.max_ms_by_target.get(target, self.max_ms)

    def to_json(self) -> str:
        return json.dumps({target: round(ms, 3) for target, ms in sorted(self.max_ms_by_target.items())})

    @classmethod
    def from_json(cls, text: str) -> InlinePolicy:
        """Parse the router's parameter; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
            return cls(max_ms_by_target={str(target): float(ms) for target, ms in data.items()})
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{INLINE_PARAMETER}: {err} in {text[:200]!r}") from None


def _parse_inline(value: object) -> InlinePolicy:
    if isinstance(value, InlinePolicy):
        return value
    return InlinePolicy.from_json(str(value)) if value else InlinePolicy()


# The router parameter: each target's limit as JSON; absent or empty: DEFAULT_MAX_MS for every target.
InlineParameter = Annotated[InlinePolicy, PlainValidator(_parse_inline),
                            PlainSerializer(lambda policy: policy.to_json(), return_type=str)]


def serves_inline(batch_size: int, in_flight: int, num_chunks: int) -> bool:
    """Whether an admitted request may be served on `execute`'s thread: the only request of the
    call, nothing of this instance in flight, one chunk (its target must not be `held_off`)."""
    return batch_size == 1 and in_flight == 0 and num_chunks == 1


def held_off(policy: InlinePolicy, target: str, held_off_until: Mapping[str, float], now_s: float) -> bool:
    """Whether `target` is served by the workers only at `now_s`: its limit is 0, or its inline
    calls were too long."""
    return policy.limit_ms(target) == 0 or held_off_until.get(target, 0.0) > now_s


def record_inline(policy: InlinePolicy, target: str, elapsed_ms: float, held_off_until: MutableMapping[str, float],
                  strikes: MutableMapping[str, int], now_s: float) -> None:
    """After an inline call to `target` that took `elapsed_ms`: count it against the target when
    it was over its limit (a call within it clears the count), and hold the target off the
    inline path for `policy.hold_off_s` at `policy.strikes` in a row."""
    if elapsed_ms <= policy.limit_ms(target):
        strikes.pop(target, None)
        return
    strikes[target] = strikes.get(target, 0) + 1
    if strikes[target] >= policy.strikes:
        held_off_until[target] = now_s + policy.hold_off_s
        strikes.pop(target, None)


def check_inline(policy: InlinePolicy, targets: list[str]) -> None:
    """The policy names only models the router sends rows to (its buckets, its express model)."""
    unknown = sorted(set(policy.max_ms_by_target) - set(targets))
    if unknown:
        raise ValueError(f"parameter {INLINE_PARAMETER} names {unknown}, which this router does not call "
                         f"({', '.join(targets)})")
