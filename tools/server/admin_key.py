"""The admin key that guards tritonserver's control endpoints: where it comes from, whether it
is usable, the server flags that require it, and the headers that carry it.

`serve` starts tritonserver with the model-repository (load, unload, index), shared-memory,
trace and logging endpoints restricted, over HTTP and gRPC, to requests that carry the key in
the `triton-admin-key` HTTP header (gRPC metadata `triton-grpc-protocol-triton-admin-key`).
Inference, health, metadata, model config and statistics stay open. A key comes from
`--admin-key-file FILE`, else $TRITON_ADMIN_KEY, else (tools only) build/admin.key when it
exists. `check_key`, `restricted_api_args`, `admin_headers` and `grpc_admin_metadata` are pure;
`read_key_file`, `find_admin_key`, `key_for_tool` and `write_new_key` read or write key files.
The `admin-key` command is `tools.cli.admin_key`.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

from tools.paths import REPO_ROOT

ADMIN_HEADER = "triton-admin-key"  # gRPC metadata keys must be lower case; HTTP headers match either way
# Over gRPC, tritonserver looks for the header under this prefix (measured on 2.51).
GRPC_ADMIN_METADATA = f"triton-grpc-protocol-{ADMIN_HEADER}"
ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"
DEFAULT_KEY_FILE = REPO_ROOT / "build" / "admin.key"
# The endpoints that change what the server serves or what it writes; see the module docstring.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
MIN_KEY_CHARS = 24
# tritonserver parses `<apis>:<header>=<value>` from one argument, so the value must not hold
# ':' '=' or ','; header values must be printable ASCII without spaces.
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_.~+/-]+")


class AdminKeyError(ValueError):
    """The admin key is missing, unreadable or unusable; the message says which and how to fix it."""


def check_key(key: str, source: str) -> str:
    """`key` if it is usable as the admin key, else an AdminKeyError naming `source` (never the key)."""
    if len(key) < MIN_KEY_CHARS:
        raise AdminKeyError(f"the admin key from {source} has {len(key)} characters; it needs at least "
                            f"{MIN_KEY_CHARS} (`python -m tools admin-key new FILE` makes one)")
    if not _KEY_PATTERN.fullmatch(key):
        raise AdminKeyError(f"the admin key from {source} may only hold letters, digits and _ . ~ + / - "
                            "(no spaces, ':', '=' or ',': tritonserver reads it from its command line)")
    return key


def read_key_file(path: Path) -> str:
    """The key in `path` (surrounding whitespace ignored)."""
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise AdminKeyError(f"admin key file {path} does not exist (`python -m tools admin-key new {path}` "
                            "makes one)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise AdminKeyError(f"cannot read admin key file {path}: {err}") from None
    return check_key(text.strip(), str(path))


def find_admin_key(key_file: Path | None, env: Mapping[str, str], default_file: Path | None = None) -> str | None:
    """The admin key: from `key_file` if given, else $TRITON_ADMIN_KEY, else `default_file` if it
    exists, else None. A source that is given but unusable is an error, never skipped."""
    if key_file is not None:
        return read_key_file(key_file)
    if env.get(ADMIN_KEY_ENV):
        return check_key(env[ADMIN_KEY_ENV].strip(), f"${ADMIN_KEY_ENV}")
    if default_file is not None and default_file.is_file():
        return read_key_file(default_file)
    return None


def restricted_api_args(key: str) -> list[str]:
    """The tritonserver flags that put RESTRICTED_APIS behind `key` on HTTP and gRPC."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]


def admin_headers(key: str | None) -> dict[str, str]:
    """HTTP headers for a call to a restricted endpoint; empty without a key."""
    return {ADMIN_HEADER: key} if key else {}


def grpc_admin_metadata(key: str | None) -> dict[str, str]:
    """gRPC metadata (tritonclient's `headers=`) for a call to a restricted protocol; empty without a key."""
    return {GRPC_ADMIN_METADATA: key} if key else {}


def add_key_file_argument(parser: argparse.ArgumentParser) -> None:
    """The `--admin-key-file` option of the tools that call restricted endpoints."""
    parser.add_argument("--admin-key-file", type=Path, default=None, metavar="FILE",
                        help=f"the server's admin key, sent with load/unload calls (default: ${ADMIN_KEY_ENV}, "
                             f"else {DEFAULT_KEY_FILE.relative_to(REPO_ROOT)} when it exists)")


def key_for_tool(args: argparse.Namespace) -> str | None:
    """The admin key a tool sends, from its `--admin-key-file`, the environment or the default file."""
    return find_admin_key(getattr(args, "admin_key_file", None), os.environ, DEFAULT_KEY_FILE)


def write_new_key(path: Path) -> None:
    """A fresh random key in `path`, readable by its owner only (made so before the key is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)  # 43 characters of [A-Za-z0-9_-]
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        os.fchmod(file.fileno(), 0o600)  # O_CREAT's mode does not apply to a file that already existed
        file.write(key + "\n")
