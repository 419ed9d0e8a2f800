"""`python -m tools serve` as a user runs it: ready banner, a working request, clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tools.triton_server import free_port

REPO = Path(__file__).resolve().parents[2]


def test_serve_prints_endpoints_serves_and_stops_cleanly_on_sigint(tmp_path):
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    process = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", f"--http-port={ports['http']}", f"--grpc-port={ports['grpc']}",
         f"--metrics-port={ports['metrics']}", "--host=127.0.0.1", f"--log-file={tmp_path / 'server.log'}"],
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
        tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"served by the CLI"]], dtype=object))
        assert client.infer("embed", [tensor]).as_numpy("EMBEDDING").shape == (1, 384)
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
