"""The LLM benchmark's request plan and its figures, on hand-built client records: the
fixed-rate summaries, the goodput search's verdicts, the closed loop's tokens/s, the decode
limit's context, the ratios and targets, and the transformers_cb peer's job and records."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tools.bench import transformers_cb
from tools.bench.llm import (
    DEFAULT_CHAT_WORKLOAD,
    FULL,
    PEER,
    QUICK,
    CapacityOptions,
    LLMSlo,
    capacity_ratios,
    certain_miss,
    chat_list,
    drain_budget_s,
    hold_summary,
    p95_miss_count,
    plan_requests,
    ratios,
    same_answers,
    saturated_summary,
    saturating_concurrency,
    setup_model,
    slo_misses,
    step_duration_s,
    summarise,
    targets,
    tokens_per_s_timeline,
)
from tools.bench.loadgen import percentile
from tools.clients.llm import STREAM_CLOSED, Generation
from tools.planning.llm_limits import decode_block_tables, mean_decode_context
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


# --- capacity ------------------------------------------------------------------------------------

SLO = LLMSlo(ttft_p95_ms=1000, tpot_p95_ms=400)


def step_summary(**figures) -> dict:
    """A search step's `summarise` figures that meet SLO, with `figures` changed."""
    return {"requests": 100, "completed": 100, "failed": 0, "unfinished": 0, "ttft_p95_s": 0.5, "tpot_p95_s": 0.2,
            **figures}


def test_the_slo_is_the_specs_targets():
    llm = load_spec().llm_models[0]
    slo = LLMSlo.of(llm)
    assert (slo.ttft_p95_ms, slo.tpot_p95_ms) == (llm.ttft_p95_ms, llm.tpot_p95_ms) == (1000, 400)
    assert (slo.min_finished_share, slo.max_failed) == (0.95, 0)


@pytest.mark.parametrize(("figures", "miss"), [
    ({"completed": 94, "unfinished": 6}, "94 of 100 finished (< 95%)"),
    ({"completed": 99, "failed": 1}, "1 failed"),
    ({"ttft_p95_s": 1.2}, "TTFT p95 1200 ms > 1000 ms"),
    ({"tpot_p95_s": 0.45}, "TPOT p95 450 ms > 400 ms"),
    ({"ttft_p95_s": None}, "no TTFT measured"),
    ({"tpot_p95_s": None}, "no TPOT measured"),
    ({"requests": 0, "completed": 0}, "no request arrived in the step"),
])
def test_a_step_misses_on_each_criterion_and_says_which(figures, miss):
    assert slo_misses(step_summary(), SLO) == []
    assert miss in slo_misses(step_summary(**figures), SLO)


def test_a_step_passes_at_the_edges_of_every_criterion():
    edge = step_summary(completed=95, unfinished=5, ttft_p95_s=1.0, tpot_p95_s=0.4)
    assert slo_misses(edge, SLO) == []
    assert slo_misses(step_summary(requests=20, completed=19, unfinished=1), SLO) == []  # 95% of 20


@pytest.mark.parametrize(("num_judged", "count"), [(1, 1), (2, 2), (20, 2), (21, 2), (100, 6), (101, 6)])
def test_the_miss_count_is_where_the_p95_must_be_over_the_target(num_judged, count):
    assert p95_miss_count(num_judged) == count
    # Against the percentile the summaries use: `count` values over the target put the p95
    # over it, whatever the others are.
    assert percentile([0.0] * (num_judged - count) + [9.0] * count, 95) > 1.0


