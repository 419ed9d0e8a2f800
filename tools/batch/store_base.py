"""The durable queue of batch inference, whatever engine holds it: its contract, errors and rows.

Two engines keep the same queue with the same semantics: `BatchStore` (`store.py`), one SQLite
file shared by the processes of one machine, and `PostgresStore` (`pg_store.py`), a PostgreSQL
database shared by workers on many machines. `BatchQueue` is their common interface: it checks
every argument and encodes what it stores once, here, so the engines cannot disagree on what
they accept; `SqlStore` (`sql_store.py`) implements its transactions once, in SQLAlchemy Core,
for both. `tools.batch.engines.open_store` picks the engine from the `--db` value.

Semantics
---------
*Leases, not locks.* A worker `claim`s items: in one transaction it marks them leased to itself
until `now_s + lease_s` and counts the attempt. A worker that is SIGKILLed holds its leases until
they expire; the next `claim` (by anyone) finds them expired and puts them back in the queue (or
ends them, below). Nothing has to notice the death, and no item is lost: processing is
at-least-once.

*First writer wins.* At-least-once means two workers may compute the same item: one whose lease
expired while it was slow (or paused, or cut off), and the one that took the item over. A final
outcome (`complete`, a final `fail`) is therefore a conditional update, `... WHERE state !=
'done'`, and the item row is the only place a result lives: the first final write lands, every
later one changes nothing and returns False. There is exactly one result per item whatever the
interleaving, and a slow worker's valid result is used rather than thrown away. A *retryable*
failure is different: it puts the item back in the queue, so it is accepted only from the worker
that holds the current lease; a stale worker's retryable failure would otherwise hand out an item
that someone else is running. (The check is by worker, not by attempt: a worker that claimed the
same item twice can requeue it from its older claim, which costs extra work, never a second result.)

*Bounded retries.* Each claim counts an attempt. A retryable failure at the last attempt, and a
lease that expires at the last attempt (a worker that dies on the item every time), end the item
as failed, so a poisonous item cannot keep its batch open forever.

*Cancel.* A cancelled batch's queued items end at once as cancelled; leased ones may still finish
(their results are kept), and if their lease expires or they fail retryably they end as cancelled
instead of going back to the queue. No item of a cancelled batch is ever queued, so claims never
see one.

*The clock is passed in.* The store never reads time: `now_s` is an argument everywhere, so the
tests expire leases and run out backoffs by moving a number instead of sleeping, and the policy
in `tools.batch.policy` stays the only place that decides when. A fresh item is claimable from
time 0, not from the API's `now_s`, so a worker whose clock reads a little behind still sees it.

One store object is one connection: open one per process (and per thread); never carry one
across `fork`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tools.batch.policy import BatchStatus, ItemCounts, Submission, batch_status, request_fingerprint

MAX_RESULTS_PAGE = 10_000


class IdempotencyConflict(Exception):
    """The idempotency key was already used for a batch with a different body (HTTP 409)."""

    def __init__(self, idempotency_key: str, batch_id: str):
        super().__init__(f"idempotency key {idempotency_key!r} was already used for batch {batch_id} "
                         "with a different body")
        self.idempotency_key = idempotency_key
        self.batch_id = batch_id


class BatchNotFound(LookupError):
    """No batch has this id (HTTP 404)."""


class ItemNotFound(LookupError):
    """No item has this key: a worker bug, never a client's."""


class StoreUnavailable(ConnectionError):
    """The queue cannot be opened: a database that does not answer, a file that cannot be created.

    The message is one line naming the queue (a URL without its password), fit for a CLI to print.
    """


@dataclass(frozen=True)
class ItemKey:
    batch_id: str
    index: int


@dataclass(frozen=True)
class ClaimedItem:
    """An item leased to a worker."""

    key: ItemKey
    model: str
    version: int | None
    payload: object  # the item as submitted
    attempt: int  # 1 on the first claim
    claimed_at_s: float
    lease_expires_at_s: float


@dataclass(frozen=True)
class BatchView:
    """A batch as the API reports it."""

    batch_id: str
    model: str
    version: int | None
    idempotency_key: str | None
    created_at_s: float
    cancelled_at_s: float | None
    finished_at_s: float | None  # when the last item became final; None while any is pending
    counts: ItemCounts
    status: BatchStatus

    @property
    def fraction_done(self) -> float:
        return self.counts.fraction_done


@dataclass(frozen=True)
class ItemResult:
    """One item's outcome, as the results page reports it."""

    index: int
    status: str  # "ok", "failed", "cancelled" or "pending"
    # When ok: the result as stored, JSON text. Kept as text so that a results page can be
    # written without decoding and re-encoding every embedding (most of a page's cost).
    result_json: str | None
    error: str | None  # when failed (or cancelled after a failed attempt)
    attempts: int

    @property
    def result(self) -> object | None:
        return json.loads(self.result_json) if self.result_json is not None else None


