"""One real tritonserver for the whole integration session, on free ports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.clients.tenant_token import ensure_key
from tools.server.triton_server import ServerConfig, TritonServer, free_port
from tools.spec.serving import load_spec

REPO = Path(__file__).resolve().parents[2]
LOG_DIR = REPO / "build" / "test-logs"
# A test's server stops once the test has its answers, so nothing is in flight to wait for; the
# default 30 s went by in full after a rollout had unloaded versions (34 s to stop the user
# models' server). tests/integration/test_server_shutdown.py checks the stop itself.
EXIT_TIMEOUT_S = 5


@pytest.fixture(scope="session")
def triton() -> TritonServer:
    # Idempotent: a no-op when `make test` has already built the model files.
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)
    # The tests sign their tenants' tokens with the spec's keys (helpers.tenant_token); the key
    # is there before the server starts, so its first read already has it.
    auth = load_spec(REPO / "serving.toml").tenant_auth
    if auth is not None:
        ensure_key(auth.keys_file)
    config = ServerConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          host="127.0.0.1", exit_timeout_s=EXIT_TIMEOUT_S)
    server = TritonServer(config, log_path=LOG_DIR / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def http_client(triton):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url, network_timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(triton):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
