"""The batch-inference API against the real tritonserver, its processes killed mid-batch.

The API and the workers run as their own processes (`python -m tools batch api|worker`) on
one queue, the way `python -m tools batch serve` runs them; the tests SIGKILL them and start
them again, then check that every item has exactly one result, in input order. The queue is a
SQLite file, and for the tests parametrized over `service` also a PostgreSQL database on the
session's real server (what workers on several machines would share).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.doc_examples import require_free, shell, shown
from tools.server.triton_server import free_port

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 3.0  # short, so that a killed worker's items come back within the test


class Service:
    """The API and workers of one queue (a SQLite file or a postgresql:// URL)."""

    def __init__(self, triton, db: str, log_dir: Path):
        self.triton = triton
        self.db = db
        self.log_dir = log_dir
        self.port = free_port()
        self.api: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.url = f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("a")
        return subprocess.Popen([sys.executable, "-m", "tools", "batch", *args, "--db", self.db],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def start_api(self) -> None:
        self.api = self._spawn("api", ["api", "--port", str(self.port)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.client().get("/healthz").status_code == 200:
                    return
            except Exception:  # not listening yet
                time.sleep(0.2)
        raise AssertionError("the batch API did not come up: " + (self.log_dir / "api.log").read_text()[-2000:])

    def start_worker(self, name: str, *extra: str) -> None:
        self.workers[name] = self._spawn(name, ["worker", "--id", name, "--grpc-url", self.triton.grpc_url,
                                                "--lease-s", str(LEASE_S), *extra])

    def kill(self, process: subprocess.Popen) -> None:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def client(self):
        import httpx

        return httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        for process in (*self.workers.values(), self.api):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (*self.workers.values(), self.api):
            if process is not None:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


@pytest.fixture
def service(request, triton, tmp_path):
    """The API on a SQLite queue; on PostgreSQL when a test parametrizes it with "postgres"."""
    engine = getattr(request, "param", "sqlite")
    db = str(tmp_path / "queue.db") if engine == "sqlite" else request.getfixturevalue("postgres_url")
    running = Service(triton, db, tmp_path)
    running.start_api()
    yield running
    running.stop()


def texts(count: int) -> list[str]:
    words = ("batch", "triton", "latency", "budget", "queue", "tensor", "embedding", "router", "bucket", "slo")
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 40)) + f" item {i}"
            for i in range(count)]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def all_results(client, batch_id: str) -> list[dict]:
    results, offset = [], 0
    while offset is not None:
        page = client.get(f"/v1/batches/{batch_id}/results", params={"offset": offset, "limit": 500}).json()
        results += page["results"]
        offset = page["next_offset"]
    return results


# The kill and restart sequence is the same on either queue; the store's exactly-once rules are
# checked on both by tests/unit/test_batch_store.py. The suite's short form kills on PostgreSQL.
@pytest.mark.parametrize("service", [pytest.param("sqlite", marks=pytest.mark.slow), "postgres"], indirect=True)
def test_killing_the_worker_and_the_api_mid_batch_loses_and_duplicates_nothing(service, grpc_client):
    items = texts(1500)
    with service.client() as client:
        created = client.post("/v1/batches", json={"model": "embed", "items": items, "idempotency_key": "kill-1"})
        assert created.status_code == 201, created.text
        batch_id = created.json()["id"]
    service.start_worker("w1")
    service.start_worker("w2")

    def progress() -> int:
        with service.client() as client:
            return client.get(f"/v1/batches/{batch_id}").json()["counts"]["ok"]

    wait_for(lambda: progress() >= 300, 120, "the first results")
    service.kill(service.workers["w1"])  # holding leases: its items come back after LEASE_S
    service.kill(service.api)  # the API dies too; the workers do not need it
    time.sleep(1.0)
    service.start_api()
    progress_before = progress()
    service.start_worker("w3")
    wait_for(lambda: progress() > progress_before, 60, "progress after the restart")
    service.kill(service.workers["w2"])
    service.start_worker("w4")
    with service.client() as client:
        view = wait_for(lambda: (v := client.get(f"/v1/batches/{batch_id}").json())["status"] != "running"
                        and v["status"] != "queued" and v, 300, "the batch to finish")
        results = all_results(client, batch_id)
        failures = Counter((r["status"], str(r.get("error")), r["attempts"]) for r in results if r["status"] != "ok")
        assert view["status"] == "completed", (view["counts"], failures.most_common(5))
        assert view["counts"] == {"total": 1500, "queued": 0, "running": 0, "ok": 1500, "failed": 0,
                                  "cancelled": 0}
        again = client.post("/v1/batches", json={"model": "embed", "items": items, "idempotency_key": "kill-1"})
    # Exactly one result per item, in input order.
    assert [r["index"] for r in results] == list(range(1500))
    assert all(r["status"] == "ok" and len(r["result"]["embedding"]) == 384 for r in results)
    # Each result is its own item's: compare a sample with direct calls.
    import tritonclient.grpc as grpcclient

    sample = [0, 1, 777, 1200, 1499]
    tensor = grpcclient.InferInput("TEXT", [len(sample), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([items[i].encode() for i in sample], dtype=np.object_).reshape(-1, 1))
    direct = grpc_client.infer("embed", [tensor]).as_numpy("EMBEDDING")
    for row, index in zip(direct, sample, strict=True):
        got = np.array(results[index]["result"]["embedding"])
        assert float(got @ row / (np.linalg.norm(got) * np.linalg.norm(row))) > 0.999
    # The idempotency key still names the same batch after the API's restart.
    assert again.status_code == 200 and again.json()["id"] == batch_id
    # Some item was tried more than once (the killed worker's), yet none has two results.
    assert max(r["attempts"] for r in results) >= 2


@pytest.mark.parametrize("service", ["sqlite", "postgres"], indirect=True)
def test_the_same_idempotency_key_returns_the_same_batch_and_a_different_body_conflicts(service):
    with service.client() as client:
        body = {"model": "embed", "items": ["a", "b"]}
        first = client.post("/v1/batches", json=body, headers={"Idempotency-Key": "same-key"})
        second = client.post("/v1/batches", json=body, headers={"Idempotency-Key": "same-key"})
        other = client.post("/v1/batches", json={"model": "embed", "items": ["c"]},
                            headers={"Idempotency-Key": "same-key"})
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert other.status_code == 409 and "same-key" in other.json()["error"]


def test_a_cancelled_batch_stops_dispatching(service):
    with service.client() as client:
        batch_id = client.post("/v1/batches", json={"model": "embed", "items": texts(4000)}).json()["id"]
        service.start_worker("w1", "--max-in-flight", "1", "--max-batch-items", "16")
        wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["counts"]["ok"] > 0, 60, "first results")
        cancelled = client.post(f"/v1/batches/{batch_id}/cancel").json()
        assert cancelled["status"] == "cancelled"
        time.sleep(LEASE_S + 2.0)  # anything in flight at the cancel has finished or been cancelled
        settled = client.get(f"/v1/batches/{batch_id}").json()["counts"]
        time.sleep(2.0)
        later = client.get(f"/v1/batches/{batch_id}").json()["counts"]
        results = all_results(client, batch_id)
    assert later == settled  # nothing more was dispatched
    assert settled["queued"] == settled["running"] == 0
    assert settled["ok"] < 4000 and settled["cancelled"] > 0 and settled["ok"] + settled["cancelled"] == 4000
    assert {r["status"] for r in results} == {"ok", "cancelled"}


def test_llm_items_are_generated(service):
    prompts = [{"prompt": "Name a primary colour.", "max_tokens": 8}, {"prompt": "Say hello.", "max_tokens": 8}]
    with service.client() as client:
        batch_id = client.post("/v1/batches", json={"model": "llm", "items": prompts}).json()["id"]
        service.start_worker("w1")
        wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "completed", 180, "generations")
        results = all_results(client, batch_id)
    assert [r["index"] for r in results] == [0, 1]
    for r in results:
        assert r["result"]["text"] and 0 < r["result"]["completion_tokens"] <= 8


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"{not json", 400, "malformed JSON"),
    (b'{"model": "embed", "items": []}', 422, "must not be empty"),
    (b'{"model": "nope", "items": ["a"]}', 422, "unknown model 'nope'"),
    (b'{"model": "embed", "items": ["a", 3]}', 422, "items[1]"),
    (b'{"model": "embed", "items": "a"}', 422, "items must be a list"),
    (b'{"model": "embed", "items": ["a"], "idempotency_kee": "x"}', 422, "unknown fields"),
    (b'[1, 2]', 422, "JSON object"),
])
def test_bad_submissions_get_a_clear_4xx_and_the_api_stays_up(service, body, status, says):
    with service.client() as client:
        response = client.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == status, response.text
        assert says in response.json()["error"]
        assert client.get("/healthz").status_code == 200


