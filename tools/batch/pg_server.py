"""A real PostgreSQL server for the batch queue, from the binaries the `pgserver` wheel ships (PostgreSQL 16).

    python -m tools batch postgres --dir build/batch/pg     # prints the URL; Ctrl-C stops the server

The tests start one per session the same way (`tests/conftest.py`). Nothing is installed on the
system: `pip install pgserver` brings `initdb` and `postgres`.

Why not pgserver's own `get_server`: it listens on a unix socket only (it starts the server with
`-h ""`), and it runs the server as a daemon that outlives its caller. Workers on other
machines need TCP, and a test session that is killed must not leave a server behind. So this
runs the wheel's `postgres` in the foreground as a child process: on TCP at `host:port` and on
no unix socket, with a parent-death signal, so that the server stops when this process ends,
however it ends.

Authentication: clients on the loopback interface are trusted, the way `initdb --auth=trust`
sets it up for a development server; any other address needs the `postgres` user's password,
generated at the first start into `<dir>/password` (scram-sha-256), which workers on other
machines pass as PGPASSWORD (or keep in ~/.pgpass) rather than in the URL.

PostgreSQL refuses to run as root. Run as root (as in containers), the server runs as the
system user `pgserver`, created if missing, the way pgserver itself does it (with its helpers):
the data directory is given to that user and the directories above it are made traversable.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

SYSTEM_USER = "pgserver"  # the user pgserver runs its servers as under root; shared, so both agree
DATABASE = "postgres"
SUPERUSER = "postgres"
WILDCARD_HOSTS = ("0.0.0.0", "*", "::")  # listen on every interface


def _pgserver():
    # pgserver reads XDG_RUNTIME_DIR at import (for a lock file this module does not use) and warns when
    # it is unset, as it is in containers and CI; and it logs every command it runs at INFO.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver
        import pgserver.utils
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    return pgserver


@functools.cache
def bin_dir() -> Path:
    """Where the wheel's PostgreSQL programs are (its pg_config knows, wherever pip put them)."""
    return Path(_pgserver().pg_config(["--bindir"]).strip())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def die_with_parent(signum: int) -> None:
    """In the child before exec: `signum` when the parent dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signum)


class LocalPostgres:
    """One PostgreSQL server on a data directory of its own; `start()`, `url`, `stop()` (or `with`).

    `directory` holds `data/` (the cluster, kept between starts), `server.log` and `password`.
    `settings` are passed as `-c name=value`: the tests turn fsync off, which a machine crash
    could cost the data of, not a process crash.
    """

    def __init__(self, directory: str | Path, *, host: str = "127.0.0.1", port: int = 5432,
                 settings: dict[str, str] | None = None):
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: a free one), got {port}")
        self.directory = Path(directory).resolve()
        self.data_dir = self.directory / "data"
        self.log_path = self.directory / "server.log"
        self.password_path = self.directory / "password"
        self.host = host
        self.port = port or free_port("127.0.0.1" if host in WILDCARD_HOSTS else host)
        self.settings = dict(settings or {})
        self.process: subprocess.Popen | None = None
        self._run_as = SYSTEM_USER if hasattr(os, "geteuid") and os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """The URL for clients on this machine (loopback: no password needed)."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"postgresql://{SUPERUSER}@{f'[{host}]' if ':' in host else host}:{self.port}/{DATABASE}"

    def remote_url(self, hostname: str | None = None) -> str:
        """The URL for other machines, without the password they need (PGPASSWORD: `password_path`)."""
        return f"postgresql://{SUPERUSER}@{hostname or socket.gethostname()}:{self.port}/{DATABASE}"

    def _as_server_user(self) -> dict:
        return {"user": self._run_as} if self._run_as else {}

    def _init_cluster(self) -> None:
        pgserver = _pgserver()
        self.directory.mkdir(parents=True, exist_ok=True)
        owner = None
        if self._run_as:
            owner = pgserver.utils.ensure_user_exists(self._run_as)
            pgserver.utils.ensure_prefix_permissions(self.directory)
            os.chown(self.directory, owner.pw_uid, owner.pw_gid)
        if (self.data_dir / "PG_VERSION").exists():
            return
        if not self.password_path.exists():
            self.password_path.write_text(secrets.token_urlsafe(24) + "\n")
            self.password_path.chmod(0o600)
        if owner is not None:
            os.chown(self.password_path, owner.pw_uid, owner.pw_gid)
        # Loopback trusted (initdb's host lines for 127.0.0.1 and ::1), every other address by password.
        subprocess.run([bin_dir() / "initdb", "-D", str(self.data_dir), "--auth=trust", "--no-locale",
                        "--encoding=UTF8", "-U", SUPERUSER, f"--pwfile={self.password_path}"],
                       check=True, capture_output=True, text=True, cwd=self.directory, **self._as_server_user())
        with (self.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write("\n# Added by tools.batch.pg_server: other machines need the password.\n"
                      "host all all all scram-sha-256\n")

    def start(self, timeout_s: float = 60.0) -> LocalPostgres:
        import psycopg

        try:
            self._init_cluster()
        except subprocess.CalledProcessError as err:
            raise RuntimeError(f"initdb failed in {self.data_dir}: {err.stderr.strip()}") from None
        log = self.log_path.open("a")
        options = ["-D", str(self.data_dir), "-h", self.host, "-p", str(self.port),
                   "-c", "unix_socket_directories="]
        for name, value in self.settings.items():
            options += ["-c", f"{name}={value}"]
        # SIGINT is PostgreSQL's fast shutdown: open transactions roll back, clients are told, then it exits.
        self.process = subprocess.Popen([bin_dir() / "postgres", *options], stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.directory,
                                        preexec_fn=lambda: die_with_parent(signal.SIGINT), **self._as_server_user())
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.process.returncode} on start; "
                                   f"{self.log_path}:\n{self._log_tail()}")
            try:
                with psycopg.connect(self.url, connect_timeout=2):
                    return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"postgres did not accept connections within {timeout_s:.0f} s; "
                                       f"{self.log_path}:\n{self._log_tail()}") from None
                time.sleep(0.1)

    def _log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGQUIT)  # immediate shutdown: recovery runs at the next start
            self.process.wait(timeout=10)

    def wait(self) -> int | None:
        """Until the server exits by itself (its exit code) or this process is interrupted (None:
        KeyboardInterrupt, which the caller may raise on SIGTERM too); the server is stopped either way."""
        try:
            return self.process.wait()
        except KeyboardInterrupt:
            return None
        finally:
            self.stop()

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
