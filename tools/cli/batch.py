"""The batch-inference API: submit many items, get every result back in order.

    python -m tools batch serve                 # API on :8080 and 2 workers, queue in build/batch/queue.db
    python -m tools batch api --port 8080       # the REST front alone
    python -m tools batch worker --id w1        # one worker alone (several may share the queue)
    python -m tools batch postgres              # a local PostgreSQL for the queue; prints its URL

The queue is a SQLite file by default (nothing to start; the processes of one machine), or a
PostgreSQL database when `--db` is a postgresql:// URL (workers on several machines, each
pointed at the same URL). `serve` runs the API in this process and the workers as child
processes, and starts again any worker that dies; SIGINT or SIGTERM stops the workers (each
sends what it holds, then exits) and then the API. Items a killed worker held come back when
their lease expires. The tritonserver to call is `--grpc-url` (`python -m tools serve` on
this machine by default).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tools.clients.tls import add_ca_argument

DEFAULT_DB = "build/batch/queue.db"
DEFAULT_PG_DIR = Path("build/batch/pg")
log = logging.getLogger("tools.batch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="batch_command", metavar="{serve,api,worker,postgres}", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=DEFAULT_DB,
                        help=f"the queue: a SQLite file, for the processes of one machine (default {DEFAULT_DB}), "
                             "or a postgresql://user@host:port/database URL, for workers on several machines "
                             "pointed at the same URL (`batch postgres` starts one); give a password through "
                             "PGPASSWORD or ~/.pgpass rather than in the URL, which process lists show")
    api_options = argparse.ArgumentParser(add_help=False)
    api_options.add_argument("--host", default="127.0.0.1", help="address the API listens on (default 127.0.0.1)")
    api_options.add_argument("--port", type=int, default=8080, help="the API's port (default 8080)")
    worker_options = argparse.ArgumentParser(add_help=False)
    worker_options.add_argument("--grpc-url", default="localhost:8001",
                                help="tritonserver's gRPC endpoint (default localhost:8001)")
    add_ca_argument(worker_options)
    worker_options.add_argument("--max-batch-items", type=int, default=4,
                                help="items per Triton request (default 4: requests the server's admission takes "
                                     "beside online traffic; its dynamic batchers batch them further)")
    worker_options.add_argument("--max-wait-ms", type=float, default=50.0,
                                help="how long the oldest claimed item waits for a fuller request (default 50)")
    worker_options.add_argument("--max-in-flight", type=int, default=8,
                                help="most Triton requests one worker has in flight; halved on each 'server busy' "
                                     "answer and grown back one by one (default 8)")
    worker_options.add_argument("--lease-s", type=float, default=60.0,
                                help="an item's lease; a dead worker's items come back after it (default 60)")
    worker_options.add_argument("--max-attempts", type=int, default=20,
                                help="attempts per item before a retryable failure (server busy, crashed "
                                     "instance, timeout) is final; backoff doubles from 0.5 s to 30 s, "
                                     "at most 1 s after a busy refusal (default 20)")
    sub.add_parser("serve", parents=[common, api_options, worker_options], help="the API and --workers workers")
    sub.choices["serve"].add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    sub.add_parser("api", parents=[common, api_options], help="the REST API alone")
    worker = sub.add_parser("worker", parents=[common, worker_options], help="one worker alone")
    worker.add_argument("--id", default=None, help="this worker's name in leases (default host-pid)")
    postgres = sub.add_parser("postgres", help="a PostgreSQL server for the queue (the pgserver wheel's "
                                               "PostgreSQL 16), in the foreground until Ctrl-C")
    postgres.add_argument("--dir", type=Path, default=DEFAULT_PG_DIR,
                          help=f"its data, log and password; kept between starts (default {DEFAULT_PG_DIR})")
    postgres.add_argument("--host", default="127.0.0.1",
                          help="address to listen on (default 127.0.0.1; 0.0.0.0 for workers on other machines, "
                               "which then need the password the server keeps in DIR/password)")
    postgres.add_argument("--port", type=int, default=5432, help="its port (default 5432; 0: a free one)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.batch_command == "postgres":
        return run_postgres(args)
    # Opened once here, before any server or worker starts: an unreachable database or an unwritable
    # file is one line naming it, not a traceback from inside uvicorn or a worker restarted in a loop.
    # It also creates the schema before the workers open the queue.
    _open_store(args).close()
    if args.batch_command == "worker":
        return run_worker(args)
    if args.batch_command == "api":
        return run_api(args)
    return run_serve(args)


def _open_store(args: argparse.Namespace):
    from tools.batch.engines import open_store
    from tools.batch.store_base import StoreUnavailable

    try:
        return open_store(args.db, max_attempts=getattr(args, "max_attempts", 5))
    except (StoreUnavailable, ValueError) as err:
        raise SystemExit(f"error: {err}") from None


def run_api(args: argparse.Namespace) -> int:
    import uvicorn

    from tools.batch.api import create_app

    _check_port_free(args.host, args.port)
    uvicorn.run(create_app(args.db), host=args.host, port=args.port, log_level="warning")
    return 0


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise SystemExit(f"cannot listen on {host}:{port}: {err.strerror}; choose another --port") from None


def worker_command(args: argparse.Namespace, worker_id: str) -> list[str]:
    return [sys.executable, "-m", "tools", "batch", "worker", "--db", str(args.db), "--id", worker_id,
            "--grpc-url", args.grpc_url, "--max-batch-items", str(args.max_batch_items),
            "--max-wait-ms", str(args.max_wait_ms), "--max-in-flight", str(args.max_in_flight),
            "--lease-s", str(args.lease_s), "--max-attempts", str(args.max_attempts),
            *(["--grpc-tls-ca", str(args.grpc_tls_ca)] if args.grpc_tls_ca else [])]


def _die_with_parent() -> None:
    """Runs in a worker child before exec: SIGTERM when `serve` dies, even by SIGKILL, so no
    worker is left claiming items for a service that is gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start_worker(args: argparse.Namespace, worker_id: str) -> subprocess.Popen:
    return subprocess.Popen(worker_command(args, worker_id), preexec_fn=_die_with_parent)


