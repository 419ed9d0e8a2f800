"""The derivation benchmark: the derived knobs against the best a structured search finds, and
against `tune`'s winner, with the measuring time each one took, in one run on one machine.

For each model named: (1) the measuring the derivation needs, timed: a fresh latency profile
of the model (`measure_profile`, the same measuring as `python -m tools profile --model NAME`,
into a copy of the spec's profile under build/bench/derivation/); everything after it uses
that profile; (2) `python -m tools search`'s structured search within its budget
(`run_search`: every point to results/search_MODEL.json with a plot; other bucket edges are
among its points); (3) `python -m tools
tune` from the derived configuration within its budget (`run_tune`: results/tune_MODEL.json);
(4) the three winners measured again side by side on one server, `rounds` rounds in turn
(derived, tuned, search best in each round), with the longer steps of the final measure; the
medians of those rounds are the report's goodputs. The search, tune and final measurements
are `tools.bench.search.PointSession` points: the goodput criterion of `bench goodput` on the
model's mix, gen-config's own configs with the point's knobs written over the derived ones.

`summarize` (pure) turns the measurements into the report's `models.NAME` keys and the
targets: derived >= 95% of the search's best with <= 10% of its measuring time; tuned >= the
search's best within the noise of the rounds.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.bench.harness import BENCH_DIR, detect_hardware, hardware_report
from tools.bench.search import PointSession, SearchOptions, run_search, run_tune
from tools.planning.search import Config, Point, config_label
from tools.spec.profile import LatencyProfile
from tools.spec.serving import BucketedModelSpec, ServingSpec

DERIVATION_DIR = BENCH_DIR / "derivation"
DERIVED_SHARE_TARGET = 0.95  # derived goodput at least this share of the search's best ...
MEASURE_SHARE_TARGET = 0.10  # ... with at most this share of its measuring time
SETUPS = ("derived", "tuned", "search_best")
POINTS = SearchOptions()  # how the search's and tune's points measure (as `search` and `tune` do)
FINAL = SearchOptions(step_s=10.0, max_steps=8)  # the final rounds: `bench goodput`'s step length


@dataclass(frozen=True)
class DerivationOptions:
    """Budgets and measuring of one run."""

    search_budget_s: float = 60 * 60.0  # the structured search's budget per model
    tune_budget_s: float = 15 * 60.0  # tune's budget per model
    rounds: int = 3  # final rounds of the three winners; medians are reported
    top_k: int = 2  # search: candidates per bucket kept for the joint phase
    points_per_bucket: int = 4  # search: phase-1 points per bucket at most
    tune_rounds: int = 3  # tune: rounds a candidate is confirmed with
    tune_min_gain: float = 0.05  # tune: gain a candidate's median must show
    points: SearchOptions = POINTS  # how the search's and tune's points measure
    final: SearchOptions = FINAL  # how the final rounds measure

    def as_dict(self) -> dict[str, Any]:
        return {"search_budget_min": round(self.search_budget_s / 60, 2), "tune_budget_min": round(
            self.tune_budget_s / 60, 2), "rounds": self.rounds, "top_k": self.top_k,
            "points_per_bucket": self.points_per_bucket, "points": self.points.as_dict(),
            "final": self.final.as_dict()}


def summarize(goodputs: Mapping[str, Sequence[float]], derived_measure_s: float, tuned_measure_s: float,
              search_measure_s: float, search_points: int) -> dict[str, Any]:
    """A model's figures: the medians of the final rounds, the measuring times, and the targets.

    `goodputs`: setup (derived, tuned, search_best) -> its goodput in each final round. The noise
    of the rounds is the largest spread (max - min over the median) of any setup's rounds: a
    tuned median within it of the search's best counts as level.
    """
    medians = {setup: float(statistics.median(values)) for setup, values in goodputs.items()}
    spread = max(((max(values) - min(values)) / statistics.median(values) if statistics.median(values) else 0.0)
                 for values in goodputs.values())
    best = medians["search_best"]
    derived_share = medians["derived"] / best if best else 0.0
    measure_share = derived_measure_s / search_measure_s if search_measure_s else 0.0
    return {
        "derived_goodput_rps": round(medians["derived"], 2),
        "tuned_goodput_rps": round(medians["tuned"], 2),
        "search_best_goodput_rps": round(best, 2),
        "goodput_rps_by_round": {setup: [round(v, 2) for v in values] for setup, values in goodputs.items()},
        "derived_measure_s": round(derived_measure_s, 1),
        "tuned_measure_s": round(tuned_measure_s, 1),
        "search_measure_s": round(search_measure_s, 1),
        "search_points": search_points,
        "derived_vs_search_best": round(derived_share, 3),
        "derived_measure_share": round(measure_share, 3),
        "tuned_vs_search_best": round(medians["tuned"] / best, 3) if best else 0.0,
        "rounds_spread": round(spread, 3),
        "targets": {
            "derived_within_95pct_of_search_best": derived_share >= DERIVED_SHARE_TARGET,
            "derived_measuring_within_10pct": measure_share <= MEASURE_SHARE_TARGET,
            "tuned_level_with_search_best": medians["tuned"] >= best * (1.0 - spread),
        },
    }


def knobs_of(config: Config) -> dict[str, dict[str, int]]:
    return {name: knobs.as_dict() for name, knobs in sorted(config.items())}


def final_rounds(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, configs: Mapping[str, Config],
                 options: DerivationOptions, start_rps: float, log: Callable[[str], None],
                 edges: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, list[float]]:
    """Each configuration's goodput in `options.rounds` rounds, the configurations in turn within
    a round, on one server (reloading what changes between them); `edges`: setup -> the bucket
    edges it runs, where not the model's own."""
    edges = {setup: tuple(e) for setup, e in (edges or {}).items() if e}
    goodputs: dict[str, list[float]] = {setup: [] for setup in configs}
    with PointSession(spec, model, profile, options.final, log, edge_sets=list(dict.fromkeys(edges.values()))
                      ) as session:
        for round_index in range(options.rounds):
            for setup, config in configs.items():
                log(f"final round {round_index + 1} of {options.rounds}: {setup}")
                measured = session.measure(config, start_rps=max(goodputs[setup] or [start_rps]),
                                           edges=edges.get(setup, ()))
                goodputs[setup].append(measured.goodput_rps)
                log(f"  {setup}: {measured.goodput_rps:.1f} req/s")
    return goodputs


