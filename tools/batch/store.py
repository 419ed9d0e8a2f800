"""The SQLite engine of the batch queue: one file shared by the API process and the workers of one machine.

The queue's semantics (leases, first writer wins, bounded retries, cancel, the clock passed in)
are those of every engine (`tools.batch.store_base`), and its SQL is every engine's
(`tools.batch.sql_store`). What is SQLite's own is here: opening the file, beginning a write,
the schema version.

*WAL mode.* Readers (status and result pages from the API) never block the writer and the
writer never blocks them; writers take turns. Every read is one statement, so one snapshot.

*`BEGIN IMMEDIATE`.* SQLite has no row locks, so the `FOR UPDATE` / `FOR SHARE` clauses the
shared statements carry for PostgreSQL render as nothing here. What makes a read-then-write
(claim, complete, fail, cancel, an idempotent submit) safe instead is that every write
transaction begins `IMMEDIATE`, taking the database's single write lock before its first
statement: no other process can write between its reads and its writes, so the read it decides on
is still true when it writes. (A plain `BEGIN` would take the lock only at the first write, and
two claimers that had both read the same queued items would then collide: the second to write
would fail with SQLITE_BUSY_SNAPSHOT, its snapshot stale once the first commits, an error no
`busy_timeout` waits out.) `busy_timeout` makes the others wait their turn instead of failing. A
SIGKILL in the middle of a transaction leaves nothing behind: the uncommitted WAL frames are
ignored on the next open. With `synchronous=FULL` (the default) a committed submission also
survives a power cut; `NORMAL` survives any process crash and costs fewer fsyncs.

One `BatchStore` is one connection: open one per process (and per thread); never carry one
across `fork`. WAL needs every process on one host, with the file on a local disk: workers on
several machines share a `PostgresStore` (`tools.batch.pg_store`) instead.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import Connection, create_engine
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.pool import NullPool

from tools.batch.sql_store import (
    QUEUE_TABLES,
    SCHEMA_VERSION,
    SqlStore,
    insert_batch_statement,
    metadata,
    shared_engine,
)
from tools.batch.store_base import (
    MAX_RESULTS_PAGE,
    BatchNotFound,
    BatchView,
    ClaimedItem,
    IdempotencyConflict,
    ItemKey,
    ItemNotFound,
    ItemResult,
    StoreUnavailable,
)

# The names other modules have always imported from here.
__all__ = ["MAX_RESULTS_PAGE", "SCHEMA_VERSION", "BatchNotFound", "BatchStore", "BatchView", "ClaimedItem",
           "IdempotencyConflict", "ItemKey", "ItemNotFound", "ItemResult", "StoreUnavailable"]

SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")


class BatchStore(SqlStore):
    """The queue, its results and its batches, in one SQLite file."""

    _insert_batch = insert_batch_statement(sqlite_insert)

    def __init__(self, path: str | Path, *, max_attempts: int = 5, busy_timeout_s: float = 30.0,
                 synchronous: str = "FULL"):
        if not busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s must be > 0, got {busy_timeout_s}")
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
        path = str(path)

        def connect() -> sqlite3.Connection:
            # isolation_level=None: the driver begins no transaction of its own; `_begin_write` and
            # SQLAlchemy's commit and rollback are the only ones.
            db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
            try:
                db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise ValueError(f"{path} cannot use WAL (journal mode stays {mode!r}); a file on a local disk can")
                db.execute(f"PRAGMA synchronous = {synchronous}")
                db.execute("PRAGMA foreign_keys = ON")
            except BaseException:
                db.close()
                raise
            return db

        # NullPool: the store's one connection is opened with it and closed with it; no pool to size.
        engine = shared_engine(("sqlite", path, busy_timeout_s, synchronous),
                               lambda: create_engine("sqlite://", creator=connect, poolclass=NullPool))
        super().__init__(engine, path, max_attempts=max_attempts)

    def _cannot_connect(self, err: BaseException) -> str:  # a missing or unwritable directory
        return f"cannot open the batch queue file {self.display}: {err}"

    def _begin_write(self, conn: Connection) -> None:
        # On the driver's connection, below SQLAlchemy, which has nothing to track here: its own
        # begin is a no-op on this driver, and its commit and rollback end what this starts.
        conn.connection.dbapi_connection.execute("BEGIN IMMEDIATE")

    def _create_schema(self, conn: Connection) -> None:
        version = conn.exec_driver_sql("PRAGMA user_version").scalar_one()
        if version == SCHEMA_VERSION:
            return
        if version != 0:
            raise ValueError(f"the batch store has schema version {version}; this code knows {SCHEMA_VERSION}")
        metadata.create_all(conn, tables=QUEUE_TABLES)
        conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION}")
