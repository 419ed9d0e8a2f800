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

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.clients.retrying import Outcome, classify
from tools.paths import DEFAULT_SPEC, REPO_ROOT
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.serving import SpecError, load_spec
from tools.spec.workload import DEFAULT_WORKLOAD, TextFactory, load_workload

TARGET_RATIO = 0.8


ENGINES = ("sqlite", "postgres")
SETUP_OF_ENGINE = {"sqlite": "batch_api", "postgres": "batch_api_postgres"}


def engine_list(value: str) -> tuple[str, ...]:
    engines = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [engine for engine in engines if engine not in ENGINES]
    if not engines or unknown:
        raise argparse.ArgumentTypeError(f"engines are a comma-separated subset of {', '.join(ENGINES)}, got {value!r}")
    return engines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("results/batch.json"),
                        help="result JSON (default: %(default)s)")
    parser.add_argument("--items", type=int, default=2000, help="texts per run (default 2000)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setup, alternating (default 2)")
    parser.add_argument("--rows", type=int, default=4, help="rows per Triton request in both setups (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="batch API workers (default 2)")
    parser.add_argument("--max-in-flight", type=int, default=8, help="requests in flight per worker (default 8)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="direct client's requests in flight (default: workers x max-in-flight)")
    parser.add_argument("--engines", type=engine_list, default=ENGINES, metavar="ENGINE,...",
                        help="queue engines to run the batch API on: sqlite, postgres (a local PostgreSQL this "
                             "bench starts) (default: both)")
    parser.add_argument("--quick", action="store_true", help="short form for the test suite: 300 items, 1 round")


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


def run(args: argparse.Namespace) -> int:
    from tools.bench.profiler import detect_hardware

    items, rounds = (300, 1) if args.quick else (args.items, args.rounds)
    if items < 1 or rounds < 1 or args.rows < 1 or args.workers < 1 or args.max_in_flight < 1:
        print("error: --items, --rounds, --rows, --workers and --max-in-flight must be >= 1", file=sys.stderr)
        return 2
    concurrency = args.concurrency or args.workers * args.max_in_flight
    try:
        spec = load_spec(DEFAULT_SPEC)
        workload = load_workload(DEFAULT_WORKLOAD)
    except (SpecError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = spec.models[0]
    texts = TextFactory().texts_for(workload, items, seed=11)
    hardware = detect_hardware(None)
    config = ServerConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1",
                          model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=(model.name, *(model.encoder_name(b) for b in model.bucket_lens)))
    print(f"batch benchmark on {hardware.description}: {items} texts, {rounds} round(s) of each setup, "
          f"{args.rows} rows per request", flush=True)
    setups = ["direct", *(SETUP_OF_ENGINE[engine] for engine in args.engines)]
    runs: dict[str, list[float]] = {setup: [] for setup in setups}
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(TritonServer(config, log_path=REPO_ROOT / "build" / "bench" / "batch.log"))
            postgres_url = None
            if "postgres" in args.engines:
                from tools.batch.pg_server import LocalPostgres

                pg_dir = Path(tempfile.mkdtemp(prefix="bench-batch-pg-"))
                stack.callback(shutil.rmtree, pg_dir, True)
                # PostgreSQL's defaults (fsync on): the figure is what a durable queue costs.
                postgres_url = stack.enter_context(LocalPostgres(pg_dir, port=0)).url
            asyncio.run(run_direct(server.grpc_url, texts[:50], args.rows, 2))  # warm-up
            for round_index in range(rounds):
                # Alternate the order each round, so no setup always runs on a warmer (or hotter) machine.
                for setup in setups if round_index % 2 == 0 else setups[::-1]:
                    if setup == "direct":
                        seconds = asyncio.run(run_direct(server.grpc_url, texts, args.rows, concurrency))
                    else:
                        db = postgres_url if setup == SETUP_OF_ENGINE["postgres"] else None
                        seconds = run_batch_api(server.grpc_url, texts, args.rows, args.workers, args.max_in_flight,
                                                db=db)
                    runs[setup].append(items / seconds)
                    print(f"  round {round_index + 1} {setup}: {items / seconds:.1f} items/s ({seconds:.1f} s)",
                          flush=True)
    except RuntimeError as err:  # ServerError, or a PostgreSQL that would not start
        print(f"error: {err}", file=sys.stderr)
        return 1
    medians = {setup: statistics.median(values) for setup, values in runs.items()}
    direct = medians["direct"]
    report = {
        "hardware": {"description": hardware.description, "cpu_count": hardware.cpu_count, "gpu": hardware.gpu},
        "command": "python -m tools bench batch " + " ".join(sys.argv[3:]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "items": items,
        "rows_per_request": args.rows,
        "direct": {"items_per_s": round(direct, 1), "runs": [round(r, 1) for r in runs["direct"]],
                   "concurrency": concurrency},
        **{setup: {"items_per_s": round(medians[setup], 1), "runs": [round(r, 1) for r in runs[setup]],
                   "ratio": round(medians[setup] / direct, 3), "workers": args.workers,
                   "max_in_flight_per_worker": args.max_in_flight}
           for setup in setups if setup != "direct"},
        "target_ratio": TARGET_RATIO,
        "note": "clients, API, workers, queue and server on the same machine",
    }
    if "batch_api" in medians:
        report["ratio"] = report["batch_api"]["ratio"]  # the default (SQLite) engine's, the headline figure
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    figures = ", ".join(f"{setup} {medians[setup]:.1f} items/s ({medians[setup] / direct:.0%} of direct)"
                        for setup in setups if setup != "direct")
    print(f"direct {direct:.1f} items/s; {figures}; target {TARGET_RATIO:.0%}; wrote {args.out}", flush=True)
    return 0
