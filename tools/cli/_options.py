"""Options more than one command takes, written once (not a command itself)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
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


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative(text: str) -> float:
    """An argparse type: a number >= 0."""
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def command_line() -> str:
    """How this run was started, `python -m tools ...`, after `KIT_HOME=...` when the run
    served another home than the checkout."""
    home = f"KIT_HOME={os.environ['KIT_HOME']} " if os.environ.get("KIT_HOME") else ""
    return f"{home}python -m tools {shlex.join(sys.argv[1:])}"


def add_point_measuring(parser: argparse.ArgumentParser) -> None:
    """What `search` and `tune` share: the model, the files, and how long each point measures."""
    parser.add_argument("model", metavar="MODEL", help="the spec's model ([models.MODEL]: a text encoder, a text "
                        "classifier, a tensor model or an external model)")
    parser.add_argument("--budget-min", type=positive_float, default=30.0,
                        help="minutes the run may take, the server's start included; no point starts that the "
                             "points so far say would not end inside it (default: %(default)s)")
    parser.add_argument("--spec", type=Path, default=None, help="serving spec (default: serving.toml of the home)")
    parser.add_argument("--profile", type=Path, default=None, help="latency profile (default: the spec's)")
    parser.add_argument("--step-seconds", type=positive_float, default=5.0,
                        help="open-loop load per measured rate (default: %(default)s)")
    parser.add_argument("--max-steps", type=positive_int, default=6,
                        help="measured rates per point at most; each search starts near the goodput expected of "
                             "its point (default: %(default)s)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http",
                        help="how the load generator sends, as in `bench goodput` (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="the short form for the test suite: 1 s steps, 2 rates per point, 300 rows")
