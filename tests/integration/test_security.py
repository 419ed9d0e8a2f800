"""The locked-down server: control endpoints behind the admin key, gRPC over TLS, model files
verified at load. The server is the one docs/security.md shows: its admin key, certificate and
`serve` command run as written, in a scratch folder (what they write under build/ stays out of the
checkout), on the ports the example shows; the sweep and load run it shows connect to it."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from python_backends.common.artifacts import MANIFEST
from tests import doc_examples
from tests.doc_examples import require_free, shell, shown
from tests.integration.helpers import wait_until_up
from tools.batch.policy import ItemKind
from tools.batch.worker import make_callers
from tools.clients.retrying import EmbedClient
from tools.paths import DEFAULT_MODEL_REPOSITORY
from tools.server.admin_key import admin_headers, grpc_admin_metadata
from tools.spec.serving import load_spec

from .conftest import LOG_DIR, REPO

DOC = "docs/security.md"
EMBED = load_spec().models[0]
ENCODERS = [EMBED.encoder_name(length) for length in EMBED.bucket_lens]
SHOWN_PORTS = (8000, 8001, 8002, 9000)  # `serve` as shown: its default HTTP, gRPC, metrics and LLM API ports


def run_shown(command: str, cwd: Path, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run a command the doc shows, as written, in `cwd`; it must exit 0."""
    result = doc_examples.run_shown(command, cwd, timeout_s=timeout_s, **env)
    assert result.returncode == 0, (f"`{command}` exited {result.returncode}\n"
                                    + result.stdout[-3000:] + result.stderr[-3000:])
    return result


def test_the_admin_key_commands_make_check_and_keep_a_key(tmp_path):
    """The three `admin-key` commands as docs/security.md shows them, in a scratch folder."""
    made = run_shown(shown("docs/security.md", "python -m tools admin-key new build/admin.key"), tmp_path)
    key_file = tmp_path / "build" / "admin.key"
    assert made.stdout.startswith("wrote a new admin key to build/admin.key (mode 0600)"), made.stdout
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text()
    kept = run_shown(shown("docs/security.md", "python -m tools admin-key new build/admin.key --keep"), tmp_path)
    assert key_file.read_text() == key and not kept.stdout, kept.stdout  # a usable key stays as it is
    checked = run_shown(shown("docs/security.md", "python -m tools admin-key check build/admin.key"), tmp_path)
    assert checked.stdout == "build/admin.key: a usable admin key\n"
    key_file.write_text("short")  # an unusable key is refused, not kept
    argv, environ = shell("python -m tools admin-key new build/admin.key --keep")
    refused = subprocess.run(argv, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.startswith("error: "), refused.stderr
    assert key_file.read_text() == "short"


def make_checkout(folder: Path) -> None:
    """A scratch folder that works as this checkout: its packages (so that Python run there,
    tritonserver's model stubs included, imports this checkout's kit, whichever one the
    environment has installed), what `make loadtest` needs (the Makefile, the load test), and
    the environment `make setup` made, with a setup stamp of its own (the checkout's may be
    older than a freshly checked-out pyproject.toml, and make would then install the kit again,
    from the scratch folder). What the commands write under build/ stays there."""
    for name in ("Makefile", "loadtest", "tools", "python_backends", "pyproject.toml", "requirements.lock"):
        (folder / name).symlink_to(REPO / name)
    venv = REPO / ".venv"
    (folder / ".venv").mkdir()
    for entry in venv.iterdir():
        if entry.name != ".installed":
            (folder / ".venv" / entry.name).symlink_to(entry)
    (folder / ".venv" / ".installed").touch()


@dataclass(frozen=True)
class LockedServer:
    folder: Path  # the scratch checkout the shown commands run in
    admin_key: str
    cert: Path
    http_url: str = f"localhost:{SHOWN_PORTS[0]}"
    grpc_port: int = SHOWN_PORTS[1]


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    """`serve` with the admin key and gRPC over TLS, its key and certificate made, all as the doc
    shows them; stopped with Ctrl-C (SIGINT) at the end, which must stop it cleanly."""
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)
    folder = tmp_path_factory.mktemp("security")
    make_checkout(folder)  # `make loadtest` runs here too
    run_shown(shown("docs/security.md", "python -m tools admin-key new build/admin.key"), folder)
    run_shown(shown("docs/security.md", "mkdir -p build/tls"), folder)
    run_shown(shown("docs/security.md",
                    "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj "
                    "/CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout build/tls/server.key "
                    "-out build/tls/server.crt"), folder)
    command = shown("docs/security.md",
                    "python -m tools serve --admin-key-file build/admin.key --grpc-tls-cert build/tls/server.crt "
                    "--grpc-tls-key build/tls/server.key")
    require_free({f"{command} ({what})": port for what, port in zip(("HTTP", "gRPC", "metrics", "LLM API"),
                                                                     SHOWN_PORTS, strict=True)})
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / "serve-tls.log"
    argv, environ = shell(command)
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, cwd=folder, env=environ, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "tritonserver is ready" not in log_path.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"`{command}` did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        banner = log_path.read_text(errors="replace")
        assert "gRPC     localhost:8001   (TLS)" in banner and "admin    control endpoints need the key from " \
            "build/admin.key" in banner, banner
        yield LockedServer(folder, (folder / "build" / "admin.key").read_text().strip(),
                           folder / "build" / "tls" / "server.crt")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    log = log_path.read_text(errors="replace")
    assert code == 0 and "tritonserver stopped (exit code 0)" in log, log[-3000:]


