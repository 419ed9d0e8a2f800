"""TLS options of serve and the gRPC clients: both server files or neither, PEM files only, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.cli.serve import grpc_tls
from tools.clients.tls import TlsConfigError, check_pem, client_tls_kwargs
from tools.server.triton_server import GrpcTls, ServerConfig, TritonDistribution, build_command

REPO = Path(__file__).resolve().parents[2]
PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
FAKE = TritonDistribution(binary=Path("/t/bin/tritonserver"), libs_dir=Path("/t/libs"),
                          backends_dir=Path("/t/backends"), stub=Path("/t/stub"))


@pytest.fixture
def pem(tmp_path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_bytes(PEM)
    return path


def test_clients_are_plaintext_without_a_ca_and_trust_the_given_ca_with_it(pem):
    assert client_tls_kwargs(None) == {}
    assert client_tls_kwargs(pem) == {"ssl": True, "root_certificates": str(pem)}


def test_a_missing_or_non_pem_file_is_named_in_the_error(tmp_path, pem):
    with pytest.raises(TlsConfigError, match=r"cannot read the gRPC TLS CA certificate .*absent.pem"):
        client_tls_kwargs(tmp_path / "absent.pem")
    der = tmp_path / "cert.der"
    der.write_bytes(b"\x30\x82\x01\x0a")
    with pytest.raises(TlsConfigError, match=r"cert.der is not a PEM file"):
        check_pem(der, "certificate")
    assert check_pem(pem, "certificate") == pem


def test_serve_takes_both_server_files_or_neither(pem):
    assert grpc_tls(None, None) is None
    assert grpc_tls(pem, pem) == GrpcTls(cert=pem.resolve(), key=pem.resolve())
    for cert, key in ((pem, None), (None, pem)):
        with pytest.raises(TlsConfigError, match="go together"):
            grpc_tls(cert, key)


def test_the_server_command_turns_on_grpc_tls_with_the_files(pem):
    command = build_command(ServerConfig(grpc_tls=GrpcTls(cert=pem, key=pem)), FAKE, Path("/b"))
    assert ["--grpc-use-ssl=true", f"--grpc-server-cert={pem}", f"--grpc-server-key={pem}"] == [
        part for part in command if part.startswith("--grpc-use-ssl") or part.startswith("--grpc-server-")]
    assert not any("ssl" in part for part in build_command(ServerConfig(), FAKE, Path("/b")))


def test_serve_refuses_half_a_tls_configuration_before_starting(pem):
    result = subprocess.run([sys.executable, "-m", "tools", "serve", "--model-control-mode=none",
                             f"--grpc-tls-cert={pem}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--grpc-tls-cert and --grpc-tls-key go together" in result.stderr
