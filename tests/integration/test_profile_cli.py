"""`python -m tools profile` and `gen-config` as docs/operations.md shows them: a private
server, every bucket's c(b), the router overhead, a profile file that gen-config takes; and
gen-config, run on the checkout, rewrites nothing that already matches."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.doc_examples import REPO, shell, shown


def test_profile_measures_every_bucket_and_the_router_and_gen_config_reads_it(tmp_path):
    # In a scratch folder: the profile and the private server's log go to its build/, not the
    # checkout's. 40 timed router requests: with a handful, one stalled request is the p95 (and
    # gen-config then rightly refuses a router that alone overshoots the SLO).
    command = shown("docs/operations.md",
                    "python -m tools profile --out build/cpu.json --time-per-point 0.1 --overhead-requests 40")
    argv, env = shell(command)
    run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "profiling: 100%" in run.stderr  # the progress bar ran to the end
    out = tmp_path / "build" / "cpu.json"
    assert "wrote build/cpu.json" in run.stdout, run.stdout[-2000:]
    profile = json.loads(out.read_text())
    assert profile["hardware"]["kind"] == "cpu" and profile["hardware"]["cpu_count"] >= 1
    assert set(profile["models"]) == {f"encoder_{n}" for n in (16, 32, 64, 128, 256)}
    for name, model in profile["models"].items():
        curve = {int(b): ms for b, ms in model["compute_ms"].items()}
        assert curve[1] > 0, name  # measured, not a zero from the wrong version's statistics
        # A bigger batch costs more. The profile stops at the first batch costing over half the
        # spec's 200 ms SLO, which on a busy 2-core host can be the 256-token bucket's first
        # (measured once: 100.9 ms).
        assert (len(curve) == 1 and curve[1] > 100) or curve[max(curve)] > curve[1], (name, curve)
    assert len(profile["models"]["encoder_16"]["compute_ms"]) > 1
    assert profile["models"]["encoder_256"]["compute_ms"]["1"] > profile["models"]["encoder_16"]["compute_ms"]["1"]
    assert profile["overhead_ms"]["embed"]["p95"] > 0

    argv, env = shell(shown("docs/operations.md", "python -m tools gen-config --profile build/cpu.json --explain"))
    explained = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert explained.returncode == 0, explained.stderr
    assert "max_batch_size" in explained.stdout and "preferred_batch_size" in explained.stdout
    assert "profile cpu" in explained.stdout


def test_gen_config_writes_only_what_changed(tmp_path):
    """`gen-config` as shown writes into the checkout's model_repository/: run it only when
    `--check` finds every file as it would write it, and then it must touch none (the server
    may be watching them)."""
    argv, env = shell("python -m tools gen-config --check")
    check = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if check.returncode != 0:
        pytest.fail("the checkout's configs drift from the spec and profile; `gen-config` would rewrite them:\n"
                    + check.stderr)
    configs = sorted((REPO / "model_repository").rglob("config.pbtxt"))
    before = {path: path.stat().st_mtime_ns for path in configs}
    argv, env = shell(shown("docs/operations.md", "python -m tools gen-config"))
    written = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    assert written.stdout.startswith("0 file(s) written, "), written.stdout
    assert {path: path.stat().st_mtime_ns for path in configs} == before
