"""A server that cannot shut down cleanly leaves nothing behind in /dev/shm."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tools.server.triton_server import (
    ModelControlMode,
    ServerConfig,
    TritonServer,
    free_port,
    process_group_shm_regions,
)

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def test_a_server_that_runs_out_of_its_exit_timeout_leaves_no_shared_memory_regions(tmp_path):
    """An HTTP connection left open holds a stopping tritonserver until its exit timeout, and
    then it exits without unloading its models, so the Python backend never unlinks its
    stubs' regions; `stop()` removes them."""
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)
    config = ServerConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1",
                          model_control_mode=ModelControlMode.EXPLICIT, load_models=("encoder_16",),
                          exit_timeout_s=2)
    server = TritonServer(config, log_path=tmp_path / "server.log")
    with server:
        regions = process_group_shm_regions(server.process.pid)
        assert regions and all((SHM / name).exists() for name in regions)  # a stub per version and instance
        held_open = socket.create_connection(("127.0.0.1", config.http_port))
    held_open.close()
    assert "Exit timeout expired" in (tmp_path / "server.log").read_text()  # it did not shut down cleanly
    assert not [name for name in regions if (SHM / name).exists()]
