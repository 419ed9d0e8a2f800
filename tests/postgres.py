"""A real PostgreSQL for the tests: one server per session (`tools.batch.pg_server`, the binaries of
the pgserver wheel), one fresh database per test or per generated example."""

from __future__ import annotations

import shutil
import tempfile
import uuid

from tools.batch.pg_server import LocalPostgres

# fsync off: a test checks what processes see and survive, never a power cut, and on a shared
# 2-core machine the fsyncs would dominate the run. Everything else is PostgreSQL's default.
TEST_SETTINGS = {"fsync": "off"}


def start_test_server() -> LocalPostgres:
    # Under the system temp dir rather than pytest's: started as root, the server runs as another
    # user, and pytest keeps its own base directory private to root (another session resets it).
    return LocalPostgres(tempfile.mkdtemp(prefix="batch-pg-"), port=0, settings=TEST_SETTINGS).start()


def stop_test_server(server: LocalPostgres) -> None:
    server.stop()
    shutil.rmtree(server.directory, ignore_errors=True)


def create_database(server: LocalPostgres) -> str:
    """A new empty database on `server`; returns its URL."""
    import psycopg

    name = f"test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server.url.rsplit('/', 1)[0]}/{name}"


def drop_database(server: LocalPostgres, url: str) -> None:
    """Drop the database of `url`, disconnecting whatever is still connected (a killed worker's session)."""
    import psycopg

    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")
