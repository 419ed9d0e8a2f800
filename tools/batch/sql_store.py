"""The batch queue in SQL, for every engine: its tables, its statements and its transactions, written once.

The tables are SQLAlchemy Core `Table` objects and every statement is built once, here, at import;
`BatchStore` (`store.py`, SQLite) and `PostgresStore` (`pg_store.py`) subclass `SqlStore` and add
only what truly differs between the engines: how a connection is opened, how a write transaction
begins, how the schema is created and versioned, and which errors mean "the queue is unavailable".
The semantics (leases, first writer wins, bounded retries, cancel, the clock passed in) are in
`tools.batch.store_base`; how each engine keeps them under concurrency:

*Locking clauses are PostgreSQL's, and no-ops on SQLite.* Every statement that must not be
overtaken between its read and its write locks the rows it reads: `with_for_update(...)` renders
`FOR UPDATE [SKIP LOCKED]`, `FOR SHARE` or `FOR NO KEY UPDATE` on PostgreSQL, where processes on
many machines write at once at READ COMMITTED, and nothing on SQLite, where every write
transaction holds the database's single write lock from its first statement (`BEGIN IMMEDIATE`,
see `store.py`), so nothing can overtake it. On PostgreSQL:

- *Claims skip, never wait.* A claim selects the oldest claimable items `FOR UPDATE OF i SKIP
  LOCKED` and leases them in the same statement: an item that another claimer holds locked is
  passed over rather than waited for, so any number of claimers take disjoint items and none
  queues behind another. Releasing expired leases, which every claim does first, skips locked
  rows too (and a batch being cancelled), leaving them to the next call.
- *First writer wins by the row lock.* A result locks its item `FOR UPDATE` with `state != 'done'`
  in the WHERE: two writers of one item serialize on the row lock, and the second, once the first
  commits, re-checks its WHERE against the committed row (READ COMMITTED does) and writes nothing.
- *Cancel against requeue.* Every transaction that may requeue an item reads its batch row `FOR
  SHARE`, and a cancel takes the batch row `FOR NO KEY UPDATE`: whichever comes second waits for
  the first and then sees it, so no item is ever queued in a cancelled batch.
- *Lock order.* Batch rows before item rows, and items batch by batch in batch id order, each
  batch's in index order, in every transaction that waits for locks, so no two transactions can
  wait on each other in a cycle. (Claims and expiry wait for no lock: they skip locked rows.)
- *Idempotency under concurrency.* The key is a unique column and a submission inserts its batch
  `ON CONFLICT (idempotency_key) DO NOTHING`: a second submission of the key waits for the first
  one's transaction and then finds its batch, so two API processes submitting one key at once
  make one batch. (Looking first and inserting after would let both pass the look.)

*Literals where an index has a WHERE.* The states in the statements are SQL literals, not bound
parameters: the partial indexes (`WHERE state = 'queued'`, `WHERE state = 'leased'`) are usable
only by a query whose WHERE names the same literal, on SQLite always and on PostgreSQL once a
statement is prepared with a generic plan.

I/O: every method of `SqlStore` runs statements on its one connection; nothing at import does.
"""

from __future__ import annotations

import json
import threading
import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

