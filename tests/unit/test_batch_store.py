"""The durable batch queue: submit, claim, results, retries, cancel, lease expiry, and exactly one result per item.

Every test that takes `store` or `db` runs twice, on each engine: a SQLite file and a real
PostgreSQL database (a fresh one per test, on the session's server; `db` in conftest.py). Every test drives the clock
by hand (`now_s`), so a lease expires or a backoff runs out by adding a number. The process
tests run real workers on one queue: racing for the same items (one worker's clock runs ahead,
so it takes over every lease it sees), killed with SIGKILL while holding leases, and an API
process killed in the middle of its submissions.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import signal
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.postgres import create_database, drop_database
from tools.batch.engines import is_postgres_url, open_store
from tools.batch.pg_store import PostgresStore
from tools.batch.policy import BatchLimits, BatchStatus, ItemCounts, Submission, validate_submission
from tools.batch.store import (
    BatchNotFound,
    BatchStore,
    IdempotencyConflict,
    ItemKey,
    ItemNotFound,
)

T0 = 1000.0
LEASE_S = 30.0


@pytest.fixture
def store(db):
    with open_store(db, max_attempts=3) as opened:
        yield opened


def query(db: str, sql: str) -> list[tuple]:
    """Rows of `sql` read straight from the queue's tables, whichever engine holds them."""
    if is_postgres_url(db):
        import psycopg

        with psycopg.connect(db) as conn:
            conn.execute("SET search_path TO batch_queue")
            return conn.execute(sql).fetchall()
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def embed_batch(num_items: int, key: str | None = None, prefix: str = "text") -> Submission:
    return Submission(model="embed", items=tuple(f"{prefix}-{index}" for index in range(num_items)),
                      idempotency_key=key)


def indexes(claimed) -> list[int]:
    return [item.key.index for item in claimed]


# -- submit and idempotency ------------------------------------------------------------------------------------


def test_a_submitted_batch_is_queued_with_every_item_pending_in_input_order(store):
    batch_id, created = store.submit(embed_batch(3), T0)
    assert created
    view = store.get_batch(batch_id)
    assert view.status is BatchStatus.QUEUED and view.counts == ItemCounts(num_queued=3)
    assert (view.model, view.version, view.created_at_s, view.finished_at_s) == ("embed", None, T0, None)
    assert [(r.index, r.status, r.result, r.error) for r in store.results(batch_id)] == [
        (0, "pending", None, None), (1, "pending", None, None), (2, "pending", None, None)]


def test_the_same_key_and_body_returns_the_same_batch_without_new_items(store):
    first_id, created = store.submit(embed_batch(3, key="order-1"), T0)
    again_id, created_again = store.submit(embed_batch(3, key="order-1"), T0 + 5)
    assert created and not created_again and again_id == first_id
    assert store.get_batch(first_id).counts.num_items == 3
    assert len(store.claim("w", 100, LEASE_S, T0 + 5)) == 3


def test_the_same_key_with_another_body_is_a_conflict_naming_the_batch(store):
    batch_id, _ = store.submit(embed_batch(3, key="order-1"), T0)
    with pytest.raises(IdempotencyConflict, match=f"'order-1' was already used for batch {batch_id}") as error:
        store.submit(embed_batch(4, key="order-1"), T0 + 1)
    assert error.value.batch_id == batch_id
    assert store.get_batch(batch_id).counts.num_items == 3


def test_batches_without_a_key_are_always_new(store):
    first, _ = store.submit(embed_batch(2), T0)
    second, created = store.submit(embed_batch(2), T0)
    assert created and first != second


def test_a_validated_submission_is_stored_as_submitted(store):
    raw = {"model": "llm", "version": 3, "items": [{"prompt": "héllo", "max_tokens": 4}, {"prompt": "b"}]}
    batch_id, _ = store.submit(validate_submission(raw, BatchLimits()), T0)
    claimed = store.claim("w", 10, LEASE_S, T0)
    assert [item.payload for item in claimed] == raw["items"]
    assert {(item.model, item.version) for item in claimed} == {("llm", 3)}
    assert store.get_batch(batch_id).version == 3


def test_unknown_batches_are_not_found(store):
    with pytest.raises(BatchNotFound, match="no batch 'nope'"):
        store.get_batch("nope")
    with pytest.raises(BatchNotFound):
        store.results("nope")
    with pytest.raises(BatchNotFound):
        store.cancel("nope", T0)


