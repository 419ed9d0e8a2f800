"""Fixtures of the batch queue's unit tests."""

from __future__ import annotations

import pytest

QUEUE_ENGINES = ("sqlite", "postgres")


@pytest.fixture(params=QUEUE_ENGINES)
def db(request, tmp_path) -> str:
    """Where a test's batch queue lives, once per engine: a SQLite file, then the URL of a fresh
    database on the session's real PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "batch.db")
    return request.getfixturevalue("postgres_url")
