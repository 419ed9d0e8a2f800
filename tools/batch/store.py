"""The SQLite engine of the batch queue: one file shared by the API process and the workers of one machine.

The queue's semantics (leases, first writer wins, bounded retries, cancel, the clock passed in)
are those of every engine: see `tools.batch.store_base`. What is SQLite's own:

*WAL mode.* Readers (status and result pages from the API) never block the writer and the
writer never blocks them; writers take turns. Every state change is one `BEGIN IMMEDIATE`
transaction, which takes the write lock up front, so a read-then-write (claim, fail) can never be
overtaken between its read and its write by another process; `busy_timeout` makes the others
wait their turn instead of failing. A SIGKILL in the middle of a transaction leaves nothing
behind: the uncommitted WAL frames are ignored on the next open. With `synchronous=FULL` (the
default) a committed submission also survives a power cut; `NORMAL` survives any process crash
and costs fewer fsyncs.

One `BatchStore` is one connection: open one per process (and per thread); never carry one
across `fork`. WAL needs every process on one host, with the file on a local disk: workers on
several machines share a `PostgresStore` (`tools.batch.pg_store`) instead.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tools.batch.policy import Submission
from tools.batch.store_base import (
    MAX_RESULTS_PAGE,
    BatchNotFound,
    BatchQueue,
    BatchView,
    ClaimedItem,
    IdempotencyConflict,
    ItemKey,
    ItemNotFound,
    ItemResult,
    StoreUnavailable,
    batch_view,
    failure_write,
    item_result,
)

# The names other modules have always imported from here.
__all__ = ["MAX_RESULTS_PAGE", "BatchNotFound", "BatchStore", "BatchView", "ClaimedItem", "IdempotencyConflict",
           "ItemKey", "ItemNotFound", "ItemResult", "StoreUnavailable"]

SCHEMA_VERSION = 1
SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")

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


class BatchStore(BatchQueue):
    """The queue, its results and its batches, in one SQLite file."""

    def __init__(self, path: str | Path, *, max_attempts: int = 5, busy_timeout_s: float = 30.0,
                 synchronous: str = "FULL"):
        super().__init__(max_attempts)
        if not busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s must be > 0, got {busy_timeout_s}")
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
        # isolation_level=None: no implicit transactions; each state change opens its own BEGIN IMMEDIATE.
        try:
            self._db = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None)
        except sqlite3.OperationalError as err:  # a missing or unwritable directory
            raise StoreUnavailable(f"cannot open the batch queue file {path}: {err}") from None
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

    # -- the API side ---------------------------------------------------------------------------------------

    def _submit(self, submission: Submission, fingerprint: str, payloads: list[str], now_s: float) -> tuple[str, bool]:
        # The write lock is held from the first statement: no other process can insert the same key
        # between this check and the insert.
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

    def _cancel(self, batch_id: str, now_s: float) -> bool:
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
            seq, *batch = row
            by_state = db.execute("SELECT state, status, COUNT(*), MAX(finished_at) FROM items "
                                  "WHERE batch_seq = ? GROUP BY state, status", (seq,)).fetchall()
        return batch_view(batch_id, *batch, by_state)

    def _results(self, batch_id: str, offset: int, limit: int) -> list[ItemResult]:
        with self._read() as db:
            row = db.execute("SELECT seq FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
            rows = db.execute("SELECT idx, status, result, error, attempts FROM items WHERE batch_seq = ? "
                              "AND idx >= ? ORDER BY idx LIMIT ?", (row[0], offset, limit)).fetchall()
        return [item_result(*row) for row in rows]

    # -- the worker side ------------------------------------------------------------------------------------

    def _claim(self, worker_id: str, max_items: int, lease_s: float, now_s: float,
               model: str | None) -> list[ClaimedItem]:
        by_model = "AND i.model = ?" if model is not None else ""
        params = (now_s, model, max_items) if model is not None else (now_s, max_items)
        expires_at = now_s + lease_s
        with self._write() as db:
            self._release_expired_in(db, now_s)
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

    def _extend_leases(self, keys: Sequence[ItemKey], worker_id: str, expires_at_s: float) -> int:
        extended = 0
        with self._write() as db:
            for key in keys:
                extended += db.execute(
                    "UPDATE items SET lease_expires_at = ? WHERE batch_seq = (SELECT seq FROM batches WHERE id = ?) "
                    "AND idx = ? AND state = 'leased' AND lease_owner = ?",
                    (expires_at_s, key.batch_id, key.index, worker_id)).rowcount
        return extended

    def _complete_many(self, encoded: Sequence[tuple[ItemKey, str]], worker_id: str, now_s: float) -> list[bool]:
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

    def _fail_many(self, keys: Sequence[ItemKey], worker_id: str, error: str, retryable: bool,
                   retry_at_s: float | None, now_s: float) -> list[bool]:
        changed = []
        with self._write() as db:
            for key in keys:
                seq, state, owner, attempts, cancelled = self._item_state(db, key)
                write = failure_write(state, owner, attempts, cancelled, worker_id, error, retryable,
                                      self.max_attempts)
                if write is None:
                    changed.append(False)
                elif write.state == "done":
                    db.execute("UPDATE items SET state = 'done', status = ?, error = ?, finished_at = ?, "
                               "finished_by = ?, lease_owner = NULL, lease_expires_at = NULL "
                               "WHERE batch_seq = ? AND idx = ?",
                               (write.status, write.error, now_s, worker_id, seq, key.index))
                    changed.append(True)
                else:
                    db.execute("UPDATE items SET state = 'queued', not_before = ?, error = ?, lease_owner = NULL, "
                               "lease_expires_at = NULL WHERE batch_seq = ? AND idx = ?",
                               (retry_at_s, write.error, seq, key.index))
                    changed.append(True)
        return changed

    def _release_expired(self, now_s: float) -> int:
        with self._write() as db:
            return self._release_expired_in(db, now_s)

    def _release_expired_in(self, db: sqlite3.Connection, now_s: float) -> int:
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
