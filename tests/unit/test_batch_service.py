"""The batch command's processes (`tools.batch.service`): the port check, the worker command line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tools.batch.service import ServiceError, WorkerOptions, check_port_free, worker_argv
from tools.cli import batch as batch_cli
from tools.cli import build_parser


def test_a_port_in_use_is_one_line_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServiceError, match=rf"^cannot listen on 127.0.0.1:{port}: .*; choose another --port$"):
            check_port_free("127.0.0.1", port)
        args = build_parser().parse_args(["batch", "api", "--port", str(port), "--db", str(tmp_path / "queue.db")])
        with pytest.raises(SystemExit, match=rf"^cannot listen on 127.0.0.1:{port}"):
            batch_cli.run(args)
    check_port_free("127.0.0.1", port)  # free again: no error


@pytest.mark.parametrize("tls_ca", [None, Path("certs/ca.pem")])
def test_a_worker_started_by_serve_gets_the_options_serve_was_given(tls_ca):
    options = WorkerOptions(grpc_url="triton:9001", grpc_tls_ca=tls_ca, max_batch_items=16, max_wait_ms=20.0,
                            max_in_flight=3, lease_s=7.5, max_attempts=9)
    argv = worker_argv("postgresql://q@db/queue", "host-1-w0", options)
    assert argv[1:5] == ["-m", "tools", "batch", "worker"]
    args = build_parser().parse_args(argv[3:])
    assert (args.db, args.id) == ("postgresql://q@db/queue", "host-1-w0")
    assert batch_cli._worker_options(args) == options