@dataclass(frozen=True)
class FailureWrite:
    """What a failed attempt does to its item (see `failure_write`)."""

    state: str  # "done" (final) or "queued" (another try from retry_at_s)
    status: str | None  # the final status when done: "failed" or "cancelled"
    error: str


def failure_write(state: str, lease_owner: str | None, attempts: int, cancelled: bool, worker_id: str,
                  error: str, retryable: bool, max_attempts: int) -> FailureWrite | None:
    """The write a failure report makes to an item in `state`, or None when it is superseded.

    Not retryable: final, first writer wins (as a result). Retryable: only the lease holder may
    say so; the item goes back to the queue unless it has had `max_attempts` attempts (then it
    ends failed) or its batch was cancelled (then it ends cancelled). An item never handed out
    (`attempts == 0`) has no attempt to fail.
    """
    if state == "done" or attempts == 0:
        return None
    if not retryable:
        return FailureWrite("done", "failed", error)
    if state != "leased" or lease_owner != worker_id:
        return None  # a stale lease: the item is someone else's (or queued) now
    if cancelled:
        return FailureWrite("done", "cancelled", error)
    if attempts >= max_attempts:
        return FailureWrite("done", "failed", f"{error} (gave up after {attempts} attempts)")
    return FailureWrite("queued", None, error)


def batch_view(batch_id: str, model: str, version: int | None, idempotency_key: str | None, created_at_s: float,
               cancelled_at_s: float | None,
               by_state: Sequence[tuple[str, str | None, int, float | None]]) -> BatchView:
    """A `BatchView` from the batch row and its items counted by (state, status, count, last finished_at)."""
    counted = {(state if state != "done" else status): count for state, status, count, _ in by_state}
    counts = ItemCounts(num_queued=counted.get("queued", 0), num_leased=counted.get("leased", 0),
                        num_ok=counted.get("ok", 0), num_failed=counted.get("failed", 0),
                        num_cancelled=counted.get("cancelled", 0))
    finished_at_s = None
    if counts.num_pending == 0:
        finished_at_s = max(last for state, _, _, last in by_state if state == "done")
    return BatchView(batch_id=batch_id, model=model, version=version, idempotency_key=idempotency_key,
                     created_at_s=created_at_s, cancelled_at_s=cancelled_at_s, finished_at_s=finished_at_s,
                     counts=counts, status=batch_status(counts, cancelled_at_s is not None))


def item_result(index: int, status: str | None, result_json: str | None, error: str | None,
                attempts: int) -> ItemResult:
    return ItemResult(index=index, status=status or "pending", result_json=result_json,
                      error=error if status in ("failed", "cancelled") else None, attempts=attempts)


def _check_now(now_s: float) -> None:
    if not now_s >= 0:  # also refuses NaN, which would compare false everywhere and freeze the queue
        raise ValueError(f"now_s must be a time >= 0, got {now_s}")