def run_serve(args: argparse.Namespace) -> int:
    """The API here, the workers as children restarted when they die."""
    import threading

    import uvicorn

    from tools.batch.api import create_app
    from tools.batch.engines import describe

    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    _check_port_free(args.host, args.port)
    stopping = threading.Event()
    names = [f"{socket.gethostname()}-{os.getpid()}-w{index}" for index in range(args.workers)]
    children = {name: start_worker(args, name) for name in names}

    def watch() -> None:
        while not stopping.wait(1.0):
            for name, child in list(children.items()):
                if child.poll() is not None and not stopping.is_set():
                    log.warning("worker %s exited with %s; starting it again", name, child.returncode)
                    children[name] = start_worker(args, name)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    print(f"batch API on http://{args.host}:{args.port} (OpenAPI at /docs), {args.workers} workers, "
          f"queue {describe(args.db)}, tritonserver {args.grpc_url}", flush=True)
    try:
        uvicorn.run(create_app(args.db), host=args.host, port=args.port, log_level="warning")
    finally:
        stopping.set()
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for child in children.values():
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.kill()
    return 0


def run_worker(args: argparse.Namespace) -> int:
    from tools.batch.engines import describe
    from tools.batch.policy import BatchLimits, RetryPolicy
    from tools.batch.worker import BatchWorker, WorkerConfig, make_callers

    worker_id = args.id or f"{socket.gethostname()}-{os.getpid()}"
    config = WorkerConfig(worker_id=worker_id, max_batch_items=args.max_batch_items,
                          max_wait_s=args.max_wait_ms / 1000.0, max_in_flight=args.max_in_flight,
                          lease_s=args.lease_s, retry=RetryPolicy(max_attempts=args.max_attempts))

    async def main() -> None:
        callers, client = make_callers(args.grpc_url, BatchLimits().models, max_rows=args.max_batch_items,
                                       tls_ca=args.grpc_tls_ca)
        with _open_store(args) as store:
            worker = BatchWorker(store, config, callers)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, worker.stop)
            log.info("worker %s: queue %s, tritonserver %s", worker_id, describe(args.db), args.grpc_url)
            try:
                stats = await worker.run()
            finally:
                await client.close()
            log.info("worker %s stopped: %s", worker_id, stats)

    asyncio.run(main())
    return 0


def run_postgres(args: argparse.Namespace) -> int:
    """A local PostgreSQL for the queue until Ctrl-C (or SIGTERM), then a fast shutdown."""
    from tools.batch.pg_server import LocalPostgres

    server = LocalPostgres(args.dir, host=args.host, port=args.port)
    try:
        server.start()
    except RuntimeError as err:
        raise SystemExit(f"error: cannot start PostgreSQL: {err}") from None
    # SIGTERM as Ctrl-C: the finally below stops the server either way. SIGINT explicitly too:
    # a shell script's background job (`... &`) starts with SIGINT ignored, and Python keeps
    # an inherited "ignore", which would leave this server deaf to the signal that stops it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(server.url)
    print(f"PostgreSQL listening on {args.host}:{server.port}, data in {server.data_dir}, log {server.log_path}; "
          f"Ctrl-C stops it.\nQueue on it: python -m tools batch serve --db {server.url}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"Workers on other machines: PGPASSWORD=$(cat {server.password_path}) python -m tools batch worker "
              f"--db {server.remote_url()}", flush=True)
    try:
        returncode = server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
    raise SystemExit(f"error: postgres exited with {returncode}; see {server.log_path}")
