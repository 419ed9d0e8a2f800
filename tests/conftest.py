"""Suite-wide options and fixtures: tests marked `slow` (full-length load runs) run only when asked
for; one real PostgreSQL server per session for the batch queue's PostgreSQL engine."""

from __future__ import annotations

import os

import pytest

from tests.postgres import create_database, drop_database, start_test_server, stop_test_server


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=bool(os.environ.get("RUN_SLOW")),
                     help="also run the tests marked slow (full-length load runs); RUN_SLOW=1 does the same")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow load run: pass --run-slow (or set RUN_SLOW=1) to run it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL 16 for the session, on TCP at a free loopback port, started the way
    `python -m tools batch postgres` starts one; started only by the tests that ask for it."""
    server = start_test_server()
    try:
        yield server
    finally:
        stop_test_server(server)


@pytest.fixture
def postgres_url(postgres_server):
    """A database of its own for one test, dropped afterwards."""
    url = create_database(postgres_server)
    yield url
    drop_database(postgres_server, url)
