"""The batch service's processes: the API under uvicorn, worker processes kept running, one worker's loop.

`python -m tools batch` (`tools.cli.batch`) parses its options and calls these; everything here
does I/O (sockets, child processes, signals, the store, tritonserver). Errors a user can fix
(a port in use) are `ServiceError`, one line fit to print.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tools.batch.pg_server import die_with_parent

if TYPE_CHECKING:
    from tools.batch.worker import WorkerStats

log = logging.getLogger("tools.batch")
STOP_TIMEOUT_S = 60.0  # how long stopping workers get to send what they hold before they are killed


class ServiceError(Exception):
    """A service that cannot start, for a reason the user can fix; the message is one line."""


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker calls tritonserver and leases items (the `batch worker` options)."""

    grpc_url: str  # tritonserver's gRPC endpoint
    grpc_tls_ca: Path | None  # CA bundle for a TLS endpoint; None: plaintext
    max_batch_items: int  # items per Triton request
    max_wait_ms: float  # how long the oldest claimed item waits for a fuller request
    max_in_flight: int  # most Triton requests in flight
    lease_s: float  # an item's lease
    max_attempts: int  # attempts per item before a retryable failure is final

    def argv(self) -> list[str]:
        """These options as `batch worker` arguments."""
        return ["--grpc-url", self.grpc_url, "--max-batch-items", str(self.max_batch_items),
                "--max-wait-ms", str(self.max_wait_ms), "--max-in-flight", str(self.max_in_flight),
                "--lease-s", str(self.lease_s), "--max-attempts", str(self.max_attempts),
                *(["--grpc-tls-ca", str(self.grpc_tls_ca)] if self.grpc_tls_ca else [])]


def check_port_free(host: str, port: int) -> None:
    """Raise `ServiceError` when nothing could listen on `host:port` now (before anything starts)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ServiceError(f"cannot listen on {host}:{port}: {err.strerror}; choose another --port") from None


API_SHUTDOWN_S = 5  # on SIGINT/SIGTERM, requests in flight get this long; clients' idle connections do not hold it up


def serve_api(db: str, host: str, port: int) -> None:
    """The REST API on the queue `db` until SIGINT or SIGTERM."""
    import uvicorn

    from tools.batch.api import create_app

    uvicorn.run(create_app(db), host=host, port=port, log_level="warning", timeout_graceful_shutdown=API_SHUTDOWN_S)


def worker_argv(db: str, worker_id: str, options: WorkerOptions) -> list[str]:
    """The command line of one worker process."""
    return [sys.executable, "-m", "tools", "batch", "worker", "--db", str(db), "--id", worker_id, *options.argv()]


class WorkerProcesses:
    """Worker processes on one queue, each started again when it dies, until `stop()`.

    Each gets SIGTERM when this process dies, even by SIGKILL, so no worker is left claiming
    items for a service that is gone.
    """

    def __init__(self, db: str, names: Sequence[str], options: WorkerOptions, check_every_s: float = 1.0):
        self._db, self._options, self._check_every_s = db, options, check_every_s
        self._stopping = threading.Event()
        self.children = {name: self._start(name) for name in names}
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _start(self, name: str) -> subprocess.Popen:
        return subprocess.Popen(worker_argv(self._db, name, self._options),
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))

    def _watch(self) -> None:
        while not self._stopping.wait(self._check_every_s):
            for name, child in list(self.children.items()):
                if child.poll() is not None and not self._stopping.is_set():
                    log.warning("worker %s exited with %s; starting it again", name, child.returncode)
                    self.children[name] = self._start(name)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every worker (each sends what it holds, then exits); SIGKILL to any still running after."""
        self._stopping.set()
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children.values():
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.kill()


def serve_with_workers(db: str, host: str, port: int, worker_names: Sequence[str], options: WorkerOptions) -> None:
    """The API in this process and the workers as children, until SIGINT or SIGTERM; then the
    workers stop (each sends what it holds) and then the API."""
    workers = WorkerProcesses(db, worker_names, options)
    try:
        serve_api(db, host, port)
    finally:
        workers.stop()


def run_worker(db: str, worker_id: str, options: WorkerOptions) -> WorkerStats:
    """One worker on the queue `db` until SIGINT or SIGTERM; returns its counts.

    A signal that arrives while the worker is still starting (importing, connecting) stops it
    as soon as it runs, the same clean way, instead of killing it mid-start.
    """
    stop_early = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_early.set())

    from tools.batch.engines import describe, open_store
    from tools.batch.policy import BatchLimits, RetryPolicy
    from tools.batch.worker import BatchWorker, WorkerConfig, make_callers

    config = WorkerConfig(worker_id=worker_id, max_batch_items=options.max_batch_items,
                          max_wait_s=options.max_wait_ms / 1000.0, max_in_flight=options.max_in_flight,
                          lease_s=options.lease_s, retry=RetryPolicy(max_attempts=options.max_attempts))

    async def main():
        callers, client = make_callers(options.grpc_url, BatchLimits().models, max_rows=options.max_batch_items,
                                       tls_ca=options.grpc_tls_ca)
        with open_store(db, max_attempts=options.max_attempts) as store:
            worker = BatchWorker(store, config, callers)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, worker.stop)
            if stop_early.is_set():
                worker.stop()
            log.info("worker %s: queue %s, tritonserver %s", worker_id, describe(db), options.grpc_url)
            try:
                return await worker.run()
            finally:
                await client.close()

    stats = asyncio.run(main())
    log.info("worker %s stopped: %s", worker_id, stats)
    return stats
