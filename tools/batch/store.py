"""The durable queue of batch inference: one SQLite file shared by the API process and the workers.

Design
------
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

*SQLite in WAL mode.* Readers (status and result pages from the API) never block the writer and
the writer never blocks them; writers take turns. Every state change is one `BEGIN IMMEDIATE`
transaction, which takes the write lock up front, so a read-then-write (claim, fail) can never be
overtaken between its read and its write by another process; `busy_timeout` makes the others
wait their turn instead of failing. A SIGKILL in the middle of a transaction leaves nothing
behind: the uncommitted WAL frames are ignored on the next open. With `synchronous=FULL` (the
default) a committed submission also survives a power cut; `NORMAL` survives any process crash
and costs fewer fsyncs.

*The clock is passed in.* The store never reads time: `now_s` is an argument everywhere, so the
tests expire leases and run out backoffs by moving a number instead of sleeping, and the policy
in `tools.batch.policy` stays the only place that decides when. A fresh item is claimable from
time 0, not from the API's `now_s`, so a worker whose clock reads a little behind still sees it.

One `BatchStore` is one connection: open one per process (and per thread); never carry one
across `fork`. WAL needs every process on one host, with the file on a local disk.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.batch.policy import BatchStatus, ItemCounts, Submission, batch_status, request_fingerprint

SCHEMA_VERSION = 1
SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
MAX_RESULTS_PAGE = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- submission order: claims serve the oldest batch first
    id TEXT NOT NULL UNIQUE,                -- what clients see
    model TEXT NOT NULL,
    version INTEGER,                        -- NULL: the server's default version
    idempotency_key TEXT UNIQUE,            -- NULL keys never collide
    fingerprint TEXT NOT NULL,              -- sha256 of the body: same key, other body -> conflict
    created_at REAL NOT NULL,
    num_items INTEGER NOT NULL,
    cancelled_at REAL
);
CREATE TABLE IF NOT EXISTS items (
    batch_seq INTEGER NOT NULL REFERENCES batches(seq),
    idx INTEGER NOT NULL,                   -- position in the submission
    model TEXT NOT NULL,                    -- the batch's, copied so a per-model claim has its own index
    payload TEXT NOT NULL,                  -- the item as JSON
    state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'done')),
    attempts INTEGER NOT NULL DEFAULT 0,    -- claims so far
    lease_owner TEXT,
    lease_expires_at REAL,
    not_before REAL NOT NULL DEFAULT 0,     -- retry backoff: not claimable before this
    result TEXT,                            -- JSON, when status = 'ok'
    error TEXT,                             -- the last error
    status TEXT CHECK (status IN ('ok', 'failed', 'cancelled')),
    finished_at REAL,
    finished_by TEXT,                       -- the worker whose write was final
    PRIMARY KEY (batch_seq, idx),
    CHECK ((state = 'done') = (status IS NOT NULL)),
    CHECK ((state = 'leased') = (lease_expires_at IS NOT NULL))
) WITHOUT ROWID;
-- Claims walk the queued items in (batch, index) order, expiry walks the leases: finished items are in no index.
CREATE INDEX IF NOT EXISTS items_queued ON items(batch_seq, idx) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS items_queued_by_model ON items(model, batch_seq, idx) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS items_leases ON items(lease_expires_at) WHERE state = 'leased';
"""


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
    result: object | None  # when ok
    error: str | None  # when failed (or cancelled after a failed attempt)
    attempts: int


def _check_now(now_s: float) -> None:
    if not now_s >= 0:  # also refuses NaN, which would compare false everywhere and freeze the queue
        raise ValueError(f"now_s must be a time >= 0, got {now_s}")


