"""`bench derivation`'s short form end to end on real tritonservers: a profile, a search and a
tune of `embed` within one-minute budgets, then the three winners side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL_KEYS = {"derived_goodput_rps", "tuned_goodput_rps", "search_best_goodput_rps", "derived_measure_s",
              "tuned_measure_s", "search_measure_s", "search_points", "derived_vs_search_best",
              "derived_measure_share", "targets", "goodput_rps_by_round", "search_report", "tune_report"}


@pytest.mark.slow  # a profile, a search, a tune and three final points: about five minutes of load runs
def test_quick_derivation_records_every_figure(tmp_path):
    out = tmp_path / "derivation.json"
    run = subprocess.run([sys.executable, "-m", "tools", "bench", "derivation", "--quick", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    entry = report["models"]["embed"]
    assert set(entry) >= MODEL_KEYS
    assert entry["hardware"] == report["hardware"] and entry["measured_at"] == report["measured_at"]  # its own run
    assert entry["derived_measure_s"] > 0 and entry["search_measure_s"] > 0 and entry["search_points"] >= 1
    assert all(value > 0 for value in (entry["derived_goodput_rps"], entry["tuned_goodput_rps"],
                                       entry["search_best_goodput_rps"]))
    search = json.loads(Path(entry["search_report"]).read_text())
    assert len(search["points"]) == entry["search_points"] and search["best"] is not None
    assert out.with_suffix(".png").is_file() and Path(entry["tune_report"]).is_file()