def test_a_step_stops_early_once_its_ttft_p95_or_a_failure_is_certain():
    judged_from = 10.0
    on_time = [record(10.0 + i, [10.5 + i], [1]) for i in range(17)]
    late = record(11.0, [13.0], [1])  # its first token 2 s after it was sent
    waiting = record(12.0, [], [], finish=None)  # no token yet
    early = record(1.0, [9.0], [1])  # late too, but sent in the warm-up: not judged
    assert certain_miss([*on_time, early], judged_from, 20, SLO, now_s=30.0) is None
    assert certain_miss([*on_time, late], judged_from, 20, SLO, now_s=30.0) is None  # 1 of 20: p95 may hold
    # A request still waiting 1 s after it was sent is past the target whatever comes.
    assert certain_miss([*on_time, late, waiting], judged_from, 20, SLO, now_s=12.5) is None
    reason = certain_miss([*on_time, late, waiting], judged_from, 20, SLO, now_s=13.5)
    assert reason == "stopped early: 2 of 20 judged requests past the TTFT target"
    failed = record(14.0, [], [], finish=None)
    failed.error = "internal: out of memory"
    assert certain_miss([*on_time, failed], judged_from, 20, SLO, now_s=15.0) == "1 failed (internal: out of memory)"
    cancelled = record(14.0, [], [], finish=None)
    cancelled.error = STREAM_CLOSED  # the benchmark's own cancel is not a failure
    assert certain_miss([*on_time, cancelled], judged_from, 20, SLO, now_s=14.5) is None
    assert certain_miss([early], judged_from, 0, SLO, now_s=30.0) is None  # nothing to judge


def test_a_step_drains_as_long_as_its_longest_answer_may_take_within_the_targets():
    assert drain_budget_s(SLO, 384) == pytest.approx(1.0 + 0.4 * 383)
    assert drain_budget_s(SLO, 1) == pytest.approx(1.0)


def test_a_low_rate_step_lasts_long_enough_for_its_requests():
    assert step_duration_s(4.0, FULL) == FULL.step_s
    assert step_duration_s(0.125, FULL) == pytest.approx(FULL.min_step_requests / 0.125)


@pytest.mark.parametrize(("changes", "message"), [
    ({"start_rps": 0.1}, "min rate <= start rate"),
    ({"max_steps": 0}, "must be >= 1"),
    ({"step_warmup_s": 80.0}, "warm-up"),
    ({"saturate_s": 0.0}, "closed loop"),
    ({"concurrency": 0}, "concurrency must be >= 1"),
    ({"hold_s": 0.0}, "closed loop"),
    ({"hold_rounds": -1}, "hold_rounds must be >= 0"),
])
def test_capacity_options_refuse_what_cannot_measure(changes, message):
    with pytest.raises(ValueError, match=message):
        CapacityOptions(**changes)
    assert QUICK.max_steps == 1 and QUICK.concurrency and QUICK.saturate_s < FULL.saturate_s


def test_the_closed_loop_counts_tokens_received_in_its_window():
    generations = [
        record(0.0, [1.0, 3.0, 5.0, 12.0], [1, 2, 3, 4]),  # tokens 2, 3 in [2, 12): 12.0 is at the end, counted
        record(0.5, [2.5, 4.0], [2, 5]),  # finished in the window: 5 tokens
        record(9.0, [10.0, 13.0], [1, 2], finish=None),  # still running at the end: 1 token by 12
    ]
    generations[2].error = STREAM_CLOSED
    found = saturated_summary(generations, start_s=0.0, warmup_s=2.0, window_s=10.0, concurrency=3)
    assert found["saturated_tokens_per_s"] == pytest.approx((3 + 5 + 1) / 10)
    details = found["saturated"]
    assert details["tokens_in_window"] == 9
    assert (details["requests"], details["completed"], details["failed"]) == (3, 2, 0)
    assert details["completion_tokens_mean"] == pytest.approx((4 + 5) / 2)
    assert details["concurrency"] == 3 and details["window_s"] == 10.0
    assert details["completion_tokens"] == [4, 5, None]  # in the order sent
    with pytest.raises(ValueError, match="window"):
        saturated_summary(generations, 0.0, 2.0, 0.0, 3)


def test_two_closed_loops_compare_answer_by_answer():
    engine = [12, 40, None, 7, 30]
    peer = [12, 38, 9, None]  # fewer sent: compared where both finished
    assert same_answers(engine, peer) == {"compared": 2, "same_length_share": 0.5,
                                          "completion_tokens_mean_engine": 26.0, "completion_tokens_mean_peer": 25.0}
    assert same_answers([None], [3])["compared"] == 0


