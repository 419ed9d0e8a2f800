"""`python -m tools profile` end to end, short form: a private server, every bucket's c(b), the
router overhead, a profile file that gen-config takes."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import REPO


def test_profile_measures_every_bucket_and_the_router_and_gen_config_reads_it(tmp_path):
    out = tmp_path / "cpu.json"
    # 40 timed router requests: with a handful, one stalled request is the p95 (and gen-config
    # then rightly refuses a router that alone overshoots the SLO).
    run = subprocess.run([sys.executable, "-m", "tools", "profile", "--out", str(out), "--time-per-point", "0.1",
                          "--overhead-requests", "40"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "profiling: 100%" in run.stderr  # the progress bar ran to the end
    profile = json.loads(out.read_text())
    assert profile["hardware"]["kind"] == "cpu" and profile["hardware"]["cpu_count"] >= 1
    assert set(profile["models"]) == {f"encoder_{n}" for n in (16, 32, 64, 128, 256)}
    for name, model in profile["models"].items():
        curve = {int(b): ms for b, ms in model["compute_ms"].items()}
        assert curve[1] > 0, name  # measured, not a zero from the wrong version's statistics
        assert curve[max(curve)] > curve[1], name  # a bigger batch costs more
    assert profile["models"]["encoder_256"]["compute_ms"]["1"] > profile["models"]["encoder_16"]["compute_ms"]["1"]
    assert profile["overhead_ms"]["embed"]["p95"] > 0

    explained = subprocess.run([sys.executable, "-m", "tools", "gen-config", "--profile", str(out), "--explain"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert explained.returncode == 0, explained.stderr
    assert "max_batch_size" in explained.stdout and "preferred_batch_size" in explained.stdout
