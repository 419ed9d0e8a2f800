"""What only the PostgreSQL engine of the batch queue has to get right, against a real server.

Claims that skip what another transaction holds instead of waiting for it, submissions of one
idempotency key racing from several processes, the schema created by several processes at once,
a cancel crossing a requeue, a connection the server dropped, a database that does not answer,
and the server the repository starts (`python -m tools batch postgres`). The semantics both
engines share are tested on both in test_batch_store.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tools.batch.engines import describe, is_postgres_url, open_store, redact_url
from tools.batch.pg_server import free_port
from tools.batch.pg_store import PostgresStore
from tools.batch.policy import BatchStatus, Submission
from tools.batch.store import BatchStore
from tools.batch.store_base import StoreUnavailable

REPO = Path(__file__).resolve().parents[2]
T0 = 1000.0
LEASE_S = 30.0


def embed_batch(num_items: int, key: str | None = None) -> Submission:
    return Submission(model="embed", items=tuple(f"text-{index}" for index in range(num_items)), idempotency_key=key)


@pytest.fixture
def store(postgres_url):
    with PostgresStore(postgres_url, max_attempts=3) as opened:
        yield opened


def in_thread(call, timeout_s: float):
    """Run `call` in a thread; its result, or AssertionError if it is still blocked after `timeout_s`."""
    outcome: dict[str, object] = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the test below
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"still blocked after {timeout_s} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# -- claims skip locked items ----------------------------------------------------------------------------------


def test_a_claim_skips_items_another_claimer_holds_locked_instead_of_waiting(store, postgres_url):
    batch_id, _ = store.submit(embed_batch(30), T0)
    with psycopg.connect(postgres_url) as other:
        # Another claimer in the middle of its transaction: the first ten queued items locked, not yet leased.
        locked = other.execute("SELECT idx FROM batch_queue.items WHERE state = 'queued' ORDER BY batch_seq, idx "
                               "LIMIT 10 FOR UPDATE SKIP LOCKED").fetchall()
        assert [index for (index,) in locked] == list(range(10))
        started = time.monotonic()
        claimed = in_thread(lambda: store.claim("w", 10, LEASE_S, T0), timeout_s=5.0)
        assert time.monotonic() - started < 1.0  # answered at once, not after the other transaction
        assert [item.key.index for item in claimed] == list(range(10, 20))
        other.rollback()  # the other claimer gives up: its items are claimable again
    assert [item.key.index for item in store.claim("w2", 30, LEASE_S, T0)] == [*range(10), *range(20, 30)]
    assert store.get_batch(batch_id).counts.num_leased == 30


def _claim_until_empty(url, worker_id, out):
    with open_store(url) as store:
        taken = []
        while claimed := store.claim(worker_id, 7, 600.0, T0):
            taken += [(item.key.index, item.attempt) for item in claimed]
    out.put((worker_id, taken))


def test_claimer_processes_racing_on_one_queue_never_take_the_same_item(store, postgres_url):
    num_items = 2000
    store.submit(embed_batch(num_items), T0)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    claimers = [context.Process(target=_claim_until_empty, args=(postgres_url, f"c{n}", out)) for n in range(4)]
    for claimer in claimers:
        claimer.start()
    reports = [out.get(timeout=60) for _ in claimers]
    for claimer in claimers:
        claimer.join(timeout=10)
    taken = [entry for _, entries in reports for entry in entries]
    assert sorted(index for index, _ in taken) == list(range(num_items))  # each item once, none left
    assert {attempt for _, attempt in taken} == {1}
    assert sum(1 for _, entries in reports if entries) >= 2  # the claimers did run side by side


# -- idempotency and schema under concurrency -------------------------------------------------------------------


def _submit_at_once(url, submission, barrier, out):
    with open_store(url) as store:
        barrier.wait(timeout=30)
        try:
            out.put(store.submit(submission, time.time()))
        except Exception as err:  # reported, not raised: the parent asserts on it
            out.put(repr(err))


def test_submissions_of_one_key_from_several_processes_at_once_make_one_batch(store, postgres_url):
    submission = embed_batch(3000, key="nightly-1")  # a long insert: the others arrive while it runs
    context = multiprocessing.get_context("fork")
    barrier, out = context.Barrier(4), context.Queue()
    apis = [context.Process(target=_submit_at_once, args=(postgres_url, submission, barrier, out)) for _ in range(4)]
    for api in apis:
        api.start()
    answers = [out.get(timeout=60) for _ in apis]
    for api in apis:
        api.join(timeout=10)
    assert all(isinstance(answer, tuple) for answer in answers), answers
    assert len({batch_id for batch_id, _ in answers}) == 1
    assert sorted(created for _, created in answers) == [False, False, False, True]
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM batch_queue.batches").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM batch_queue.items").fetchone() == (3000,)


def _open_at_once(url, barrier, out):
    barrier.wait(timeout=30)
    try:
        with open_store(url) as store:
            out.put(store.submit(embed_batch(1), T0)[1])
    except Exception as err:  # reported, not raised: the parent asserts on it
        out.put(repr(err))


def test_processes_opening_a_new_database_at_once_create_the_schema_once(postgres_url):
    context = multiprocessing.get_context("fork")
    barrier, out = context.Barrier(4), context.Queue()
    openers = [context.Process(target=_open_at_once, args=(postgres_url, barrier, out)) for _ in range(4)]
    for opener in openers:
        opener.start()
    answers = [out.get(timeout=60) for _ in openers]
    for opener in openers:
        opener.join(timeout=10)
    assert answers == [True] * 4
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT key, value FROM batch_queue.meta").fetchall() == [("schema_version", "1")]


def test_the_tables_live_in_their_own_schema_beside_an_applications_own(postgres_url):
    with psycopg.connect(postgres_url) as conn:
        conn.execute("CREATE TABLE public.items (sku text PRIMARY KEY)")  # an application's table of that name
    with PostgresStore(postgres_url) as store:
        store.submit(embed_batch(2), T0)
        assert len(store.claim("w", 5, LEASE_S, T0)) == 2
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM public.items").fetchone() == (0,)


# -- a cancel crossing a requeue --------------------------------------------------------------------------------


def test_a_retryable_failure_waits_for_a_cancel_in_flight_and_then_ends_the_item_cancelled(store, postgres_url):
    batch_id, _ = store.submit(embed_batch(2), T0)
    first, _ = store.claim("w", 2, LEASE_S, T0)
    with psycopg.connect(postgres_url) as canceller, PostgresStore(postgres_url, max_attempts=3) as worker:
        # A cancel half done: it holds the batch row and has marked the batch, not yet committed.
        canceller.execute("SELECT seq FROM batch_queue.batches WHERE id = %s FOR NO KEY UPDATE", (batch_id,))
        canceller.execute("UPDATE batch_queue.batches SET cancelled_at = %s WHERE id = %s", (T0 + 1, batch_id))
        failing = threading.Thread(target=lambda: worker.fail(first.key, "w", "busy", True, T0 + 5, T0 + 2))
        failing.start()
        failing.join(0.5)
        assert failing.is_alive()  # the requeue waits for the cancel instead of reading past it
        canceller.commit()
        failing.join(10)
        assert not failing.is_alive()
    (result, _) = store.results(batch_id)
    assert (result.status, result.error) == ("cancelled", "busy")  # not queued in a cancelled batch
    assert store.get_batch(batch_id).status is BatchStatus.CANCELLED


def test_expired_leases_of_a_batch_being_cancelled_are_left_for_the_next_release(store, postgres_url):
    batch_id, _ = store.submit(embed_batch(1), T0)
    store.claim("dead", 1, LEASE_S, T0)
    with psycopg.connect(postgres_url) as canceller:
        canceller.execute("SELECT seq FROM batch_queue.batches WHERE id = %s FOR NO KEY UPDATE", (batch_id,))
        assert in_thread(lambda: store.release_expired(T0 + LEASE_S), timeout_s=5.0) == 0  # skipped, not waited
    assert store.release_expired(T0 + LEASE_S) == 1


# -- connections ------------------------------------------------------------------------------------------------


def test_a_connection_the_server_dropped_is_opened_again_at_the_next_call(store, postgres_url):
    batch_id, _ = store.submit(embed_batch(1), T0)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    with pytest.raises(StoreUnavailable, match=r"^lost the connection to the batch queue at postgresql://"):
        store.get_batch(batch_id)  # the call that finds the connection gone fails: it may have been a write
    assert store.get_batch(batch_id).counts.num_queued == 1  # the next one reconnects


def test_an_unreachable_database_is_one_line_naming_the_url_without_its_password():
    port = free_port()  # nothing listens there
    with pytest.raises(StoreUnavailable) as error:
        open_store(f"postgresql://batch:s3cret@127.0.0.1:{port}/queue")
    message = str(error.value)
    assert message.startswith(f"cannot connect to the batch queue at postgresql://batch:***@127.0.0.1:{port}/queue: ")
    assert "s3cret" not in message and "\n" not in message and "Connection refused" in message


def test_the_cli_says_so_in_one_line_and_exits_1():
    url = f"postgresql://batch:s3cret@127.0.0.1:{free_port()}/queue"
    done = subprocess.run([sys.executable, "-m", "tools", "batch", "worker", "--db", url], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: cannot connect to the batch queue at postgresql://batch:***@")
    assert len(done.stderr.strip().splitlines()) == 1 and "s3cret" not in done.stderr + done.stdout


def test_an_error_with_a_nul_character_is_still_recorded(store):
    batch_id, _ = store.submit(embed_batch(1), T0)
    (item,) = store.claim("w", 1, LEASE_S, T0)
    assert store.fail(item.key, "w", "bad\x00byte", retryable=False, retry_at_s=None, now_s=T0)
    assert store.results(batch_id)[0].error == "bad\\x00byte"


# -- choosing the engine -----------------------------------------------------------------------------------------


def test_open_store_picks_the_engine_by_the_db_value(tmp_path, postgres_url):
    with open_store(postgres_url) as pg, open_store(tmp_path / "new" / "queue.db") as lite:
        assert isinstance(pg, PostgresStore) and isinstance(lite, BatchStore)
    assert (tmp_path / "new" / "queue.db").exists()
    assert is_postgres_url("postgres://u@h/d") and not is_postgres_url("build/postgresql.db")
    with pytest.raises(ValueError, match=r"'mysql://u:\*\*\*@h/d' is a URL of an unknown kind"):
        open_store("mysql://u:pw@h/d")
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        PostgresStore(str(tmp_path / "queue.db"))


def test_the_urls_libpq_reads_open_the_same_queue(postgres_url):
    """The URL goes to libpq as given: the postgres:// scheme, and a host and port in the query."""
    server, database = postgres_url.removeprefix("postgresql://").split("/")
    user, host_port = server.split("@")
    host, port = host_port.rsplit(":", 1)
    with open_store(postgres_url) as store:
        batch_id, _ = store.submit(embed_batch(1), T0)
    for url in (f"postgres://{server}/{database}", f"postgresql:///{database}?host={host}&port={port}&user={user}"):
        with open_store(url) as store:
            assert store.get_batch(batch_id).counts.num_queued == 1


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://u:pw@h:5432/d", "postgresql://u:***@h:5432/d"),
    ("postgresql://u@h/d", "postgresql://u@h/d"),
    ("postgresql://u:p%40ss@h/d?sslmode=require&password=x", "postgresql://u:***@h/d?sslmode=require&password=***"),
    ("postgresql:///d?host=/tmp&PASSWORD=x", "postgresql:///d?host=/tmp&PASSWORD=***"),
    ("mysql://u:pw@h/d", "mysql://u:***@h/d"),
    ("build/batch/queue.db", "build/batch/queue.db"),
])
def test_urls_are_shown_without_their_password(url, shown):
    assert redact_url(url) == describe(url) == shown


