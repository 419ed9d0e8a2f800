"""The benchmark tables of the docs, rendered from the result files.

Every figure in `docs/benchmarks.md` and in the README's headline table comes from
`results/*.json`; a document holds each rendered section between two marker comments,
`<!-- report:NAME -->` and `<!-- /report:NAME -->`, and everything outside the markers is
prose. `python -m tools report` rewrites the sections, `--check` says which documents
disagree with the result files (a unit test runs it, so the docs cannot drift).

The goodput results come in three namings: `goodput.json` (the default model on its spec's
mix), `goodput_<model>.json` (another model, a row each) and `<either stem>.<mix>.json` (the
same benchmark on another length mix, `bench goodput --mixes`, a row each beside its default).

Pure: `render_sections` (parsed result files -> Markdown per section), `splice` (a document
with its sections replaced) and `drift`. I/O: `load_results` reads the result files,
`update_documents` reads and writes the documents.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMES = "\N{MULTIPLICATION SIGN}"

RESULT_FILES = ("goodput", "llm", "overload", "batch", "loadtest_step")
MODEL_GOODPUT = "goodput_models"  # the section of results/goodput_<model>.json, one row per model
# The section of the goodput results of other mixes: results/goodput.<mix>.json beside goodput.json
# (and goodput_<model>.<mix>.json beside a model's), one row per mix with the default mix's first.
MIX_GOODPUT = "goodput_mixes"
DEFAULT_GOODPUT = "goodput"  # the stem of the default model's default mix

MARKER = re.compile(r"<!-- report:(?P<name>[a-z_]+) -->\n(?P<body>.*?)<!-- /report:(?P=name) -->",
                    re.DOTALL)

GOODPUT_SETUPS = {
    "no_batching": "one model, every input padded to 256 tokens, no dynamic batching",
    "default_batching": "one model, padded to 256, `dynamic_batching { }`, max batch 32",
    "slo_bucketed": "five length buckets, configs derived from `serving.toml` + `profiles/cpu.json`",
}
LLM_SETUPS = {
    "static": "a batch runs until its last member finishes; finished rows keep computing",
    "static_retiring": "the same, but a finished member leaves the batch's compute at once",
    "continuous": "the engine as `serve` runs it: requests join and leave at every step",
}
LLM_PEER = "transformers_cb"  # transformers' own continuous batching, in-process
LLM_TARGETS = {  # bench llm's capacity targets, as the table names them
    "goodput_above_every_baseline": "continuous's goodput above every baseline's",
    "saturated_at_least_70pct_of_decode_limit": "saturated tokens/s ≥ 70% of the decode limit",
    "saturated_at_least_3x_transformers_cb": f"saturated tokens/s ≥ 3{TIMES} `{LLM_PEER}`'s",
}


class ReportError(ValueError):
    """A result file or a document the report cannot use, with the file named."""


@dataclass(frozen=True)
class Document:
    """A document with rendered sections, and the link prefix from it to `results/`."""

    path: Path
    sections: tuple[str, ...]
    results_link: str  # "results/" from the README, "../results/" from docs/


def _num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _int(value: float) -> str:
    return f"{round(value):,}"


def _ratio(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}{TIMES}"


def _seconds(value: float) -> str:
    if value >= 10:
        return f"{value:.0f} s"
    return f"{value:.1f} s" if value >= 1 else f"{value:.2f} s"


def _pct(fraction: float, digits: int = 1) -> str:
    return f"{fraction * 100:.{digits}f}%"


def _hardware(result: Mapping[str, Any]) -> str:
    hardware = result.get("hardware")
    if not hardware:
        return "not recorded"
    gpu = hardware.get("gpu") or "no GPU"
    return f"{hardware['description']}, {hardware['cpu_count']} vCPU, {gpu}"


def _provenance(result: Mapping[str, Any]) -> str:
    lines = [f"- command: `{result['command']}`"]
    if "measured_at" in result:
        lines.append(f"- measured: {result['measured_at']}")
    lines.append(f"- hardware: {_hardware(result)}")
    return "\n".join(lines)


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_goodput(result: Mapping[str, Any], results_link: str) -> str:
    setups = result["setups"]
    default = setups["default_batching"]["goodput_rps"]
    rows = []
    for name, what in GOODPUT_SETUPS.items():
        setup = setups[name]
        rounds = ", ".join(_num(r) for r in setup["goodput_rps_by_round"])
        rows.append([f"`{name}`: {what}", _num(setup["goodput_rps"]), rounds,
                     _ratio(setup["goodput_rps"] / default, 1)])
    ceiling_rounds = ", ".join(_num(r) for r in result["ceiling_rps_by_round"])
    rows.append(["ceiling: the same mix in-process through ONNX Runtime, ideal buckets (rows/s)",
                 _num(result["ceiling_rps"]), ceiling_rounds, ""])
    ratios = result["ratios"]
    by_round = ", ".join(_pct(r) for r in ratios["slo_bucketed_vs_ceiling_by_round"])
    return "\n".join([
        _provenance(result),
        f"- SLO: p95 {_int(result['slo_ms'])} ms; workload `{result['workload']}`; "
        f"{result['rounds']} rounds, medians; load generator over {result['load_generator']['protocol']}"
        + (" on the measured machine" if result["load_generator"].get("on_the_measured_machine") else ""),
        "",
        _table(["setup", "goodput (req/s)", "by round", "vs. `default_batching`"],
               ["---", "---:", "---:", "---:"], rows),
        "",
        f"`slo_bucketed` reached **{_pct(ratios['slo_bucketed_vs_ceiling'])} of the ceiling** "
        f"(median of the rounds' paired ratios: {by_round}) and "
        f"**{_ratio(ratios['slo_bucketed_vs_default_batching'], 1)}** `default_batching`'s goodput "
        f"({_ratio(ratios['slo_bucketed_vs_no_batching'], 1)} `no_batching`'s).",
        "",
        render_router_figures(result),
        "",
        f"![goodput]({results_link}goodput.png)",
    ])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _fine_ms(value: float) -> str:
    """A few tenths of a millisecond, which `_ms` would round away."""
    return f"{value:.2f} ms"


def _target(met: bool) -> str:
    return "met" if met else "missed"


def render_router_figures(result: Mapping[str, Any]) -> str:
    """The light-load and router-cost sentences of a goodput result (`light_load`,
    `router_overhead_ms`, `router_cpu_ms_per_request`), or a line saying it has none."""
    light = result.get("light_load")
    if light is None or "router_overhead_ms" not in result:
        return ("Light load and the router's own cost: not in this result file (`bench goodput` with "
                "`slo_bucketed` among its setups measures them).")
    overhead, detail = result["router_overhead_ms"], result["router_overhead"]
    ratio, p50 = light["ratio"], overhead["p50"]
    light_text = (f"**Light load**: short requests (bucket {light['short_bucket']}) at {_num(light['rate_rps'])} "
                  f"req/s had p50 {_ms(light['p50_ms'])} (p95 {_ms(light['p95_ms'])}) against "
                  f"{_ms(light['unbatched_p50_ms'])} one at a time unbatched: "
                  + ("no ratio (a run without answers)." if ratio is None else
                     f"**{_ratio(ratio, 1)}**, target ≤ {_ratio(light['target_ratio'], 0)} "
                     f"({_target(ratio <= light['target_ratio'])})."))
    router_text = (f"**Router overhead**: p50 {_ms(p50)}, p95 {_ms(overhead['p95'])} over the same rows sent "
                   f"straight to their bucket model ({_ms(detail['router_ms']['p50_ms'])} against "
                   f"{_ms(detail['direct_ms']['p50_ms'])} at p50)"
                   + ("" if p50 is None else
                      f", target p50 ≤ {_ms(detail['target_p50_ms'])} ({_target(p50 <= detail['target_p50_ms'])})")
                   + f"; the router path's CPU: {result['router_cpu_ms_per_request']:.2f} ms per request.")
    floor = detail.get("python_floor_ms")
    if floor and floor["p50"] is not None:
        router_text += (f" Of that, the Python backend's own hop: a Python model that only forwards the same rows "
                        f"to `{floor['bucket']}` over one BLS call adds p50 {_ms(floor['p50'])}; on those requests "
                        f"the router adds {_ms(floor['router_p50'])}, and {_ms(floor['own_p50'])} over the forwarding "
                        f"model: its own work (medians of the per-request differences).")
        server = floor.get("server_ms")
        in_stub = [figures["in_stub"] for figures in (server or {}).values()]
        if server and any(ms is None or ms < 0 for ms in in_stub):
            router_text += (" Triton's statistics cannot split the router's time on this run: it answered some "
                            "of these requests from its worker threads, and a Python model's statistics end when "
                            "`execute` returns.")
        elif server:
            router, forward = server["router"], server["forward"]
            moved = {side: figures["input"] + figures["output"] for side, figures in server.items()}
            router_text += (f" Inside the server (Triton's statistics, means): the router's Python stub takes "
                            f"{_fine_ms(router['in_stub'])} beside its BLS call against the forwarding model's "
                            f"{_fine_ms(forward['in_stub'])}; its scheduler queue {_fine_ms(router['queue'])} "
                            f"against {_fine_ms(forward['queue'])}, input and output {_fine_ms(moved['router'])} "
                            f"against {_fine_ms(moved['forward'])}.")
    return f"{light_text}\n{router_text}"


def render_llm(result: Mapping[str, Any], results_link: str) -> str:
    rows = []
    for name, what in LLM_SETUPS.items():
        setup = result[name]
        rows.append([f"`{name}`: {what}", _num(setup["tokens_per_s"]), _seconds(setup["ttft_p50_s"]),
                     _seconds(setup["ttft_p95_s"]), _seconds(setup["tpot_p95_s"]),
                     _seconds(setup["latency_p95_s"]), _seconds(setup["drain_s"]),
                     f"{setup['failed']} / {setup['unfinished']}"])
    ratios = result["ratios"]
    engine = result["engine"]
    return "\n".join([
        _provenance(result),
        f"- model: {result['model']}; workload `{result['workload']}`, {result['requests']} requests at "
        f"{_num(result['rate_rps'])} req/s for {_int(result['duration_s'])} s; steady state from "
        f"{_int(result['warmup_s'])} s; engine: {engine['max_num_seqs']} sequences, "
        f"{engine['max_num_batched_tokens']} tokens per step, {_int(engine['kv_cache_mb'])} MB KV cache",
        "",
        _table(["setup", "output tokens/s (steady)", "TTFT p50", "TTFT p95", "TPOT p95", "end-to-end p95",
                "last answer after the last arrival", "failed / unfinished"],
               ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows),
        "",
        f"Continuous batching: **{_ratio(ratios['tokens_per_s_continuous_vs_static'])}** the tokens/s of "
        f"`static` at {_ratio(ratios['ttft_p95_continuous_vs_static'], 3)} its TTFT p95; "
        f"{_ratio(ratios['tokens_per_s_continuous_vs_static_retiring'])} the tokens/s of `static_retiring` at "
        f"{_ratio(ratios['ttft_p95_continuous_vs_static_retiring'], 3)} its TTFT p95.",
        "",
        render_llm_capacity(result),
        "",
        f"![llm]({results_link}llm.png)",
    ])


def _rate(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def render_llm_capacity(result: Mapping[str, Any]) -> str:
    """The capacity table of `bench llm`: each setup's goodput and saturated tokens/s, the
    transformers_cb peer's, the decode limit, the ratios and the targets."""
    if "decode_limit_tokens_per_s" not in result:
        return ("Capacity (goodput under the TTFT and TPOT targets, saturated tokens/s, the decode limit, "
                f"`{LLM_PEER}`): not in this result file; `python -m tools bench llm` measures it.")
    capacity, limit = result["capacity"], result["decode_limit_tokens_per_s"]
    lowest = capacity["search_min_rps"]
    rows = []
    for name in (n for n in LLM_SETUPS if n in result):
        setup = result[name]
        goodput = setup["llm_goodput_rps"]
        steps = ", ".join(f"{_rate(step['rate_rps'])} {'pass' if step['passed'] else 'fail'}"
                          for step in setup["goodput_steps"])
        shown = _rate(goodput) if goodput else f"none at ≥ {_rate(lowest)}"
        rows.append([f"`{name}`", f"**{shown}**" if name == "continuous" else shown, steps,
                     _num(setup["saturated_tokens_per_s"]), _pct(setup["saturated_tokens_per_s"] / limit, 0)])
    if LLM_PEER in result:
        peer = result[LLM_PEER]
        same = peer.get("same_answers_as_continuous") or {}
        alike = (f"; answers as long as continuous's for {_pct(same['same_length_share'], 0)} of the "
                 f"{same['compared']} requests both finished" if same.get("compared") else "")
        rows.append([f"`{LLM_PEER}`: transformers {peer['transformers']}'s own continuous batching "
                     f"(`{peer['attn_implementation']}` over its paged cache), in-process; the engine's KV memory, "
                     f"block size and sequences{alike}", "-", "-", _num(peer["saturated_tokens_per_s"]),
                     _pct(peer["saturated_tokens_per_s"] / limit, 0)])
    decode = result["decode_limit"]
    bursts = f", the median of {len(decode['bursts'])} bursts" if decode.get("bursts") else ""
    rows.append([f"decode limit: the engine's forward alone, {decode['num_seqs']} sequences at "
                 f"{decode['context_tokens']} tokens of context ({decode['step_ms_median']:.0f} ms a step{bursts}; "
                 f"the KV budget holds {decode['kv_budget_num_seqs']} such sequences)", "-", "-", _num(limit), "100%"])
    ratios, targets = result["ratios"], result["targets"]
    goodput_ratios = [f"{_ratio(ratios[f'llm_goodput_continuous_vs_{name}'])} `{name}`'s"
                      if ratios.get(f"llm_goodput_continuous_vs_{name}") is not None
                      else f"`{name}` has none at ≥ {_rate(lowest)} req/s"
                      for name in LLM_SETUPS if name != "continuous" and name in result]
    saturated = [f"{_pct(ratios['saturated_continuous_vs_decode_limit'], 0)} of the decode limit"]
    if ratios.get(f"saturated_continuous_vs_{LLM_PEER}") is not None:
        saturated.append(f"{_ratio(ratios[f'saturated_continuous_vs_{LLM_PEER}'])} `{LLM_PEER}`'s")
    verdicts = [f"{what}: {_target(met)}" for name, what in LLM_TARGETS.items()
                if (met := targets.get(name)) is not None]
    hold = result["continuous"].get("stream_hold") if "continuous" in result else None
    held = ([f"Streams held while requests wait (each token up to {_int(hold['hold_ms'])} ms, then sent with "
             f"the stream's next): {_num(statistics.median(hold['held_tokens_per_s']))} tokens/s against "
             f"{_num(statistics.median(hold['every_token_tokens_per_s']))} sending every token as it is made, "
             f"{_ratio(hold['held_vs_every_token'])} (median of {len(hold['held_tokens_per_s'])} rounds of the two "
             f"closed loops alternating on one server, {_int(capacity['hold_s'])} s each after "
             f"{_int(capacity['hold_warmup_s'])} s; by round: "
             + ", ".join(f"{_num(h)} vs {_num(e)}" for h, e in zip(hold["held_tokens_per_s"],
                                                                   hold["every_token_tokens_per_s"], strict=True))
             + ")."] if hold else [])
    return "\n".join([
        f"At capacity: goodput is the highest Poisson arrival rate with ≥ "
        f"{_pct(capacity['min_finished_share'], 0)} of the requests finished, none failed, TTFT p95 ≤ "
        f"{_int(result['ttft_p95_ms'])} ms and TPOT p95 ≤ {_int(result['tpot_p95_ms'])} ms (a search from "
        f"{_rate(capacity['search_start_rps'])} req/s, doubling then bisecting; steps of "
        f"{_int(capacity['step_s'])} s judged after {_int(capacity['step_warmup_s'])} s); saturated tokens/s is a "
        f"closed loop of {capacity['concurrency']} streams over the same {capacity['saturated_list']} chats, "
        f"tokens counted for {_int(capacity['saturate_s'])} s after {_int(capacity['saturate_warmup_s'])} s.",
        "",
        _table(["setup", "goodput (req/s)", "rates measured", "saturated output tokens/s", "of the decode limit"],
               ["---", "---:", "---", "---:", "---:"], rows),
        "",
        f"Continuous batching at capacity: goodput {'; '.join(goodput_ratios)}; saturated tokens/s "
        f"{' and '.join(saturated)}. Targets: {'; '.join(verdicts)}.",
        *(["", *held] if held else []),
    ])


