"""Which engine keeps the queue, chosen by the `--db` value.

    build/batch/queue.db                        a SQLite file: the API and workers of one machine
    postgresql://user@host:5432/database        PostgreSQL: workers on any number of machines

A value with any other `scheme://` is refused rather than taken for a file name, so a mistyped
URL fails naming itself instead of quietly creating a SQLite file in a directory called `mysql:`.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from tools.batch.store_base import BatchQueue, StoreUnavailable

POSTGRES_SCHEMES = ("postgresql", "postgres")


def is_postgres_url(db: str) -> bool:
    return "://" in db and urlsplit(db).scheme in POSTGRES_SCHEMES


def redact_url(url: str) -> str:
    """The URL with its password, in the user part or the query, replaced by ***: fit for logs and errors.

    Edited in place rather than parsed and rebuilt: urlunsplit would drop the empty host of
    `postgresql:///db?host=/run/postgresql`, changing what the URL means.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    end = min([position for position in map(rest.find, "/?#") if position >= 0] + [len(rest)])
    authority, tail = rest[:end], rest[end:]
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        authority = f"{userinfo.split(':', 1)[0]}:***@{host}"
    tail = re.sub(r"([?&]password=)[^&#]*", r"\1***", tail, flags=re.IGNORECASE)
    return f"{scheme}://{authority}{tail}"


def describe(db: str | Path) -> str:
    """The queue as logs and errors name it: a URL without its password, or the file."""
    db = str(db)
    return redact_url(db) if "://" in db else db


def open_store(db: str | Path, *, max_attempts: int = 5) -> BatchQueue:
    """The queue `db` names: a `PostgresStore` for a postgresql:// (or postgres://) URL, else a
    `BatchStore` on that SQLite file, its directory created if missing.

    Raises `StoreUnavailable` (a one-line message) when the database does not answer or the file
    cannot be opened, and `ValueError` for a URL of another scheme.
    """
    db = str(db)
    if is_postgres_url(db):
        from tools.batch.pg_store import PostgresStore  # psycopg is needed only here

        return PostgresStore(db, max_attempts=max_attempts)
    if "://" in db:
        raise ValueError(f"--db {describe(db)!r} is a URL of an unknown kind; give a SQLite file path or a "
                         f"{' or '.join(scheme + '://' for scheme in POSTGRES_SCHEMES)} URL")
    from tools.batch.store import BatchStore

    try:
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreUnavailable(f"cannot create the directory of the batch queue file {db}: {err.strerror}") from None
    return BatchStore(db, max_attempts=max_attempts)