def _check_worker(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")


def _check_lease(lease_s: float) -> None:
    if not lease_s > 0:
        raise ValueError(f"lease_s must be > 0, got {lease_s}")


class BatchQueue(ABC):
    """The queue, its results and its batches: the interface both engines implement.

    The public methods check their arguments and encode JSON before any transaction starts (a
    result that is not JSON fails before anything is written), then call the engine's `_...`
    method, which does the whole change in one transaction.
    """

    def __init__(self, max_attempts: int):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = max_attempts

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> BatchQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the API side ---------------------------------------------------------------------------------------

    def submit(self, submission: Submission, now_s: float) -> tuple[str, bool]:
        """Store a batch and all its items as one transaction: (batch id, whether it was created now).

        A submission with an idempotency key already used returns that batch (created False) when
        the bodies match and raises `IdempotencyConflict` when they do not. Two submissions of one
        key at the same moment, from any processes, make one batch.
        """
        _check_now(now_s)
        payloads = [json.dumps(item, ensure_ascii=False) for item in submission.items]
        return self._submit(submission, request_fingerprint(submission), payloads, now_s)

    def cancel(self, batch_id: str, now_s: float) -> bool:
        """Cancel a batch: its queued items end as cancelled and nothing more is claimed.

        Returns False when there was nothing to cancel: already cancelled, or already finished
        (a finished batch keeps its results and its status). Raises `BatchNotFound`.
        """
        _check_now(now_s)
        return self._cancel(batch_id, now_s)

    @abstractmethod
    def get_batch(self, batch_id: str) -> BatchView:
        """The batch and its counts, read in one snapshot. Raises `BatchNotFound`."""

    def results(self, batch_id: str, offset: int = 0, limit: int = 1000) -> list[ItemResult]:
        """Items `offset` .. `offset + limit - 1` of a batch, in input order, finished or not."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if not 1 <= limit <= MAX_RESULTS_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_RESULTS_PAGE}, got {limit}")
        return self._results(batch_id, offset, limit)

    # -- the worker side ------------------------------------------------------------------------------------

    def claim(self, worker_id: str, max_items: int, lease_s: float, now_s: float,
              model: str | None = None) -> list[ClaimedItem]:
        """Lease up to `max_items` claimable items to `worker_id` until `now_s + lease_s`.

        Oldest batch first, each in index order; an item in retry backoff is skipped until its
        time. Expired leases are dealt with first (`release_expired`), so a dead worker's items
        are claimable again in the same call.
        """
        _check_worker(worker_id)
        _check_now(now_s)
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        _check_lease(lease_s)
        return self._claim(worker_id, max_items, lease_s, now_s, model)

    def extend_leases(self, keys: Sequence[ItemKey], worker_id: str, lease_s: float, now_s: float) -> int:
        """Push the leases `worker_id` still holds on `keys` to `now_s + lease_s` (a long generation
        outlives one lease); returns how many it still held."""
        _check_worker(worker_id)
        _check_now(now_s)
        _check_lease(lease_s)
        return self._extend_leases(keys, worker_id, now_s + lease_s) if keys else 0

    def complete(self, item_key: ItemKey, worker_id: str, result: object, now_s: float) -> bool:
        """Record an item's result. True when this was the item's final write; False when the item
        already had one (another worker's result, a final failure or a cancel), which is kept."""
        return self.complete_many([(item_key, result)], worker_id, now_s)[0]

    def complete_many(self, outcomes: Sequence[tuple[ItemKey, object]], worker_id: str, now_s: float) -> list[bool]:
        """`complete` for the items of one Triton request, in one transaction (one commit, not one per item).

        Raises `ItemNotFound` (and writes nothing) when a key names no item.
        """
        _check_worker(worker_id)
        _check_now(now_s)
        encoded = [(key, json.dumps(result, ensure_ascii=False)) for key, result in outcomes]
        return self._complete_many(encoded, worker_id, now_s) if encoded else []

    def fail(self, item_key: ItemKey, worker_id: str, error: str, retryable: bool, retry_at_s: float | None,
             now_s: float) -> bool:
        """Record a failed attempt. True when it changed the item, False when it was superseded.

        Not retryable: the item ends as failed, first writer wins (as `complete`). Retryable:
        only the worker holding the lease may say so; the item goes back to the queue, claimable
        from `retry_at_s`, unless it has had `max_attempts` attempts (then it ends as failed) or its
        batch was cancelled (then it ends as cancelled).
        """
        return self.fail_many([item_key], worker_id, error, retryable, retry_at_s, now_s)[0]

    def fail_many(self, keys: Sequence[ItemKey], worker_id: str, error: str, retryable: bool,
                  retry_at_s: float | None, now_s: float) -> list[bool]:
        """`fail` for the items of one Triton request (which fail together), in one transaction."""
        _check_worker(worker_id)
        _check_now(now_s)
        if retryable and (retry_at_s is None or not retry_at_s >= now_s):
            raise ValueError(f"a retryable failure needs retry_at_s >= now_s ({now_s}), got {retry_at_s}")
        return self._fail_many(keys, worker_id, error, retryable, retry_at_s, now_s) if keys else []

    def release_expired(self, now_s: float) -> int:
        """Deal with every lease expired at `now_s` (claim does this too); returns how many."""
        _check_now(now_s)
        return self._release_expired(now_s)

    # -- what each engine implements, each as one transaction ---------------------------------------------------

    @abstractmethod
    def _submit(self, submission: Submission, fingerprint: str, payloads: list[str], now_s: float) -> tuple[str, bool]:
        ...

    @abstractmethod
    def _cancel(self, batch_id: str, now_s: float) -> bool: ...

    @abstractmethod
    def _results(self, batch_id: str, offset: int, limit: int) -> list[ItemResult]: ...

    @abstractmethod
    def _claim(self, worker_id: str, max_items: int, lease_s: float, now_s: float,
               model: str | None) -> list[ClaimedItem]: ...

    @abstractmethod
    def _extend_leases(self, keys: Sequence[ItemKey], worker_id: str, expires_at_s: float) -> int: ...

    @abstractmethod
    def _complete_many(self, encoded: Sequence[tuple[ItemKey, str]], worker_id: str, now_s: float) -> list[bool]: ...

    @abstractmethod
    def _fail_many(self, keys: Sequence[ItemKey], worker_id: str, error: str, retryable: bool,
                   retry_at_s: float | None, now_s: float) -> list[bool]: ...

    @abstractmethod
    def _release_expired(self, now_s: float) -> int: ...