# -- the server the repository starts ----------------------------------------------------------------------------


def _postmaster_pid(directory: Path) -> int:
    return int((directory / "data" / "postmaster.pid").read_text().split()[0])


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _start_cli_server(directory: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "tools", "batch", "postgres", "--dir", str(directory),
                                "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = process.stdout.readline().strip()
    assert is_postgres_url(url), url + process.stdout.read() if process.poll() is not None else url
    return process, url


def test_the_postgres_command_serves_a_queue_until_ctrl_c_then_stops_the_server(tmp_path):
    directory = tmp_path / "pg"
    process, url = _start_cli_server(directory)
    try:
        with open_store(url) as store:
            batch_id, _ = store.submit(embed_batch(1), T0)
        postmaster = _postmaster_pid(directory)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert _wait_gone(postmaster, 10)
        # Started again on the same directory: the queue is still there.
        process, url = _start_cli_server(directory)
        with open_store(url) as store:
            assert store.get_batch(batch_id).counts.num_queued == 1
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def test_a_server_whose_parent_is_killed_stops_rather_than_lingering(tmp_path):
    directory = tmp_path / "pg"
    process, _ = _start_cli_server(directory)
    postmaster = _postmaster_pid(directory)
    process.kill()  # SIGKILL: no finally, no atexit runs in the parent
    process.wait(timeout=10)
    assert _wait_gone(postmaster, 30)