from sqlalchemy import (
    REAL,
    BigInteger,
    CheckConstraint,
    Column,
    Connection,
    Double,
    Engine,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    bindparam,
    cast,
    exists,
    func,
    literal,
    literal_column,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.dml import Insert

from tools.batch.policy import Submission
from tools.batch.store_base import (
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

SCHEMA_VERSION = 1

# -- the tables ---------------------------------------------------------------------------------------------------

metadata = MetaData()
# SQLite: an INTEGER PRIMARY KEY is the rowid (AUTOINCREMENT: never reused); PostgreSQL: a bigint identity.
_SEQ = BigInteger().with_variant(Integer(), "sqlite")
_TIME = Double().with_variant(REAL(), "sqlite")  # seconds, on the caller's clock

batches = Table(
    "batches", metadata,
    Column("seq", _SEQ, Identity(always=True), primary_key=True),  # submission order: oldest batch claimed first
    Column("id", Text, nullable=False, unique=True),  # what clients see
    Column("model", Text, nullable=False),
    Column("version", Integer),  # NULL: the server's default version
    Column("idempotency_key", Text, unique=True),  # NULL keys never collide
    Column("fingerprint", Text, nullable=False),  # sha256 of the body: same key, other body -> conflict
    Column("created_at", _TIME, nullable=False),
    Column("num_items", Integer, nullable=False),
    Column("cancelled_at", _TIME),
    sqlite_autoincrement=True,
)

items = Table(
    "items", metadata,
    Column("batch_seq", _SEQ, ForeignKey("batches.seq"), primary_key=True),
    Column("idx", Integer, primary_key=True),  # position in the submission
    Column("model", Text, nullable=False),  # the batch's, copied so a per-model claim has its own index
    Column("payload", Text, nullable=False),  # the item as JSON text, as written (jsonb would reorder keys)
    Column("state", Text, nullable=False),
    Column("attempts", Integer, nullable=False, server_default=literal_column("0")),  # claims so far
    Column("lease_owner", Text),
    Column("lease_expires_at", _TIME),
    Column("not_before", _TIME, nullable=False, server_default=literal_column("0")),  # retry backoff
    Column("result", Text),  # JSON text, when status = 'ok'
    Column("error", Text),  # the last error
    Column("status", Text),
    Column("finished_at", _TIME),
    Column("finished_by", Text),  # the worker whose write was final
    CheckConstraint("state IN ('queued', 'leased', 'done')", name="items_state"),
    CheckConstraint("status IN ('ok', 'failed', 'cancelled')", name="items_status"),
    CheckConstraint("(state = 'done') = (status IS NOT NULL)", name="items_done_has_status"),
    CheckConstraint("(state = 'leased') = (lease_expires_at IS NOT NULL)", name="items_leased_has_expiry"),
    sqlite_with_rowid=False,
)

# Claims walk the queued items in (batch, index) order, expiry walks the leases: finished items are in no index.
_QUEUED, _LEASED, _DONE = (literal_column(f"'{state}'") for state in ("queued", "leased", "done"))
for _name, _columns, _where in (("items_queued", (items.c.batch_seq, items.c.idx), items.c.state == _QUEUED),
                                ("items_queued_by_model", (items.c.model, items.c.batch_seq, items.c.idx),
                                 items.c.state == _QUEUED),
                                ("items_leases", (items.c.lease_expires_at,), items.c.state == _LEASED)):
    Index(_name, *_columns, sqlite_where=_where, postgresql_where=_where)

QUEUE_TABLES = (batches, items)

# -- the statements -------------------------------------------------------------------------------------------------
# Bound parameters are named unlike any column: SQLAlchemy keeps column names for an UPDATE's SET values.

_INDEXES = bindparam("indexes", expanding=True)  # a batch's item indexes, a list at execution
_SEQ_OF_BATCH = select(batches.c.seq).where(batches.c.id == bindparam("batch_id_")).scalar_subquery()
_b = batches.alias("b")
_i = items.alias("i")
_FINAL = {"lease_owner": None, "lease_expires_at": None}  # what every write that ends a lease also sets


def insert_batch_statement(dialect_insert) -> Insert:
    """The batch's INSERT for one engine's `insert` (SQLite's and PostgreSQL's both have ON CONFLICT):
    it returns the new seq, or no row when the idempotency key is taken."""
    return (dialect_insert(batches).on_conflict_do_nothing(index_elements=[batches.c.idempotency_key])
            .returning(batches.c.seq))


_BATCH_BY_KEY = select(batches.c.id, batches.c.fingerprint).where(batches.c.idempotency_key == bindparam("key_"))
_INSERT_ITEMS = items.insert()

# Cancel: the batch row first (a requeue in flight, holding it FOR SHARE, finishes before or sees the cancel after).
_BATCH_TO_CANCEL = (select(batches.c.seq, batches.c.cancelled_at).where(batches.c.id == bindparam("batch_id_"))
                    .with_for_update(key_share=True))
_HAS_PENDING = select(exists().where(items.c.batch_seq == bindparam("seq_"), items.c.state != _DONE))
_MARK_CANCELLED = update(batches).where(batches.c.seq == bindparam("seq_")).values(cancelled_at=bindparam("now_s"))
# An item a claimer holds locked is waited for: once its claim commits it is leased, not queued, and
# stays out of this update (a leased item may finish).
_queued = items.alias("queued")
_CANCEL_QUEUED = (update(items).where(tuple_(items.c.batch_seq, items.c.idx).in_(
    select(_queued.c.batch_seq, _queued.c.idx)
    .where(_queued.c.batch_seq == bindparam("seq_"), _queued.c.state == _QUEUED)
    .order_by(_queued.c.idx).with_for_update()))
    .values(state=_DONE, status="cancelled", finished_at=bindparam("now_s")))

# One statement, so one snapshot on either engine: the counts always add up to the batch's items, and
# agree with its cancelled_at. The items are counted apart and joined to the batch row after: grouping
# the joined rows would carry the batch's columns through the sort (measured: 1.4 ms against 0.9 ms
# for a batch of 3,000 items on SQLite).
_counts = (select(items.c.state, items.c.status, func.count().label("num_items"),
                  func.max(items.c.finished_at).label("last_finished_at"))
           .where(items.c.batch_seq == _SEQ_OF_BATCH).group_by(items.c.state, items.c.status).subquery("counts"))
_BATCH_COUNTS = (select(_b.c.model, _b.c.version, _b.c.idempotency_key, _b.c.created_at, _b.c.cancelled_at,
                        _counts.c.state, _counts.c.status, _counts.c.num_items, _counts.c.last_finished_at)
                 .select_from(_b.join(_counts, true())).where(_b.c.id == bindparam("batch_id_")))
_RESULTS_PAGE = (select(_i.c.idx, _i.c.status, _i.c.result, _i.c.error, _i.c.attempts)
                 .select_from(_b.join(_i, _i.c.batch_seq == _b.c.seq))
                 .where(_b.c.id == bindparam("batch_id_"), _i.c.idx >= bindparam("offset_"))
                 .order_by(_i.c.idx).limit(bindparam("limit_")))
_BATCH_SEQ = select(batches.c.seq).where(batches.c.id == bindparam("batch_id_"))

# A claim is one UPDATE of the oldest claimable items: the subquery picks them (skipping, on
# PostgreSQL, those another claimer holds locked), the UPDATE leases them and returns them.
_claimable = (select(_i.c.batch_seq, _i.c.idx).select_from(_i.join(_b, _b.c.seq == _i.c.batch_seq))
              .where(_i.c.state == _QUEUED, _i.c.not_before <= bindparam("now_s"), _b.c.cancelled_at.is_(None))
              .order_by(_i.c.batch_seq, _i.c.idx).limit(bindparam("max_items"))
              .with_for_update(of=_i, skip_locked=True))


def _lease(claimable):
    return (update(items).where(tuple_(items.c.batch_seq, items.c.idx).in_(claimable))
            .values(state=_LEASED, lease_owner=bindparam("worker_id"), lease_expires_at=bindparam("expires_at_s"),
                    attempts=items.c.attempts + 1)
            .returning(items.c.batch_seq, items.c.idx, items.c.attempts, items.c.payload))


_CLAIM = _lease(_claimable)
_CLAIM_OF_MODEL = _lease(_claimable.where(_i.c.model == bindparam("model_")))
# What a claimed item carries of its batch: never changed once written, so a store keeps what it read.
_BATCH_INFO = (select(batches.c.seq, batches.c.id, batches.c.model, batches.c.version)
               .where(batches.c.seq.in_(bindparam("seqs", expanding=True))))
_MAX_BATCHES_KEPT = 10_000

# Statements that name items by key run once per batch, its indexes one list: a row value
# `(batch_seq, idx) IN (VALUES ...)` would take every batch at once, but SQLite plans it as a scan
# of the whole table (measured: 14 times the CPU of a claim-and-complete loop).
_held = items.alias("held")
_EXTEND = (update(items).where(tuple_(items.c.batch_seq, items.c.idx).in_(
    select(_held.c.batch_seq, _held.c.idx)
    .where(_held.c.batch_seq == _SEQ_OF_BATCH, _held.c.idx.in_(_INDEXES), _held.c.state == _LEASED,
           _held.c.lease_owner == bindparam("worker_id"))
    .order_by(_held.c.idx).with_for_update()))
    .values(lease_expires_at=bindparam("expires_at_s")).returning(items.c.idx))

# First writer wins: only an item without a final outcome takes one. `attempts > 0`: only an item that
# was handed out can have a result.
_WRITABLE = (select(items.c.batch_seq, items.c.idx)
             .where(items.c.batch_seq == _SEQ_OF_BATCH, items.c.idx.in_(_INDEXES), items.c.state != _DONE,
                    items.c.attempts > 0)
             .order_by(items.c.idx).with_for_update())
_COMPLETE = (update(items)
             .where(items.c.batch_seq == bindparam("seq_"), items.c.idx == bindparam("idx_"), items.c.state != _DONE)
             .values(state=_DONE, status="ok", result=bindparam("result_"), error=None,
                     finished_at=bindparam("now_s"), finished_by=bindparam("worker_id"), **_FINAL))
_EXISTING = select(items.c.idx).where(items.c.batch_seq == _SEQ_OF_BATCH, items.c.idx.in_(_INDEXES))

# Batch rows FOR SHARE before the items: a cancel either finished before (and is seen) or waits for this
# transaction, so a requeue never lands in a cancelled batch.
_BATCHES_TO_FAIL = (select(batches.c.id, batches.c.seq, batches.c.cancelled_at.is_not(None))
                    .where(batches.c.id.in_(bindparam("batch_ids", expanding=True)))
                    .order_by(batches.c.seq).with_for_update(read=True))
_ITEMS_TO_FAIL = (select(items.c.idx, items.c.state, items.c.lease_owner, items.c.attempts)
                  .where(items.c.batch_seq == bindparam("seq_"), items.c.idx.in_(_INDEXES))
                  .order_by(items.c.idx).with_for_update())
_FAIL = (update(items).where(items.c.batch_seq == bindparam("seq_"), items.c.idx == bindparam("idx_"))
         .values(state=bindparam("state_"), status=bindparam("status_"), error=bindparam("error_"),
                 not_before=func.coalesce(bindparam("retry_at_s", type_=_TIME), items.c.not_before),
                 finished_at=bindparam("finished_at_s", type_=_TIME), finished_by=bindparam("finished_by_"),
                 **_FINAL))

# Expiry. The batches of expired leases, FOR SHARE so that a cancel cannot cross the requeue; SKIP
# LOCKED throughout: a batch being cancelled, or an item another transaction holds (a claimer
# releasing the same leases, a worker completing it), is left to the next call rather than waited for.
_EXPIRED_BATCHES = (select(batches.c.seq, batches.c.cancelled_at.is_not(None))
                    .where(batches.c.seq.in_(select(items.c.batch_seq).where(
                        items.c.state == _LEASED, items.c.lease_expires_at <= bindparam("now_s"))))
                    .order_by(batches.c.seq).with_for_update(read=True, skip_locked=True))
_expired = items.alias("expired")


def _expired_in(*extra):
    return tuple_(items.c.batch_seq, items.c.idx).in_(
        select(_expired.c.batch_seq, _expired.c.idx)
        .where(_expired.c.batch_seq.in_(bindparam("seqs", expanding=True)), _expired.c.state == _LEASED,
               _expired.c.lease_expires_at <= bindparam("now_s"), *extra)
        .order_by(_expired.c.batch_seq, _expired.c.idx).with_for_update(skip_locked=True))


# A cancelled batch's item is never handed out again; an item at its last attempt has had its chances
# (a worker that dies on it every time must not keep its batch open).
_EXPIRE_CANCELLED = (update(items).where(_expired_in())
                     .values(state=_DONE, status="cancelled", finished_at=bindparam("now_s"), **_FINAL))
_EXPIRE_EXHAUSTED = (update(items).where(_expired_in(_expired.c.attempts >= bindparam("max_attempts")))
                     .values(state=_DONE, status="failed", finished_at=bindparam("now_s"),
                             error=(literal("no result after ") + cast(items.c.attempts, Text)
                                    + literal(" attempts: the lease of worker ") + items.c.lease_owner
                                    + literal(" expired")), **_FINAL))
_EXPIRE_REQUEUE = update(items).where(_expired_in()).values(state=_QUEUED, **_FINAL)


_ENGINES: dict[tuple, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(key: tuple, make: Callable[[], Engine]) -> Engine:
    """The engine for `key`, made by `make` the first time: one per queue and settings in a process.

    An engine holds no connection here (each store holds its own, under `NullPool`), only what
    its dialect learnt from its first connection, which costs several round trips to the server.
    Measured on PostgreSQL, an open and close took 3.5 times what the hand-written store's did with
    an engine per store (42 ms against 12 ms), 1.5 times with one shared (8.2 ms against 5.6 ms).
    Safe across `fork`, having no connection to carry.
    """
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = make()
        return engine


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


class SqlStore(BatchQueue):
    """The queue on one SQLAlchemy connection: every transaction of `BatchQueue`, for any engine.

    A subclass gives the engine (`sqlalchemy.Engine`, from `shared_engine`; the store holds one
    connection of it for its life),
    its `INSERT ... ON CONFLICT` (`insert_batch_statement`), and overrides the hooks below where
    its engine differs.
    """

    _insert_batch: ClassVar[Insert]

    def __init__(self, engine: Engine, display: str, *, max_attempts: int):
        super().__init__(max_attempts)
        self.display = display  # the queue as errors name it: a file, or a URL without its password
        self._engine = engine
        self._batches: dict[int, tuple[str, str, int | None]] = {}  # seq -> (id, model, version), see _BATCH_INFO
        try:
            self._conn = engine.connect()
        except DBAPIError as err:
            raise StoreUnavailable(self._cannot_connect(err.orig)) from None
        try:
            with self._write() as conn:
                self._create_schema(conn)
        except BaseException:
            self.close()
            raise

    # -- what an engine overrides -------------------------------------------------------------------------------

    def _cannot_connect(self, err: BaseException) -> str:
        """The one-line `StoreUnavailable` message for a connection that cannot be opened."""
        return f"cannot connect to the batch queue at {self.display}: {one_line(err)}"

    def _begin_write(self, conn: Connection) -> None:
        """Run first in every write transaction (PostgreSQL: nothing; its row locks do the work)."""

    @abstractmethod
    def _create_schema(self, conn: Connection) -> None:
        """Create the tables when missing, in the write transaction `conn`; refuse another schema version."""

    def _text(self, text: str) -> str:
        """`text` as the engine can store it."""
        return text

    def _insert_items(self, conn: Connection, seq: int, model: str, payloads: Sequence[str]) -> None:
        conn.execute(_INSERT_ITEMS, [{"batch_seq": seq, "idx": index, "model": model, "payload": payload,
                                      "state": "queued"} for index, payload in enumerate(payloads)])

    # -- transactions -------------------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Connection]:
        """One transaction, committed when the block ends and rolled back when it raises.

        A connection lost since the last call is opened again here (nothing of this call was sent
        yet); one lost during the call raises `StoreUnavailable`, and its caller decides (the API
        answers 500, a worker exits, is started again, and its leases expire).
        """
        try:
            transaction = self._conn.begin()
        except DBAPIError as err:
            raise StoreUnavailable(self._cannot_connect(err.orig)) from None
        try:
            with transaction:
                if write:
                    self._begin_write(self._conn)
                yield self._conn
        except DBAPIError as err:
            if err.connection_invalidated:
                raise StoreUnavailable(f"lost the connection to the batch queue at {self.display}: "
                                       f"{one_line(err.orig)}") from err
            raise

    def _write(self):
        return self._transaction(write=True)

    def _read(self):
        return self._transaction(write=False)

    def close(self) -> None:
        self._conn.close()

    # -- the API side -------------------------------------------------------------------------------------------

    def _submit(self, submission: Submission, fingerprint: str, payloads: list[str], now_s: float) -> tuple[str, bool]:
        key = submission.idempotency_key
        batch_id = uuid.uuid4().hex
        with self._write() as conn:
            seq = conn.execute(self._insert_batch, {
                "id": batch_id, "model": submission.model, "version": submission.version, "idempotency_key": key,
                "fingerprint": fingerprint, "created_at": now_s, "num_items": len(payloads)}).scalar_one_or_none()
            if seq is None:
                # The key is taken, by a batch committed before or by one whose transaction this insert
                # waited for; this statement sees it either way.
                existing_id, existing_fingerprint = conn.execute(_BATCH_BY_KEY, {"key_": key}).one()
                if existing_fingerprint != fingerprint:
                    raise IdempotencyConflict(key, existing_id)
                return existing_id, False
            self._insert_items(conn, seq, submission.model, payloads)
        return batch_id, True

    def _cancel(self, batch_id: str, now_s: float) -> bool:
        with self._write() as conn:
            row = conn.execute(_BATCH_TO_CANCEL, {"batch_id_": batch_id}).one_or_none()
            if row is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
            seq, cancelled_at = row
            if cancelled_at is not None or not conn.execute(_HAS_PENDING, {"seq_": seq}).scalar_one():
                return False
            conn.execute(_MARK_CANCELLED, {"seq_": seq, "now_s": now_s})
            conn.execute(_CANCEL_QUEUED, {"seq_": seq, "now_s": now_s})
        return True

    def get_batch(self, batch_id: str) -> BatchView:
        with self._read() as conn:
            rows = conn.execute(_BATCH_COUNTS, {"batch_id_": batch_id}).all()
        if not rows:  # every batch has at least one item
            raise BatchNotFound(f"no batch {batch_id!r}")
        return batch_view(batch_id, *rows[0][:5], [tuple(row[5:]) for row in rows])

    def _results(self, batch_id: str, offset: int, limit: int) -> list[ItemResult]:
        with self._read() as conn:
            rows = conn.execute(_RESULTS_PAGE, {"batch_id_": batch_id, "offset_": offset, "limit_": limit}).all()
            # An empty page: past the end, or no such batch (batches are never deleted, so a second
            # statement cannot disagree with the first).
            if not rows and conn.execute(_BATCH_SEQ, {"batch_id_": batch_id}).first() is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
        return [item_result(*row) for row in rows]

    # -- the worker side ----------------------------------------------------------------------------------------

    def _claim(self, worker_id: str, max_items: int, lease_s: float, now_s: float,
               model: str | None) -> list[ClaimedItem]:
        expires_at = now_s + lease_s
        params = {"now_s": now_s, "max_items": max_items, "worker_id": worker_id, "expires_at_s": expires_at}
        with self._write() as conn:
            self._release_expired_in(conn, now_s)
            if model is None:
                rows = conn.execute(_CLAIM, params).all()
            else:
                rows = conn.execute(_CLAIM_OF_MODEL, {**params, "model_": model}).all()
            unseen = sorted({seq for seq, *_ in rows} - self._batches.keys())
            if unseen:
                if len(self._batches) > _MAX_BATCHES_KEPT:
                    self._batches.clear()
                self._batches.update((seq, info) for seq, *info in conn.execute(_BATCH_INFO, {"seqs": unseen}))
        rows.sort(key=lambda row: (row[0], row[1]))  # RETURNING has no order of its own
        claimed = []
        for seq, index, attempt, payload in rows:
            batch_id, batch_model, version = self._batches[seq]
            claimed.append(ClaimedItem(key=ItemKey(batch_id, index), model=batch_model, version=version,
                                       payload=json.loads(payload), attempt=attempt, claimed_at_s=now_s,
                                       lease_expires_at_s=expires_at))
        return claimed

    def _extend_leases(self, keys: Sequence[ItemKey], worker_id: str, expires_at_s: float) -> int:
        with self._write() as conn:
            held = {(batch_id, index) for batch_id, indexes in _by_batch(keys)
                    for (index,) in conn.execute(_EXTEND, {"batch_id_": batch_id, "indexes": indexes,
                                                           "worker_id": worker_id, "expires_at_s": expires_at_s})}
        # Counted by key, not by row: a key given twice counts twice, as when extended one key at a time.
        return sum((key.batch_id, key.index) in held for key in keys)

    def _complete_many(self, encoded: Sequence[tuple[ItemKey, str]], worker_id: str, now_s: float) -> list[bool]:
        with self._write() as conn:
            writable = {(batch_id, index): seq for batch_id, indexes in _by_batch(key for key, _ in encoded)
                        for seq, index in conn.execute(_WRITABLE, {"batch_id_": batch_id, "indexes": indexes})}
            # A key given twice: its first result is the one offered, the later ones come second.
            accepted, writes = [], []
            for key, result in encoded:
                seq = writable.pop((key.batch_id, key.index), None)
                accepted.append(seq is not None)
                if seq is not None:
                    writes.append({"seq_": seq, "idx_": key.index, "result_": result, "now_s": now_s,
                                   "worker_id": worker_id})
            if len(writes) < len(encoded):
                self._check_items_exist(conn, [key for key, _ in encoded])  # ItemNotFound rolls everything back
            if writes:
                conn.execute(_COMPLETE, writes)
        return accepted

    def _fail_many(self, keys: Sequence[ItemKey], worker_id: str, error: str, retryable: bool,
                   retry_at_s: float | None, now_s: float) -> list[bool]:
        error = self._text(error)
        with self._write() as conn:
            batch_rows = conn.execute(_BATCHES_TO_FAIL, {"batch_ids": sorted({key.batch_id for key in keys})}).all()
            seqs = {batch_id: seq for batch_id, seq, _ in batch_rows}
            cancelled = {seq for _, seq, is_cancelled in batch_rows if is_cancelled}
            found = {(seq, index): (state, owner, attempts) for batch_id, indexes in _by_batch(keys)
                     if (seq := seqs.get(batch_id)) is not None
                     for index, state, owner, attempts in conn.execute(_ITEMS_TO_FAIL, {"seq_": seq,
                                                                                        "indexes": indexes})}
            changed, writes = [], []
            # Key by key, each seeing the writes before it: a key given twice behaves as two calls.
            for key in keys:
                pair = (seqs.get(key.batch_id), key.index)
                if pair not in found:
                    raise ItemNotFound(f"no item {key.index} in batch {key.batch_id!r}")
                state, owner, attempts = found[pair]
                write = failure_write(state, owner, attempts, pair[0] in cancelled, worker_id, error, retryable,
                                      self.max_attempts)
                changed.append(write is not None)
                if write is None:
                    continue
                found[pair] = (write.state, None, attempts)
                final = write.state == "done"
                writes.append({"seq_": pair[0], "idx_": key.index, "state_": write.state, "status_": write.status,
                               "error_": write.error, "retry_at_s": None if final else retry_at_s,
                               "finished_at_s": now_s if final else None, "finished_by_": worker_id if final else None})
            if writes:
                conn.execute(_FAIL, writes)
        return changed

    def _release_expired(self, now_s: float) -> int:
        with self._write() as conn:
            return self._release_expired_in(conn, now_s)

    def _release_expired_in(self, conn: Connection, now_s: float) -> int:
        batch_rows = conn.execute(_EXPIRED_BATCHES, {"now_s": now_s}).all()
        cancelled = [seq for seq, is_cancelled in batch_rows if is_cancelled]
        live = [seq for seq, is_cancelled in batch_rows if not is_cancelled]
        released = 0
        if cancelled:
            released += conn.execute(_EXPIRE_CANCELLED, {"seqs": cancelled, "now_s": now_s}).rowcount
        if live:
            released += conn.execute(_EXPIRE_EXHAUSTED, {"seqs": live, "now_s": now_s,
                                                         "max_attempts": self.max_attempts}).rowcount
            released += conn.execute(_EXPIRE_REQUEUE, {"seqs": live, "now_s": now_s}).rowcount
        return released

    @staticmethod
    def _check_items_exist(conn: Connection, keys: Sequence[ItemKey]) -> None:
        """Raise `ItemNotFound` for the first of `keys` that names no item (the transaction then rolls back)."""
        existing = {(batch_id, index) for batch_id, indexes in _by_batch(keys)
                    for (index,) in conn.execute(_EXISTING, {"batch_id_": batch_id, "indexes": indexes})}
        for key in keys:
            if (key.batch_id, key.index) not in existing:
                raise ItemNotFound(f"no item {key.index} in batch {key.batch_id!r}")


def _by_batch(keys: Iterable[ItemKey]) -> list[tuple[str, list[int]]]:
    """Each batch the keys name, with its indexes: batches in id order, indexes in order, each once.

    The order is the lock order: every transaction that waits for item locks takes them batch by
    batch in this order, so no two wait on each other in a cycle.
    """
    indexes: dict[str, set[int]] = {}
    for key in keys:
        indexes.setdefault(key.batch_id, set()).add(key.index)
    return [(batch_id, sorted(batch_indexes)) for batch_id, batch_indexes in sorted(indexes.items())]
