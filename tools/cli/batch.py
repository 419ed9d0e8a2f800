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

Options, printing and wiring only: the processes are `tools.batch.service`, the local
PostgreSQL `tools.batch.pg_server`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from pathlib import Path

from tools.clients.tls import add_ca_argument

DEFAULT_DB = "build/batch/queue.db"
DEFAULT_PG_DIR = Path("build/batch/pg")


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
    from tools.batch.service import ServiceError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.batch_command == "postgres":
        return run_postgres(args)
    # Opened once here, before any server or worker starts: an unreachable database or an unwritable
    # file is one line naming it, not a traceback from inside uvicorn or a worker restarted in a loop.
    # It also creates the schema before the workers open the queue.
    _check_store(args)
    try:
        if args.batch_command == "worker":
            return run_worker(args)
        if args.batch_command == "api":
            return run_api(args)
        return run_serve(args)
    except ServiceError as err:
        raise SystemExit(str(err)) from None


def _check_store(args: argparse.Namespace) -> None:
    from tools.batch.engines import open_store
    from tools.batch.store_base import StoreUnavailable

    try:
        open_store(args.db, max_attempts=getattr(args, "max_attempts", 5)).close()
    except (StoreUnavailable, ValueError) as err:
        raise SystemExit(f"error: {err}") from None


def _worker_options(args: argparse.Namespace):
    from tools.batch.service import WorkerOptions

    return WorkerOptions(grpc_url=args.grpc_url, grpc_tls_ca=args.grpc_tls_ca, max_batch_items=args.max_batch_items,
                         max_wait_ms=args.max_wait_ms, max_in_flight=args.max_in_flight, lease_s=args.lease_s,
                         max_attempts=args.max_attempts)


def run_api(args: argparse.Namespace) -> int:
    from tools.batch import service

    service.check_port_free(args.host, args.port)
    service.serve_api(args.db, args.host, args.port)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """The API here, the workers as children restarted when they die."""
    from tools.batch import service
    from tools.batch.engines import describe

    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    service.check_port_free(args.host, args.port)
    names = [f"{socket.gethostname()}-{os.getpid()}-w{index}" for index in range(args.workers)]
    print(f"batch API on http://{args.host}:{args.port} (OpenAPI at /docs), {args.workers} workers, "
          f"queue {describe(args.db)}, tritonserver {args.grpc_url}", flush=True)
    service.serve_with_workers(args.db, args.host, args.port, names, _worker_options(args))
    return 0


def run_worker(args: argparse.Namespace) -> int:
    from tools.batch import service

    service.run_worker(args.db, args.id or f"{socket.gethostname()}-{os.getpid()}", _worker_options(args))
    return 0


def run_postgres(args: argparse.Namespace) -> int:
    """A local PostgreSQL for the queue until Ctrl-C (or SIGTERM), then a fast shutdown."""
    from tools.batch.pg_server import LocalPostgres

    server = LocalPostgres(args.dir, host=args.host, port=args.port)
    try:
        server.start()
    except RuntimeError as err:
        raise SystemExit(f"error: cannot start PostgreSQL: {err}") from None
    # SIGTERM as Ctrl-C: `wait` stops the server either way. SIGINT explicitly too: a shell
    # script's background job (`... &`) starts with SIGINT ignored, and Python keeps an
    # inherited "ignore", which would leave this server deaf to the signal that stops it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(server.url)
    print(f"PostgreSQL listening on {args.host}:{server.port}, data in {server.data_dir}, log {server.log_path}; "
          f"Ctrl-C stops it.\nQueue on it: python -m tools batch serve --db {server.url}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"Workers on other machines: PGPASSWORD=$(cat {server.password_path}) python -m tools batch worker "
              f"--db {server.remote_url()}", flush=True)
    returncode = server.wait()
    if returncode is None:
        return 0
    raise SystemExit(f"error: postgres exited with {returncode}; see {server.log_path}")