def profiling_record(model_name: str) -> Path:
    """Where a run notes how long its profile of `model_name` took (for `--resume`)."""
    return DERIVATION_DIR / f"profile_{model_name}.measure.json"


def remaining_budget_s(budget_s: float, search_report: Mapping[str, Any] | None) -> float:
    """The search budget left to a resumed run: what its earlier points and server starts did
    not spend (a fresh run: all of it)."""
    if not search_report:
        return budget_s
    spent = sum(float(point.get("measure_s", 0.0)) for point in search_report.get("points", []))
    spent += sum(float(start) for start in search_report.get("server_start_s", []))
    return max(0.0, budget_s - spent)


def run_model(spec: ServingSpec, model: BucketedModelSpec,
              measure_profile: Callable[[BucketedModelSpec], LatencyProfile], options: DerivationOptions,
              results_dir: Path, command: str, log: Callable[[str], None],
              resume: Callable[[BucketedModelSpec], tuple[LatencyProfile, float] | None] | None = None
              ) -> dict[str, Any]:
    """One model's part of the report (see the module). `resume(model)`: the profile and its
    measuring seconds of an interrupted run, if one is to be continued (its search goes on from
    its report, within what is left of its budget; tune and the final rounds run again)."""
    search_out = results_dir / f"search_{model.name}.json"
    earlier = resume(model) if resume is not None else None
    if earlier is not None:
        profile, derived_measure_s = earlier
        previous = json.loads(search_out.read_text()) if search_out.is_file() else None
        search_budget_s = remaining_budget_s(options.search_budget_s, previous)
        log(f"{model.name}: resuming the run whose profile took {derived_measure_s:.0f} s; "
            f"{search_budget_s / 60:.1f} min of the search's budget left")
    else:
        log(f"{model.name}: profiling (the derivation's measuring)")
        started = time.monotonic()
        profile = measure_profile(model)
        derived_measure_s = time.monotonic() - started
        record = profiling_record(model.name)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"profile": str(profile.path), "measure_s": round(derived_measure_s, 1)}))
        log(f"{model.name}: profiled in {derived_measure_s:.0f} s")
        search_budget_s = options.search_budget_s

    log(f"{model.name}: structured search, budget {search_budget_s / 60:.0f} min")
    search = run_search(spec, model, profile, options.points, search_budget_s, options.top_k,
                        options.points_per_bucket, search_out, earlier is None, command, log)
    if search["best"] is None:
        raise ValueError(f"{model.name}: the search measured no point within its budget; give it more")
    search_best = Point.from_dict(search["best"])

    log(f"{model.name}: tune from the derived configuration, budget {options.tune_budget_s / 60:.0f} min")
    tune_out = results_dir / f"tune_{model.name}.json"
    tune, climb = run_tune(spec, model, profile, options.points, options.tune_budget_s, options.tune_rounds,
                           options.tune_min_gain, tune_out, command, log)
    configs: dict[str, Config] = {"derived": {}, "tuned": dict(climb.incumbent), "search_best": search_best.config}
    goodputs = final_rounds(spec, model, profile, configs, options, search_best.goodput_rps, log,
                            {"search_best": search_best.edges})
    summary = summarize(goodputs, derived_measure_s, tune["measure_s"], search["measure_s"], len(search["points"]))
    return {
        **summary,
        "slo_ms": model.slo_p95_ms,
        "workload": search["workload"],
        "profile": str(profile.path),
        "configs": {setup: knobs_of(config) for setup, config in configs.items() if config},
        "search_best_label": config_label(search_best.config),
        "search_best_edges": list(search_best.edges) or list(model.bucket_lens),
        "search_edge_sets": search.get("edge_sets", []),
        "tuned_changed": tune.get("changed", []),
        "search_report": str(search_out),
        "tune_report": str(tune_out),
    }


