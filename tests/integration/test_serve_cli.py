"""`python -m tools serve` as a user runs it: ready banner, a working request, clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tools.server.admin_key import ADMIN_HEADER, admin_headers, grpc_admin_metadata, read_key_file, write_new_key
from tools.server.triton_server import free_port

REPO = Path(__file__).resolve().parents[2]


def text_tensor(text: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def test_serve_prints_endpoints_serves_and_stops_cleanly_on_sigint(tmp_path):
    """Also runs explicit model control behind the admin key: unloading without the key is
    denied and the model keeps serving; with it, a bucket model unloaded at run time fails only
    the rows that need it, with a retryable status naming the bucket."""
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    key_file = tmp_path / "admin.key"
    write_new_key(key_file)
    key = read_key_file(key_file)
    process = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", f"--http-port={ports['http']}", f"--grpc-port={ports['grpc']}",
         f"--metrics-port={ports['metrics']}", "--host=127.0.0.1", f"--log-file={tmp_path / 'server.log'}",
         "--model-control-mode=explicit", f"--admin-key-file={key_file}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
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
        assert "tritonserver is ready" in banner, banner
        assert f"http://localhost:{ports['http']}" in banner
        assert f"localhost:{ports['grpc']}" in banner
        assert f"http://localhost:{ports['metrics']}/metrics" in banner
        assert f"curl -s -X POST localhost:{ports['http']}/v2/models/embed/infer" in banner
        assert f"control endpoints need the key from {key_file}" in banner and key not in banner

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

        # Explicit mode loaded every model; with the key, take one bucket away at run time.
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

        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, rest
    assert "tritonserver stopped (exit code 0)" in rest
    # The server and its Python backend stubs are gone: the ports are free again.
    time.sleep(0.5)
    from tools.server.triton_server import busy_ports

    assert busy_ports({"HTTP": ports["http"], "gRPC": ports["grpc"]}, "127.0.0.1") == {}
