"""The short form of `python -m tools bench batch`: direct calls and the API on both queue engines, side by side."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import REPO


def test_the_batch_benchmark_measures_the_api_beside_direct_calls(tmp_path):
    out = tmp_path / "batch.json"
    run = subprocess.run([sys.executable, "-m", "tools", "bench", "batch", "--quick", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["items"] == 300 and report["hardware"]["cpu_count"] >= 1
    assert report["direct"]["items_per_s"] > 0 and report["batch_api"]["items_per_s"] > 0
    expected = report["batch_api"]["items_per_s"] / report["direct"]["items_per_s"]
    assert abs(report["ratio"] - expected) < 0.01 and report["batch_api"]["ratio"] == report["ratio"]
    # The PostgreSQL queue (a real server the bench starts) is measured in the same run.
    postgres = report["batch_api_postgres"]
    assert postgres["items_per_s"] > 0 and len(postgres["runs"]) == 1
    assert abs(postgres["ratio"] - postgres["items_per_s"] / report["direct"]["items_per_s"]) < 0.01
    assert "% of direct" in run.stdout
