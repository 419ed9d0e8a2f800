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
import sys
from pathlib import Path

from tools.server.admin_key import AdminKeyError, read_key_file, write_new_key


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
