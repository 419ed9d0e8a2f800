"""The PostgreSQL engine of the batch queue: one database shared by the API and by workers on many machines.

The queue's semantics are those of every engine (`tools.batch.store_base`); this module is how
PostgreSQL keeps them while processes on several machines write at once, each change one
transaction at READ COMMITTED (psycopg 3, one connection per store).

*Claims skip, never wait.* A claim selects the oldest claimable items `FOR UPDATE SKIP LOCKED`
and leases them in the same statement: an item that another claimer has locked in its open
transaction is passed over rather than waited for, so any number of claimers take disjoint items
and none queues behind another. Releasing expired leases, which every claim does first, skips
locked rows too.

*First writer wins by the row lock.* A result is an `UPDATE ... WHERE state != 'done'`: two
writers of one item serialize on its row lock, and the second, once the first commits, re-checks
its WHERE against the committed row (READ COMMITTED does) and writes nothing.

*Cancel against requeue.* Without care a cancel and a requeue (a retryable failure, an expired
lease) could cross, each reading the other's row as it was before, and put an item back in the
queue of a batch just cancelled, where no claim would ever take it and the batch would never
finish. So every transaction that may requeue reads its batch rows `FOR SHARE`, and a cancel takes
its batch row `FOR NO KEY UPDATE`: whichever comes second waits for the first and then sees it.

*Lock order.* Batch rows before item rows, each in (seq, index) order, in every transaction that
waits for locks, so no two transactions can wait on each other in a cycle.

*Idempotency under concurrency.* The key is a unique column and a submission inserts with
`ON CONFLICT (idempotency_key) DO NOTHING`: a second submission of the key waits for the first
one's transaction and then finds its batch, so two API processes submitting one key at once make
one batch. (Looking first and inserting after, as the SQLite engine does under its write lock,
would let both pass the look here.)

*Schema.* The tables live in a schema of their own, `batch_queue`, in the URL's database, so they
cannot collide with an application's `items` table. The first open creates them under an
advisory lock (`CREATE ... IF NOT EXISTS` is not safe when two processes run it at once) and
records the schema version in `meta`; an open that finds another version refuses.

*Durability.* A commit returns once the WAL is flushed (PostgreSQL's default `synchronous_commit`);
a client killed in the middle of a transaction leaves nothing, the server rolls it back.

*Connection.* As with SQLite, one store is one connection: one per process (and thread), never
across `fork`. A connection found broken at the start of a call (the server restarted) is opened
again; a call that fails part-way raises, and its caller decides (the API answers 500, a worker
exits, is started again, and its leases expire).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psycopg
from psycopg.conninfo import conninfo_to_dict

from tools.batch.engines import is_postgres_url, redact_url
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
SCHEMA = "batch_queue"
DEFAULT_CONNECT_TIMEOUT_S = 10  # libpq waits forever by default for a host that drops packets
# pg_advisory_xact_lock takes a bigint: the first 8 bytes of a hash of this module's purpose.
_SCHEMA_LOCK_ID = int.from_bytes(hashlib.sha256(b"tools.batch.pg_store schema").digest()[:8], "big", signed=True)

_TABLES = """
CREATE TABLE meta (
    key text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE batches (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- submission order: claims serve the oldest first
    id text NOT NULL UNIQUE,                -- what clients see
    model text NOT NULL,
    version integer,                        -- NULL: the server's default version
    idempotency_key text UNIQUE,            -- NULL keys never collide
    fingerprint text NOT NULL,              -- sha256 of the body: same key, other body -> conflict
    created_at double precision NOT NULL,
    num_items integer NOT NULL,
    cancelled_at double precision
);
CREATE TABLE items (
    batch_seq bigint NOT NULL REFERENCES batches (seq),
    idx integer NOT NULL,                   -- position in the submission
    model text NOT NULL,                    -- the batch's, copied so a per-model claim has its own index
    payload text NOT NULL,                  -- the item as JSON text, as written (jsonb would reorder keys)
    state text NOT NULL CHECK (state IN ('queued', 'leased', 'done')),
    attempts integer NOT NULL DEFAULT 0,    -- claims so far
    lease_owner text,
    lease_expires_at double precision,
    not_before double precision NOT NULL DEFAULT 0,  -- retry backoff: not claimable before this
    result text,                            -- JSON text, when status = 'ok'
    error text,                             -- the last error
    status text CHECK (status IN ('ok', 'failed', 'cancelled')),
    finished_at double precision,
    finished_by text,                       -- the worker whose write was final
    PRIMARY KEY (batch_seq, idx),
    CHECK ((state = 'done') = (status IS NOT NULL)),
    CHECK ((state = 'leased') = (lease_expires_at IS NOT NULL))
);
-- Claims walk the queued items in (batch, index) order, expiry walks the leases: finished items are in no index.
CREATE INDEX items_queued ON items (batch_seq, idx) WHERE state = 'queued';
CREATE INDEX items_queued_by_model ON items (model, batch_seq, idx) WHERE state = 'queued';
CREATE INDEX items_leases ON items (lease_expires_at) WHERE state = 'leased'
"""

# The items named by a list of keys, joined to their rows: a CTE the writes below share.
_GIVEN_ITEMS = ("SELECT i.batch_seq, i.idx, g.batch_id, g.pos "
                "FROM unnest(%s::text[], %s::int[], %s::int[]) AS g(batch_id, idx, pos) "
                "JOIN batches AS b ON b.id = g.batch_id JOIN items AS i ON i.batch_seq = b.seq AND i.idx = g.idx")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _pg_text(text: str) -> str:
    """PostgreSQL text cannot hold NUL; an error message with one must not make the failure unrecordable."""
    return text.replace("\x00", "\\x00")


class PostgresStore(BatchQueue):
    """The queue, its results and its batches, in the `batch_queue` schema of a PostgreSQL database."""

    def __init__(self, url: str, *, max_attempts: int = 5, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        super().__init__(max_attempts)
        if not is_postgres_url(url):
            raise ValueError(f"not a PostgreSQL URL (postgresql://user@host:port/database): {redact_url(url)!r}")
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self.url = url
        self.display_url = redact_url(url)
        try:
            given = conninfo_to_dict(url)
        except psycopg.ProgrammingError as err:
            raise ValueError(f"cannot read the PostgreSQL URL {self.display_url}: {_one_line(err)}") from None
        # Settings the URL names win; these are defaults for the ones it leaves out.
        self._connect_options = {key: value for key, value in (("connect_timeout", max(1, round(connect_timeout_s))),
                                                               ("application_name", "tools.batch"))
                                 if key not in given}
        self._closed = False
        self._conn = self._connect()
        try:
            self._create_schema()
        except BaseException:
            self._conn.close()
            raise

    def _connect(self) -> psycopg.Connection:
        try:
            conn = psycopg.connect(self.url, autocommit=True, **self._connect_options)
        except psycopg.OperationalError as err:
            raise StoreUnavailable(f"cannot connect to the batch queue at {self.display_url}: {_one_line(err)}") \
                from None
        # autocommit: no implicit transactions; every change opens its own (`_transaction`).
        conn.execute(f"SET search_path TO {SCHEMA}")
        return conn

    def _create_schema(self) -> None:
        with self._transaction() as conn:
            # Held to the end of this transaction: a second process starting now waits, then finds the tables.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_ID,))
            if conn.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.meta",)).fetchone()[0] is None:
                # Only when missing: CREATE SCHEMA needs a privilege on the database that using it does not.
                if conn.execute("SELECT to_regnamespace(%s)", (SCHEMA,)).fetchone()[0] is None:
                    conn.execute(f"CREATE SCHEMA {SCHEMA}")
                for statement in _TABLES.split(";"):
                    conn.execute(statement)
                conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', %s)", (str(SCHEMA_VERSION),))
                return
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = int(row[0]) if row is not None else 0
            if version != SCHEMA_VERSION:
                raise ValueError(f"the batch store has schema version {version}; this code knows {SCHEMA_VERSION}")

    def _connection(self) -> psycopg.Connection:
        if self._conn.broken and not self._closed:  # lost since the last call: nothing of this call was sent yet
            self._conn = self._connect()
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction: committed when the block ends, rolled back when it raises."""
        conn = self._connection()
        with conn.transaction():
            yield conn

    def close(self) -> None:
        self._closed = True
        self._conn.close()

    # -- the API side ---------------------------------------------------------------------------------------

    def _submit(self, submission: Submission, fingerprint: str, payloads: list[str], now_s: float) -> tuple[str, bool]:
        key = submission.idempotency_key
        batch_id = uuid.uuid4().hex
        with self._transaction() as conn:
            row = conn.execute(
                "INSERT INTO batches (id, model, version, idempotency_key, fingerprint, created_at, num_items) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING RETURNING seq",
                (batch_id, submission.model, submission.version, key, fingerprint, now_s, len(payloads))).fetchone()
            if row is None:
                # The key is taken, by a batch committed before or by one whose transaction this insert
                # waited for; this statement's snapshot is newer than either, so it sees the batch.
                existing_id, existing_fingerprint = conn.execute(
                    "SELECT id, fingerprint FROM batches WHERE idempotency_key = %s", (key,)).fetchone()
                if existing_fingerprint != fingerprint:
                    raise IdempotencyConflict(key, existing_id)
                return existing_id, False
            with conn.cursor().copy("COPY items (batch_seq, idx, model, payload, state) FROM STDIN") as copy:
                for index, payload in enumerate(payloads):
                    copy.write_row((row[0], index, submission.model, payload, "queued"))
        return batch_id, True

    def _cancel(self, batch_id: str, now_s: float) -> bool:
        with self._transaction() as conn:
            # The batch row first: a requeue in flight (FOR SHARE) finishes before, or sees the cancel after.
            row = conn.execute("SELECT seq, cancelled_at FROM batches WHERE id = %s FOR NO KEY UPDATE",
                               (batch_id,)).fetchone()
            if row is None:
                raise BatchNotFound(f"no batch {batch_id!r}")
            seq, cancelled_at = row
            if cancelled_at is not None:
                return False
            pending = conn.execute("SELECT EXISTS (SELECT 1 FROM items WHERE batch_seq = %s AND state != 'done')",
                                   (seq,)).fetchone()[0]
            if not pending:
                return False
            conn.execute("UPDATE batches SET cancelled_at = %s WHERE seq = %s", (now_s, seq))
            # An item a claimer holds locked is waited for: once its claim commits, it is leased, not queued,
            # and stays out of this update (a leased item may finish).
            conn.execute("UPDATE items SET state = 'done', status = 'cancelled', finished_at = %s "
                         "WHERE (batch_seq, idx) IN (SELECT batch_seq, idx FROM items WHERE batch_seq = %s "
                         "AND state = 'queued' ORDER BY idx FOR UPDATE)", (now_s, seq))
        return True

    def get_batch(self, batch_id: str) -> BatchView:
        # One statement, so one snapshot: the counts always add up to the batch's items.
        rows = self._connection().execute(
            "SELECT b.model, b.version, b.idempotency_key, b.created_at, b.cancelled_at, "
            "i.state, i.status, count(*), max(i.finished_at) "
            "FROM batches AS b JOIN items AS i ON i.batch_seq = b.seq WHERE b.id = %s "
            "GROUP BY b.seq, i.state, i.status", (batch_id,)).fetchall()
        if not rows:  # every batch has at least one item
            raise BatchNotFound(f"no batch {batch_id!r}")
        return batch_view(batch_id, *rows[0][:5], [row[5:] for row in rows])

    def _results(self, batch_id: str, offset: int, limit: int) -> list[ItemResult]:
        # The batch LEFT JOIN its page: no row means no batch, one row of NULLs an empty page.
        rows = self._connection().execute(
            "SELECT page.idx, page.status, page.result, page.error, page.attempts FROM batches AS b "
            "LEFT JOIN LATERAL (SELECT idx, status, result, error, attempts FROM items WHERE batch_seq = b.seq "
            "AND idx >= %s ORDER BY idx LIMIT %s) AS page ON true WHERE b.id = %s ORDER BY page.idx",
            (offset, limit, batch_id)).fetchall()
        if not rows:
            raise BatchNotFound(f"no batch {batch_id!r}")
        return [item_result(*row) for row in rows if row[0] is not None]

    # -- the worker side ------------------------------------------------------------------------------------

    def _claim(self, worker_id: str, max_items: int, lease_s: float, now_s: float,
               model: str | None) -> list[ClaimedItem]:
        by_model = "AND i.model = %(model)s" if model is not None else ""
        expires_at = now_s + lease_s
        with self._transaction() as conn:
            self._release_expired_in(conn, now_s)
            rows = conn.execute(
                "WITH picked AS (SELECT i.batch_seq, i.idx FROM items AS i JOIN batches AS b ON b.seq = i.batch_seq "
                f"WHERE i.state = 'queued' AND i.not_before <= %(now)s AND b.cancelled_at IS NULL {by_model} "
                "ORDER BY i.batch_seq, i.idx LIMIT %(max_items)s FOR UPDATE OF i SKIP LOCKED) "
                "UPDATE items AS i SET state = 'leased', lease_owner = %(worker)s, lease_expires_at = %(expires)s, "
                "attempts = i.attempts + 1 FROM picked JOIN batches AS b ON b.seq = picked.batch_seq "
                "WHERE i.batch_seq = picked.batch_seq AND i.idx = picked.idx "
                "RETURNING i.batch_seq, i.idx, i.attempts, i.payload, b.id, b.model, b.version",
                {"now": now_s, "model": model, "max_items": max_items, "worker": worker_id,
                 "expires": expires_at}).fetchall()
        rows.sort(key=lambda row: (row[0], row[1]))  # RETURNING has no order of its own
        return [ClaimedItem(key=ItemKey(batch_id, index), model=batch_model, version=version,
                            payload=json.loads(payload), attempt=attempt, claimed_at_s=now_s,
                            lease_expires_at_s=expires_at)
                for _, index, attempt, payload, batch_id, batch_model, version in rows]

    def _extend_leases(self, keys: Sequence[ItemKey], worker_id: str, expires_at_s: float) -> int:
        with self._transaction() as conn:
            held = conn.execute(
                f"WITH target AS ({_GIVEN_ITEMS} WHERE i.state = 'leased' AND i.lease_owner = %s "
                "ORDER BY i.batch_seq, i.idx FOR UPDATE OF i) "
                "UPDATE items AS i SET lease_expires_at = %s FROM target "
                "WHERE i.batch_seq = target.batch_seq AND i.idx = target.idx RETURNING target.batch_id, i.idx",
                (*_key_arrays(keys), worker_id, expires_at_s)).fetchall()
        # Counted by key, not by row: a key given twice counts twice, as when extended one key at a time.
        held_keys = {ItemKey(batch_id, index) for batch_id, index in held}
        return sum(key in held_keys for key in keys)

    def _complete_many(self, encoded: Sequence[tuple[ItemKey, str]], worker_id: str, now_s: float) -> list[bool]:
        # A key given twice: its first result is the one offered, the later ones come second.
        first_position: dict[ItemKey, int] = {}
        for position, (key, _) in enumerate(encoded):
            first_position.setdefault(key, position)
        offered = sorted(first_position.values())
        with self._transaction() as conn:
            # First writer wins: only an item without a final outcome takes one. `attempts > 0`: only
            # an item that was handed out can have a result.
            written = {row[0] for row in conn.execute(
                f"WITH target AS ({_GIVEN_ITEMS} WHERE i.state != 'done' AND i.attempts > 0 "
                "ORDER BY i.batch_seq, i.idx FOR UPDATE OF i) "
                "UPDATE items AS i SET state = 'done', status = 'ok', result = (%s::text[])[target.pos + 1], "
                "error = NULL, finished_at = %s, finished_by = %s, lease_owner = NULL, lease_expires_at = NULL "
                "FROM target WHERE i.batch_seq = target.batch_seq AND i.idx = target.idx RETURNING target.pos",
                (*_key_arrays([encoded[p][0] for p in offered], offered), [result for _, result in encoded],
                 now_s, worker_id))}
            if len(written) < len(offered):
                self._check_items_exist(conn, [key for key, _ in encoded])
        return [position in written for position in range(len(encoded))]

    def _fail_many(self, keys: Sequence[ItemKey], worker_id: str, error: str, retryable: bool,
                   retry_at_s: float | None, now_s: float) -> list[bool]:
        error = _pg_text(error)
        with self._transaction() as conn:
            # Batch rows FOR SHARE before the items: a cancel of one of them either finished before (and
            # is seen here) or waits for this transaction; a requeue never lands in a cancelled batch.
            batches = {batch_id: (seq, cancelled) for batch_id, seq, cancelled in conn.execute(
                "SELECT id, seq, cancelled_at IS NOT NULL FROM batches WHERE id = ANY(%s::text[]) "
                "ORDER BY seq FOR SHARE", (sorted({key.batch_id for key in keys}),))}
            item_rows = conn.execute(
                f"WITH given AS ({_GIVEN_ITEMS}) SELECT i.batch_seq, i.idx, i.state, i.lease_owner, i.attempts "
                "FROM items AS i WHERE (i.batch_seq, i.idx) IN (SELECT batch_seq, idx FROM given) "
                "ORDER BY i.batch_seq, i.idx FOR UPDATE", _key_arrays(keys)).fetchall()
            items = {(seq, index): (state, owner, attempts) for seq, index, state, owner, attempts in item_rows}
            changed, writes = [], []
            # Key by key, each seeing the writes before it: a key given twice behaves as two calls.
            for key in keys:
                seq, cancelled = batches.get(key.batch_id, (None, False))
                if (seq, key.index) not in items:
                    raise ItemNotFound(f"no item {key.index} in batch {key.batch_id!r}")
                state, owner, attempts = items[(seq, key.index)]
                write = failure_write(state, owner, attempts, cancelled, worker_id, error, retryable,
                                      self.max_attempts)
                changed.append(write is not None)
                if write is None:
                    continue
                items[(seq, key.index)] = (write.state, None, attempts)
                final = write.state == "done"
                writes.append((write.state, write.status, write.error, None if final else retry_at_s,
                               now_s if final else None, worker_id if final else None, seq, key.index))
            if writes:
                conn.cursor().executemany(
                    "UPDATE items SET state = %s, status = %s, error = %s, not_before = coalesce(%s, not_before), "
                    "finished_at = %s, finished_by = %s, lease_owner = NULL, lease_expires_at = NULL "
                    "WHERE batch_seq = %s AND idx = %s", writes)
        return changed

    def _release_expired(self, now_s: float) -> int:
        with self._transaction() as conn:
            return self._release_expired_in(conn, now_s)

    def _release_expired_in(self, conn: psycopg.Connection, now_s: float) -> int:
        # The batches of expired leases, FOR SHARE so that a cancel cannot cross the requeue below.
        # SKIP LOCKED throughout: a batch being cancelled, or an item another transaction holds (a
        # claimer releasing the same leases, a worker completing it), is left to the next call rather
        # than waited for, so claims never wait on each other.
        batches = conn.execute(
            "SELECT seq, cancelled_at IS NOT NULL FROM batches WHERE seq IN (SELECT batch_seq FROM items "
            "WHERE state = 'leased' AND lease_expires_at <= %s) ORDER BY seq FOR SHARE SKIP LOCKED",
            (now_s,)).fetchall()
        cancelled = [seq for seq, is_cancelled in batches if is_cancelled]
        live = [seq for seq, is_cancelled in batches if not is_cancelled]
        expired = ("(batch_seq, idx) IN (SELECT batch_seq, idx FROM items WHERE batch_seq = ANY(%(seqs)s::bigint[]) "
                   "AND state = 'leased' AND lease_expires_at <= %(now)s {} ORDER BY batch_seq, idx "
                   "FOR UPDATE SKIP LOCKED)")
        released = 0
        # A cancelled batch's item is never handed out again; an item at its last attempt has had
        # its chances (a worker that dies on it every time must not keep its batch open).
        if cancelled:
            released += conn.execute(
                "UPDATE items SET state = 'done', status = 'cancelled', finished_at = %(now)s, lease_owner = NULL, "
                f"lease_expires_at = NULL WHERE {expired.format('')}", {"seqs": cancelled, "now": now_s}).rowcount
        if live:
            released += conn.execute(
                "UPDATE items SET state = 'done', status = 'failed', finished_at = %(now)s, "
                "error = format(%(message)s, attempts, lease_owner), lease_owner = NULL, lease_expires_at = NULL "
                f"WHERE {expired.format('AND attempts >= %(max_attempts)s')}",
                {"seqs": live, "now": now_s, "max_attempts": self.max_attempts,
                 "message": "no result after %s attempts: the lease of worker %s expired"}).rowcount
            released += conn.execute(
                "UPDATE items SET state = 'queued', lease_owner = NULL, lease_expires_at = NULL "
                f"WHERE {expired.format('')}", {"seqs": live, "now": now_s}).rowcount
        return released

    @staticmethod
    def _check_items_exist(conn: psycopg.Connection, keys: Sequence[ItemKey]) -> None:
        """Raise `ItemNotFound` for the first of `keys` that names no item (the transaction then rolls back)."""
        missing = conn.execute(
            "SELECT g.pos FROM unnest(%s::text[], %s::int[], %s::int[]) AS g(batch_id, idx, pos) "
            "WHERE NOT EXISTS (SELECT 1 FROM batches AS b JOIN items AS i ON i.batch_seq = b.seq "
            "WHERE b.id = g.batch_id AND i.idx = g.idx) ORDER BY g.pos LIMIT 1", _key_arrays(keys)).fetchone()
        if missing is not None:
            key = keys[missing[0]]
            raise ItemNotFound(f"no item {key.index} in batch {key.batch_id!r}")


def _key_arrays(keys: Sequence[ItemKey], positions: Sequence[int] | None = None) -> tuple[list, list, list]:
    """(batch ids, indexes, positions) of `keys`: the three arrays `_GIVEN_ITEMS` unnests."""
    return ([key.batch_id for key in keys], [key.index for key in keys],
            list(positions) if positions is not None else list(range(len(keys))))