def text_input(module, text: str):
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def test_grpc_over_tls_serves_a_client_that_trusts_the_certificate_and_refuses_plaintext(locked_server):
    server = locked_server
    port, cert = server.grpc_port, server.cert
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


def test_a_sweep_and_a_load_run_connect_over_tls(locked_server):
    """The doc's sweep and `make loadtest` over TLS, as written, from the folder holding the
    certificate; the load run made short and small through Locust's variables."""
    server = locked_server
    sweep = run_shown(shown("docs/security.md",
                            "python -m tools sweep --url localhost:8001 --grpc-tls-ca build/tls/server.crt "
                            "--model embed --rates 10 --duration 5"), server.folder, timeout_s=180)
    (step,) = [line for line in sweep.stdout.splitlines() if line.strip().startswith("10 rps:")]
    ok_per_s, errors = re.search(r"\| ([0-9.]+) ok/s \|.*\| errors (\d+) \|", step).groups()
    assert float(ok_per_s) > 0 and int(errors) == 0, sweep.stdout

    checkout = server.folder
    command = shown("docs/security.md", 'make loadtest LOADTEST_ARGS="--triton-grpc-tls-ca build/tls/server.crt"')
    argv, environ = shell(command, LOCUST_USERS="2", LOCUST_SPAWN_RATE="2",
                          LOCUST_RUN_TIME="8s", LOCUST_MIX="embed")
    locust = subprocess.run(argv, cwd=checkout, env=environ, capture_output=True, text=True, timeout=180)
    stats = (checkout / "build" / "loadtest" / "locust_stats.csv").read_text()
    grpc_row = next(line for line in stats.splitlines() if line.startswith("gRPC,embed,"))
    requests, failures = (int(value) for value in grpc_row.split(",")[2:4])
    assert requests > 0 and failures == 0, locust.stdout[-3000:] + locust.stderr[-3000:]
    assert (checkout / "build" / "loadtest" / "verdict.json").is_file(), locust.stdout[-3000:] + locust.stderr[-3000:]


def test_the_llm_api_beside_the_server_calls_it_over_tls(locked_server):
    """`serve` starts the OpenAI-compatible API beside a server whose gRPC is TLS only: the API
    trusts the server's certificate."""
    assert "  OpenAI   http://localhost:9000/v1   (llm; " in (LOG_DIR / "serve-tls.log").read_text()
    wait_until_up("http://localhost:9000/health")  # it starts once the server is ready
    reply = requests.post("http://localhost:9000/v1/completions", timeout=120,
                          json={"model": "llm", "prompt": "The capital of France is", "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length", reply.text


def test_control_endpoints_refuse_without_the_key_and_the_model_keeps_serving(locked_server):
    server = locked_server
    client = httpclient.InferenceServerClient(server.http_url)
    for headers in ({}, {"triton-admin-key": secrets.token_urlsafe(32)}):
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("encoder_16", headers=headers)
    grpc = grpcclient.InferenceServerClient(f"localhost:{server.grpc_port}", ssl=True,
                                            root_certificates=str(server.cert))
    with pytest.raises(InferenceServerException, match="restricted"):
        grpc.unload_model("encoder_16")
    assert client.is_model_ready("encoder_16")
    assert client.infer("embed", [text_input(httpclient, "still served")]).as_numpy("EMBEDDING").shape == (1, 384)
    # Reading is open: statistics (the observability tools) need no key.
    assert client.get_inference_statistics("encoder_16")["model_stats"]
    index = grpc.get_model_repository_index(headers=grpc_admin_metadata(server.admin_key))
    assert {m.name for m in index.models} >= {"embed", *ENCODERS}
    grpc.close()
    client.close()


def test_a_tampered_onnx_file_fails_to_load_naming_the_file_while_other_models_serve(locked_server):
    """The files of `encoder_32` version 1 with one byte of model.onnx flipped, loaded through the
    repository API (Triton writes them to a folder of its own and loads the model from there,
    so the checkout's model files stay untouched): the load fails, naming the model and the file."""
    server = locked_server
    client = httpclient.InferenceServerClient(server.http_url)
    admin = admin_headers(server.admin_key)
    version = DEFAULT_MODEL_REPOSITORY / "encoder_32" / "1"
    files = {f"file:1/{path.name}": path.read_bytes() for path in version.iterdir() if path.is_file()}
    data = bytearray(files["file:1/model.onnx"])
    data[len(data) // 2] ^= 0xFF  # one flipped byte deep in the weights
    files["file:1/model.onnx"] = bytes(data)
    config = client.get_model_config("encoder_32")
    config["version_policy"] = {"specific": {"versions": [1]}}

    client.unload_model("encoder_32", headers=admin, unload_dependents=False)
    with pytest.raises(InferenceServerException) as error:
        client.load_model("encoder_32", headers=admin, config=json.dumps(config), files=files)
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
