"""The locked-down server: control endpoints behind the admin key, gRPC over TLS, model files
verified at load. One real tritonserver for the module, started the way `serve` starts it, on a
copy of the repository (so a test can tamper with a file without touching the real one)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from python_backends.common.artifacts import MANIFEST
from tools.batch.policy import ItemKind
from tools.batch.worker import make_callers
from tools.clients.retrying import EmbedClient
from tools.paths import DEFAULT_MODEL_REPOSITORY
from tools.server.admin_key import admin_headers, grpc_admin_metadata
from tools.server.triton_server import GrpcTls, ModelControlMode, ServerConfig, TritonServer, free_port
from tools.spec.serving import load_spec

from .conftest import LOG_DIR, REPO

EMBED = load_spec().models[0]
ENCODERS = [EMBED.encoder_name(length) for length in EMBED.bucket_lens]
ADMIN_KEY = secrets.token_urlsafe(32)


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, valid for a day, and its private key (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)
    repository = tmp_path_factory.mktemp("locked-repo")
    for name in ["embed", *ENCODERS]:  # hard links: the copy costs no disk and loads the same files
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / name, repository / name, copy_function=os.link,
                        ignore=shutil.ignore_patterns("__pycache__", "routing.json"))
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=("embed", *ENCODERS), admin_key=ADMIN_KEY, grpc_tls=GrpcTls(cert, key))
    server = TritonServer(config, log_path=LOG_DIR / "tritonserver-locked.log")
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        yield server, repository, cert
    finally:
        server.stop()


def text_input(module, text: str):
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def test_grpc_over_tls_serves_a_client_that_trusts_the_certificate_and_refuses_plaintext(locked_server):
    server, _, cert = locked_server
    port = server.config.grpc_port
    secure = grpcclient.InferenceServerClient(f"localhost:{port}", ssl=True, root_certificates=str(cert))
    result = secure.infer("embed", [text_input(grpcclient, "over TLS")])
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    secure.close()

    plaintext = grpcclient.InferenceServerClient(f"localhost:{port}")
    with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
        plaintext.infer("embed", [text_input(grpcclient, "in the clear")], client_timeout=10)
    plaintext.close()

    # The kit's own client connects over it with the CA option the tools take (--grpc-tls-ca).
    client = EmbedClient(f"localhost:{port}", tls_ca=cert)
    assert client.embed(["the tools speak TLS"]).shape == (1, 384)

    # So do the batch workers (`batch worker --grpc-tls-ca`).
    async def batch_call():
        callers, aio_client = make_callers(f"localhost:{port}", {"embed": ItemKind.EMBED}, max_rows=4, tls_ca=cert)
        try:
            return await callers["embed"](["a batch item", "another"])
        finally:
            await aio_client.close()

    outcomes = asyncio.run(batch_call())
    assert [len(o.result["embedding"]) for o in outcomes] == [384, 384], outcomes


def test_a_sweep_and_a_load_run_connect_over_tls(locked_server, tmp_path):
    server, _, cert = locked_server
    sweep = subprocess.run(
        [sys.executable, "-m", "tools", "sweep", "--url", f"localhost:{server.config.grpc_port}",
         "--grpc-tls-ca", str(cert), "--rates", "5", "--duration", "3", "--warmup", "1", "--slo-ms", "1000",
         "--out", str(tmp_path / "sweep.json")], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    (step,) = json.loads((tmp_path / "sweep.json").read_text())["steps"]
    assert step["num_sent"] > 0 and step["num_ok"] == step["num_sent"] and step["num_errors"] == 0

    locust = subprocess.run(
        [sys.executable, "-m", "locust", "--config", "loadtest/locust.conf", "--mix", "embed", "-u", "2", "-r", "2",
         "--run-time", "8s", "--triton-grpc", f"localhost:{server.config.grpc_port}",
         "--triton-grpc-tls-ca", str(cert), "--triton-http", server.http_url, "--csv", str(tmp_path / "locust"),
         "--html", str(tmp_path / "locust.html"), "--slo-report", str(tmp_path / "summary.md"),
         "--slo-json", str(tmp_path / "verdict.json")], cwd=REPO, capture_output=True, text=True, timeout=180)
    stats = (tmp_path / "locust_stats.csv").read_text()
    grpc_row = next(line for line in stats.splitlines() if line.startswith("gRPC,embed,"))
    requests, failures = (int(value) for value in grpc_row.split(",")[2:4])
    assert requests > 0 and failures == 0, locust.stdout[-3000:] + locust.stderr[-3000:]


def test_control_endpoints_refuse_without_the_key_and_the_model_keeps_serving(locked_server):
    server, _, cert = locked_server
    client = httpclient.InferenceServerClient(server.http_url)
    for headers in ({}, {"triton-admin-key": secrets.token_urlsafe(32)}):
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("encoder_16", headers=headers)
    grpc = grpcclient.InferenceServerClient(f"localhost:{server.config.grpc_port}", ssl=True,
                                            root_certificates=str(cert))
    with pytest.raises(InferenceServerException, match="restricted"):
        grpc.unload_model("encoder_16")
    assert client.is_model_ready("encoder_16")
    assert client.infer("embed", [text_input(httpclient, "still served")]).as_numpy("EMBEDDING").shape == (1, 384)
    # Reading is open: statistics (the observability tools) need no key.
    assert client.get_inference_statistics("encoder_16")["model_stats"]
    index = grpc.get_model_repository_index(headers=grpc_admin_metadata(ADMIN_KEY))
    assert {m.name for m in index.models} >= {"embed", *ENCODERS}
    grpc.close()
    client.close()


def test_a_tampered_onnx_file_fails_to_load_naming_the_file_while_other_models_serve(locked_server):
    server, repository, _ = locked_server
    client = httpclient.InferenceServerClient(server.http_url)
    admin = admin_headers(ADMIN_KEY)
    onnx = repository / "encoder_32" / "1" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte deep in the weights
    onnx.unlink()  # the copy is a hard link to the real file: replace it, never write through it
    onnx.write_bytes(bytes(data))

    client.unload_model("encoder_32", headers=admin, unload_dependents=False)
    with pytest.raises(InferenceServerException) as error:
        client.load_model("encoder_32", headers=admin)
    message = error.value.message()
    assert "encoder_32" in message and "model.onnx does not match its checksum in " + MANIFEST in message, message
    assert not client.is_model_ready("encoder_32", "1")

    # The other models serve: a short text is the 16-token bucket's, untouched.
    result = client.infer("embed", [text_input(httpclient, "short texts still work")])
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    assert client.is_model_ready("encoder_16") and client.is_model_ready("encoder_64")
    client.close()


def test_request_payloads_never_reach_the_server_log_at_default_verbosity(triton, http_client):
    """Texts, prompts and malformed bodies, good and bad requests alike: the log (what the
    session server writes at --log-verbose 0) holds none of them."""
    from tools.clients.llm import LLMStream

    marker = f"confidential-{secrets.token_hex(8)}"
    assert http_client.infer("embed", [text_input(httpclient, f"{marker} in a text")]).as_numpy("EMBEDDING").size
    tensor = httpclient.InferInput("TEXT", [1, 2], "BYTES")  # a wrong shape: refused
    tensor.set_data_from_numpy(np.array([[marker.encode(), b"x"]], dtype=object))
    with pytest.raises(InferenceServerException):
        http_client.infer("embed", [tensor])
    stream = LLMStream(triton.grpc_url)
    try:
        good = stream.submit(text_input=f"Repeat {marker}", max_tokens=4, temperature=0.0)
        assert good.done.wait(120)
        # One at a time: an error response may carry no request id to match it by.
        bad = stream.submit(messages=f'[{{"role": "user", "content": "{marker}"', max_tokens=4)  # not a list
        assert bad.done.wait(120)
    finally:
        stream.close()
    assert good.error is None and bad.error is not None
    log = (LOG_DIR / "tritonserver.log").read_text(errors="replace")
    assert log and marker not in log