def render_batch(result: Mapping[str, Any], results_link: str) -> str:
    del results_link  # the batch benchmark writes no plot
    direct = result["direct"]
    rows = [["`direct`: asyncio gRPC client, requests of "
             f"{result['rows_per_request']} rows, {direct['concurrency']} in flight",
             _num(direct["items_per_s"]), ", ".join(_num(r) for r in direct["runs"]), "1.00"]]
    for name, engine in (("batch_api", "SQLite"), ("batch_api_postgres", "PostgreSQL")):
        if name not in result:
            continue
        setup = result[name]
        rows.append([f"`{name}`: `python -m tools batch serve` on {engine}, {setup['workers']} workers, "
                     f"{setup['max_in_flight_per_worker']} requests in flight each",
                     _num(setup["items_per_s"]), ", ".join(_num(r) for r in setup["runs"]),
                     f"{setup['ratio']:.2f}"])
    return "\n".join([
        _provenance(result),
        f"- {result['items']} items per run; {result['note']}",
        "",
        _table(["setup", "items/s (median)", "runs", "÷ direct"], ["---", "---:", "---", "---:"], rows),
        "",
        f"Target: the batch API at ≥ {result['target_ratio']:.2f} of direct calls; "
        f"{'met' if result['ratio'] >= result['target_ratio'] else 'missed'} ({result['ratio']:.2f}).",
    ])


