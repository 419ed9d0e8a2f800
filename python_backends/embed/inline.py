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

What bounds that wait is the call's duration, and the router does not know its bucket models'
queue delays (a lingering bucket holds a lone request for its delay): each inline call is
timed, and a target that took longer than `max_ms` is served by workers only for `hold_off_s`.
A request of several chunks always goes to a worker (its lanes run side by side there).
Free of Triton imports.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class InlinePolicy:
    """How long an inline call may keep an instance from taking the next request."""

    max_ms: float = 15.0  # a call longer than this (queue delay included) sends its target to the workers
    hold_off_s: float = 30.0  # for this long; then one inline call tries the target again

    def __post_init__(self) -> None:
        if not self.max_ms > 0 or not self.hold_off_s >= 0:
            raise ValueError(f"max_ms must be > 0 and hold_off_s >= 0, got {self.max_ms}, {self.hold_off_s}")


def serves_inline(batch_size: int, in_flight: int, num_chunks: int) -> bool:
    """Whether an admitted request may be served on `execute`'s thread: the only request of the
    call, nothing of this instance in flight, one chunk (its target must not be `held_off`)."""
    return batch_size == 1 and in_flight == 0 and num_chunks == 1


def held_off(target: str, held_off_until: Mapping[str, float], now_s: float) -> bool:
    """Whether `target` is served by the workers only at `now_s` (its last inline call was too long)."""
    return held_off_until.get(target, 0.0) > now_s


def record_inline(policy: InlinePolicy, target: str, elapsed_ms: float,
                  held_off_until: MutableMapping[str, float], now_s: float) -> None:
    """After an inline call to `target` that took `elapsed_ms`: hold the target off the inline
    path for `policy.hold_off_s` when the call was longer than `policy.max_ms`."""
    if elapsed_ms > policy.max_ms:
        held_off_until[target] = now_s + policy.hold_off_s
