"""Every request the docs show against a server, run as written against the session's
tritonserver (ports substituted), with its output checked; the convention is in
tests/doc_examples.py. Examples of the batch API run against `python -m tools batch serve`, as
docs/batch.md shows it, in front of that server."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.doc_examples import (
    DEFAULT_PORTS,
    blocks,
    console_commands,
    require_free,
    run_console,
    run_pycon,
    shell,
    shown,
)

SERVER_BLOCKS = [b for b in blocks() if b.runs_on == "server"]
BATCH_BLOCKS = [b for b in blocks() if b.runs_on == "batch"]


@pytest.fixture(scope="module")
def ports(triton):
    config = triton.config
    return {"http": config.http_port, "grpc": config.grpc_port, "metrics": config.metrics_port}


@pytest.fixture(scope="module")
def batch_ports(ports, tmp_path_factory):
    """`python -m tools batch serve` as docs/batch.md shows it, in front of the session's
    tritonserver (its gRPC port substituted), on the API port it shows, in a scratch folder
    (its queue, build/batch/queue.db, is a fresh one there); stopped with SIGTERM, cleanly."""
    command = shown("docs/batch.md", "python -m tools batch serve --grpc-url localhost:8001")
    port = DEFAULT_PORTS["batch"]
    require_free({command: port})
    folder = tmp_path_factory.mktemp("docs-batch")
    argv, env = shell(command, ports)
    with (folder / "batch.log").open("w") as log:
        process = subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # the API answers and both workers have started
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    if (folder / "batch.log").read_text().count(": queue ") >= 2:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise AssertionError("the batch API did not come up: "
                                     + (folder / "batch.log").read_text()[-2000:])
            time.sleep(0.2)
        assert (folder / "build" / "batch" / "queue.db").is_file()
        yield {**ports, "batch": port}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    # Workers first, then the API; uvicorn then ends the process with the signal it was sent.
    log = (folder / "batch.log").read_text()
    assert code in (0, -signal.SIGTERM) and log.count("stopped: WorkerStats") == 2, (code, log[-2000:])


@pytest.mark.parametrize("block", SERVER_BLOCKS, ids=lambda b: b.where)
def test_shown_requests_answer_as_shown(block, ports):
    if block.language == "pycon":
        run_pycon(block, ports)
        return
    for command, stdout in zip(console_commands(block), run_console(block, ports), strict=True):
        if "generate_stream" in command.command and '"stream": true' in command.command:
            # The stream examples promise one event per text delta, not one event at the end.
            events = [line for line in stdout.splitlines() if line.startswith("data: ")]
            assert len(events) > 1, f"{block.where}: a streamed generation came back in {len(events)} event(s)"


@pytest.mark.parametrize("block", BATCH_BLOCKS, ids=lambda b: b.where)
def test_shown_batch_requests_answer_as_shown(block, batch_ports):
    run_console(block, batch_ports, timeout_s=180)


def test_the_docs_show_requests_of_every_kind():
    shown = " ".join(c.command for b in SERVER_BLOCKS if b.language == "console" for c in console_commands(b))
    assert "/v2/models/embed/infer" in shown and '"stream": true' in shown
    assert any(b.language == "pycon" for b in SERVER_BLOCKS), "no Python client example against the server"
    assert BATCH_BLOCKS, "no batch API example"