def _admitted(part: Mapping[str, Any]) -> str:
    return (f"{_int(part['admitted_p50_ms'])} / {_int(part['admitted_p95_ms'])} / "
            f"{_int(part['admitted_p99_ms'])} ms")


def render_overload(result: Mapping[str, Any], results_link: str) -> str:
    del results_link  # the overload benchmark writes no plot
    flood = result["overload"]
    phases = [result[part] for part in ("overload", "overload_10x") if part in result]
    overload_rows = [[f"{_int(phase['offered'])} ({_int(phase['offered_rps'])} req/s, "
                      f"{_num(phase['offered_rps'] / phase['goodput_rps'], 0)}{TIMES} goodput "
                      f"{_int(phase['goodput_rps'])})",
                      f"{_int(phase['ok'])} ({_int(phase['ok'] / phase['duration_s'])} req/s)",
                      _int(phase["rejected"]), _int(phase["failed_other"] + phase["crashed"]), _int(phase["lost"]),
                      _admitted(phase), _pct(phase["admitted_within_slo"])] for phase in phases]
    breakdown_rows = [[f"{_num(phase['offered_rps'] / phase['goodput_rps'], 0)}{TIMES}",
                       *(_ms(phase["wait_breakdown"][key])
                         for key in ("client_mean_ms", "router_queue_ms", "router_ms", "unseen_ms")),
                       _pct(phase["cpu"]["load_generator_share"]), _pct(phase["cpu"]["server_share"])]
                      for phase in phases if "wait_breakdown" in phase]
    isolation = result["isolation"]
    b, a = isolation["b"], isolation["a"]
    isolation_rows = [
        [f"B (`{b['tenant']}`, {b['tier']}) alone, {_int(b['rate_rps'])} req/s", f"{b['p95_ms_alone']:.1f} ms",
         _int(b["alone"]["offered"] - b["alone"]["ok"]), "", ""],
        [f"B with A (`{a['tenant']}`, {a['tier']}, quota {_int(a['quota_rps'])} req/s) flooding "
         f"{_int(a['rate_rps'])} req/s", f"{b['p95_ms_with_flood']:.1f} ms",
         _int(b["with_flood"]["offered"] - b["with_flood"]["ok"]), _int(a["ok"]),
         f"{_int(a['rejected'])} ({_int(a['rejected_over_quota'])} / "
         f"{_int(a['rejected'] - a['rejected_over_quota'])})"],
    ]
    crash = result["crash"]
    crash_rows = []
    for name, label in (("without_retries", "no retries"), ("with_retries", "retrying client")):
        run = crash[name]
        crash_rows.append([label, _int(run["ok"]), _int(run["failed"]), _int(run["failed_by_crash"]),
                           _int(run["retried"]), f"{run['seconds_to_detect']:.2f} s",
                           f"{run['seconds_to_recover']:.2f} s"])
    return "\n".join([
        _provenance(result),
        f"- SLO: p95 {_int(result['slo_ms'])} ms; {result['note']}",
        "",
        f"**Overload**: open-loop arrivals for {_int(flood['duration_s'])} s.",
        "",
        _table(["offered", "ok", "rejected (503)", "failed otherwise", "lost", "admitted p50 / p95 / p99",
                "admitted within SLO"], ["---:"] * 7, overload_rows),
        "",
        *([("Where an admitted request's time went (means: the client's latency = the router model's "
            "queue + the router's own clock + what no server figure covers), and the CPU each side used, "
            "as shares of the machine:"),
           "",
           _table(["offered", "client mean", "router queue", "router", "unseen", "load generator CPU",
                   "server CPU"], ["---"] + ["---:"] * 6, breakdown_rows),
           "",
           *_generator_bound(phases)] if breakdown_rows else []),
        *([f"**Refusals**: {_int(refusals['offered'])} requests at {_int(refusals['rate_rps'])} req/s, each "
           f"stamped (`X-Request-Start`) as sent {_int(refusals['stamp_age_ms'])} ms earlier: "
           f"{_int(refusals['rejected'])} refused (503) before any work on them, at "
           f"{_num(refusals['server_cpu_ms_per_refusal'], 2)} ms of server CPU each (tritonserver and the "
           "router's stubs, less their idle use).", ""]
          if (refusals := result.get("refusals")) is not None else []),
        "**Isolation**: a premium tenant B beside a batch-tier tenant A's flood.",
        "",
        _table(["", "B p95", "B not served", "A ok", "A rejected (over quota / by admission)"],
               ["---", "---:", "---:", "---:", "---:"], isolation_rows),
        "",
        f"**Crash**: {_int(crash['rate_rps'])} req/s while one `{crash['victim_model']}` instance is killed.",
        "",
        _table(["clients", "ok", "failed", "of which hit the crash", "retried", "detected after",
                "whole again after"], ["---", "---:", "---:", "---:", "---:", "---:", "---:"], crash_rows),
        "",
        f"Server healthy at the end: {'yes' if result['server_healthy_at_end'] else 'no'}.",
    ])


