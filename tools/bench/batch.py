"""Batch API throughput against direct tritonclient calls, on the same server in the same run.

    python -m tools bench batch --out results/batch.json

One tritonserver (explicit mode, the embedding models) serves both setups, run in
alternation (`--rounds` of each, medians reported) on the same `--items` texts from the
serving spec's length mix:

  direct     an asyncio gRPC client sends the texts in requests of `--rows` rows with
             `--concurrency` requests in flight, retrying "server busy" answers after a short
             backoff: the best a client that calls Triton itself does with the same request size.
  batch_api  `python -m tools batch serve` (API + `--workers` workers on a fresh SQLite queue):
             one POST of every item, then the time until the batch is completed and every
             result has been read back through the API.

items/s = items ÷ (first request sent .. last result in hand). The target: batch_api at
least 80% of direct.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tools.bench.harness import BENCH_DIR, detect_hardware, hardware_report
from tools.clients.retrying import Outcome, classify
from tools.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.serving import ServingSpec
from tools.spec.workload import TextFactory, Workload

TARGET_RATIO = 0.8


ENGINES = ("sqlite", "postgres")
SETUP_OF_ENGINE = {"sqlite": "batch_api", "postgres": "batch_api_postgres"}


async def run_direct(grpc_url: str, texts: list[str], rows: int, concurrency: int) -> float:
    """Seconds to embed every text directly: `concurrency` requests of `rows` rows in flight."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    client = grpcaio.InferenceServerClient(grpc_url)
    chunks = [texts[i:i + rows] for i in range(0, len(texts), rows)]
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    rng = random.Random(0)

    async def sender() -> None:
        while not queue.empty():
            chunk = queue.get_nowait()
            tensor = grpcclient.InferInput("TEXT", [len(chunk), 1], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in chunk], dtype=np.object_).reshape(-1, 1))
            for attempt in range(100):
                try:
                    await client.infer("embed", [tensor], client_timeout=60)
                    break
                except InferenceServerException as err:
                    if classify(str(err.status()), err.message() or "") is Outcome.FAILED:
                        raise
                    await asyncio.sleep(min(0.5, 0.02 * 2 ** attempt) * rng.random())

    started = time.perf_counter()
    try:
        await asyncio.gather(*(sender() for _ in range(concurrency)))
    finally:
        await client.close()
    return time.perf_counter() - started


def run_batch_api(grpc_url: str, texts: list[str], rows: int, workers: int, max_in_flight: int,
                  db: str | None = None) -> float:
    """Seconds from the POST of every text to the last result read back through the API, on the
    queue `db` (a PostgreSQL URL), or on a fresh SQLite file when None."""
    import httpx

    workdir = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    port = free_port()
    log = (workdir / "serve.log").open("w")
    queue = db or str(workdir / "queue.db")
    service = subprocess.Popen([sys.executable, "-m", "tools", "batch", "serve", "--db", queue,
                                "--port", str(port), "--workers", str(workers), "--grpc-url", grpc_url,
                                "--max-batch-items", str(rows), "--max-in-flight", str(max_in_flight)],
                               cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or service.poll() is not None:
                    raise ServerError("the batch API did not start: " + (workdir / "serve.log").read_text()[-2000:])
                time.sleep(0.2)
            time.sleep(2.0)  # the workers connect to tritonserver
            started = time.perf_counter()
            batch_id = client.post("/v1/batches", json={"model": "embed", "items": texts}).json()["id"]
            while (view := client.get(f"/v1/batches/{batch_id}").json())["status"] in ("queued", "running"):
                time.sleep(0.1)
            results, offset = 0, 0
            while offset is not None:
                page = client.get(f"/v1/batches/{batch_id}/results", params={"offset": offset, "limit": 1000}).json()
                results += sum(1 for r in page["results"] if r["status"] == "ok")
                offset = page["next_offset"]
            elapsed = time.perf_counter() - started
        if view["status"] != "completed" or results != len(texts):
            raise ServerError(f"batch ended {view['status']} with {results} of {len(texts)} results")
        return elapsed
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=60)
        except subprocess.TimeoutExpired:
            service.kill()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run_benchmark(spec: ServingSpec, workload: Workload, engines: Sequence[str], items: int, rounds: int,
                  rows: int, workers: int, max_in_flight: int, concurrency: int, command: str, log,
                  postgres_url: str | None = None) -> tuple[dict, dict[str, float]]:
    """Direct calls and the batch API on each queue engine, alternating, on one tritonserver;
    the report and each setup's median items/s. The postgres engine's queue is at
    `postgres_url`. Raises `ServerError`."""
    model = spec.models[0]
    texts = TextFactory().texts_for(workload, items, seed=11)
    hardware = detect_hardware(None)
    config = ServerConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1",
                          model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=(model.name, *model.bucket_models(DEFAULT_MODEL_REPOSITORY)))
    log(f"batch benchmark on {hardware.description}: {items} texts, {rounds} round(s) of each setup, "
        f"{rows} rows per request")
    setups = ["direct", *(SETUP_OF_ENGINE[engine] for engine in engines)]
    runs: dict[str, list[float]] = {setup: [] for setup in setups}
    with TritonServer(config, log_path=BENCH_DIR / "batch.log") as server:
        asyncio.run(run_direct(server.grpc_url, texts[:50], rows, 2))  # warm-up
        for round_index in range(rounds):
            # Alternate the order each round, so no setup always runs on a warmer (or hotter) machine.
            for setup in setups if round_index % 2 == 0 else setups[::-1]:
                if setup == "direct":
                    seconds = asyncio.run(run_direct(server.grpc_url, texts, rows, concurrency))
                else:
                    db = postgres_url if setup == SETUP_OF_ENGINE["postgres"] else None
                    seconds = run_batch_api(server.grpc_url, texts, rows, workers, max_in_flight, db=db)
                runs[setup].append(items / seconds)
                log(f"  round {round_index + 1} {setup}: {items / seconds:.1f} items/s ({seconds:.1f} s)")
    medians = {setup: statistics.median(values) for setup, values in runs.items()}
    direct = medians["direct"]
    report = {
        "hardware": hardware_report(hardware),
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "items": items,
        "rows_per_request": rows,
        "direct": {"items_per_s": round(direct, 1), "runs": [round(r, 1) for r in runs["direct"]],
                   "concurrency": concurrency},
        **{setup: {"items_per_s": round(medians[setup], 1), "runs": [round(r, 1) for r in runs[setup]],
                   "ratio": round(medians[setup] / direct, 3), "workers": workers,
                   "max_in_flight_per_worker": max_in_flight}
           for setup in setups if setup != "direct"},
        "target_ratio": TARGET_RATIO,
        "note": "clients, API, workers, queue and server on the same machine",
    }
    if "batch_api" in medians:
        report["ratio"] = report["batch_api"]["ratio"]  # the default (SQLite) engine's, the headline figure
    return report, medians


def summary(medians: Mapping[str, float]) -> str:
    """One line: each setup's median items/s against direct's, and the target."""
    direct = medians["direct"]
    figures = ", ".join(f"{setup} {value:.1f} items/s ({value / direct:.0%} of direct)"
                        for setup, value in medians.items() if setup != "direct")
    return f"direct {direct:.1f} items/s; {figures}; target {TARGET_RATIO:.0%}"
