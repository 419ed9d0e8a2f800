"""The goodput benchmark's short form, end to end against real tritonservers."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_quick_goodput_benchmark_writes_json_and_plot(tmp_path):
    out = tmp_path / "goodput.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "goodput", "--quick", "--setups", "slo_bucketed",
         "--start-rps", "8", "--repeats", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["model"] == "embed" and report["slo_ms"] == 200
    assert report["load_generator"] == {"protocol": "http", "on_the_measured_machine": True}
    assert report["hardware"]["cpu_count"] >= 1 and report["hardware"]["description"]
    setup = report["setups"]["slo_bucketed"]
    assert setup["goodput_rps"] >= 8  # 8 req/s is far below this machine's capacity
    # Two rounds, each a search and a ceiling; the figures are their medians.
    assert report["rounds"] == 2 and len(setup["goodput_rps_by_round"]) == 2
    assert setup["goodput_rps"] == statistics.median(setup["goodput_rps_by_round"])
    assert {step["round"] for step in setup["steps"]} == {1, 2}
    assert len(report["ceiling_rps_by_round"]) == 2
    assert report["ceiling_rps"] == pytest.approx(statistics.median(report["ceiling_rps_by_round"]), abs=0.1)
    ratios = report["ratios"]["slo_bucketed_vs_ceiling_by_round"]
    assert ratios == [pytest.approx(g / c, abs=0.01) for g, c in
                      zip(setup["goodput_rps_by_round"], report["ceiling_rps_by_round"], strict=True)]
    assert report["ratios"]["slo_bucketed_vs_ceiling"] == pytest.approx(statistics.median(ratios), abs=0.002)
    for step in setup["steps"]:
        assert {"offered_rps", "p50_ms", "p95_ms", "p99_ms", "num_errors", "goodput_fraction"} <= set(step)
    assert report["ceiling_rps"] > setup["goodput_rps"]
    assert set(report["ceiling"]["buckets"]) == {"16", "32", "64", "128", "256"}
    for bucket in report["ceiling"]["buckets"].values():  # the better of the two ways to use every core
        ways = bucket["seconds_by_way"]
        assert set(ways) == {"one_session_all_cores", "one_thread_per_core"}
        assert bucket["seconds"] == min(ways.values()) and ways[bucket["way"]] == bucket["seconds"]
    assert out.with_suffix(".png").stat().st_size > 1000


def test_unknown_setup_is_refused():
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "goodput", "--setups", "fastest"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown setups ['fastest']" in result.stderr


def test_zero_rounds_are_refused():
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "goodput", "--repeats", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--repeats must be >= 1, got 0" in result.stderr


def test_a_model_the_spec_does_not_have_is_refused_with_the_specs_models():
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "goodput", "--model", "rerank"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no model 'rerank'; the spec's text models: embed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