def _generator_bound(phases: list[Mapping[str, Any]]) -> list[str]:
    """The sentence on the load generator's CPU bound and whether every phase kept it (none
    for a run that recorded no bound)."""
    cpus = [phase["cpu"] for phase in phases if "load_generator_max_share" in phase.get("cpu", {})]
    if not cpus:
        return []
    held = all(cpu["load_generator_within_bound"] for cpu in cpus)
    verdict = ("every phase kept within it." if held else
               "**a phase went over it**: its figures describe the load generator as much as the server.")
    return [f"The load generator's bound: {_pct(cpus[0]['load_generator_max_share'])} of the machine's CPU; "
            f"{verdict}", ""]


def render_loadtest_step(result: Mapping[str, Any], results_link: str) -> str:
    info = result["info"]
    check_rows = []
    for check in result["checks"]:
        check_rows.append([check["model"], check["tenant"] or "all", _int(check["requests"]),
                           f"{_int(check['errors'])} ({_pct(check['error_rate'])})",
                           _pct(check["max_error_rate"]), f"{_int(check['p95_ms'])} ({check['metric']})",
                           _int(check["target_ms"]), "pass" if check["passed"] else "FAIL"])
    models = sorted({model for stage in result["stages"] for model in stage["p95_ms"]})
    stage_rows = []
    for stage in result["stages"]:
        stage_rows.append([str(stage["index"]), str(stage["users"]), _num(stage["throughput_rps"]),
                           _int(stage["errors"])] + [_int(stage["p95_ms"][m]) for m in models]
                          + ["yes" if stage["within_slo"] else "no"])
    passing = [stage for stage in result["stages"] if stage["within_slo"]]
    if passing and passing[-1] is result["stages"][-1]:
        knee = (f"Knee not reached: the last stage ({passing[-1]['users']} users, "
                f"{_num(passing[-1]['throughput_rps'])} req/s) still met every SLO.")
    elif passing:
        best = max(passing, key=lambda stage: stage["throughput_rps"])
        knee = f"Knee: stage {best['index']} ({best['users']} users, {_num(best['throughput_rps'])} req/s)."
    else:
        knee = "No stage met every SLO."
    kinds = ", ".join(f"{kind} {_int(count)}" for kind, count in sorted(result["error_kinds"].items()))
    return "\n".join([
        _provenance(result),
        f"- mix: {info['mix']}; shape: {info['shape']}; load generators: {info['load generators']}",
        f"- verdict: **{'PASS' if result['passed'] else 'FAIL'}**; failed requests by kind: {kinds or 'none'}",
        "",
        _table(["model", "tenant", "requests", "errors", "allowed", "p95 (ms)", "target (ms)", "verdict"],
               ["---", "---", "---:", "---:", "---:", "---:", "---:", "---"], check_rows),
        "",
        _table(["stage", "users", "ok req/s", "errors"] + [f"{m} p95 (ms)" for m in models] + ["within SLO"],
               ["---:"] * (4 + len(models)) + ["---"], stage_rows),
        "",
        knee,
        "",
        f"Locust's own summary of the run: [{results_link}loadtest_step.md]({results_link}loadtest_step.md).",
    ])