def test_the_decode_context_is_averaged_over_every_decoded_token():
    # A 10-token prompt with 3 output tokens decodes twice, at contexts 11 and 12; a 4-token
    # prompt with 1 output token decodes never.
    assert mean_decode_context([10, 4], [3, 1]) == pytest.approx((11 + 12) / 2)
    assert mean_decode_context([10, 100], [3, 3]) == pytest.approx((11 + 12 + 101 + 102) / 4)
    with pytest.raises(ValueError, match="no decode steps"):
        mean_decode_context([10], [1])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        mean_decode_context([10, 4], [3])


def test_decode_limit_sequences_hold_disjoint_blocks_covering_their_context():
    tables = decode_block_tables(3, 33, 16)
    assert tables == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError):
        decode_block_tables(0, 33, 16)


def test_the_closed_loops_list_is_the_workloads_chats_reproducibly():
    workload = load_chat_workload(DEFAULT_CHAT_WORKLOAD)
    chats = chat_list(workload, 300, seed=5)
    assert chats == chat_list(workload, 300, seed=5) and len(chats) == 300
    assert {c.kind for c in chats} == {k.name for k in workload.kinds}
    assert all(c.at_s == 0.0 for c in chats)


def capacity_report(**peer) -> dict:
    report = {"static": {"llm_goodput_rps": 0.0, "saturated_tokens_per_s": 60.0},
              "static_retiring": {"llm_goodput_rps": 0.5, "saturated_tokens_per_s": 150.0},
              "continuous": {"llm_goodput_rps": 3.0, "saturated_tokens_per_s": 210.0},
              "decode_limit_tokens_per_s": 400.0}
    if peer:
        report[PEER] = peer
    return report


def test_the_closed_loop_has_more_streams_than_the_engine_has_slots():
    assert [saturating_concurrency(n) for n in (1, 4, 96, 97)] == [2, 5, 120, 122]
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        saturating_concurrency(0)


def test_the_stream_hold_comparison_is_the_median_of_its_rounds_ratios():
    found = hold_summary([300.0, 330.0, 280.0], [290.0, 300.0, 300.0], hold_ms=400.0)
    assert found["held_vs_every_token"] == pytest.approx(1.034, abs=1e-3)  # 1.034, 1.1, 0.933
    assert found["hold_ms"] == 400.0 and found["every_token_tokens_per_s"] == [290.0, 300.0, 300.0]
    report = capacity_report()
    report["continuous"]["stream_hold"] = found
    assert capacity_ratios(report)["saturated_held_vs_every_token"] == found["held_vs_every_token"]
    with pytest.raises(ValueError, match="as many held rounds"):
        hold_summary([300.0], [], hold_ms=400.0)


def test_capacity_ratios_and_targets():
    report = capacity_report(saturated_tokens_per_s=70.0)
    report["ratios"] = capacity_ratios(report)
    assert report["ratios"] == {"llm_goodput_continuous_vs_static": None,  # the baseline's goodput is 0
                                "llm_goodput_continuous_vs_static_retiring": 6.0,
                                "saturated_continuous_vs_decode_limit": 0.525,
                                "saturated_continuous_vs_transformers_cb": 3.0}
    assert targets(report) == {"goodput_above_every_baseline": True,
                               "saturated_at_least_70pct_of_decode_limit": False,
                               "saturated_at_least_3x_transformers_cb": True}
    alone = capacity_report()  # without the peer: its target is not measured
    del alone["static"], alone["static_retiring"]
    alone["ratios"] = capacity_ratios(alone)
    assert f"saturated_continuous_vs_{PEER}" not in alone["ratios"]
    assert targets(alone)["goodput_above_every_baseline"] is None
    assert targets(alone)["saturated_at_least_3x_transformers_cb"] is None
    level = capacity_report()
    level["static_retiring"]["llm_goodput_rps"] = 3.0  # a tie is not above
    level["ratios"] = capacity_ratios(level)
    assert targets(level)["goodput_above_every_baseline"] is False