def _check_worker(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")


class BatchStore:
    """The queue, its results and its batches, in one SQLite file."""

    def __init__(self, path: str | Path, *, max_attempts: int = 5, busy_timeout_s: float = 30.0,
                 synchronous: str = "FULL"):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s must be > 0, got {busy_timeout_s}")
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
        self.max_attempts = max_attempts
        # isolation_level=None: no implicit transactions; each state change opens its own BEGIN IMMEDIATE.
        self._db = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None)
        try:
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise ValueError(f"{path} cannot use WAL (journal mode stays {mode!r}); a file on a local disk can")
            self._db.execute(f"PRAGMA synchronous = {synchronous}")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._create_schema()
        except BaseException:
            self._db.close()
            raise

    def _create_schema(self) -> None:
        with self._write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == SCHEMA_VERSION:
                return
            if version != 0:
                raise ValueError(f"the batch store has schema version {version}; this code knows {SCHEMA_VERSION}")
            for statement in _SCHEMA.split(";"):  # executescript would commit the open transaction
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, holding the write lock from its first statement."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            # SQLite may already have rolled back (e.g. a full disk); a second rollback would hide the error.
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: its statements see one snapshot, whatever writers do meanwhile."""
        self._db.execute("BEGIN")
        try:
            yield self._db
        finally:
            self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> BatchStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the API side ---------------------------------------------------------------------------------------

    def submit(self, submission: Submission, now_s: float) -> tuple[str, bool]:
        """Store a batch and all its items as one transaction: (batch id, whether it was created now).

        A submission with an idempotency key already used returns that batch (created False) when
        the bodies match and raises `IdempotencyConflict` when they do not.
        """
        _check_now(now_s)
        fingerprint = request_fingerprint(submission)
        # Encoded before the transaction: nothing slow or failing happens while holding the write lock.
        payloads = [json.dumps(item, ensure_ascii=False) for item in submission.items]
        with self._write() as db:
            key = submission.idempotency_key
            if key is not None:
                row = db.execute("SELECT id, fingerprint FROM batches WHERE idempotency_key = ?", (key,)).fetchone()
                if row is not None:
                    if row[1] != fingerprint:
                        raise IdempotencyConflict(key, row[0])
                    return row[0], False
            batch_id = uuid.uuid4().hex
            seq = db.execute(
                "INSERT INTO batches (id, model, version, idempotency_key, fingerprint, created_at, num_items) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (batch_id, submission.model, submission.version, key, fingerprint, now_s, len(payloads)),
            ).lastrowid
            db.executemany(
                "INSERT INTO items (batch_seq, idx, model, payload, state) VALUES (?, ?, ?, ?, 'queued')",
                ((seq, index, submission.model, payload) for index, payload in enumerate(payloads)),
            )
        return batch_id, True

    def cancel(self, batch_id: str, now_s: float) -> bool:
        """Cancel a batch: its queued items end as cancelled and nothing more is claimed.

        Returns False when there was nothing to cancel: already cancelled, or already finished
        (a finished batch keeps its results and its status).
        """
        _check_now(now_s)
        with self._write() as db:
            row = db.execute("SELECT seq, cancelled_at FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
            seq, cancelled_at = row
            if cancelled_at is not None:
                return False
            pending = db.execute("SELECT EXISTS (SELECT 1 FROM items WHERE batch_seq = ? AND state != 'done')",
                                 (seq,)).fetchone()[0]
            if not pending:
                return False
            db.execute("UPDATE batches SET cancelled_at = ? WHERE seq = ?", (now_s, seq))
            db.execute("UPDATE items SET state = 'done', status = 'cancelled', finished_at = ? "
                       "WHERE batch_seq = ? AND state = 'queued'", (now_s, seq))
        return True

    def get_batch(self, batch_id: str) -> BatchView:
        with self._read() as db:
            row = db.execute("SELECT seq, model, version, idempotency_key, created_at, cancelled_at "
                             "FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
            seq, model, version, key, created_at, cancelled_at = row
            by_state = db.execute("SELECT state, status, COUNT(*), MAX(finished_at) FROM items "
                                  "WHERE batch_seq = ? GROUP BY state, status", (seq,)).fetchall()
        counted = {(state if state != "done" else status): count for state, status, count, _ in by_state}
        counts = ItemCounts(num_queued=counted.get("queued", 0), num_leased=counted.get("leased", 0),
                            num_ok=counted.get("ok", 0), num_failed=counted.get("failed", 0),
                            num_cancelled=counted.get("cancelled", 0))
        finished_at = None
        if counts.num_pending == 0:
            finished_at = max(last for state, _, _, last in by_state if state == "done")
        return BatchView(batch_id=batch_id, model=model, version=version, idempotency_key=key,
                         created_at_s=created_at, cancelled_at_s=cancelled_at, finished_at_s=finished_at,
                         counts=counts, status=batch_status(counts, cancelled_at is not None))

    def results(self, batch_id: str, offset: int = 0, limit: int = 1000) -> list[ItemResult]:
        """Items `offset` .. `offset + limit - 1` of a batch, in input order, finished or not."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if not 1 <= limit <= MAX_RESULTS_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_RESULTS_PAGE}, got {limit}")
        with self._read() as db:
            row = db.execute("SELECT seq FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
            rows = db.execute("SELECT idx, status, result, error, attempts FROM items WHERE batch_seq = ? "
                              "AND idx >= ? ORDER BY idx LIMIT ?", (row[0], offset, limit)).fetchall()
        return [ItemResult(index=index, status=status or "pending",
                           result=json.loads(result) if result is not None else None,
                           error=error if status in ("failed", "cancelled") else None, attempts=attempts)
                for index, status, result, error, attempts in rows]

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
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        by_model = "AND i.model = ?" if model is not None else ""
        params = (now_s, model, max_items) if model is not None else (now_s, max_items)
        expires_at = now_s + lease_s
        with self._write() as db:
            self._release_expired(db, now_s)
            rows = db.execute(
                "SELECT i.batch_seq, i.idx, i.attempts, i.payload, b.id, b.model, b.version "
                "FROM items AS i JOIN batches AS b ON b.seq = i.batch_seq "
                f"WHERE i.state = 'queued' AND i.not_before <= ? AND b.cancelled_at IS NULL {by_model} "
                "ORDER BY i.batch_seq, i.idx LIMIT ?", params).fetchall()
            db.executemany("UPDATE items SET state = 'leased', lease_owner = ?, lease_expires_at = ?, "
                           "attempts = attempts + 1 WHERE batch_seq = ? AND idx = ?",
                           ((worker_id, expires_at, seq, index) for seq, index, *_ in rows))
        return [ClaimedItem(key=ItemKey(batch_id, index), model=batch_model, version=version,
                            payload=json.loads(payload), attempt=attempts + 1, claimed_at_s=now_s,
                            lease_expires_at_s=expires_at)
                for _, index, attempts, payload, batch_id, batch_model, version in rows]

    def extend_leases(self, keys: Sequence[ItemKey], worker_id: str, lease_s: float, now_s: float) -> int:
        """Push the leases `worker_id` still holds on `keys` to `now_s + lease_s` (a long generation
        outlives one lease); returns how many it still held."""
        _check_worker(worker_id)
        _check_now(now_s)
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        extended = 0
        with self._write() as db:
            for key in keys:
                extended += db.execute(
                    "UPDATE items SET lease_expires_at = ? WHERE batch_seq = (SELECT seq FROM batches WHERE id = ?) "
                    "AND idx = ? AND state = 'leased' AND lease_owner = ?",
                    (now_s + lease_s, key.batch_id, key.index, worker_id)).rowcount
        return extended

    def complete(self, item_key: ItemKey, worker_id: str, result: object, now_s: float) -> bool:
        """Record an item's result. True when this was the item's final write; False when the item
        already had one (another worker's result, a final failure or a cancel), which is kept."""
        return self.complete_many([(item_key, result)], worker_id, now_s)[0]

    def complete_many(self, outcomes: Sequence[tuple[ItemKey, object]], worker_id: str, now_s: float) -> list[bool]:
        """`complete` for the items of one Triton request, in one transaction (one fsync, not one per item)."""
        _check_worker(worker_id)
        _check_now(now_s)
        # Encoded before the transaction: a result that is not JSON fails before anything is written.
        encoded = [(key, json.dumps(result, ensure_ascii=False)) for key, result in outcomes]
        accepted = []
        with self._write() as db:
            for key, result in encoded:
                # First writer wins: only an item without a final outcome takes one. `attempts > 0`:
                # only an item that was handed out can have a result.
                written = db.execute(
                    "UPDATE items SET state = 'done', status = 'ok', result = ?, error = NULL, finished_at = ?, "
                    "finished_by = ?, lease_owner = NULL, lease_expires_at = NULL "
                    "WHERE batch_seq = (SELECT seq FROM batches WHERE id = ?) AND idx = ? "
                    "AND state != 'done' AND attempts > 0",
                    (result, now_s, worker_id, key.batch_id, key.index)).rowcount == 1
                if not written:
                    self._item_state(db, key)  # raises ItemNotFound for a key that names no item
                accepted.append(written)
        return accepted

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
        changed = []
        with self._write() as db:
            for key in keys:
                seq, state, owner, attempts, cancelled = self._item_state(db, key)
                where = (seq, key.index)
                if state == "done" or attempts == 0:
                    changed.append(False)
                elif not retryable:
                    db.execute("UPDATE items SET state = 'done', status = 'failed', error = ?, finished_at = ?, "
                               "finished_by = ?, lease_owner = NULL, lease_expires_at = NULL "
                               "WHERE batch_seq = ? AND idx = ?", (error, now_s, worker_id, *where))
                    changed.append(True)
                elif state != "leased" or owner != worker_id:
                    changed.append(False)  # a stale lease: the item is someone else's (or queued) now
                elif cancelled or attempts >= self.max_attempts:
                    final_status = "cancelled" if cancelled else "failed"
                    final_error = error if cancelled else f"{error} (gave up after {attempts} attempts)"
                    db.execute("UPDATE items SET state = 'done', status = ?, error = ?, finished_at = ?, "
                               "finished_by = ?, lease_owner = NULL, lease_expires_at = NULL "
                               "WHERE batch_seq = ? AND idx = ?", (final_status, final_error, now_s, worker_id, *where))
                    changed.append(True)
                else:
                    db.execute("UPDATE items SET state = 'queued', not_before = ?, error = ?, lease_owner = NULL, "
                               "lease_expires_at = NULL WHERE batch_seq = ? AND idx = ?", (retry_at_s, error, *where))
                    changed.append(True)
        return changed

    def release_expired(self, now_s: float) -> int:
        """Deal with every lease expired at `now_s` (claim does this too); returns how many."""
        _check_now(now_s)
        with self._write() as db:
            return self._release_expired(db, now_s)

    def _release_expired(self, db: sqlite3.Connection, now_s: float) -> int:
        # A cancelled batch's item is never handed out again; an item at its last attempt has had
        # its chances (a worker that dies on it every time must not keep its batch open).
        cancelled = db.execute(
            "UPDATE items SET state = 'done', status = 'cancelled', finished_at = ?, lease_owner = NULL, "
            "lease_expires_at = NULL WHERE state = 'leased' AND lease_expires_at <= ? "
            "AND EXISTS (SELECT 1 FROM batches WHERE seq = items.batch_seq AND cancelled_at IS NOT NULL)",
            (now_s, now_s)).rowcount
        exhausted = db.execute(
            "UPDATE items SET state = 'done', status = 'failed', finished_at = ?, "
            "error = printf('no result after %d attempts: the lease of worker %s expired', attempts, lease_owner), "
            "lease_owner = NULL, lease_expires_at = NULL "
            "WHERE state = 'leased' AND lease_expires_at <= ? AND attempts >= ?",
            (now_s, now_s, self.max_attempts)).rowcount
        requeued = db.execute(
            "UPDATE items SET state = 'queued', lease_owner = NULL, lease_expires_at = NULL "
            "WHERE state = 'leased' AND lease_expires_at <= ?", (now_s,)).rowcount
        return cancelled + exhausted + requeued

    @staticmethod
    def _item_state(db: sqlite3.Connection, key: ItemKey) -> tuple[int, str, str | None, int, bool]:
        row = db.execute("SELECT i.batch_seq, i.state, i.lease_owner, i.attempts, b.cancelled_at IS NOT NULL "
                         "FROM items AS i JOIN batches AS b ON b.seq = i.batch_seq WHERE b.id = ? AND i.idx = ?",
                         (key.batch_id, key.index)).fetchone()
        if row is None:
            raise ItemNotFound(f"no item {key.index} in batch {key.batch_id!r}")
        seq, state, owner, attempts, cancelled = row
        return seq, state, owner, attempts, bool(cancelled)