def _llm_capacity_headline(llm: Mapping[str, Any], results_link: str) -> list[str]:
    continuous, ratios = llm["continuous"], llm["ratios"]
    return ["LLM capacity (p95 TTFT, TPOT within target)",
            f"goodput {_rate(continuous['llm_goodput_rps'])} req/s; {_num(continuous['saturated_tokens_per_s'])} "
            "tokens/s saturated",
            f"{_pct(ratios['saturated_continuous_vs_decode_limit'], 0)} of the decode limit"
            + (f", {_ratio(ratios[f'saturated_continuous_vs_{LLM_PEER}'])} transformers' continuous batching"
               if ratios.get(f"saturated_continuous_vs_{LLM_PEER}") is not None else ""),
            f"[llm.json]({results_link}llm.json)"]


def render_headline(results: Mapping[str, Mapping[str, Any]], results_link: str) -> str:
    goodput, llm, overload, batch, step = (results[name] for name in RESULT_FILES)
    slo_bucketed = goodput["setups"]["slo_bucketed"]["goodput_rps"]
    isolation = overload["isolation"]["b"]
    crash = overload["crash"]["with_retries"]
    last_stage = step["stages"][-1]
    rows = [
        ["embedding goodput (p95 ≤ SLO)",
         f"{_num(slo_bucketed)} req/s, {_pct(goodput['ratios']['slo_bucketed_vs_ceiling'])} of the ceiling",
         f"{_ratio(goodput['ratios']['slo_bucketed_vs_default_batching'], 1)} the goodput of Triton's default batching",
         f"[goodput.json]({results_link}goodput.json)"],
        ["LLM streaming throughput",
         f"{_num(llm['continuous']['tokens_per_s'])} tokens/s, TTFT p95 {llm['continuous']['ttft_p95_s']:.2f} s",
         f"{_ratio(llm['ratios']['tokens_per_s_continuous_vs_static'])} the tokens/s of static batching",
         f"[llm.json]({results_link}llm.json)"],
        *([_llm_capacity_headline(llm, results_link)] if "decode_limit_tokens_per_s" in llm else []),
        *([f"overload at {_num(phase['offered_rps'] / phase['goodput_rps'], 0)}{TIMES} goodput",
           f"{_int(phase['ok'] / phase['duration_s'])} req/s served, {_int(phase['lost'])} lost, "
           f"{_int(phase['failed_other'])} failed",
           f"admitted p95 / p99 {_int(phase['admitted_p95_ms'])} / {_int(phase['admitted_p99_ms'])} ms",
           f"[overload.json]({results_link}overload.json)"]
          for phase in (overload[part] for part in ("overload", "overload_10x") if part in overload)),
        ["tenant isolation", f"premium p95 {isolation['p95_ms_with_flood']:.1f} ms beside a flood",
         f"{isolation['p95_ms_alone']:.1f} ms alone", f"[overload.json]({results_link}overload.json)"],
        ["crash of an instance", f"{_int(crash['failed'])} failed with retries",
         f"whole again after {crash['seconds_to_recover']:.1f} s", f"[overload.json]({results_link}overload.json)"],
        ["batch API", f"{_num(batch['batch_api']['items_per_s'])} items/s",
         f"{batch['batch_api']['ratio']:.2f} of direct calls", f"[batch.json]({results_link}batch.json)"],
        ["Locust step ramp", f"{_num(last_stage['throughput_rps'])} req/s at {last_stage['users']} users, "
         f"{'PASS' if step['passed'] else 'FAIL'}", "p95 within the SLO at every stage"
         if all(stage["within_slo"] for stage in step["stages"]) else "SLO missed at some stage",
         f"[loadtest_step.json]({results_link}loadtest_step.json)"],
    ]
    machines = sorted({_hardware(results[name]) for name in RESULT_FILES if results[name].get("hardware")})
    return "\n".join([
        _table(["benchmark", "result", "against", "from"], ["---", "---", "---", "---"], rows),
        "",
        f"Measured on {'; '.join(machines)}. Commands, details, plots and method: "
        "[docs/benchmarks.md](docs/benchmarks.md).",
    ])