# -- claims ----------------------------------------------------------------------------------------------------


def test_claims_lease_the_oldest_batch_first_in_index_order(store):
    older, _ = store.submit(embed_batch(3, prefix="old"), T0)
    newer, _ = store.submit(embed_batch(3, prefix="new"), T0 + 1)
    first = store.claim("w1", 4, LEASE_S, T0 + 2)
    assert [(item.key.batch_id, item.key.index) for item in first] == [(older, 0), (older, 1), (older, 2), (newer, 0)]
    assert [item.payload for item in first] == ["old-0", "old-1", "old-2", "new-0"]
    assert {(item.attempt, item.claimed_at_s, item.lease_expires_at_s) for item in first} == {
        (1, T0 + 2, T0 + 2 + LEASE_S)}
    second = store.claim("w2", 4, LEASE_S, T0 + 2)
    assert [(item.key.batch_id, item.key.index) for item in second] == [(newer, 1), (newer, 2)]
    assert store.claim("w3", 4, LEASE_S, T0 + 2) == []
    assert store.get_batch(older).status is BatchStatus.RUNNING
    assert store.get_batch(older).counts == ItemCounts(num_leased=3)


def test_a_claim_for_one_model_skips_the_others(store):
    store.submit(embed_batch(2), T0)
    llm_id, _ = store.submit(Submission(model="llm", items=({"prompt": "a"},)), T0 + 1)
    claimed = store.claim("w", 10, LEASE_S, T0 + 2, model="llm")
    assert [(item.key.batch_id, item.model) for item in claimed] == [(llm_id, "llm")]
    assert store.claim("w", 10, LEASE_S, T0 + 2, model="rerank") == []
    assert indexes(store.claim("w", 10, LEASE_S, T0 + 2, model="embed")) == [0, 1]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"worker_id": ""}, "worker_id must be a non-empty string"),
    ({"max_items": 0}, "max_items must be >= 1, got 0"),
    ({"lease_s": 0.0}, "lease_s must be > 0, got 0.0"),
    ({"now_s": math.nan}, "now_s must be a time >= 0, got nan"),
])
def test_claims_refuse_impossible_arguments(store, kwargs, message):
    with pytest.raises(ValueError, match=message):
        store.claim(**{"worker_id": "w", "max_items": 1, "lease_s": LEASE_S, "now_s": T0, **kwargs})


# -- results: first writer wins ---------------------------------------------------------------------------------


def test_results_come_back_in_input_order_with_their_statuses(store):
    batch_id, _ = store.submit(embed_batch(4), T0)
    claimed = store.claim("w", 4, LEASE_S, T0)
    # Finished out of order: results are still listed by input index.
    assert store.complete(claimed[2].key, "w", [0.2], T0 + 1)
    assert store.fail(claimed[0].key, "w", "400: input too long", retryable=False, retry_at_s=None, now_s=T0 + 1)
    assert store.complete(claimed[1].key, "w", [0.1], T0 + 2)
    page = store.results(batch_id)
    assert [(r.index, r.status, r.result, r.error) for r in page] == [
        (0, "failed", None, "400: input too long"), (1, "ok", [0.1], None), (2, "ok", [0.2], None),
        (3, "pending", None, None)]
    assert [r.index for r in store.results(batch_id, offset=1, limit=2)] == [1, 2]
    assert store.results(batch_id, offset=10) == []