def new_report(command: str, options: DerivationOptions) -> dict[str, Any]:
    return {
        "hardware": hardware_report(detect_hardware(None), details=True),
        "criterion": "highest offered open-loop rate with >= 95% of requests within the SLO and no errors",
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "options": options.as_dict(),
        "targets": {"derived_vs_search_best": f">= {DERIVED_SHARE_TARGET:.0%}",
                    "derived_measure_share": f"<= {MEASURE_SHARE_TARGET:.0%} of the search's measuring time",
                    "tuned": "level with the search's best within the rounds' spread"},
        "models": {},
    }


PROVENANCE = ("hardware", "measured_at", "command", "options")  # what each model's entry says of its run


def merge_models(previous: Mapping[str, Any] | None, entries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The report's `models`: the entries measured now (`entries`) and every other model of the
    `previous` report, each with the hardware, time, command and options of the run that measured
    it (an entry of a report that kept them only at its top level takes them from there). Each
    model's proof is one run on one machine; models measured apart, on other machines, sit side by
    side and say so."""
    models: dict[str, Any] = {}
    for name, entry in ((previous or {}).get("models") or {}).items():
        if name not in entries:
            models[name] = {**{key: previous[key] for key in PROVENANCE if key in previous}, **entry}
    return {**models, **entries}


def plot_derivation(report: Mapping[str, Any], path: Path) -> None:
    """Per model: the three setups' median goodput (rounds as dots) and their measuring minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(SETUPS)
    colors = {"derived": "#2e7d32", "tuned": "#6c8ebf", "search_best": "#999999"}
    for index, setup in enumerate(SETUPS):
        xs = [i + index * width for i in range(len(models))]
        values = [report["models"][m][f"{setup}_goodput_rps"] for m in models]
        axes[0].bar(xs, values, width, label=setup.replace("_", " "), color=colors[setup])
        for x, model in zip(xs, models, strict=True):
            rounds = report["models"][model]["goodput_rps_by_round"][setup]
            axes[0].plot([x] * len(rounds), rounds, "o", color="black", markersize=3)
        minutes = [report["models"][m][f"{setup.replace('search_best', 'search')}_measure_s"] / 60 for m in models]
        axes[1].bar(xs, minutes, width, label=setup.replace("_", " "), color=colors[setup])
    for ax, label in zip(axes, ("goodput, req/s (median of rounds)", "measuring, minutes"), strict=True):
        ax.set_xticks([i + width for i in range(len(models))], models)
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=7)
    machines = sorted({report["models"][m].get("hardware", report["hardware"])["description"] for m in models})
    fig.suptitle(f"derived knobs vs tune vs structured search, {'; '.join(machines)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


