"""Admission of the `embed` router: turn a request away at once when it cannot meet the SLO.

Under overload a queue only adds waiting: every request admitted beyond what the device can
finish within the SLO is served late, and so is every request behind it. The router
therefore keeps count of the work in flight, in device milliseconds (rows in flight times
the measured compute per row of their bucket, divided by the lanes that run in parallel),
and admits a request only while that work plus its own fits in `max_work_ms`, the part of
the SLO left for waiting and computing once the fixed overhead and the slowest single
batch are set aside. A refused request gets UNAVAILABLE (HTTP 503) with the numbers and
a "retry after" hint (the time the excess work takes to drain), at the cost of a
tokenization, and a client may retry it then or elsewhere.

Work is counted in device time, not requests: a 256-token row costs the device about 15x a
16-token one, so a count of requests would either refuse short requests needlessly or
admit long ones that cannot finish. The bucket models share the lanes at once (each has
its own queue and instances, and a CPU's cores are time-sliced between them), so a request
does not wait for all the work ahead of it: while it runs, a row ahead of it takes at most
as much of the lanes as the request itself needs (`shared_work_ahead_ms`, processor
sharing). A short request behind a burst of long ones is admitted; a long one is not.
`decide` and `shared_work_ahead_ms` are pure; `SharedWork` is the few bytes every router
instance (each its own process) shares.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from python_backends.common.shared_table import SharedTable

MAX_SLOTS = 1024  # router instances one server can run (64 per instance group, 16 groups)
COLUMNS = 16  # work columns per instance: work of no bucket, then up to 15 buckets


@dataclass(frozen=True)
class AdmissionPolicy:
    """What a row costs and how much work may be in flight; written by gen-config from the profile."""

    row_cost_ms: Mapping[int, float]  # bucket length -> device ms per row (at its preferred batch)
    lanes: int  # executions the device runs side by side
    max_work_ms: float  # starting bound on in-flight work (ms of device time per lane); 0: admit all
    target_ms: float = 0.0  # router-side latency an admitted request should stay within; 0: fixed bound
    min_work_ms: float = 0.0  # the adaptive bound never goes below this
    max_limit_ms: float = 0.0  # ... nor above this
    shared_lanes: bool = False  # buckets share the lanes at once: count work ahead as processor sharing
    # While probing, a request with no more than this ahead (ms per lane) is admitted as by an
    # idle server: one row of the slowest bucket W is taken over on each lane (`decide`); 0: none
    probe_ms: float = 0.0
    # bucket length -> c(max_batch), its longest execution: with it, every admitted request's
    # chunks carry a queue deadline to their bucket (`queue_wait_ms`); empty: none
    batch_ms: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if not self.max_work_ms >= 0:
            raise ValueError(f"max_work_ms must be >= 0, got {self.max_work_ms}")
        if self.adaptive and not 0 < self.min_work_ms <= self.max_work_ms <= self.max_limit_ms:
            raise ValueError(f"need 0 < min_work_ms <= max_work_ms <= max_limit_ms, got {self.min_work_ms}, "
                             f"{self.max_work_ms}, {self.max_limit_ms}")
        if not self.probe_ms >= 0:
            raise ValueError(f"probe_ms must be >= 0, got {self.probe_ms}")
        for what, costs in (("row_cost_ms", self.row_cost_ms), ("batch_ms", self.batch_ms)):
            for bucket, cost in costs.items():
                if not cost >= 0:
                    raise ValueError(f"{what} of bucket {bucket} must be >= 0, got {cost}")

    @property
    def adaptive(self) -> bool:
        return self.max_work_ms > 0 and self.target_ms > 0

    @property
    def smallest_work_ms(self) -> float:
        """The least work any request brings: one row of the cheapest bucket (ms per lane)."""
        return min(self.row_cost_ms.values(), default=0.0) / self.lanes

    def work_ms(self, rows_by_bucket: Mapping[int, int]) -> float:
        """Device time (per lane) that these rows take."""
        return sum(self.work_by_bucket(rows_by_bucket).values())

    def work_by_bucket(self, rows_by_bucket: Mapping[int, int]) -> dict[int, float]:
        """Device time (per lane) that these rows take, bucket by bucket."""
        costs, work = self.row_cost_ms, {}
        for bucket, rows in rows_by_bucket.items():
            cost = costs.get(bucket)
            if cost is None:
                raise ValueError(f"no row cost for buckets {sorted(set(rows_by_bucket) - set(costs))}")
            work[bucket] = rows * cost / self.lanes
        return work

    def to_json(self) -> str:
        return json.dumps({"row_cost_ms": {str(b): round(c, 4) for b, c in sorted(self.row_cost_ms.items())},
                           "lanes": self.lanes, "max_work_ms": round(self.max_work_ms, 3),
                           "target_ms": round(self.target_ms, 3), "min_work_ms": round(self.min_work_ms, 3),
                           "max_limit_ms": round(self.max_limit_ms, 3), "shared_lanes": self.shared_lanes,
                           "probe_ms": round(self.probe_ms, 3),
                           **({"batch_ms": {str(b): round(c, 3) for b, c in sorted(self.batch_ms.items())}}
                              if self.batch_ms else {})},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AdmissionPolicy:
        try:
            data = json.loads(text)
            lanes, min_work_ms = int(data["lanes"]), float(data.get("min_work_ms", 0.0))
            return cls(row_cost_ms={int(b): float(c) for b, c in data["row_cost_ms"].items()},
                       lanes=lanes, max_work_ms=float(data["max_work_ms"]),
                       target_ms=float(data.get("target_ms", 0.0)), min_work_ms=min_work_ms,
                       max_limit_ms=float(data.get("max_limit_ms", 0.0)),
                       shared_lanes=bool(data.get("shared_lanes", False)),
                       # a config written before probe_ms: the floor on every lane, as it was admitted then
                       probe_ms=float(data.get("probe_ms", min_work_ms * lanes)),
                       batch_ms={int(b): float(c) for b, c in data.get("batch_ms", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"admission policy is not valid: {err}") from None


ADMIT_ALL = AdmissionPolicy(row_cost_ms={}, lanes=1, max_work_ms=0.0)


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    work_ahead_ms: float  # in flight when the request arrived, ms per lane
    own_work_ms: float  # what the request adds
    limit_ms: float  # what its tier may have in flight, its own work included
    waited_ms: float | None = None  # how long it waited before the router took it; None: unknown
    bound_ms: float = 0.0  # the shared bound it was decided under, before its tier's share
    at_least: bool = False  # own_work_ms is the least any request brings, decided before its rows were known

    @property
    def filled(self) -> float:
        """The share of its limit in use once it was admitted, its own work included."""
        return (self.work_ahead_ms + self.own_work_ms) / self.limit_ms if self.limit_ms > 0 else 1.0

    @property
    def retry_after_s(self) -> float:
        """When refused: how long until enough of the work in flight has drained for this
        request to fit, had nothing else arrived (work is in ms per lane, and a lane drains a
        ms of it per ms); at least 1 ms. 0 when admitted."""
        if self.admitted:
            return 0.0
        return max(0.001, (self.work_ahead_ms + self.own_work_ms - self.limit_ms) / 1000.0)

    def message(self) -> str:
        waited = f" after its {self.waited_ms:.0f} ms wait before the router" if self.waited_ms else ""
        if self.waited_ms and self.limit_ms <= 0:
            return (f"server busy: this request waited {self.waited_ms:.0f} ms before the router took it, too "
                    f"long to meet the latency SLO; retry after {self.retry_after_s:.3f} s")
        own = f"at least {self.own_work_ms:.0f}" if self.at_least else f"{self.own_work_ms:.0f}"
        return (f"server busy: {self.work_ahead_ms:.0f} ms of work in flight plus this request's "
                f"{own} ms exceeds the {self.limit_ms:.0f} ms that still meets the latency SLO"
                f"{waited}; retry after {self.retry_after_s:.3f} s")


def shared_work_ahead_ms(policy: AdmissionPolicy, ahead_by_bucket: Mapping[int | None, float],
                         own_work_ms: float) -> float:
    """The work in flight that runs before a request of `own_work_ms` finishes (ms per lane).

    Without `shared_lanes` the device is one queue: all of it. With them, the buckets run side
    by side on the lanes and share them evenly (processor sharing): until the request has had
    its own `own_work_ms`, every row ahead has had at most as much, so a bucket's work ahead
    counts in full only when its rows are no larger than the request. Its rows then finish
    first; a longer row is still running when the request is done. The request finishes after
    sum over buckets of (work ahead x min(1, own / the bucket's row cost)) + its own work.
    Work of a bucket without a row cost (None: counted without a bucket) counts in full.
    """
    total = sum(ahead_by_bucket.values())
    if not policy.shared_lanes or own_work_ms <= 0:
        return total
    ahead = 0.0
    for bucket, work_ms in ahead_by_bucket.items():
        row_ms = policy.row_cost_ms.get(bucket, 0.0) / policy.lanes
        ahead += work_ms if row_ms <= own_work_ms else work_ms * own_work_ms / row_ms
    return ahead


def tier_share(priority: int, default_priority: int) -> float:
    """Share of the admission budget a tier may fill: the default tier and those above it all of
    it, each level below the default half of the level above. A bulk tier is then turned away
    while the tiers above still find room, and its own work can never fill their share."""
    return 1.0 if priority <= default_priority else 0.5 ** (priority - default_priority)


def decide(policy: AdmissionPolicy, work_ahead_ms: float, own_work_ms: float, share: float = 1.0,
           bound_ms: float | None = None, waited_ms: float | None = None,
           probing: bool = False) -> AdmissionDecision:
    """Admit when the work in flight, this request's included, stays within its tier's share of
    the bound (`bound_ms`, the adaptive bound now; `max_work_ms` when None). An idle server
    admits anything, so a request larger than the whole bound is served (late) rather than
    refused forever.

    While `probing` (no answer has been late since the server last drained), a server with no
    more than its tier's share of `probe_ms` ahead of a request (one row of the slowest bucket
    W is taken over, on each lane) admits it whatever its own work, as an idle one does: the
    request then waits at most one such row, which W already sets aside. At light load the
    bound has rarely been in use and has barely moved from its starting guess, or sits at its
    floor where earlier bursts left it, which says nothing about the load now: without this,
    long rows that happened to overlap at 6 req/s were turned away (one request in 91, and in
    90, of 15 s Locust runs of three users, on servers whose answers all came back within the
    target). Exempting only the floor's worth (half a longest row per lane: one longest row in
    all, the other lane idle) still refused one request in 92 of such a run on a slower 2-core
    host (its p95 57 ms against the 200 ms SLO): a longest row and any other request ahead are
    more than that, while three users never have more than two rows ahead of them, at most one
    longest row per lane. Such an admission fills the bound, so its answer moves the bound
    either way (`adjust_bound`): light load teaches it what the long rows cost. Under overload
    answers are late and the server never drains, so this never applies there; in a surge from
    idle it admits only until one such row per lane is in flight, and the bound decides after.

    `waited_ms`, how long the request waited before the router took it (its `X-Request-Start`
    stamp; None: unknown), takes what it used from the latency left to it: the work ahead and
    its own must also fit in `max_limit_ms` (S - o) less the wait, and a request that waited
    longer than that is refused even by an idle server: its answer would be late whatever the
    router did, so it costs no compute (a deadline that passed in a queue)."""
    bound_ms = policy.max_work_ms if bound_ms is None else bound_ms
    limit_ms = bound_ms * share
    if policy.max_work_ms <= 0:
        return AdmissionDecision(True, work_ahead_ms, own_work_ms, limit_ms, bound_ms=bound_ms)
    late = deadline_passed(policy, waited_ms)
    if late is not None:
        return late
    if waited_ms is not None and policy.max_limit_ms > 0:
        limit_ms = min(limit_ms, policy.max_limit_ms - waited_ms)
    idle_ms = policy.probe_ms * share if probing and policy.adaptive else 0.0
    admitted = work_ahead_ms <= idle_ms or work_ahead_ms + own_work_ms <= limit_ms
    return AdmissionDecision(admitted, work_ahead_ms, own_work_ms, limit_ms, waited_ms, bound_ms)


def deadline_passed(policy: AdmissionPolicy, waited_ms: float | None) -> AdmissionDecision | None:
    """The refusal of a request that waited longer than `max_limit_ms` (S - o) before the
    router took it, decided before any work on it (tokenizing included); None otherwise."""
    if waited_ms is None or policy.max_work_ms <= 0 or policy.max_limit_ms <= 0 or waited_ms < policy.max_limit_ms:
        return None
    return AdmissionDecision(False, 0.0, 0.0, 0.0, waited_ms)


def answer_deadline_s(policy: AdmissionPolicy, started_s: float, waited_ms: float | None,
                      chunks_by_bucket: Mapping[int, int], work_ahead_ms: float) -> float | None:
    """When the answer to a request the router took at `started_s` (its clock) turns late:
    S - o after it arrived, its wait before the router (`waited_ms`, its stamp) included.

    None where no deadline travels with it: admission off, no `batch_ms`, a request admitted
    with no work in flight ahead of it (`work_ahead_ms` below the least any request brings),
    or one whose own chunks (`chunks_by_bucket`: a bucket's chunks run one after another) take
    longer than that even at their buckets' longest batches on an idle server. The deadline
    sheds work that would queue behind others; an idle server dropping a request frees nothing
    for anyone, and its own slowness there (a cold server's first calls, the router's own
    work) is no reason to tell the client it is busy. Like `decide` on an idle server, such a
    request is served, late if need be, rather than refused at every try."""
    if not policy.batch_ms or policy.max_work_ms <= 0 or policy.max_limit_ms <= 0:
        return None
    if work_ahead_ms < max(policy.smallest_work_ms, 1e-9):
        return None
    left_ms = policy.max_limit_ms - (waited_ms or 0.0)
    if any(chunks * policy.batch_ms.get(bucket, 0.0) > left_ms for bucket, chunks in chunks_by_bucket.items()):
        return None
    return started_s + left_ms / 1000.0


def queue_wait_ms(policy: AdmissionPolicy, bucket_len: int, now_s: float, deadline_s: float | None,
                  chunks_left: int = 1) -> float | None:
    """How long a chunk of bucket `bucket_len` sent at `now_s` may wait in the bucket's queue and
    still be answered by `deadline_s` (`answer_deadline_s`): the time left less the bucket's
    longest execution, c(max_batch), for it and for each of the request's chunks of that
    bucket still to go after it (`chunks_left` counts it too). The router sends it as the
    request's timeout, so Triton rejects in its queue, before any compute, a chunk whose answer
    would be late (a deadline that travels with the request, as gRPC's do). None: no
    deadline; <= 0: late already."""
    if deadline_s is None or bucket_len not in policy.batch_ms:
        return None
    return (deadline_s - now_s) * 1000.0 - chunks_left * policy.batch_ms[bucket_len]


def seen_latency_ms(policy: AdmissionPolicy, router_ms: float, waited_ms: float | None) -> float:
    """The latency the adaptive bound judges an answer by: the router's own (from its instance
    taking the request to the answer), plus what the request waited before that when its
    stamp says (`waited_ms`; None: unknown).

    The target T leaves S - o - T for what the router cannot see. Without a stamp that is the
    wait before the router and the way back after its answer (the front end writing it, the
    network); with one, the wait is seen and counts in full, and the allowance is left to the
    way back alone. Letting the wait use the allowance first counted it twice: at 10x goodput
    on 2 vCPU the way back took 15 ms on average and the admitted p95 sat at the SLO (197 ms
    in two runs) while the bound aimed below it."""
    if waited_ms is None or policy.target_ms <= 0:
        return router_ms
    return router_ms + waited_ms


STEP = 0.05  # relative change of the bound per late answer
MAX_CUT = 0.5  # a late answer cuts the bound to no less than this share of the bound it was admitted under
LATE_SHARE = 0.05  # answers allowed past the target: the SLO is a p95
PROBE_STEP = 0.02  # growth per on-time answer until the first late one
FILLED_TO_MOVE = 0.5  # an answer moves the bound only if this share of it was in use at its admission


def adjust_bound(policy: AdmissionPolicy, bound_ms: float, latency_ms: float, probing: bool = False,
                 admitted: AdmissionDecision | None = None) -> float:
    """The bound after an admitted request came back in `latency_ms`; `admitted`, the decision
    that admitted it (None: as if under the bound now, with the bound in use).

    It tracks the largest bound at which no more than `LATE_SHARE` of the answers are later
    than the target: each late answer shrinks it by `STEP`, each one on time grows it by the
    factor that makes one late answer and 19 on time cancel, so it settles where 5% are late.
    Under overload it shrinks until what is admitted is on time again. The work estimate only
    has to be proportional to the truth.

    A late answer cuts the bound it was admitted under, not the bound now, and never raises
    it: the requests admitted together under one bound that was too large come back late
    together, and they are one signal, not one each (TCP halves its window once per round
    trip, not once per lost packet). Counted one by one, a burst of a hundred late answers
    took the bound to its floor (0.95^100), where it then stayed for hundreds of answers while
    the lanes ran short of work. An answer past `max_limit_ms` (S - o: the SLO itself missed)
    cuts deeper, by target / latency (the work that would have met the target, were latency
    proportional to it), down to `MAX_CUT` of the bound it was admitted under, so that a surge
    is met within a round trip or two.

    The starting bound is a guess from the profile, and at that pace an on-time server would
    take hundreds of answers to climb from it, refusing requests at light load meanwhile. So
    while `probing` (no answer has been late since the server last drained, like TCP's slow
    start) each on-time answer grows it by `PROBE_STEP`: about 60 answers span the whole range,
    and the first late answer ends the probing where the edge is.

    Only an answer admitted while the bound was at least `FILLED_TO_MOVE` in use moves it: one
    that came back on time while little was in flight says nothing about admitting more (TCP
    grows its window only while the window limits what it sends, RFC 7661), and one that came
    back late with little ahead of it was late for its own compute, which no bound shortens.
    Otherwise 40 answers of a 2 s warm-up at 20 req/s took the bound from 58 to 128 ms per
    lane, and the surge that followed was admitted on it: a fifth of its first 5 s came back
    past the SLO; and near capacity a lone long row late on its own halved the bound.
    """
    if admitted is not None and admitted.filled < FILLED_TO_MOVE:
        return bound_ms
    if latency_ms > policy.target_ms:
        admitted_under_ms = bound_ms if admitted is None else admitted.bound_ms
        cut = 1.0 - STEP
        if 0 < policy.max_limit_ms < latency_ms:  # past S - o: the SLO itself was missed
            cut = max(MAX_CUT, min(cut, policy.target_ms / latency_ms))
        bound_ms = min(bound_ms, admitted_under_ms * cut)
    elif probing:
        bound_ms *= 1.0 + PROBE_STEP
    else:
        bound_ms *= (1.0 / (1.0 - STEP)) ** (LATE_SHARE / (1.0 - LATE_SHARE))
    return min(policy.max_limit_ms, max(policy.min_work_ms, bound_ms))


def instance_slot(instance_name: str) -> int:
    """Slot of a Triton instance name such as `embed_0_3` (model, group index, instance index).

    A restarted instance keeps its name, so it takes over its slot (and resets it) rather
    than leaving the work of its dead predecessor counted forever.
    """
    match = re.search(r"_(\d+)_(\d+)$", instance_name)
    if not match:
        raise ValueError(f"instance name {instance_name!r} does not end in _<group>_<index>")
    group, index = int(match.group(1)), int(match.group(2))
    slot = group * 64 + index
    if index >= 64 or slot >= MAX_SLOTS:
        raise ValueError(f"instance {instance_name!r} is beyond the {MAX_SLOTS} admission slots")
    return slot


WORK_FIELDS = (("work_ms", "<f8", (COLUMNS,)),)  # a row per instance: work of no bucket, then by bucket
# Table-wide: the adaptive bound (0 until a request adjusted it), whether an answer was late
# since the server last drained (1.0) or not (0.0: probing), and how many rows from the top
# any instance has used (one past the highest slot opened): the sums read only those.
BOUND_FIELDS = (("bound_ms", "<f8"), ("late_seen", "<f8"), ("num_slots_used", "<u8"))


class SharedWork:
    """In-flight work of every router instance, by bucket: a row of floats per instance in a `SharedTable`.

    Each instance writes only its own row (a column per bucket, and column 0 for work of no
    bucket). `admit` reads the totals, decides and adds the request's work under the table's
    lock, so two instances deciding at the same moment cannot both take the last room. The
    totals sum only the rows up to the highest slot opened (`num_slots_used`): a router has a
    few instances, and the sums over all MAX_SLOTS rows were a fifth of the router's own CPU per
    request (measured in-process with a fake Triton on 2 vCPU: 237 -> 185 us per request).
    """

    def __init__(self, path: Path, slot: int, buckets: Sequence[int] = ()):
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot must be in [0, {MAX_SLOTS}), got {slot}")
        if len(set(buckets)) >= COLUMNS:
            raise ValueError(f"at most {COLUMNS - 1} buckets share admission, got {len(set(buckets))}")
        self._columns = {bucket: 1 + index for index, bucket in enumerate(sorted(set(buckets)))}
        self._table = SharedTable(path, MAX_SLOTS, WORK_FIELDS, BOUND_FIELDS)
        # [MAX_SLOTS, COLUMNS] of plain floats viewing the file (sums over it run as over any array).
        self._rows = self._table.rows.view("<f8").reshape(MAX_SLOTS, COLUMNS)
        self._slot = slot
        self._row = self._rows[slot]  # this instance's row
        self._mine = [0.0] * COLUMNS  # what this instance has written there
        with self._table.locked():
            used = self._table.extra["num_slots_used"]
            self._table.extra["num_slots_used"] = max(int(used), slot + 1)
            self._store()

    def _store(self) -> None:
        self._row[:] = self._mine

    def _column_totals(self) -> np.ndarray:
        return self._rows[: int(self._table.extra["num_slots_used"])].sum(axis=0)

    def total_ms(self) -> float:
        return float(self._column_totals().sum())

    def ahead_by_bucket(self) -> dict[int | None, float]:
        """Work in flight (ms per lane) by bucket; None: work added without a bucket."""
        totals = self._column_totals().tolist()
        ahead: dict[int | None, float] = {None: totals[0]}
        for bucket, column in self._columns.items():
            ahead[bucket] = totals[column]
        return ahead

    def bound_ms(self, policy: AdmissionPolicy) -> float:
        """The adaptive bound now (the policy's starting bound until a request has adjusted it)."""
        if not policy.adaptive:
            return policy.max_work_ms
        bound = float(self._table.extra["bound_ms"])
        return bound if bound > 0 else policy.max_work_ms

    def _probing(self, policy: AdmissionPolicy) -> bool:
        """No answer has been late since the server last drained (an adaptive bound only)."""
        return policy.adaptive and float(self._table.extra["late_seen"]) == 0.0

    def record_latency(self, policy: AdmissionPolicy, latency_ms: float,
                       admitted: AdmissionDecision | None = None) -> None:
        """Feed an admitted request's latency back into the shared bound (`adjust_bound`)."""
        if not policy.adaptive:
            return
        with self._table.locked():
            self._adjust_bound(policy, latency_ms, admitted)

    def release(self, policy: AdmissionPolicy, own: float | Mapping[int, float], latency_ms: float,
                admitted: AdmissionDecision | None = None) -> None:
        """An admitted request was answered after `latency_ms`: give its work `own` back and
        feed the latency into the shared bound (`adjust_bound`: `admitted` is the decision
        that admitted it), under one taking of the lock."""
        with self._table.locked(across_processes=policy.adaptive):
            self._add(own, sign=-1.0)
            if policy.adaptive:
                self._adjust_bound(policy, latency_ms, admitted)

    def _adjust_bound(self, policy: AdmissionPolicy, latency_ms: float, admitted: AdmissionDecision | None) -> None:
        """The bound after one more answer; the caller holds the table across processes."""
        shared = self._table.extra
        probing = self._probing(policy)
        shared["bound_ms"] = adjust_bound(policy, self.bound_ms(policy), latency_ms, probing, admitted)
        if self.total_ms() <= 0.0:
            # Drained: the late answers were about a queue that is gone, so the next
            # traffic probes again (TCP restarts its slow start after idle, too).
            # Under sustained overload the server never drains and this never fires.
            shared["late_seen"] = 0.0
        elif latency_ms > policy.target_ms:
            shared["late_seen"] = 1.0

    def add(self, work: float | Mapping[int, float]) -> None:
        """Count work in flight (negative: give it back), in ms per lane: a number (no
        bucket) or a mapping bucket -> ms."""
        with self._table.locked(across_processes=False):  # only this instance writes its row
            self._add(work)

    def _add(self, work: float | Mapping[int, float], sign: float = 1.0) -> None:
        items = work.items() if isinstance(work, Mapping) else ((None, work),)
        mine, row = self._mine, self._row
        for bucket, work_ms in items:
            column = self._columns.get(bucket, 0)  # None (no bucket) and unknown buckets: column 0
            total = mine[column] + sign * work_ms
            mine[column] = total = total if total > 1e-6 else 0.0  # no float residue left on an idle instance
            row[column] = total

    def admit(self, policy: AdmissionPolicy, own: float | Mapping[int, float], share: float = 1.0,
              waited_ms: float | None = None) -> AdmissionDecision:
        """Decide on a request of `own` work (ms per lane; by bucket for the lanes' sharing to
        count) that waited `waited_ms` before the router (None: unknown) and, when admitted,
        count its work, as one step."""
        own_work_ms = sum(own.values()) if isinstance(own, Mapping) else own
        with self._table.locked():
            work_ahead_ms = shared_work_ahead_ms(policy, self.ahead_by_bucket(), own_work_ms)
            decision = decide(policy, work_ahead_ms, own_work_ms, share, self.bound_ms(policy), waited_ms,
                              self._probing(policy))
            if decision.admitted:
                self._add(own)
            return decision

    def refuses_any(self, policy: AdmissionPolicy, share: float = 1.0,
                    waited_ms: float | None = None) -> AdmissionDecision | None:
        """The refusal that even the smallest request (`smallest_work_ms`) gets now, or None
        when one could fit: a request refused here is refused whatever its rows, so the router
        turns it away before tokenizing it. Read without the lock: `admit` decides for those
        that pass, under it."""
        if policy.max_work_ms <= 0:
            return None
        own_ms = policy.smallest_work_ms
        ahead_ms = shared_work_ahead_ms(policy, self.ahead_by_bucket(), own_ms)
        decision = decide(policy, ahead_ms, own_ms, share, self.bound_ms(policy), waited_ms, self._probing(policy))
        return None if decision.admitted else replace(decision, at_least=True)

    def close(self) -> None:
        with self._table.locked(across_processes=False):
            self._mine = [0.0] * COLUMNS
            self._store()
        del self._rows, self._row  # the arrays view the map: drop them before the table closes
        self._table.close()
