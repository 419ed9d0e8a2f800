"""Every request the docs show against a server, run as written against the session's
tritonserver (ports substituted), with its output checked: the convention is in
tests/doc_examples.py."""

from __future__ import annotations

import pytest

from tests.doc_examples import blocks, console_commands, run_command, run_pycon

BLOCKS = [b for b in blocks() if b.needs_server]
COMMANDS = [c for b in BLOCKS if b.language == "console" for c in console_commands(b)]
PYCON = [b for b in BLOCKS if b.language == "pycon"]


@pytest.fixture(scope="module")
def ports(triton):
    config = triton.config
    return {"http": config.http_port, "grpc": config.grpc_port, "metrics": config.metrics_port}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.block.where} {c.command[:40]}")
def test_shown_request_answers_as_shown(command, ports):
    stdout = run_command(command, ports)
    if "generate_stream" in command.command and '"stream": true' in command.command:
        # The stream example promises one event per text delta, not one event at the end.
        events = [line for line in stdout.splitlines() if line.startswith("data: ")]
        assert len(events) > 1, f"{command.block.where}: a streamed generation came back in {len(events)} event(s)"


@pytest.mark.parametrize("block", PYCON, ids=lambda b: b.where)
def test_shown_python_client_works_as_shown(block, ports):
    run_pycon(block, ports)


def test_the_docs_show_requests_of_every_kind():
    shown = " ".join(c.command for c in COMMANDS)
    assert "/v2/models/embed/infer" in shown and "generate_stream" in shown
    assert PYCON, "no Python client example against the server"
