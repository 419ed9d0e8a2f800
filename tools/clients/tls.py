"""How the tools, the batch workers and the load tests reach tritonserver's gRPC port over TLS.

`python -m tools serve --grpc-tls-cert CERT --grpc-tls-key KEY` serves gRPC over TLS (and
only TLS: a plaintext client is refused). A client trusts the server through `--grpc-tls-ca
FILE`, the PEM certificate of the authority that signed the server's certificate (for a
self-signed certificate, the certificate itself); the `host` of the gRPC URL must be a name the
certificate was issued for. Without `--grpc-tls-ca`, clients connect in plaintext. Triton's
HTTP front end has no TLS: put a TLS-terminating proxy in front of the HTTP port.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


class TlsConfigError(ValueError):
    """A TLS file that was asked for is missing or is not PEM."""


def check_pem(path: Path, what: str) -> Path:
    """`path` if it is a readable PEM file, else a TlsConfigError naming it."""
    try:
        head = path.read_bytes()[:4096]
    except OSError as err:
        raise TlsConfigError(f"cannot read the {what} {path}: {err.strerror}") from None
    if b"-----BEGIN " not in head:
        raise TlsConfigError(f"the {what} {path} is not a PEM file (no '-----BEGIN' line)")
    return path


def client_tls_kwargs(ca_file: Path | None) -> dict[str, Any]:
    """Keyword arguments of tritonclient's gRPC clients (sync and asyncio) for `ca_file`; {} is plaintext."""
    if ca_file is None:
        return {}
    return {"ssl": True, "root_certificates": str(check_pem(ca_file, "gRPC TLS CA certificate"))}


def add_ca_argument(parser: argparse.ArgumentParser) -> None:
    """The `--grpc-tls-ca` option of every tool that calls tritonserver over gRPC."""
    parser.add_argument("--grpc-tls-ca", type=Path, default=None, metavar="PEM",
                        help="connect to gRPC over TLS, trusting this CA certificate (for a self-signed server "
                             "certificate: the certificate itself); default: plaintext")