def render_goodput_models(results: Mapping[str, Mapping[str, Any]], results_link: str) -> str:
    """One row per `results/goodput_<model>.json`: the same three setups and ceiling on a user's
    model (`bench goodput --model NAME`)."""
    if not results:
        return "No model besides `embed` has a goodput result yet (`python -m tools bench goodput --model NAME`)."
    rows, commands = [], []
    for name, result in sorted(results.items()):
        setups, ratios = result["setups"], result["ratios"]
        ceiling = result.get("ceiling_rps")  # none for an external model: its backend runs only in the server
        rows.append([f"`{name}`", f"`{result['workload']}`" if result.get("workload") else "-", _int(result["slo_ms"]),
                     *(_num(setups[setup]["goodput_rps"]) for setup in GOODPUT_SETUPS),
                     _num(ceiling) if ceiling is not None else "-",
                     f"**{_ratio(ratios['slo_bucketed_vs_default_batching'], 1)}**",
                     _pct(ratios["slo_bucketed_vs_ceiling"]) if ceiling is not None else "-",
                     f"[{name}]({results_link}goodput_{name}.json)"])
        commands.append(f"- `{name}`: `{result['command']}`, measured {result['measured_at']} on {_hardware(result)}; "
                        f"{result['rounds']} rounds, medians")
    return "\n".join([
        _table(["model", "workload", "SLO p95 (ms)", "`no_batching`", "`default_batching`", "`slo_bucketed`",
                "ceiling", "kit vs. default", "of the ceiling", "file"],
               ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---"], rows),
        "",
        *commands,
    ])


def _setup_goodput(result: Mapping[str, Any], setup: str) -> str:
    data = result["setups"].get(setup)
    return _num(data["goodput_rps"]) if data is not None else "-"


def mix_row(model: str, result: Mapping[str, Any], stem: str, results_link: str) -> list[str]:
    """One mix's row: its setups' goodput, the ceiling and the kit's ratios ("-" where the run
    had no such setup or ceiling)."""
    ratios = result.get("ratios", {})
    ceiling = result.get("ceiling_rps")
    versus_default = ratios.get("slo_bucketed_vs_default_batching")
    versus_ceiling = ratios.get("slo_bucketed_vs_ceiling")
    return [f"`{model}`", f"`{result['workload']}`", _int(result["slo_ms"]),
            *(_setup_goodput(result, setup) for setup in GOODPUT_SETUPS),
            _num(ceiling) if ceiling is not None else "-",
            f"**{_ratio(versus_default, 1)}**" if versus_default is not None else "-",
            _pct(versus_ceiling) if versus_ceiling is not None else "-",
            f"[{stem}.json]({results_link}{stem}.json)"]


def render_goodput_mixes(results: Mapping[str, Mapping[str, Any]], results_link: str) -> str:
    """One row per mix a model's goodput was measured on: the default result file first
    (results/goodput.json, results/goodput_<model>.json), then each `<that stem>.<mix>.json`."""
    mixes: Mapping[str, Mapping[str, Any]] = results.get(MIX_GOODPUT, {})
    bases = sorted({stem.split(".", 1)[0] for stem in mixes} | {DEFAULT_GOODPUT},
                   key=lambda stem: (stem != DEFAULT_GOODPUT, stem))
    rows, commands = [], []
    for base in bases:
        default = (results[DEFAULT_GOODPUT] if base == DEFAULT_GOODPUT
                   else results.get(MODEL_GOODPUT, {}).get(base.removeprefix("goodput_")))
        own = sorted((stem, result) for stem, result in mixes.items() if stem.split(".", 1)[0] == base)
        for stem, result in ([(base, default)] if default is not None else []) + own:
            rows.append(mix_row(result.get("model", "embed"), result, stem, results_link))
            if stem != base:
                commands.append(f"- `{stem}.json`: `{result['command']}`, measured {result['measured_at']} on "
                                f"{_hardware(result)}; {result['rounds']} rounds, medians")
    table = _table(["model", "mix", "SLO p95 (ms)", "`no_batching`", "`default_batching`", "`slo_bucketed`",
                    "ceiling", "kit vs. default", "of the ceiling", "file"],
                   ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---"], rows)
    if not commands:
        return "\n".join([table, "", "No other mix has a goodput result yet "
                           "(`python -m tools bench goodput --mixes embed_mix,embed_long_tail,embed_bimodal`)."])
    return "\n".join([table, "", *commands])


DERIVATION = "derivation"  # results/derivation.json: optional until `bench derivation` has run


def render_derivation(result: Mapping[str, Any] | None, results_link: str) -> str:
    """Per model: the derived, tuned and search-best goodput (medians of the final rounds), the
    measuring each took, and whether the targets hold."""
    if not result:
        return ("No derivation result yet: `python -m tools bench derivation` writes "
                "`results/derivation.json` (about 90 minutes a model on 2 vCPU).")
    rows = []
    for name, entry in sorted(result["models"].items()):
        targets = entry["targets"]
        rows.append([
            f"`{name}`", _num(entry["derived_goodput_rps"]), _num(entry["tuned_goodput_rps"]),
            _num(entry["search_best_goodput_rps"]), ",".join(map(str, entry.get("search_best_edges") or [])) or "-",
            f"**{_pct(entry['derived_vs_search_best'], 0)}**",
            f"{_num(entry['derived_measure_s'] / 60)} / {_num(entry['tuned_measure_s'] / 60)} / "
            f"{_num(entry['search_measure_s'] / 60)} ({entry['search_points']} points)",
            f"**{_pct(entry['derived_measure_share'], 0)}**",
            ", ".join(f"{'met' if met else 'NOT met'}: {what.replace('_', ' ')}" for what, met in targets.items()),
        ])
    table = _table(["model", "derived (req/s)", "tuned", "search best", "search best's edges", "derived / best",
                    "measuring min: derived / tuned / search", "derived's share of the search's time", "targets"],
                   ["---", "---:", "---:", "---:", "---", "---:", "---", "---:", "---"], rows)
    runs = []
    for name, entry in sorted(result["models"].items()):
        run = {**{key: result[key] for key in ("hardware", "measured_at", "command", "options") if key in result},
               **entry}  # an entry says where it was measured; an older file said it once for all
        runs.append(f"- `{name}`: medians of {run['options']['rounds']} final rounds, measured {run['measured_at']} "
                    f"on {_hardware(run)} by `{run['command']}`")
    return "\n".join([table, "", *runs, "", f"Each model's figures come from one run on one machine "
                      f"([derivation.json]({results_link}derivation.json), plot "
                      f"[derivation.png]({results_link}derivation.png)); every point of the search and of tune is "
                      f"in `search_MODEL.json` and `tune_MODEL.json` beside it."])


SECTION_RENDERERS: dict[str, Callable[[Mapping[str, Any], str], str]] = {
    "goodput": render_goodput,
    "llm": render_llm,
    "overload": render_overload,
    "batch": render_batch,
    "loadtest_step": render_loadtest_step,
}


def render_sections(results: Mapping[str, Mapping[str, Any]], results_link: str) -> dict[str, str]:
    """Every section, its Markdown keyed by its marker name, with plots linked by `results_link`."""
    sections = {}
    for name, render in SECTION_RENDERERS.items():
        try:
            sections[name] = render(results[name], results_link)
        except (KeyError, TypeError, ZeroDivisionError) as error:
            raise ReportError(f"results/{name}.json: a field the report needs is missing or malformed "
                              f"({type(error).__name__}: {error})") from None
    try:
        sections[MODEL_GOODPUT] = render_goodput_models(results.get(MODEL_GOODPUT, {}), results_link)
    except (KeyError, TypeError, ZeroDivisionError) as error:
        raise ReportError(f"results/goodput_*.json: a field the report needs is missing or malformed "
                          f"({type(error).__name__}: {error})") from None
    try:
        sections[MIX_GOODPUT] = render_goodput_mixes(results, results_link)
    except (KeyError, TypeError, ZeroDivisionError) as error:
        raise ReportError(f"results/goodput*.<mix>.json: a field the report needs is missing or malformed "
                          f"({type(error).__name__}: {error})") from None
    try:
        sections[DERIVATION] = render_derivation(results.get(DERIVATION), results_link)
    except (KeyError, TypeError, ZeroDivisionError) as error:
        raise ReportError(f"results/{DERIVATION}.json: a field the report needs is missing or malformed "
                          f"({type(error).__name__}: {error})") from None
    try:
        sections["headline"] = render_headline(results, results_link)
    except (KeyError, TypeError, ZeroDivisionError) as error:
        raise ReportError(f"results/*.json: a field of the headline table is missing or malformed "
                          f"({type(error).__name__}: {error})") from None
    return sections


def structure_problems(text: str, known: Mapping[str, str], required: tuple[str, ...],
                       where: str) -> list[str]:
    """Markers in `text` that `splice` cannot use: a required section missing, an unknown name,
    an opening marker without its closing one."""
    closed = {match["name"] for match in MARKER.finditer(text)}
    opened = set(re.findall(r"<!-- report:([a-z_]+) -->", text))
    problems = [f"{where}: no '<!-- report:{name} -->' section" for name in required if name not in opened]
    problems += [f"{where}: unknown report section '{name}' (known: {', '.join(sorted(known))})"
                 for name in sorted(opened - set(known))]
    problems += [f"{where}: section '{name}' has no closing '<!-- /report:{name} -->' marker"
                 for name in sorted(opened - closed)]
    return problems


def splice(text: str, sections: Mapping[str, str]) -> str:
    """`text` with the body between each pair of markers replaced by its section (names that
    `sections` lacks are left as they are: `structure_problems` reports them)."""

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in sections:
            return match[0]
        return f"<!-- report:{name} -->\n{sections[name]}\n<!-- /report:{name} -->"

    return MARKER.sub(replace, text)


def drift(text: str, sections: Mapping[str, str], required: tuple[str, ...], where: str) -> list[str]:
    """What in `text` disagrees with the rendered sections: bad markers and stale sections."""
    problems = structure_problems(text, sections, required, where)
    problems += [f"{where}: section '{match['name']}' differs from the result files"
                 for match in MARKER.finditer(text)
                 if match["name"] in sections and match["body"] != sections[match["name"]] + "\n"]
    return problems


def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Read `results_dir/<name>.json` for every result file the report renders (I/O)."""
    results = {}
    for name in RESULT_FILES:
        path = results_dir / f"{name}.json"
        try:
            results[name] = json.loads(path.read_text())
        except FileNotFoundError:
            raise ReportError(f"{path}: no such result file; its benchmark writes it") from None
        except json.JSONDecodeError as error:
            raise ReportError(f"{path}: not valid JSON ({error})") from None
    derivation = results_dir / f"{DERIVATION}.json"
    if derivation.is_file():
        try:
            results[DERIVATION] = json.loads(derivation.read_text())
        except json.JSONDecodeError as error:
            raise ReportError(f"{derivation}: not valid JSON ({error})") from None
    results[MODEL_GOODPUT] = {}
    results[MIX_GOODPUT] = {}
    for path in sorted(results_dir.glob("goodput*.json")):
        if path.stem != DEFAULT_GOODPUT and "." not in path.stem and not path.stem.startswith("goodput_"):
            continue  # not a goodput result of this kit's naming
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ReportError(f"{path}: not valid JSON ({error})") from None
        if "." in path.stem:  # another mix's result beside its default (`bench goodput --mixes`)
            results[MIX_GOODPUT][path.stem] = result
        elif path.stem != DEFAULT_GOODPUT:
            results[MODEL_GOODPUT][path.stem.removeprefix("goodput_")] = result
    return results


def update_documents(documents: tuple[Document, ...], results: Mapping[str, Mapping[str, Any]],
                     check: bool) -> list[str]:
    """Rewrite each document's sections from the results, or with `check` only list the drift;
    returns the problems found (I/O: reads the documents, writes the ones that changed unless
    `check`; a document with bad markers is left as it is)."""
    problems: list[str] = []
    for document in documents:
        sections = render_sections(results, document.results_link)
        try:
            text = document.path.read_text()
        except FileNotFoundError:
            problems.append(f"{document.path}: no such document")
            continue
        if check:
            problems += drift(text, sections, document.sections, str(document.path))
            continue
        broken = structure_problems(text, sections, document.sections, str(document.path))
        if broken:
            problems += broken
            continue
        spliced = splice(text, sections)
        if spliced != text:
            document.path.write_text(spliced)
    return problems
