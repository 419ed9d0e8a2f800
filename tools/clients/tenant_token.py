"""Tenant tokens for the kit's own clients, and the keys file that signs them.

Issuing (`issue`: an HS256 JWT signed with the newest key, or a chosen one), the keys file's
read-modify-write under a lock beside it (`add_key`, `drop_key`, `ensure_key`), and the request
parameters a benchmark or load-test client attaches to count as a tenant (`tenant_parameters`).
The token format and its verification are `python_backends.common.tenant_auth`'s; the
`python -m tools tenant-token` command (`tools.cli.tenant_token`) is the thin layer over this.

I/O: reads and atomically replaces the keys file (mode 0600), and locks `.<name>.lock` beside
it. A keys file that is a JWKS document (an identity provider's public keys) is refused: the
kit cannot sign with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from python_backends.common.tenant_auth import (
    MIN_SECRET_BYTES,
    TOKEN_PARAMETER,
    format_keys,
    issue_token,
    parse_secrets,
)
from tools.spec.serving import ServingSpec


class KeysError(RuntimeError):
    """The keys file is missing, unreadable, invalid (a JWKS document included), or lacks the key asked for."""


def read_keys(path: Path) -> dict[str, bytes]:
    """The keys in the file, oldest first; KeysError when it is missing or invalid."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeysError(f"no keys file at {path}; add a key with `python -m tools tenant-token --new-key ID`") from None
    except (OSError, UnicodeDecodeError) as err:
        raise KeysError(f"cannot read the keys file {path}: {err}") from None
    try:
        return parse_secrets(text)
    except ValueError as err:
        raise KeysError(f"{path}: {err}") from None


def write_keys(path: Path, keys: dict[str, bytes]) -> None:
    """Replace the keys file atomically, readable by its owner only: a server re-reading it sees
    the old keys or the new, never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(format_keys(keys))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(staging, 0o600)  # O_CREAT's mode does not apply to a leftover staging file
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialize read-modify-write of the keys file between processes (a lock file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_key(path: Path, new_key_id: str) -> int:
    """Add a fresh random key (the newest from now on); returns how many keys the file holds."""
    with locked(path):
        keys = read_keys(path) if path.exists() else {}
        if new_key_id in keys:
            raise KeysError(f"{path} already holds a key {new_key_id!r}; choose a new id (e.g. the date)")
        keys[new_key_id] = secrets.token_bytes(MIN_SECRET_BYTES)
        write_keys(path, keys)
        return len(keys)


def drop_key(path: Path, old_key_id: str) -> int:
    """Remove a key; returns how many keys are left."""
    with locked(path):
        keys = read_keys(path)
        if old_key_id not in keys:
            raise KeysError(f"{path} holds no key {old_key_id!r} (it has {', '.join(keys) or 'none'})")
        del keys[old_key_id]
        write_keys(path, keys)
        return len(keys)


def ensure_key(path: Path, default_key_id: str = "local-1") -> None:
    """Add a key when the file is missing or empty. For test and benchmark runs that need to
    sign tokens on the machine that serves; an operator adds keys with --new-key."""
    with locked(path):
        if not path.exists() or not read_keys(path):
            keys = {default_key_id: secrets.token_bytes(MIN_SECRET_BYTES)}
            write_keys(path, keys)


def issue(path: Path, tenant: str, ttl_s: float, signing_key_id: str | None = None,
          now_s: float | None = None) -> tuple[str, str, int]:
    """A token for `tenant` valid for `ttl_s`, signed with `signing_key_id` (default: the newest
    key). Returns (token, key id, expiry in Unix seconds)."""
    keys = read_keys(path)
    if not keys:
        raise KeysError(f"{path} holds no keys; add one with `python -m tools tenant-token --new-key ID`")
    chosen = signing_key_id or list(keys)[-1]
    if chosen not in keys:
        raise KeysError(f"{path} holds no key {chosen!r} (it has {', '.join(keys)})")
    expiry_s = int((time.time() if now_s is None else now_s) + ttl_s)
    return issue_token(tenant, expiry_s, chosen, keys[chosen]), chosen, expiry_s


def token_for(path: Path, tenant: str, ttl_s: float = 3600.0) -> str:
    """A token for a test or benchmark client: signed with the newest key, one made if there is none."""
    ensure_key(path)
    token, _, _ = issue(path, tenant, ttl_s)
    return token


def tenant_parameters(spec: ServingSpec, tenants: Iterable[str], ttl_s: float = 6 * 3600.0) -> dict[str, dict]:
    """Request parameters that make a client's requests count as each of `tenants`: the
    tenant's token when the spec authenticates tenants (signed with the newest key of its keys
    file; one is made if there is none), else the bare `tenant` parameter. For the benchmark
    and load-test clients, which run where the server's keys are."""
    if spec.tenant_auth is None:
        return {tenant: {"tenant": tenant} for tenant in tenants}
    return {tenant: {TOKEN_PARAMETER: token_for(spec.tenant_auth.keys_file, tenant, ttl_s)} for tenant in tenants}
