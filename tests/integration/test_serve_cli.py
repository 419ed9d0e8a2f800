"""`python -m tools serve` as a user runs it: ready banner, a working request, clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tools.triton_server import free_port

REPO = Path(__file__).resolve().parents[2]


def text_tensor(text: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def test_serve_prints_endpoints_serves_and_stops_cleanly_on_sigint(tmp_path):
    """Also runs explicit model control: a bucket model unloaded at run time fails only the
    rows that need it, with a retryable status naming the bucket."""
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    process = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", f"--http-port={ports['http']}", f"--grpc-port={ports['grpc']}",
         f"--metrics-port={ports['metrics']}", "--host=127.0.0.1", f"--log-file={tmp_path / 'server.log'}",
         "--model-control-mode=explicit"],
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

        client = httpclient.InferenceServerClient(f"localhost:{ports['http']}")
        short = text_tensor("served by the CLI")
        assert client.infer("embed", [short]).as_numpy("EMBEDDING").shape == (1, 384)

        # Explicit mode loaded every model; take one bucket away at run time.
        assert {m["name"] for m in client.get_model_repository_index() if m.get("state") == "READY"} >= {
            "embed", "encoder_16", "encoder_64"}
        client.unload_model("encoder_64")
        with pytest.raises(InferenceServerException) as info:
            client.infer("embed", [text_tensor(" ".join(["token"] * 40))])
        assert info.value.status() == "503", info.value.message()
        assert "bucket model encoder_64" in info.value.message()
        assert client.infer("embed", [short]).as_numpy("EMBEDDING").shape == (1, 384)
        client.load_model("encoder_64")
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
    from tools.triton_server import busy_ports

    assert busy_ports({"HTTP": ports["http"], "gRPC": ports["grpc"]}, "127.0.0.1") == {}
