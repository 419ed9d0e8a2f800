"""The LLM benchmark's request plan and its figures, on hand-built client records."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tools.bench.llm import (
    DEFAULT_CHAT_WORKLOAD,
    plan_requests,
    ratios,
    setup_model,
    summarise,
    tokens_per_s_timeline,
)
from tools.clients.llm import STREAM_CLOSED, Generation
from tools.repository.configs import plan_llm_model
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec
from tools.spec.workload import load_chat_workload


def test_plan_is_open_loop_poisson_reproducible_and_spreads_lengths():
    workload = load_chat_workload(DEFAULT_CHAT_WORKLOAD)
    planned = plan_requests(workload, rate_rps=2.0, duration_s=300, seed=3)
    assert planned == plan_requests(workload, rate_rps=2.0, duration_s=300, seed=3)
    assert 480 < len(planned) < 720  # ~600 arrivals
    assert all(0 <= a.at_s < b.at_s < 300 for a, b in itertools.pairwise(planned))
    kinds = {k.name: k for k in workload.kinds}
    for request in planned:
        low, high = kinds[request.kind].max_tokens
        assert low <= request.max_tokens <= high
    budgets = sorted(r.max_tokens for r in planned)
    assert budgets[-1] >= 10 * budgets[0]  # output budgets spread over more than a decade
    shares = {name: sum(r.kind == name for r in planned) / len(planned) for name in kinds}
    assert shares["question"] == pytest.approx(kinds["question"].share, abs=0.07)
    long_prompts = [r for r in planned if r.kind == "long_context"]
    assert long_prompts and all(len(r.messages[0]["content"].split()) > 60 for r in long_prompts)


@pytest.mark.parametrize(("text", "message"), [
    ("[[kinds]]\nshare = 0\nprompts = ['x']\nmax_tokens = [1, 2]", "share must be a number > 0"),
    ("[[kinds]]\nshare = 1\nprompts = []\nmax_tokens = [1, 2]", "prompts must be a non-empty list"),
    ("[[kinds]]\nshare = 1\nprompts = ['x']\nmax_tokens = [5, 2]", r"max_tokens must be \[low, high\]"),
    ("name = 'x'", r"needs at least one \[\[kinds\]\]"),
    ("kinds = [", "chat workload"),
])
def test_bad_workload_files_are_named(tmp_path: Path, text, message):
    path = tmp_path / "w.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_chat_workload(path)


def record(sent: float, arrivals: list[float], counts: list[int], finish: str | None = "length") -> Generation:
    generation = Generation(request_id=str(sent), sent_s=sent, arrivals_s=arrivals, token_counts=counts,
                            completion_tokens=counts[-1] if counts else 0, finish_reason=finish)
    if finish is not None:
        generation.done.set()
    return generation


def test_summary_counts_tokens_received_inside_the_window_and_client_side_latencies():
    generations = [
        record(0.0, [0.5, 1.0, 1.5], [1, 2, 3]),  # all three tokens inside the 10 s window
        record(1.0, [2.0, 9.0, 12.0], [1, 5, 9]),  # 5 tokens by t=10, 9 by the end
        record(2.0, [], [], finish=None),  # still running at the drain deadline: unfinished, no TTFT
        record(3.0, [], [], finish=None),  # refused by the server: failed
    ]
    generations[2].error = STREAM_CLOSED
    generations[3].error = "invalid request: the prompt is empty"
    summary = summarise(generations, start_s=0.0, window_s=10.0)
    assert summary["tokens_per_s"] == pytest.approx((3 + 5) / 10)
    assert summary["completion_tokens"] == 12 and summary["tokens_per_s_to_drain"] == pytest.approx(12 / 12.0)
    assert (summary["requests"], summary["completed"], summary["failed"], summary["unfinished"]) == (4, 2, 1, 1)
    assert summary["ttft_p50_s"] == pytest.approx(0.75)  # interpolated between 0.5 and 1.0
    assert summary["ttft_p95_s"] == pytest.approx(1.0, abs=0.03)
    assert summary["tpot_p95_s"] == pytest.approx(10.0 / 8, abs=0.1)  # (12 - 2) s over 8 tokens after the first
    assert summary["drain_s"] == pytest.approx(2.0)
    assert summary["timeline_tokens_per_s"] == [pytest.approx(8 / 10), pytest.approx(4 / 10)]  # 0-10 s, 10-20 s


def test_steady_state_leaves_the_warm_up_out_of_tokens_and_latencies():
    generations = [
        record(0.0, [1.0, 5.0, 20.0, 31.0], [1, 2, 3, 4]),  # sent in the warm-up: only its tokens after 10 s count
        record(12.0, [12.5, 14.0, 30.0, 50.0], [1, 2, 3, 4]),  # sent in the steady state: its tokens to 30 s
        record(25.0, [29.0], [1]),
    ]
    summary = summarise(generations, start_s=0.0, window_s=30.0, warmup_s=10.0)
    assert summary["tokens_per_s"] == pytest.approx((1 + 3 + 1) / 20)
    assert summary["ttft_p50_s"] == pytest.approx((0.5 + 4.0) / 2)  # the warm-up request's 1 s TTFT is left out
    assert summary["latency_p95_s"] == pytest.approx(4 + 0.95 * 34, abs=0.01)  # the steady requests: 38 and 4 s
    assert summary["completion_tokens"] == 9  # every request still counts in the totals
    with pytest.raises(ValueError, match="warm-up"):
        summarise(generations, start_s=0.0, window_s=30.0, warmup_s=30.0)


def test_timeline_bins_tokens_received():
    generations = [record(0.0, [0.5, 1.5, 2.5, 3.5], [1, 2, 3, 4]), record(1.0, [1.2, 3.9], [2, 6])]
    assert tokens_per_s_timeline(generations, 0.0, 4.0, bin_s=2.0) == [pytest.approx(4 / 2), pytest.approx(6 / 2)]
    # The last bin is whole, past the end if need be.
    assert tokens_per_s_timeline(generations, 0.0, 3.0, bin_s=2.0) == [pytest.approx(2.0), pytest.approx(3.0)]


def test_ratios_compare_continuous_with_each_baseline_that_ran():
    report = {"static": {"tokens_per_s": 80.0, "ttft_p95_s": 40.0},
              "static_retiring": {"tokens_per_s": 200.0, "ttft_p95_s": 20.0},
              "continuous": {"tokens_per_s": 240.0, "ttft_p95_s": 0.5}}
    assert ratios(report) == {"tokens_per_s_continuous_vs_static": 3.0, "ttft_p95_continuous_vs_static": 0.013,
                              "tokens_per_s_continuous_vs_static_retiring": 1.2,
                              "ttft_p95_continuous_vs_static_retiring": 0.025}
    del report["static_retiring"]
    report["static"] = {"tokens_per_s": 0.0, "ttft_p95_s": None}  # a baseline that delivered nothing
    assert ratios(report) == {"tokens_per_s_continuous_vs_static": None, "ttft_p95_continuous_vs_static": None}


@pytest.mark.parametrize("setup", ["static", "static_retiring", "continuous"])
def test_each_setup_serves_the_spec_engine_without_tenant_quotas(setup):
    spec = load_spec()
    profile = load_profile(spec.profile)
    llm = spec.llm_models[0]
    (served, *_) = plan_llm_model(llm, spec, profile)
    assert "tenants" in served.config.parameters  # what `serve` runs has the quotas
    model = setup_model(llm, setup, spec, profile)
    params = model.config.parameters
    assert model.name == llm.name
    assert params["batching"].string_value == setup
    assert params["kv_cache_mb"].string_value == f"{llm.kv_cache_mb:g}"
    assert params["max_num_seqs"].string_value == str(llm.max_num_seqs)
    assert "tenants" not in params  # one anonymous tenant sends everything: its quota would cap the figures
    assert "tenant_auth" in params
    assert "quotas are taken out" in model.config_text()