# --- the transformers_cb peer --------------------------------------------------------------------


def test_the_peer_job_carries_the_engines_requests_and_limits(tmp_path):
    job = transformers_cb.peer_job(tmp_path, [([1, 2, 3], 16), ([4], 8)], concurrency=2, duration_s=5.0,
                                   num_threads=2, eos_token_ids=(2,), kv_cache_bytes=1 << 20, block_size=16,
                                   max_num_seqs=96, max_num_batched_tokens=256, device="cpu", dtype="float32")
    assert job["requests"] == [[[1, 2, 3], 16], [[4], 8]]
    assert (job["block_size"], job["max_num_seqs"], job["max_num_batched_tokens"], job["kv_cache_bytes"]) == (
        16, 96, 256, 1 << 20)
    assert job["attn_implementation"] == transformers_cb.ATTENTION and job["model_dir"] == str(tmp_path)
    with pytest.raises(ValueError, match="needs requests"):
        transformers_cb.peer_job(tmp_path, [], concurrency=2, duration_s=5.0, num_threads=2, eos_token_ids=(2,),
                                 kv_cache_bytes=1, block_size=16, max_num_seqs=96, max_num_batched_tokens=256,
                                 device="cpu", dtype="float32")


def test_the_peers_records_are_summarised_as_the_engines_streams_are():
    records = [
        {"request": 0, "sent_s": 0.0, "arrivals_s": [1.0, 3.0, 5.0], "token_counts": [1, 2, 3], "finished": True,
         "error": None},
        {"request": 1, "sent_s": 0.0, "arrivals_s": [2.5, 4.0], "token_counts": [1, 2], "finished": False,
         "error": None},  # running when the loop ended
        {"request": 2, "sent_s": 0.5, "arrivals_s": [], "token_counts": [], "finished": True, "error": "boom"},
    ]
    generations = transformers_cb.generations_from_records(records)
    assert [g.error for g in generations] == [None, STREAM_CLOSED, "boom"]
    assert generations[0].finish_reason == "stop" and generations[0].completion_tokens == 3
    same = [record(0.0, [1.0, 3.0, 5.0], [1, 2, 3]), record(0.0, [2.5, 4.0], [1, 2], finish=None),
            record(0.5, [], [], finish=None)]
    same[1].error, same[2].error = STREAM_CLOSED, "boom"
    assert saturated_summary(generations, 0.0, 2.0, 4.0, 2) == saturated_summary(same, 0.0, 2.0, 4.0, 2)
    assert saturated_summary(generations, 0.0, 2.0, 4.0, 2)["saturated"]["failed"] == 1


def test_the_peers_virtualenv_is_reused_while_its_lock_is_unchanged(tmp_path):
    lock = tmp_path / "peer.lock"
    lock.write_text("transformers==5.23.0\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / transformers_cb.STAMP).write_text(transformers_cb.lock_digest(lock) + "\n")
    logged = []
    assert transformers_cb.ensure_venv(logged.append, venv, lock) == venv / "bin" / "python"
    assert logged == []  # nothing made, nothing installed


def test_a_virtualenv_that_cannot_be_made_is_a_clear_error(tmp_path):
    lock = tmp_path / "peer.lock"
    lock.write_text("transformers==5.23.0\n")
    in_the_way = tmp_path / "venv"
    in_the_way.write_text("not a folder")
    logged = []
    with pytest.raises(transformers_cb.PeerError, match=r"-m venv .* failed \(exit 1\)"):
        transformers_cb.ensure_venv(logged.append, in_the_way, lock)
    assert "making its virtualenv" in logged[0]
    with pytest.raises(transformers_cb.PeerError, match="cannot make"):
        transformers_cb.ensure_venv(logged.append, in_the_way / "venv", lock)  # its folder is a file
