"""Suite-wide options: tests marked `slow` (full-length load runs) run only when asked for."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=bool(os.environ.get("RUN_SLOW")),
                     help="also run the tests marked slow (full-length load runs); RUN_SLOW=1 does the same")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow load run: pass --run-slow (or set RUN_SLOW=1) to run it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