def test_results_pages_refuse_impossible_ranges(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        store.results(batch_id, offset=-1)
    with pytest.raises(ValueError, match=r"limit must be in 1..10000, got 0"):
        store.results(batch_id, limit=0)


def test_progress_counts_every_state_and_a_finished_batch_records_when(store):
    batch_id, _ = store.submit(embed_batch(5), T0)
    claimed = store.claim("w", 3, LEASE_S, T0)
    store.complete(claimed[0].key, "w", "r0", T0 + 1)
    store.fail(claimed[1].key, "w", "bad", retryable=False, retry_at_s=None, now_s=T0 + 2)
    view = store.get_batch(batch_id)
    assert view.counts == ItemCounts(num_queued=2, num_leased=1, num_ok=1, num_failed=1)
    assert view.fraction_done == pytest.approx(0.4) and view.finished_at_s is None
    store.complete(claimed[2].key, "w", "r2", T0 + 3)
    for item in store.claim("w", 5, LEASE_S, T0 + 4):
        store.complete(item.key, "w", "r", T0 + 7)
    view = store.get_batch(batch_id)
    assert view.status is BatchStatus.COMPLETED_WITH_ERRORS and view.fraction_done == 1.0
    assert view.finished_at_s == T0 + 7


def test_a_batch_with_every_result_is_completed(store):
    batch_id, _ = store.submit(embed_batch(2), T0)
    assert store.complete_many([(item.key, "r") for item in store.claim("w", 2, LEASE_S, T0)], "w", T0 + 1) == [
        True, True]
    assert store.get_batch(batch_id).status is BatchStatus.COMPLETED


def test_a_second_completion_is_ignored_and_the_first_result_kept(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    (item,) = store.claim("w", 1, LEASE_S, T0)
    assert store.complete(item.key, "w", "first", T0 + 1)
    assert not store.complete(item.key, "w", "second", T0 + 2)
    assert not store.fail(item.key, "w", "late error", retryable=False, retry_at_s=None, now_s=T0 + 2)
    (result,) = store.results(batch_id)
    assert (result.status, result.result, result.error) == ("ok", "first", None)
    assert store.get_batch(batch_id).finished_at_s == T0 + 1


def test_an_item_never_handed_out_cannot_be_completed_and_an_unknown_one_is_an_error(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    assert not store.complete(ItemKey(batch_id, 0), "w", "made up", T0)
    assert store.results(batch_id)[0].status == "pending"
    with pytest.raises(ItemNotFound, match=f"no item 5 in batch '{batch_id}'"):
        store.complete(ItemKey(batch_id, 5), "w", "r", T0)
    with pytest.raises(ItemNotFound):
        store.fail(ItemKey("nope", 0), "w", "e", retryable=False, retry_at_s=None, now_s=T0)


def test_a_result_that_is_not_json_is_refused_before_anything_is_written(store):
    batch_id, _ = store.submit(embed_batch(2), T0)
    first, second = store.claim("w", 2, LEASE_S, T0)
    with pytest.raises(TypeError):
        store.complete_many([(first.key, "fine"), (second.key, object())], "w", T0)
    assert [r.status for r in store.results(batch_id)] == ["pending", "pending"]


# -- lease expiry: a dead worker's items come back, a stale worker's write is ignored ------------------------------


def test_an_expired_lease_comes_back_to_the_next_claim_with_the_attempt_counted(store):
    batch_id, _ = store.submit(embed_batch(2), T0)
    store.claim("dead", 2, LEASE_S, T0)  # then SIGKILLed: never reports
    assert store.claim("alive", 2, LEASE_S, T0 + LEASE_S - 0.001) == []  # still leased
    taken_over = store.claim("alive", 2, LEASE_S, T0 + LEASE_S)
    assert indexes(taken_over) == [0, 1] and {item.attempt for item in taken_over} == {2}
    assert store.get_batch(batch_id).counts == ItemCounts(num_leased=2)


def test_a_stale_worker_completing_after_the_take_over_does_not_add_a_second_result(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    (slow,) = store.claim("slow", 1, LEASE_S, T0)
    (fast,) = store.claim("fast", 1, LEASE_S, T0 + LEASE_S + 1)
    assert store.complete(fast.key, "fast", "from fast", T0 + LEASE_S + 2)
    assert not store.complete(slow.key, "slow", "from slow", T0 + LEASE_S + 3)
    (result,) = store.results(batch_id)
    assert (result.status, result.result, result.attempts) == ("ok", "from fast", 2)


def test_a_stale_worker_that_writes_first_wins_and_the_new_holder_is_ignored(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    (slow,) = store.claim("slow", 1, LEASE_S, T0)
    (fast,) = store.claim("fast", 1, LEASE_S, T0 + LEASE_S + 1)
    assert store.complete(slow.key, "slow", "from slow", T0 + LEASE_S + 2)  # its work is as good as anyone's
    assert not store.complete(fast.key, "fast", "from fast", T0 + LEASE_S + 3)
    assert store.results(batch_id)[0].result == "from slow"
    assert store.claim("other", 1, LEASE_S, T0 + 10 * LEASE_S) == []  # a finished item is never handed out again


def test_a_stale_workers_retryable_failure_does_not_requeue_an_item_someone_else_holds(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    (slow,) = store.claim("slow", 1, LEASE_S, T0)
    store.claim("fast", 1, LEASE_S, T0 + LEASE_S + 1)
    assert not store.fail(slow.key, "slow", "timeout", retryable=True, retry_at_s=T0 + LEASE_S + 2,
                          now_s=T0 + LEASE_S + 2)
    assert store.get_batch(batch_id).counts == ItemCounts(num_leased=1)
    assert store.claim("third", 1, LEASE_S, T0 + LEASE_S + 3) == []


def test_extending_a_lease_keeps_the_item_from_being_taken_over(store):
    store.submit(embed_batch(2), T0)
    first, second = store.claim("w", 2, LEASE_S, T0)
    assert store.extend_leases([first.key, second.key], "w", LEASE_S, T0 + 20) == 2
    assert store.extend_leases([first.key], "someone-else", LEASE_S, T0 + 20) == 0
    assert store.claim("other", 2, LEASE_S, T0 + LEASE_S + 1) == []
    assert indexes(store.claim("other", 2, LEASE_S, T0 + 20 + LEASE_S)) == [0, 1]


def test_a_lease_that_expires_at_the_last_attempt_ends_the_item_as_failed(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    now = T0
    for _ in range(store.max_attempts):  # a worker that dies on this item every time
        assert len(store.claim("doomed", 1, LEASE_S, now)) == 1
        now += LEASE_S
    assert store.release_expired(now) == 1
    (result,) = store.results(batch_id)
    assert result.status == "failed" and result.attempts == 3
    assert result.error == "no result after 3 attempts: the lease of worker doomed expired"
    assert store.claim("w", 1, LEASE_S, now) == []


# -- retries ----------------------------------------------------------------------------------------------------


def test_a_retryable_failure_waits_out_its_backoff_then_is_claimed_again(store):
    batch_id, _ = store.submit(embed_batch(2), T0)
    first, _second = store.claim("w", 2, LEASE_S, T0)
    assert store.fail(first.key, "w", "503 busy", retryable=True, retry_at_s=T0 + 5, now_s=T0 + 1)
    assert store.get_batch(batch_id).counts == ItemCounts(num_queued=1, num_leased=1)
    assert store.claim("w", 2, LEASE_S, T0 + 4.9) == []  # in backoff
    (again,) = store.claim("w", 2, LEASE_S, T0 + 5)
    assert (again.key, again.attempt) == (first.key, 2)


def test_a_retryable_failure_at_the_last_attempt_is_final(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    now = T0
    for attempt in range(1, store.max_attempts + 1):
        (item,) = store.claim("w", 1, LEASE_S, now)
        assert item.attempt == attempt
        assert store.fail(item.key, "w", "503 busy", retryable=True, retry_at_s=now + 1, now_s=now)
        now += 1
    (result,) = store.results(batch_id)
    assert (result.status, result.error, result.attempts) == ("failed", "503 busy (gave up after 3 attempts)", 3)
    assert store.claim("w", 1, LEASE_S, now + 100) == []
    assert store.get_batch(batch_id).status is BatchStatus.COMPLETED_WITH_ERRORS


def test_a_non_retryable_failure_is_final_at_once(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    (item,) = store.claim("w", 1, LEASE_S, T0)
    assert store.fail(item.key, "w", "400 bad input", retryable=False, retry_at_s=None, now_s=T0)
    assert store.results(batch_id)[0].status == "failed"
    assert store.claim("w", 1, LEASE_S, T0 + 100) == []


def test_a_retryable_failure_needs_a_retry_time_not_in_the_past(store):
    store.submit(embed_batch(1), T0)
    (item,) = store.claim("w", 1, LEASE_S, T0)
    with pytest.raises(ValueError, match="needs retry_at_s >= now_s"):
        store.fail(item.key, "w", "busy", retryable=True, retry_at_s=None, now_s=T0)
    with pytest.raises(ValueError, match=r"got 999\.0"):
        store.fail(item.key, "w", "busy", retryable=True, retry_at_s=T0 - 1, now_s=T0)


# -- cancel -----------------------------------------------------------------------------------------------------


def test_cancel_finalizes_queued_items_and_stops_claims_while_leased_ones_may_finish(store):
    batch_id, _ = store.submit(embed_batch(4), T0)
    other_id, _ = store.submit(embed_batch(1, prefix="other"), T0)
    running = store.claim("w", 2, LEASE_S, T0)
    assert store.cancel(batch_id, T0 + 1)
    view = store.get_batch(batch_id)
    assert view.status is BatchStatus.CANCELLED and view.cancelled_at_s == T0 + 1
    assert view.counts == ItemCounts(num_leased=2, num_cancelled=2)
    # Only the other batch is claimable now.
    assert [item.key.batch_id for item in store.claim("w", 10, LEASE_S, T0 + 2)] == [other_id]
    # In-flight items: one finishes (its result is kept), one fails retryably (it ends cancelled, not queued).
    assert store.complete(running[0].key, "w", "done anyway", T0 + 3)
    assert store.fail(running[1].key, "w", "busy", retryable=True, retry_at_s=T0 + 4, now_s=T0 + 3)
    assert [(r.status, r.result) for r in store.results(batch_id)] == [
        ("ok", "done anyway"), ("cancelled", None), ("cancelled", None), ("cancelled", None)]
    view = store.get_batch(batch_id)
    assert view.counts == ItemCounts(num_ok=1, num_cancelled=3) and view.finished_at_s == T0 + 3


def test_an_expired_lease_of_a_cancelled_batch_ends_cancelled(store):
    batch_id, _ = store.submit(embed_batch(2), T0)
    store.claim("dead", 1, LEASE_S, T0)
    store.cancel(batch_id, T0 + 1)
    assert store.claim("w", 10, LEASE_S, T0 + LEASE_S + 1) == []
    assert store.get_batch(batch_id).counts == ItemCounts(num_cancelled=2)


def test_cancel_is_a_no_op_once_cancelled_or_finished(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    assert store.cancel(batch_id, T0) and not store.cancel(batch_id, T0 + 1)
    assert store.get_batch(batch_id).cancelled_at_s == T0
    finished_id, _ = store.submit(embed_batch(1), T0)
    (item,) = store.claim("w", 1, LEASE_S, T0)
    store.complete(item.key, "w", "r", T0)
    assert not store.cancel(finished_id, T0 + 1)
    assert store.get_batch(finished_id).status is BatchStatus.COMPLETED


# -- the file, the database ---------------------------------------------------------------------------------------


def test_everything_survives_closing_and_reopening_the_store(db):
    with open_store(db) as first:
        batch_id, _ = first.submit(embed_batch(2, key="k"), T0)
        (item,) = first.claim("w", 1, LEASE_S, T0)
        first.complete(item.key, "w", {"v": [1, 2]}, T0)
    with open_store(db) as reopened:
        assert [(r.status, r.result) for r in reopened.results(batch_id)] == [("ok", {"v": [1, 2]}),
                                                                              ("pending", None)]
        assert reopened.submit(embed_batch(2, key="k"), T0 + 1) == (batch_id, False)
    if not is_postgres_url(db):
        assert query(db, "PRAGMA journal_mode") == [("wal",)]


def test_a_store_of_another_schema_version_is_refused(db):
    open_store(db).close()
    if is_postgres_url(db):
        import psycopg

        with psycopg.connect(db) as conn:
            conn.execute("UPDATE batch_queue.meta SET value = '7' WHERE key = 'schema_version'")
    else:
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA user_version = 7")
    with pytest.raises(ValueError, match="schema version 7; this code knows 1"):
        open_store(db)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
    ({"busy_timeout_s": 0}, "busy_timeout_s must be > 0, got 0"),
    ({"synchronous": "SOMETIMES"}, "synchronous must be one of"),
])
def test_the_store_refuses_impossible_settings(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchStore(tmp_path / "batch.db", **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
    ({"connect_timeout_s": 0}, "connect_timeout_s must be > 0, got 0"),
])
def test_the_postgres_store_refuses_impossible_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):  # before it tries to connect: no server needed
        PostgresStore("postgresql://nobody@127.0.0.1:1/none", **kwargs)


# -- random interleavings ---------------------------------------------------------------------------------------


WORKERS = ("a", "b", "c")


class QueueMachine(RuleBasedStateMachine):
    """Random claims, completions, failures, deaths, cancels and clock jumps against one store.

    The invariant is checked by observation after every step: an item, once final, never changes,
    and a final write (`complete`, a non-retryable `fail`) is accepted exactly when the item had no
    final outcome before. At the end the clock runs far ahead and a worker drains the queue:
    every item must then have exactly one final outcome, and whatever the workers still hold
    (stale claims) is refused.
    """

    def __init__(self, postgres_server=None):
        super().__init__()
        self.postgres_server = postgres_server
        if postgres_server is None:
            self.directory = tempfile.mkdtemp(prefix="batch-machine-")
            # synchronous=OFF: durability is not what this test checks, and fsyncs would dominate it.
            self.store = BatchStore(Path(self.directory) / "batch.db", max_attempts=3, synchronous="OFF")
        else:
            self.url = create_database(postgres_server)  # one per example: each starts from an empty queue
            self.store = PostgresStore(self.url, max_attempts=3)
        self.now = T0
        self.batch_ids: list[str] = []
        self.held: list[tuple[str, object]] = []  # (worker, ClaimedItem) handed out and not reported yet
        self.latest_claim: dict[ItemKey, tuple[str, int]] = {}  # item -> (worker, attempt) of its last claim
        self.final: dict[ItemKey, tuple[str, object, str | None]] = {}  # item -> (status, result, error) seen
        self.num_final_writes: dict[ItemKey, int] = {}

    def teardown(self):
        try:
            self.drain()
        finally:
            self.store.close()
            if self.postgres_server is None:
                shutil.rmtree(self.directory, ignore_errors=True)
            else:
                drop_database(self.postgres_server, self.url)

    def drain(self):
        for _ in range(self.store.max_attempts + 2):
            self.now += 10 * LEASE_S  # past every lease and every backoff
            for item in self.store.claim("drainer", 1000, LEASE_S, self.now):
                self._complete("drainer", item)
            self.observe()
        for batch_id in self.batch_ids:
            assert self.store.get_batch(batch_id).counts.num_pending == 0
        # Workers that outlived their leases report last: every item is final, so all are refused.
        for worker, item in self.held:
            assert not self.store.fail(item.key, worker, "late", True, self.now, self.now)
            self._complete(worker, item)
        self.observe()
        assert set(self.final) == {ItemKey(batch_id, r.index) for batch_id in self.batch_ids
                                   for r in self.store.results(batch_id)}

    @precondition(lambda self: len(self.batch_ids) < 3)  # few items, many steps on each
    @rule(num_items=st.integers(1, 5), model=st.sampled_from(["embed", "llm"]))
    def submit(self, num_items, model):
        items = tuple({"prompt": f"p{index}"} if model == "llm" else f"t{index}" for index in range(num_items))
        batch_id, created = self.store.submit(Submission(model=model, items=items), self.now)
        assert created
        self.batch_ids.append(batch_id)

    @rule(worker=st.sampled_from(WORKERS), max_items=st.integers(1, 4),
          model=st.sampled_from([None, "embed", "llm"]))
    def claim(self, worker, max_items, model):
        for item in self.store.claim(worker, max_items, LEASE_S, self.now, model=model):
            assert item.key not in self.final, "a final item was handed out again"
            assert model is None or item.model == model
            self.held.append((worker, item))
            self.latest_claim[item.key] = (worker, item.attempt)

    def _complete(self, worker, item):
        was_final = item.key in self.final
        accepted = self.store.complete(item.key, worker, {"by": worker, "attempt": item.attempt}, self.now)
        assert accepted == (not was_final)
        if accepted:
            self.num_final_writes[item.key] = self.num_final_writes.get(item.key, 0) + 1
            assert self.store.results(item.key.batch_id, item.key.index, 1)[0].result == {
                "by": worker, "attempt": item.attempt}

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def complete(self, data):
        worker, item = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self._complete(worker, item)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), retryable=st.booleans(), backoff_s=st.floats(0.0, 3 * LEASE_S))
    def fail(self, data, retryable, backoff_s):
        worker, item = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        was_final = item.key in self.final
        changed = self.store.fail(item.key, worker, "boom", retryable, self.now + backoff_s if retryable else None,
                                  self.now)
        if not retryable:
            assert changed == (not was_final)
            if changed:
                self.num_final_writes[item.key] = self.num_final_writes.get(item.key, 0) + 1
        elif changed:
            # The lease is checked by owner, not by attempt: a worker holding an older claim of an item it
            # claimed again may still requeue it (extra work at worst, never a second result).
            assert not was_final and self.latest_claim[item.key][0] == worker

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def die(self, data):
        """A worker is SIGKILLed holding this item: it never reports."""
        self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def take_over(self, data):
        """A worker is slow: its lease runs out while it still works, and another worker takes the items."""
        slow_worker, _ = self.held[data.draw(st.integers(0, len(self.held) - 1))]
        self.now += LEASE_S
        self.claim(data.draw(st.sampled_from([w for w in WORKERS if w != slow_worker])), 4, None)

    @rule(seconds=st.one_of(st.sampled_from([LEASE_S, 2 * LEASE_S]), st.floats(0.0, 2 * LEASE_S)))
    def advance(self, seconds):
        self.now += seconds

    @precondition(lambda self: self.batch_ids)
    @rule(data=st.data())
    def cancel(self, data):
        self.store.cancel(data.draw(st.sampled_from(self.batch_ids)), self.now)

    @invariant()
    def observe(self):
        for batch_id in self.batch_ids:
            for result in self.store.results(batch_id):
                key = ItemKey(batch_id, result.index)
                if result.status == "pending":
                    assert key not in self.final, f"{key} was final and is pending again"
                    continue
                seen = (result.status, result.result, result.error)
                assert self.final.setdefault(key, seen) == seen, f"{key} changed after it was final"
                assert result.attempts <= self.store.max_attempts
        assert all(count == 1 for count in self.num_final_writes.values())


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_random_interleavings_leave_exactly_one_final_outcome_per_item(engine, request):
    server = request.getfixturevalue("postgres_server") if engine == "postgres" else None
    run_state_machine_as_test(lambda: QueueMachine(server),
                              settings=settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow]))


# -- processes --------------------------------------------------------------------------------------------------


def _work_until_done(db, batch_id, worker_id, clock_offset_s, lease_s, chunk, work_s, out):
    """A worker process: claim, 'compute', complete, until the batch has nothing pending.

    Its clock is the wall clock plus `clock_offset_s`: a worker whose clock runs ahead sees the
    others' leases as expired and takes their items over while they still work on them.
    """
    store = open_store(db)
    accepted, num_stale = [], 0
    deadline = time.monotonic() + 60  # a broken store fails the test instead of hanging it
    while time.monotonic() < deadline:
        claimed = store.claim(worker_id, chunk, lease_s, time.time() + clock_offset_s)
        if not claimed:
            if store.get_batch(batch_id).counts.num_pending == 0:
                break
            time.sleep(0.002)
            continue
        time.sleep(work_s)
        outcomes = [(item.key, {"echo": item.payload}) for item in claimed]
        for (key, _), written in zip(outcomes, store.complete_many(outcomes, worker_id, time.time() + clock_offset_s),
                                     strict=True):
            if written:
                accepted.append(key.index)
            else:
                num_stale += 1
    store.close()
    out.put((worker_id, accepted, num_stale))


def _run_workers(context, db, batch_id, offsets, lease_s, chunk, work_s):
    out = context.Queue()
    workers = [context.Process(target=_work_until_done,
                               args=(db, batch_id, f"w{number}", offset, lease_s, chunk, work_s, out))
               for number, offset in enumerate(offsets)]
    for worker in workers:
        worker.start()
    try:
        reports = [out.get(timeout=90) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
                worker.join()
    assert [worker.exitcode for worker in workers] == [0] * len(workers)
    return reports


def _finished_by(db) -> dict[int, str]:
    return dict(query(db, "SELECT idx, finished_by FROM items WHERE status = 'ok'"))


def test_racing_worker_processes_leave_exactly_one_result_per_item(db):
    num_items = 3000
    with open_store(db) as store:  # closed before the fork: a connection must not cross it
        batch_id, _ = store.submit(embed_batch(num_items), time.time())
    # w3's clock is 2 s ahead of a 1 s lease: every item the others hold looks expired to it.
    reports = _run_workers(multiprocessing.get_context("fork"), db, batch_id, offsets=[0.0, 0.0, 0.0, 2.0],
                           lease_s=1.0, chunk=20, work_s=0.003)
    accepted = sorted(index for _, indexes_written, _ in reports for index in indexes_written)
    assert accepted == list(range(num_items))  # each item's result accepted exactly once, none lost
    assert sum(num_stale for *_, num_stale in reports) > 0  # the race happened: some writes came second
    with open_store(db) as store:
        results = store.results(batch_id, limit=num_items)
        assert [(r.index, r.status, r.result) for r in results] == [
            (index, "ok", {"echo": f"text-{index}"}) for index in range(num_items)]
        assert store.get_batch(batch_id).status is BatchStatus.COMPLETED
    writers = {worker_id: set(indexes_written) for worker_id, indexes_written, _ in reports}
    assert all(index in writers[worker_id] for index, worker_id in _finished_by(db).items())


def _hold_then_hang(db, worker_id, ready):
    """A worker that claims 100 items, completes 20, says so, then crawls on until it is killed."""
    store = open_store(db)
    claimed = store.claim(worker_id, 100, 600.0, time.time())
    for number, item in enumerate(claimed):
        store.complete(item.key, worker_id, {"echo": item.payload}, time.time())
        if number == 19:
            ready.set()
        time.sleep(0.002 if number < 19 else 0.05)


def test_a_sigkilled_workers_leases_expire_and_the_others_finish_with_one_result_each(db):
    num_items = 2000
    with open_store(db) as store:
        batch_id, _ = store.submit(embed_batch(num_items), time.time())
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    victim = context.Process(target=_hold_then_hang, args=(db, "victim", ready))
    victim.start()
    assert ready.wait(timeout=30)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    assert victim.exitcode == -signal.SIGKILL
    with open_store(db) as store:
        held = store.get_batch(batch_id).counts
    assert held.num_leased > 0 and held.num_ok >= 20  # it died holding leases, after writing some results
    victim_done = set(_finished_by(db))

    # The survivors' clocks are past the victim's 600 s leases (as if that much time had gone by).
    reports = _run_workers(context, db, batch_id, offsets=[601.0] * 3, lease_s=30.0, chunk=25, work_s=0.001)
    accepted = sorted([index for _, indexes_written, _ in reports for index in indexes_written] + list(victim_done))
    assert accepted == list(range(num_items))
    with open_store(db) as store:
        results = store.results(batch_id, limit=num_items)
    assert all(r.status == "ok" and r.result == {"echo": f"text-{r.index}"} for r in results)
    # What the victim finished ran once; what it held when killed ran again, once more.
    assert {r.attempts for r in results if r.index in victim_done} == {1}
    assert {r.attempts for r in results[:100] if r.index not in victim_done} == {2}
    assert {r.attempts for r in results[100:]} == {1}


def _submit_forever(db, submitted):
    store = open_store(db)
    for number in range(10_000):
        store.submit(embed_batch(2000, key=f"batch-{number}"), time.time())
        submitted.value = number + 1


def test_an_api_process_sigkilled_mid_submission_leaves_only_whole_batches(db):
    open_store(db).close()
    context = multiprocessing.get_context("fork")
    submitted = context.Value("i", 0)
    api = context.Process(target=_submit_forever, args=(db, submitted))
    api.start()
    deadline = time.monotonic() + 30
    while submitted.value < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.007)  # land somewhere inside the next transaction (each takes ~10-20 ms)
    os.kill(api.pid, signal.SIGKILL)
    api.join(timeout=10)
    assert submitted.value >= 3
    if not is_postgres_url(db):
        assert query(db, "PRAGMA integrity_check") == [("ok",)]
    batches = query(db, "SELECT b.idempotency_key, b.num_items, COUNT(i.idx) FROM batches AS b "
                        "LEFT JOIN items AS i ON i.batch_seq = b.seq GROUP BY b.seq")
    # Every acknowledged submission is there, and at most the one in flight besides (committed, not yet counted).
    assert submitted.value <= len(batches) <= submitted.value + 1
    assert all(num_items == num_rows == 2000 for _, num_items, num_rows in batches)
    # A client retrying its last request after the crash gets its batch, or a new one if it never landed.
    with open_store(db) as store:
        _, created = store.submit(embed_batch(2000, key="batch-0"), time.time())
        assert not created
        assert store.claim("w", 10, LEASE_S, time.time())[0].key.index == 0