def test_too_many_items_is_413_and_unknown_batches_are_404_and_the_spec_is_served(service):
    with service.client() as client:
        too_many = client.post("/v1/batches", json={"model": "embed", "items": ["a"] * 10_001})
        missing = client.get("/v1/batches/does-not-exist")
        spec = client.get("/openapi.json").json()
    assert too_many.status_code == 413 and "10000 allowed" in too_many.json()["error"]
    assert missing.status_code == 404
    assert {"/v1/batches", "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/results",
            "/v1/batches/{batch_id}/cancel"} <= set(spec["paths"])


def test_a_worker_without_a_server_keeps_items_queued_for_retry_not_failed(triton, tmp_path):
    """A worker pointed at no server backs off and retries; the items stay pending, not lost."""
    running = Service(triton, str(tmp_path / "queue.db"), tmp_path)
    running.start_api()
    try:
        with running.client() as client:
            batch_id = client.post("/v1/batches", json={"model": "embed", "items": ["x"] * 4}).json()["id"]
        running.workers["dead"] = running._spawn("dead", ["worker", "--id", "dead", "--grpc-url",
                                                          f"127.0.0.1:{free_port()}", "--max-attempts", "50"])
        time.sleep(4.0)
        with running.client() as client:
            counts = client.get(f"/v1/batches/{batch_id}").json()["counts"]
            results = client.get(f"/v1/batches/{batch_id}/results").json()["results"]
        assert counts["failed"] == 0 and counts["ok"] == 0
        assert all(r["attempts"] >= 1 for r in results)
    finally:
        running.stop()


