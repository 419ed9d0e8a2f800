"""Make, find and check the admin key that guards tritonserver's control endpoints.

    python -m tools admin-key new build/admin.key    # a fresh random key in a 0600 file
    python -m tools admin-key new build/admin.key --keep   # ... unless the file exists
    python -m tools admin-key check build/admin.key  # is it a usable key?

`serve` starts tritonserver with the model-repository (load, unload, index), shared-memory,
trace and logging endpoints restricted, over HTTP and gRPC, to requests that carry the key in
the `triton-admin-key` HTTP header (gRPC metadata `triton-grpc-protocol-triton-admin-key`).
Inference, health, metadata, model config and statistics stay open: clients and the
observability tools (`top`, `explain`, `sweep`, Prometheus) need them, and none of them changes
what the server serves.

Where the key comes from, for `serve` and for every tool that calls those endpoints (`rollout`,
`profile`, the supervisor inside `serve`): `--admin-key-file FILE`, else the environment
variable TRITON_ADMIN_KEY, else (tools only) the file build/admin.key when it exists. No key
is ever baked into the repository: `make serve` makes one per checkout on first use.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="admin_command", metavar="{new,check}", required=True)
    new = sub.add_parser("new", help="write a fresh random key to FILE (mode 0600)")
    new.add_argument("file", type=Path, metavar="FILE")
    new.add_argument("--keep", action="store_true", help="leave FILE as it is when it already holds a usable key")
    check = sub.add_parser("check", help="exit 0 when FILE holds a usable key")
    check.add_argument("file", type=Path, metavar="FILE")


def run(args: argparse.Namespace) -> int:
    try:
        if args.admin_command == "check":
            read_key_file(args.file)
            print(f"{args.file}: a usable admin key")
            return 0
        if args.keep and args.file.is_file():
            read_key_file(args.file)  # an unusable file is an error, not something to keep
            return 0
        write_new_key(args.file)
        print(f"wrote a new admin key to {args.file} (mode 0600); restart `serve` for it to take effect")
        return 0
    except AdminKeyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
