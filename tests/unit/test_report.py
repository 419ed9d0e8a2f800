"""`python -m tools report`: the docs' benchmark tables rendered from the result files, and the
check that fails when the two disagree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tools.bench.report import (
    RESULT_FILES,
    ReportError,
    drift,
    load_results,
    render_sections,
    splice,
    structure_problems,
)
from tools.cli import main
from tools.paths import REPO_ROOT


@pytest.fixture
def kit(tmp_path) -> dict[str, Path]:
    """A copy of the result files and of the two documents, to break on purpose."""
    results = tmp_path / "results"
    results.mkdir()
    for name in RESULT_FILES:
        shutil.copy(REPO_ROOT / "results" / f"{name}.json", results)
    for path in (REPO_ROOT / "results").glob("goodput[_.]*.json"):  # the per-model and per-mix goodput results
        shutil.copy(path, results)
    if (REPO_ROOT / "results" / "derivation.json").is_file():  # optional until `bench derivation` has run
        shutil.copy(REPO_ROOT / "results" / "derivation.json", results)
    readme = tmp_path / "README.md"
    shutil.copy(REPO_ROOT / "README.md", readme)
    benchmarks = tmp_path / "benchmarks.md"
    shutil.copy(REPO_ROOT / "docs" / "benchmarks.md", benchmarks)
    return {"results": results, "readme": readme, "benchmarks": benchmarks}


def report(kit, *extra) -> int:
    return main(["report", "--results", str(kit["results"]), "--readme", str(kit["readme"]),
                 "--benchmarks", str(kit["benchmarks"]), *extra])


def test_committed_docs_agree_with_the_committed_results(kit, capsys):
    assert report(kit, "--check") == 0
    assert "agree" in capsys.readouterr().out


def test_a_changed_result_fails_the_check_and_report_renders_it(kit, capsys):
    path = kit["results"] / "goodput.json"
    result = json.loads(path.read_text())
    result["setups"]["slo_bucketed"]["goodput_rps"] = 999.0
    path.write_text(json.dumps(result))

    assert report(kit, "--check") == 1
    err = capsys.readouterr().err
    assert "section 'goodput' differs from the result files" in err
    assert "section 'headline' differs" in err
    assert "python -m tools report" in err

    assert report(kit) == 0
    assert "999.0 req/s" in kit["readme"].read_text()
    assert "| 999.0 |" in kit["benchmarks"].read_text()
    assert report(kit, "--check") == 0


def test_a_figure_edited_by_hand_fails_the_check(kit, capsys):
    text = kit["benchmarks"].read_text()
    figure = json.loads((kit["results"] / "llm.json").read_text())["continuous"]["tokens_per_s"]
    shown = f"| {figure:,.1f} |"
    assert shown in text, "the figure to edit is no longer in the document"
    kit["benchmarks"].write_text(text.replace(shown, f"| {figure + 1:,.1f} |", 1))
    assert report(kit, "--check") == 1
    assert "section 'llm' differs" in capsys.readouterr().err
    assert report(kit) == 0
    assert kit["benchmarks"].read_text() == text


def test_prose_outside_the_markers_is_kept(kit):
    kit["benchmarks"].write_text(kit["benchmarks"].read_text() + "\nA closing remark.\n")
    assert report(kit) == 0
    assert kit["benchmarks"].read_text().endswith("\nA closing remark.\n")


def test_a_missing_section_is_an_error_and_nothing_is_written(kit, capsys):
    text = kit["readme"].read_text()
    start, end = text.index("<!-- report:headline -->"), text.index("<!-- /report:headline -->")
    kit["readme"].write_text(text[:start] + text[end + len("<!-- /report:headline -->"):])
    before = kit["readme"].read_text()
    assert report(kit) == 1
    assert "no '<!-- report:headline -->' section" in capsys.readouterr().err
    assert kit["readme"].read_text() == before


def test_unknown_and_unclosed_markers_are_named():
    sections = {"goodput": "table"}
    text = "<!-- report:goodputt -->\n<!-- /report:goodputt -->\n<!-- report:goodput -->\n"
    problems = structure_problems(text, sections, ("goodput",), "doc.md")
    assert "doc.md: unknown report section 'goodputt' (known: goodput)" in problems
    assert "doc.md: section 'goodput' has no closing '<!-- /report:goodput -->' marker" in problems
    assert splice(text, sections) == text


def test_splice_replaces_only_between_markers_and_is_idempotent():
    text = "before\n<!-- report:goodput -->\nold\n<!-- /report:goodput -->\nafter\n"
    once = splice(text, {"goodput": "new"})
    assert once == "before\n<!-- report:goodput -->\nnew\n<!-- /report:goodput -->\nafter\n"
    assert splice(once, {"goodput": "new"}) == once
    assert drift(once, {"goodput": "new"}, ("goodput",), "doc.md") == []


def test_a_missing_result_file_is_named(kit, capsys):
    (kit["results"] / "overload.json").unlink()
    assert report(kit, "--check") == 2
    assert "overload.json: no such result file" in capsys.readouterr().err


def test_a_result_file_without_a_field_is_named(kit):
    path = kit["results"] / "batch.json"
    result = json.loads(path.read_text())
    del result["direct"]
    path.write_text(json.dumps(result))
    with pytest.raises(ReportError, match=r"results/batch.json: a field the report needs is missing"):
        render_sections(load_results(kit["results"]), "results/")


def test_invalid_json_is_named(kit):
    (kit["results"] / "llm.json").write_text("{")
    with pytest.raises(ReportError, match=r"llm.json: not valid JSON"):
        load_results(kit["results"])


def test_every_section_names_its_command_and_hardware_and_links_its_plot():
    sections = render_sections(load_results(REPO_ROOT / "results"), "../results/")
    for name in ("goodput", "llm", "overload", "batch", "loadtest_step"):
        assert "- command: `" in sections[name] and "- hardware: " in sections[name], name
    assert "![goodput](../results/goodput.png)" in sections["goodput"]
    assert "![llm](../results/llm.png)" in sections["llm"]


def test_each_models_goodput_file_is_a_row_of_its_own(kit, capsys):
    result = json.loads((kit["results"] / "goodput.json").read_text())
    result.update(model="rerank", workload="embed_mix pairs", command="python -m tools bench goodput --model rerank")
    (kit["results"] / "goodput_rerank.json").write_text(json.dumps(result))
    assert report(kit, "--check") == 1
    assert "section 'goodput_models' differs from the result files" in capsys.readouterr().err
    assert report(kit) == 0
    text = kit["benchmarks"].read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `rerank` |"))
    lead = result["ratios"]["slo_bucketed_vs_default_batching"]  # the recorded figure, whatever it is
    assert "| `embed_mix pairs` | 200 |" in row and f"**{lead:.1f}\N{MULTIPLICATION SIGN}**" in row
    assert "[rerank](../results/goodput_rerank.json)" in row
    assert "- `rerank`: `python -m tools bench goodput --model rerank`" in text


def test_each_other_mix_is_a_row_beside_its_default_and_not_a_model(kit, capsys):
    result = json.loads((kit["results"] / "goodput.json").read_text())
    result.update(workload="embed_long_tail", command="python -m tools bench goodput --mixes embed_long_tail",
                  ceiling_rps=100.0, ratios={"slo_bucketed_vs_ceiling": 0.44, "slo_bucketed_vs_default_batching": 2.75})
    result["setups"] = {"slo_bucketed": {**result["setups"]["slo_bucketed"], "goodput_rps": 44.0},
                        "default_batching": {**result["setups"]["default_batching"], "goodput_rps": 16.0}}
    (kit["results"] / "goodput.embed_long_tail.json").write_text(json.dumps(result))
    assert report(kit, "--check") == 1
    err = capsys.readouterr().err
    assert "section 'goodput_mixes' differs from the result files" in err
    assert "goodput_models" not in err  # a mix of embed is no model of its own
    assert report(kit) == 0
    text = kit["benchmarks"].read_text()
    mixes = text[text.index("<!-- report:goodput_mixes -->"):text.index("<!-- /report:goodput_mixes -->")]
    rows = [line for line in mixes.splitlines() if line.startswith("| `embed` |")]
    assert "| `embed_mix` |" in rows[0] and "[goodput.json](../results/goodput.json)" in rows[0]
    [long_tail] = [row for row in rows if "| `embed_long_tail` |" in row]
    assert "| `embed_long_tail` | 200 | - | 16.0 | 44.0 | 100.0 | **2.8\N{MULTIPLICATION SIGN}** | 44.0% |" in long_tail
    assert "[goodput.embed_long_tail.json](../results/goodput.embed_long_tail.json)" in long_tail
    assert "- `goodput.embed_long_tail.json`: `python -m tools bench goodput --mixes embed_long_tail`" in mixes
    models = text[text.index("<!-- report:goodput_models -->"):text.index("<!-- /report:goodput_models -->")]
    assert "embed_long_tail" not in models


def test_a_models_other_mix_follows_that_models_own_row(kit):
    result = json.loads((kit["results"] / "goodput.json").read_text())
    result.update(model="search", workload="embed_bimodal", command="python -m tools bench goodput --model search")
    (kit["results"] / "goodput_search.embed_bimodal.json").write_text(json.dumps(result))
    sections = render_sections(load_results(kit["results"]), "../results/")
    rows = [line for line in sections["goodput_mixes"].splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[1] for row in rows][-2:] == ["`embed_mix`", "`embed_bimodal`"]
    assert rows[-1].startswith("| `search` |") and "goodput_search.embed_bimodal.json" in rows[-1]
    assert "No other mix" not in sections["goodput_mixes"]


def test_the_light_load_and_router_figures_are_rendered_from_the_goodput_result(kit):
    path = kit["results"] / "goodput.json"
    result = json.loads(path.read_text())
    sections = render_sections(load_results(kit["results"]), "../results/")
    if "light_load" not in result:  # a result file from before these figures says it has none
        assert "Light load and the router's own cost: not in this result file" in sections["goodput"]
    result["light_load"] = {"rate_rps": 4.0, "p50_ms": 72.0, "p95_ms": 95.5, "unbatched_p50_ms": 9.0,
                            "ratio": 8.0, "target_ratio": 2.0, "short_bucket": "16"}
    result["router_overhead_ms"] = {"p50": 0.8, "p95": 2.5}
    result["router_cpu_ms_per_request"] = 0.31
    result["router_overhead"] = {"router_ms": {"p50_ms": 10.3}, "direct_ms": {"p50_ms": 9.5}, "target_p50_ms": 1.0}
    path.write_text(json.dumps(result))
    section = render_sections(load_results(kit["results"]), "../results/")["goodput"]
    assert ("**Light load**: short requests (bucket 16) at 4.0 req/s had p50 72.0 ms (p95 95.5 ms) against 9.0 ms "
            "one at a time unbatched: **8.0\N{MULTIPLICATION SIGN}**, target ≤ 2\N{MULTIPLICATION SIGN} (missed)."
            ) in section
    assert ("**Router overhead**: p50 0.8 ms, p95 2.5 ms over the same rows sent straight to their bucket model "
            "(10.3 ms against 9.5 ms at p50), target p50 ≤ 1.0 ms (met); the router path's CPU: 0.31 ms per "
            "request.") in section
    assert "Python backend's own hop" not in section  # a result without the forwarding model's figures
    result["router_overhead"]["python_floor_ms"] = {"p50": 0.6, "router_p50": 0.9, "own_p50": 0.3,
                                                    "bucket": "encoder_16"}
    path.write_text(json.dumps(result))
    section = render_sections(load_results(kit["results"]), "../results/")["goodput"]
    assert ("Of that, the Python backend's own hop: a Python model that only forwards the same rows to "
            "`encoder_16` over one BLS call adds p50 0.6 ms; on those requests the router adds 0.9 ms, and 0.3 ms "
            "over the forwarding model: its own work (medians of the per-request differences).") in section
    assert "Inside the server" not in section  # nor Triton's statistics
    split = {"queue": 0.05, "input": 0.03, "output": 0.07}
    result["router_overhead"]["python_floor_ms"]["server_ms"] = {"router": {**split, "in_stub": 1.34},
                                                                 "forward": {**split, "in_stub": 0.6, "queue": 0.04}}
    path.write_text(json.dumps(result))
    section = render_sections(load_results(kit["results"]), "../results/")["goodput"]
    assert ("Inside the server (Triton's statistics, means): the router's Python stub takes 1.34 ms beside its BLS "
            "call against the forwarding model's 0.60 ms; its scheduler queue 0.05 ms against 0.04 ms, input and "
            "output 0.10 ms against 0.10 ms.") in section
    result["router_overhead"]["python_floor_ms"]["server_ms"]["router"]["in_stub"] = -2.8  # answered by workers
    path.write_text(json.dumps(result))
    section = render_sections(load_results(kit["results"]), "../results/")["goodput"]
    assert "Inside the server" not in section and "cannot split the router's time on this run" in section


def test_the_ten_times_phase_is_a_row_and_the_breakdown_a_table_of_its_own():
    results = load_results(REPO_ROOT / "results")
    overload = json.loads(json.dumps(results["overload"]))
    breakdown = {"client_mean_ms": 150.0, "router_queue_ms": 40.0, "router_ms": 90.0, "unseen_ms": 20.0,
                 "router_p95_ms": 180.0, "buckets": {}}
    cpu = {"load_generator_s": 12.0, "server_s": 100.0, "load_generator_share": 0.1, "server_share": 0.83, "cores": 2}
    overload["overload"].update(wait_breakdown=breakdown, cpu=cpu)
    ten = dict(overload["overload"], offered_rps=10 * overload["overload"]["goodput_rps"], offered=123456)
    overload["overload_10x"] = ten
    section = render_sections({**results, "overload": overload}, "../results/")["overload"]
    assert "123,456" in section  # the 10x phase's row
    assert f"| 10{chr(0xD7)} | 150.0 ms | 40.0 ms | 90.0 ms | 20.0 ms | 10.0% | 83.0% |" in section
    assert "The load generator's bound" not in section  # a run that recorded none
    overload["overload"]["cpu"] = dict(cpu, load_generator_max_share=0.15, load_generator_within_bound=True)
    overload["overload_10x"]["cpu"] = dict(cpu, load_generator_max_share=0.15, load_generator_within_bound=True)
    section = render_sections({**results, "overload": overload}, "../results/")["overload"]
    assert "The load generator's bound: 15.0% of the machine's CPU; every phase kept within it." in section
    overload["overload_10x"]["cpu"] = dict(cpu, load_generator_max_share=0.15, load_generator_within_bound=False)
    section = render_sections({**results, "overload": overload}, "../results/")["overload"]
    assert "**a phase went over it**" in section


def test_the_cost_of_a_refusal_is_rendered_when_the_run_measured_it():
    results = load_results(REPO_ROOT / "results")
    overload = json.loads(json.dumps(results["overload"]))
    overload["refusals"] = {"rate_rps": 960.0, "duration_s": 10.0, "stamp_age_ms": 400.0, "offered": 9558,
                            "rejected": 9558, "server_cpu_ms_per_refusal": 0.891}
    section = render_sections({**results, "overload": overload}, "../results/")["overload"]
    assert ("**Refusals**: 9,558 requests at 960 req/s, each stamped (`X-Request-Start`) as sent 400 ms earlier: "
            "9,558 refused (503) before any work on them, at 0.89 ms of server CPU each") in section
    del overload["refusals"]
    assert "**Refusals**" not in render_sections({**results, "overload": overload}, "../results/")["overload"]


def llm_capacity(result: dict, *, peer: bool) -> dict:
    """The LLM result with the capacity figures `bench llm` adds (hand-picked numbers)."""
    steps = {"static": [(1.0, False), (0.5, False), (0.25, False)], "static_retiring": [(1.0, False), (0.5, True)],
             "continuous": [(1.0, True), (2.0, True), (4.0, False), (3.0, True)]}
    goodput = {"static": 0.0, "static_retiring": 0.5, "continuous": 3.0}
    saturated = {"static": 61.0, "static_retiring": 150.0, "continuous": 252.0}
    for name in steps:
        result[name] = {**result[name], "llm_goodput_rps": goodput[name], "saturated_tokens_per_s": saturated[name],
                        "goodput_steps": [{"rate_rps": rate, "passed": passed} for rate, passed in steps[name]]}
    result.update(
        ttft_p95_ms=1000.0, tpot_p95_ms=400.0, decode_limit_tokens_per_s=400.0,
        decode_limit={"num_seqs": 96, "context_tokens": 131, "step_ms_median": 240.0, "kv_budget_num_seqs": 66},
        capacity={"search_start_rps": 1.0, "search_min_rps": 0.25, "step_s": 80.0, "step_warmup_s": 20.0,
                  "min_finished_share": 0.95, "concurrency": 96, "saturated_list": 1000, "saturate_s": 150.0,
                  "saturate_warmup_s": 30.0, "hold_rounds": 3, "hold_warmup_s": 15.0, "hold_s": 45.0},
        targets={"goodput_above_every_baseline": True, "saturated_at_least_70pct_of_decode_limit": False,
                 "saturated_at_least_3x_transformers_cb": True if peer else None})
    result["continuous"]["stream_hold"] = {"hold_ms": 400.0, "held_tokens_per_s": [300.0, 310.0, 290.0],
                                           "every_token_tokens_per_s": [280.0, 300.0, 290.0],
                                           "held_vs_every_token": 1.033}
    result["ratios"] = {**result["ratios"], "llm_goodput_continuous_vs_static": None,
                        "llm_goodput_continuous_vs_static_retiring": 6.0, "saturated_continuous_vs_decode_limit": 0.63}
    if peer:
        result["transformers_cb"] = {"saturated_tokens_per_s": 80.0, "transformers": "5.23.0",
                                     "attn_implementation": "sdpa",
                                     "same_answers_as_continuous": {"compared": 200, "same_length_share": 0.97}}
        result["ratios"]["saturated_continuous_vs_transformers_cb"] = 3.15
    else:  # a run without the peer (the recorded file may have one)
        result.pop("transformers_cb", None)
        result["ratios"].pop("saturated_continuous_vs_transformers_cb", None)
    return result


def test_the_llm_capacity_figures_are_a_table_of_their_own(kit):
    path = kit["results"] / "llm.json"
    result = json.loads(path.read_text())
    sections = render_sections(load_results(kit["results"]), "../results/")
    if "decode_limit_tokens_per_s" not in result:  # a result file from before these figures says it has none
        assert "Capacity (goodput under the TTFT and TPOT targets" in sections["llm"]
        assert "LLM capacity" not in sections["headline"]
    path.write_text(json.dumps(llm_capacity(json.loads(json.dumps(result)), peer=True)))
    sections = render_sections(load_results(kit["results"]), "../results/")
    section = sections["llm"]
    assert "TTFT p95 ≤ 1,000 ms and TPOT p95 ≤ 400 ms" in section
    assert "| `static` | none at ≥ 0.25 | 1.00 fail, 0.50 fail, 0.25 fail | 61.0 | 15% |" in section
    assert "| `continuous` | **3.00** | 1.00 pass, 2.00 pass, 4.00 fail, 3.00 pass | 252.0 | 63% |" in section
    assert "| `transformers_cb`: transformers 5.23.0's own continuous batching" in section
    assert "answers as long as continuous's for 97% of the 200 requests both finished | - | - | 80.0 | 20% |" in section
    assert ("| decode limit: the engine's forward alone, 96 sequences at 131 tokens of context (240 ms a step; "
            "the KV budget holds 66 such sequences) | - | - | 400.0 | 100% |") in section
    times = "\N{MULTIPLICATION SIGN}"
    assert (f"goodput `static` has none at ≥ 0.25 req/s; 6.00{times} `static_retiring`'s; saturated tokens/s 63% "
            f"of the decode limit and 3.15{times} `transformers_cb`'s") in section
    assert ("Targets: continuous's goodput above every baseline's: met; saturated tokens/s ≥ 70% of the decode "
            f"limit: missed; saturated tokens/s ≥ 3{times} `transformers_cb`'s: met.") in section
    assert ("| LLM capacity (p95 TTFT, TPOT within target) | goodput 3.00 req/s; 252.0 tokens/s saturated | 63% of "
            f"the decode limit, 3.15{times} transformers' continuous batching |") in sections["headline"]
    assert ("Streams held while requests wait (each token up to 400 ms, then sent with the stream's next): 300.0 "
            f"tokens/s against 290.0 sending every token as it is made, 1.03{times} (median of 3 rounds of the two "
            "closed loops alternating on one server, 45 s each after 15 s; by round: 300.0 vs 280.0, 310.0 vs 300.0, "
            "290.0 vs 290.0).") in section
    # Without the peer: no row, no ratio, no verdict for it.
    path.write_text(json.dumps(llm_capacity(result, peer=False)))
    section = render_sections(load_results(kit["results"]), "../results/")["llm"]
    assert "`transformers_cb`:" not in section and "`transformers_cb`'s: " not in section
    # Without the stream-hold comparison (a run before it, or --setups without continuous's copy): no sentence.
    result = llm_capacity(result, peer=False)
    del result["continuous"]["stream_hold"]
    path.write_text(json.dumps(result))
    assert "Streams held" not in render_sections(load_results(kit["results"]), "../results/")["llm"]