def non_loopback_address() -> str:
    """An address of this machine that is not loopback (the route out), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
    return "127.0.0.1" if address.startswith("127.") else address


def test_the_shown_postgresql_queue_serves_workers_on_other_machines(triton):
    """docs/batch.md's PostgreSQL block as written, in a scratch folder: the server on 5432 for
    every interface, `batch serve` on it, and a worker that reaches it the way one on another
    machine does (a non-loopback address of this machine as `queue-host`, so only the password
    lets it in; the session's tritonserver as `triton-host:8001`). A batch completes; Ctrl-C
    (SIGINT to each process group, as a terminal sends it) stops all three cleanly."""
    import httpx
    import psycopg

    start_pg = shown("docs/batch.md", "python -m tools batch postgres --dir build/batch/pg --host 0.0.0.0")
    serve = shown("docs/batch.md", "python -m tools batch serve --db postgresql://postgres@127.0.0.1:5432/postgres "
                                   "--grpc-url localhost:8001")
    worker = shown("docs/batch.md", "PGPASSWORD=$(cat build/batch/pg/password) python -m tools batch worker --db "
                                    "postgresql://postgres@queue-host:5432/postgres --grpc-url triton-host:8001")
    require_free({start_pg: 5432, serve: 8080})
    queue_host = non_loopback_address()
    worker = worker.replace("queue-host", queue_host).replace("triton-host:8001", triton.grpc_url)
    # Under the system temp dir, as tests/postgres.py does: the server runs as another user.
    folder = Path(tempfile.mkdtemp(prefix="batch-pg-doc-"))
    processes: dict[str, subprocess.Popen] = {}

    def start(name: str, command: str) -> None:
        argv, env = shell(command, {"grpc": triton.config.grpc_port})
        with (folder / f"{name}.log").open("w") as log:
            processes[name] = subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)

    def log(name: str) -> str:
        return (folder / f"{name}.log").read_text(errors="replace")

    try:
        start("postgres", start_pg)
        def printed_url() -> str | None:
            text = log("postgres")
            assert "\n" in text or processes["postgres"].poll() is None, text
            return text.split("\n", 1)[0] if "\n" in text else None

        url = wait_for(printed_url, 120, "PostgreSQL to start")
        assert url == "postgresql://postgres@127.0.0.1:5432/postgres", log("postgres")
        start("serve", serve)
        with httpx.Client(base_url="http://127.0.0.1:8080", timeout=30) as client:
            def api_up() -> bool:
                assert processes["serve"].poll() is None, log("serve")
                try:
                    return client.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(api_up, 60, "the batch API")
            remote_url = f"postgresql://postgres@{queue_host}:5432/postgres"
            if queue_host != "127.0.0.1":  # without the password, the server lets no other address in
                argv, env = shell(worker.split(") ", 1)[1] + " --max-attempts 1")
                refused = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=60)
                assert refused.returncode != 0 and remote_url in refused.stderr, refused.stderr[-2000:]
            start("worker", worker)

            def worker_up() -> bool:  # it opened the queue, over the network, with the password
                assert processes["worker"].poll() is None, log("worker")
                return f": queue {remote_url}" in log("worker")

            wait_for(worker_up, 30, "the worker to open the queue")
            items = texts(40)
            created = client.post("/v1/batches", json={"model": "embed", "items": items})
            assert created.status_code == 201, created.text
            batch_id = created.json()["id"]
            done = wait_for(lambda: (b := client.get(f"/v1/batches/{batch_id}").json())["status"] == "completed"
                            and b, 120, "the batch to complete")
            assert done["counts"]["ok"] == len(items), done
            results = all_results(client, batch_id)
            assert [r["index"] for r in results] == list(range(len(items)))
            assert all(r["status"] == "ok" and len(r["result"]["embedding"]) == 384 for r in results)
            with psycopg.connect(url) as conn:
                finished_by = dict(conn.execute("SELECT finished_by, count(*) FROM batch_queue.items "
                                                "GROUP BY finished_by").fetchall())
            assert sum(finished_by.values()) == len(items), finished_by
    finally:
        codes = {}
        for name in ("worker", "serve", "postgres"):  # the clients first, then the database
            process = processes.get(name)
            if process is None:
                continue
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
            try:
                codes[name] = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                codes[name] = "killed"
        logs = {name: log(name)[-2000:] for name in processes}
        shutil.rmtree(folder, ignore_errors=True)
    # Each stops in order (the workers send what they hold; PostgreSQL shuts down fast); a process
    # may then end with the SIGINT it was sent, as a Ctrl-C'd program does.
    assert all(code in (0, -signal.SIGINT, 128 + signal.SIGINT) for code in codes.values()), (codes, logs)
    assert "stopped: WorkerStats" in logs["worker"] and logs["serve"].count("stopped: WorkerStats") == 2, logs
