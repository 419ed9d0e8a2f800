"""The LLM benchmark's short form, end to end against real tritonservers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def short_answers_workload(folder: Path) -> Path:
    """The chat workload with output budgets cut to a few tokens (its essays ask for up to
    384): the policies are compared on the same arrivals all the same, and the drain is short."""
    workloads = REPO / "loadtest" / "workloads"
    text = (workloads / "llm_chat.toml").read_text()
    for budget in ("[12, 48]", "[96, 384]", "[16, 64]"):
        assert f"max_tokens = {budget}" in text, budget
    for budget, short in (("[12, 48]", "[4, 8]"), ("[96, 384]", "[16, 32]"), ("[16, 64]", "[4, 8]")):
        text = text.replace(f"max_tokens = {budget}", f"max_tokens = {short}")
    (folder / "llm_chat_short.toml").write_text(text)
    shutil.copy2(workloads / "corpus.txt", folder / "corpus.txt")
    return folder / "llm_chat_short.toml"


def test_short_llm_benchmark_compares_the_batching_policies_on_the_same_arrivals(tmp_path):
    out = tmp_path / "llm.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "llm", "--duration", "6", "--warmup", "1", "--rate", "1",
         "--seed", "1", "--drain-timeout", "240", "--workload", str(short_answers_workload(tmp_path)),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["rate_rps"] == 1 and report["requests"] >= 3
    assert report["hardware"]["description"]
    for setup in ("static", "static_retiring", "continuous"):
        figures = report[setup]
        assert figures["requests"] == report["requests"]
        assert figures["completed"] == report["requests"] and figures["failed"] == 0
        assert figures["tokens_per_s"] > 0 and figures["completion_tokens"] > 0
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"]
        assert figures["tpot_p95_s"] > 0
        # Tokens/s over time, in bins of timeline_bin_s, from the first request to the last answer.
        timeline = figures["timeline_tokens_per_s"]
        assert sum(timeline) * report["timeline_bin_s"] == pytest.approx(figures["completion_tokens"])
    assert set(report["ratios"]) == {f"{figure}_continuous_vs_{baseline}" for figure in ("tokens_per_s", "ttft_p95")
                                     for baseline in ("static", "static_retiring")}
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bad_benchmark_arguments_are_refused():
    for args in (["--setups", "dynamic"], ["--rate", "0"], ["--model", "gpt"], ["--duration", "30", "--warmup", "30"]):
        result = subprocess.run([sys.executable, "-m", "tools", "bench", "llm", *args],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, args
        assert "error:" in result.stderr
