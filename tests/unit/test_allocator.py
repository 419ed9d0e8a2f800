"""retain_freed_memory: a thread that allocates and frees tensors again and again faults no new pages."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from python_backends.common.allocator import RETAIN_SETTINGS, retain_freed_memory

REPO = Path(__file__).resolve().parents[2]
GLIBC = platform.libc_ver()[0] == "glibc"

# A step's pattern in miniature, on a thread that is not the main one (as the engine loop
# in a stub): five 19 MB tensors and two small ones, made, written and freed every round.
CHURN = """
import resource, sys, threading, torch
from python_backends.common.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    retain_freed_memory({})
def rounds(n):
    for _ in range(n):
        tensors = [torch.ones(size, dtype=torch.uint8) for size in (300_000,) + (19_000_000,) * 5 + (1_000_000,)]
        del tensors
def work():
    rounds(5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rounds(30)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 30)
thread = threading.Thread(target=work)
thread.start()
thread.join()
"""


def faults_per_round(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, check=True)
    return float(done.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_freed_tensors_are_reused_without_page_faults():
    # ~100 MB freed per round: without the settings glibc hands much of it back and
    # faults it in again next round (thousands of pages); with them, it is reused.
    assert faults_per_round("default") > 1000
    assert faults_per_round("retain") < 100


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_parameters_the_environment_sets_are_left_alone():
    names = [env_name for _, env_name, _ in RETAIN_SETTINGS]
    applied = retain_freed_memory({names[0]: "65536"})
    assert applied == [name.rstrip("_") for name in names[1:]]


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert retain_freed_memory({}) == []
