"""The LLM benchmark's short form, end to end against real tritonservers: the fixed-rate
comparison, each setup's goodput step and closed loop, the decode limit; and (slow: it makes
a virtualenv with pip the first time) the transformers_cb peer beside continuous, with a round
of the stream-hold comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.user_models import short_answers_workload

REPO = Path(__file__).resolve().parents[2]


def test_short_llm_benchmark_compares_the_batching_policies_on_the_same_arrivals(tmp_path):
    out = tmp_path / "llm.json"
    result = subprocess.run(
        # static_retiring is the same code path as static here (only the engine's policy differs,
        # tested in test_llm_engine): two servers instead of three keep the suite's time.
        [sys.executable, "-m", "tools", "bench", "llm", "--quick", "--seed", "1",
         "--setups", "static,continuous", "--workload", str(short_answers_workload(tmp_path)),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["rate_rps"] == 1 and report["duration_s"] == 6 and report["requests"] >= 3
    assert report["hardware"]["description"]
    assert (report["ttft_p95_ms"], report["tpot_p95_ms"]) == (1000, 400)  # the spec's targets
    assert "static_retiring" not in report
    for setup in ("static", "continuous"):
        figures = report[setup]
        assert figures["requests"] == report["requests"]
        assert figures["completed"] == report["requests"] and figures["failed"] == 0
        assert figures["tokens_per_s"] > 0 and figures["completion_tokens"] > 0
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"]
        assert figures["tpot_p95_s"] > 0
        # Tokens/s over time, in bins of timeline_bin_s, from the first request to the last answer.
        timeline = figures["timeline_tokens_per_s"]
        assert sum(timeline) * report["timeline_bin_s"] == pytest.approx(figures["completion_tokens"])
        # One goodput step at 1 req/s; its verdict is what its figures say.
        (step,) = figures["goodput_steps"]
        assert step["rate_rps"] == 1.0 and step["requests"] >= 1
        assert step["passed"] == (not step["misses"])
        assert figures["llm_goodput_rps"] == (1.0 if step["passed"] else 0.0)
        # The closed loop kept its streams busy and counted what they received.
        assert figures["saturated_tokens_per_s"] > 0
        assert figures["saturated"]["concurrency"] == report["capacity"]["concurrency"] == 4
        assert figures["saturated"]["requests"] >= 4 and figures["saturated"]["failed"] == 0
    limit = report["decode_limit"]
    assert report["decode_limit_tokens_per_s"] > 0
    assert limit["num_seqs"] == report["engine"]["max_num_seqs"] and limit["context_tokens"] > 1
    # Measured in two bursts around continuous's closed loop; the limit is their median step.
    assert [burst["when"] for burst in limit["bursts"]] == ["before continuous's closed loop",
                                                           "after continuous's closed loop"]
    assert limit["steps"] == sum(burst["steps"] for burst in limit["bursts"])
    assert min(b["step_ms_median"] for b in limit["bursts"]) <= limit["step_ms_median"] \
        <= max(b["step_ms_median"] for b in limit["bursts"])
    assert "transformers_cb" not in report
    # --quick runs no stream-hold rounds (the slow test below does).
    assert "stream_hold" not in report["continuous"] and "stream_hold" not in report["static"]
    assert set(report["ratios"]) == {
        *(f"{figure}_continuous_vs_static" for figure in ("tokens_per_s", "ttft_p95", "llm_goodput")),
        "saturated_continuous_vs_decode_limit"}
    assert report["targets"]["saturated_at_least_3x_transformers_cb"] is None  # the peer did not run
    assert out.with_suffix(".png").stat().st_size > 1000
    for part in ("goodput search from", "closed loop of 4 streams", "decode limit:"):
        assert part in result.stdout, part


@pytest.mark.slow
def test_transformers_continuous_batching_runs_beside_the_engine_on_the_same_requests(tmp_path):
    """The peer, and the stream-hold comparison (a copy of the model that sends every token)."""
    out = tmp_path / "llm.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "llm", "--quick", "--setups", "continuous,transformers_cb",
         "--saturate-seconds", "20", "--saturate-warmup", "5", "--hold-rounds", "1",
         "--workload", str(short_answers_workload(tmp_path)), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    # The stream-hold comparison: closed loops on the same server, every token sent vs held.
    hold = report["continuous"]["stream_hold"]
    assert hold["hold_ms"] == report["tpot_p95_ms"]  # the spec sets no stream_hold_ms: the TPOT target
    assert len(hold["held_tokens_per_s"]) == len(hold["every_token_tokens_per_s"]) == 1
    assert min(hold["held_tokens_per_s"] + hold["every_token_tokens_per_s"]) > 0
    assert report["ratios"]["saturated_held_vs_every_token"] > 0
    assert "every token sent vs held" in result.stdout
    peer = report["transformers_cb"]
    assert peer["transformers"] == "5.23.0" and peer["saturated_tokens_per_s"] > 0
    engine = report["engine"]
    assert (peer["cache"]["page_size"], peer["cache"]["max_requests_per_batch"], peer["cache"]["max_batch_tokens"]) == (
        engine["block_size"], engine["max_num_seqs"], engine["max_num_batched_tokens"])  # the engine's limits
    assert peer["same_answers_as_continuous"]["compared"] > 0  # the same chats, answer by answer
    assert peer["saturated"]["concurrency"] == report["continuous"]["saturated"]["concurrency"]
    assert peer["saturated"]["failed"] == 0 and peer["saturated"]["completed"] > 0
    assert report["ratios"]["saturated_continuous_vs_transformers_cb"] > 0
    assert report["targets"]["saturated_at_least_3x_transformers_cb"] is not None


def test_bad_benchmark_arguments_are_refused():
    for args in (["--setups", "dynamic"], ["--setups", "transformers_cb"], ["--rate", "0"], ["--model", "gpt"],
                 ["--duration", "30", "--warmup", "30"], ["--step-seconds", "5", "--step-warmup", "5"],
                 ["--search-start-rps", "0.1"], ["--concurrency", "0"], ["--hold-rounds", "-1"]):
        result = subprocess.run([sys.executable, "-m", "tools", "bench", "llm", *args],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, args
        assert "error:" in result.stderr
