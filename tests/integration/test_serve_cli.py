"""`make serve` as the README shows it: ready banner, a working request, the control endpoints
behind the admin key, a clean stop on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.doc_examples import REPO, setup_problem, shell, shown
from tests.integration.helpers import wait_until_up
from tools.server.admin_key import ADMIN_HEADER, admin_headers, grpc_admin_metadata, read_key_file
from tools.server.triton_server import busy_ports, free_port


def text_tensor(text: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def test_make_serve_prints_endpoints_serves_and_stops_cleanly_on_ctrl_c(tmp_path):
    """Also runs explicit model control behind the admin key: unloading without the key is
    denied and the model keeps serving; with it, a bucket model unloaded at run time fails only
    the rows that need it, with a retryable status naming the bucket."""
    command = shown("README.md", "make serve")
    assert shown("docs/batch.md", "make serve") == shown("docs/loadtests.md", "make serve") == command
    assert shown("docs/operations.md", "make serve") == command
    # What make serve runs after the set-up (the make variables only add options to it).
    serve = shown("docs/security.md", "python -m tools serve --admin-key-file build/admin.key")
    if (problem := setup_problem()) is not None:
        pytest.fail(problem)
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port(), "llm_api": free_port()}
    serve_args = (f"--http-port={ports['http']} --grpc-port={ports['grpc']} --metrics-port={ports['metrics']} "
                  f"--llm-api-port={ports['llm_api']} --host=127.0.0.1 --log-file={tmp_path / 'server.log'}")
    argv, env = shell(command, SERVE_ARGS=serve_args)
    # Its own process group, as a terminal gives a foreground job: Ctrl-C signals all of it.
    process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    output = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            output.append(line)
            if "Ctrl-C stops the server" in line:
                break
        banner = "".join(output)
        assert f"{serve} {serve_args}\n" in banner, banner  # make echoes what it runs
        # `admin-key new --keep` made the checkout's key once, or kept the one there.
        key = read_key_file(REPO / "build" / "admin.key")
        assert "tritonserver is ready" in banner, banner
        assert f"http://localhost:{ports['http']}" in banner
        assert f"localhost:{ports['grpc']}" in banner
        assert f"http://localhost:{ports['metrics']}/metrics" in banner
        assert f"curl -s -X POST localhost:{ports['http']}/v2/models/embed/infer" in banner
        assert "control endpoints need the key from build/admin.key" in banner and key not in banner
        assert f"OpenAI   http://localhost:{ports['llm_api']}/v1   (llm; the API key is a tenant token)" in banner
        wait_until_up(f"http://localhost:{ports['llm_api']}/health")  # it starts once the server is ready
        models = requests.get(f"http://localhost:{ports['llm_api']}/v1/models", timeout=5)
        assert [m["id"] for m in models.json()["data"]] == ["llm"]

        client = httpclient.InferenceServerClient(f"localhost:{ports['http']}")
        short = text_tensor("served by the CLI")
        assert client.infer("embed", [short]).as_numpy("EMBEDDING").shape == (1, 384)

        # Without the key the control endpoints refuse, over HTTP and gRPC, and nothing changes.
        for forged in ({}, {ADMIN_HEADER: "x" * 43}):
            with pytest.raises(InferenceServerException, match="restricted"):
                client.unload_model("encoder_64", headers=forged)
        grpc = grpcclient.InferenceServerClient(f"localhost:{ports['grpc']}")
        with pytest.raises(InferenceServerException, match="restricted"):
            grpc.unload_model("encoder_64")
        with pytest.raises(InferenceServerException, match="restricted"):
            grpc.unload_model("encoder_64", headers={ADMIN_HEADER: key})  # gRPC wants the prefixed name
        assert client.is_model_ready("encoder_64")
        assert client.infer("embed", [text_tensor(" ".join(["token"] * 40))]).as_numpy("TOKENS")[0, 0] == 42

        # Explicit model control is the default: every model loaded; with the key, take one
        # bucket away at run time.
        admin = admin_headers(key)
        assert grpc.get_model_repository_index(headers=grpc_admin_metadata(key)).models
        grpc.close()
        assert {m["name"] for m in client.get_model_repository_index(headers=admin)
                if m.get("state") == "READY"} >= {"embed", "encoder_16", "encoder_64"}
        client.unload_model("encoder_64", headers=admin)
        with pytest.raises(InferenceServerException) as info:
            client.infer("embed", [text_tensor(" ".join(["token"] * 40))])
        assert info.value.status() == "503", info.value.message()
        assert "bucket model encoder_64" in info.value.message()
        assert client.infer("embed", [short]).as_numpy("EMBEDDING").shape == (1, 384)
        client.load_model("encoder_64", headers=admin)
        assert client.infer("embed", [text_tensor(" ".join(["token"] * 40))]).as_numpy("TOKENS")[0, 0] == 42
        client.close()

        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does to the foreground job
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    # make waits for `serve` to finish and then ends as interrupted, as after any Ctrl-C;
    # `serve` itself drained the server and returned normally.
    assert process.returncode == -signal.SIGINT, rest
    assert "tritonserver stopped (exit code 0)" in rest, rest
    assert "Traceback" not in rest and "error:" not in rest, rest
    # The server and its Python backend stubs are gone: the ports are free again.
    time.sleep(0.5)
    assert busy_ports({"HTTP": ports["http"], "gRPC": ports["grpc"], "LLM API": ports["llm_api"]}, "127.0.0.1") == {}
