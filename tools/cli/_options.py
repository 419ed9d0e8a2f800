"""Options more than one command takes, written once (not a command itself)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tools.paths import REPO_ROOT


def add_server_or_recording(parser: argparse.ArgumentParser, replay_help: str) -> None:
    """Where a command that reads a running server, or a recording of one, reads: /metrics and
    the served configs, or a `top --record` file and the repository's configs; the spec's SLOs."""
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="the server's metrics endpoint")
    parser.add_argument("--http-url", default="localhost:8000",
                        help="the server's HTTP endpoint, for the served configs (host:port)")
    parser.add_argument("--replay", type=Path, default=None, help=replay_help)
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository",
                        help="model repository whose config.pbtxt files give the knobs in --replay mode")
    parser.add_argument("--spec", type=Path, default=None, help="serving spec, for the SLOs (default serving.toml)")
