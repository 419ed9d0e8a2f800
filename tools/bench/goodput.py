"""The goodput benchmark: three setups of the embedding service against the machine's ceiling.

`run_benchmark` builds a model repository per setup (`no_batching`, `default_batching`:
one 256-token bucket, `slo_bucketed`: the generated configs) under build/bench/, starts a
tritonserver on each in turn and searches for the highest open-loop rate that meets the
SLO (`search_goodput`), then runs the same texts through ONNX Runtime in-process for the
ceiling (`measure_ceiling`), in rounds; it returns the report that `python -m tools bench
goodput` writes to results/goodput.json (its --help says what each figure means). The
round medians, paired ratios and the per-step CPU breakdown are pure.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from tools.bench.harness import BENCH_DIR, build_repository, detect_hardware, hardware_report, without_tenant_quotas
from tools.bench.loadgen import LoadTarget, RateSearch, StepResult, flatten_step, run_open_loop
from tools.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.repository.configs import LLM_INFER_SUFFIX, ROUTER_VERSIONS, GeneratedModel, plan_all
from tools.server.triton_server import ServerConfig, TritonServer, free_port
from tools.spec.profile import LatencyProfile
from tools.spec.serving import ServingSpec
from tools.spec.workload import TextFactory, Workload

SETUPS = ("no_batching", "default_batching", "slo_bucketed")
DEFAULT_MAX_BATCH = 32  # a common hand-picked max_batch_size: the "default knobs" baseline
PROTOCOLS = ("http", "grpc")
DEFAULT_REPEATS = 3  # rounds of the full goodput run: a median of three outvotes one lucky or unlucky search


@dataclass(frozen=True)
class GoodputOptions:
    """How long and how hard the goodput search measures."""

    step_s: float  # seconds of open-loop load per measured rate
    start_rps: float  # first rate tried by the search
    max_steps: int  # measured rates per setup at most
    num_texts: int  # distinct payload texts drawn from the workload
    ceiling_rows: int  # rows run through ONNX Runtime for the ceiling
    repeats: int = 1  # rounds of every setup's search and the ceiling; medians are reported
    protocol: str = "http"  # how the load generator sends: "http" (tools.clients.http_infer) or "grpc" (tritonclient)


def median_index(values: Sequence[float]) -> int:
    """Index of the median of `values` (the lower middle one for an even count)."""
    if not values:
        raise ValueError("no values to take the median of")
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(values) - 1) // 2]


def round_ratios(ours: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Round by round, our figure over the reference measured in the same round (0 where the
    reference is 0): pairs taken close together in time, so a drifting machine cancels out."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} rounds of ours against {len(reference)} of the reference")
    return [o / r if r > 0 else 0.0 for o, r in zip(ours, reference, strict=True)]


def median_ratio(ours: Sequence[float], reference: Sequence[float]) -> float:
    """The median of the paired per-round ratios."""
    return float(statistics.median(round_ratios(ours, reference)))


def embed_plan(spec: ServingSpec, profile: LatencyProfile) -> list[GeneratedModel]:
    """The generated configs of the embedding service alone (the LLM is benchmarked by `bench llm`)."""
    llm_names = {m.name for m in spec.llm_models} | {f"{m.name}{LLM_INFER_SUFFIX}" for m in spec.llm_models}
    return [m for m in plan_all(spec, profile) if m.name not in llm_names]


def padded_only_plan(spec: ServingSpec, profile: LatencyProfile, batching: bool) -> list[GeneratedModel]:
    """The baselines: the router with a single 256-token bucket, so every input is padded to 256."""
    plan = {m.name: m for m in embed_plan(spec, profile)}
    model = spec.models[0]
    largest = model.bucket_lens[-1]
    router = mc.ModelConfig()
    router.CopyFrom(plan[model.name].config)
    encoder = mc.ModelConfig()
    encoder.CopyFrom(plan[model.encoder_name(largest)].config)
    encoder.ClearField("dynamic_batching")
    if batching:
        encoder.max_batch_size = DEFAULT_MAX_BATCH
        encoder.dynamic_batching.SetInParent()  # `dynamic_batching { }`: Triton's defaults
    else:
        encoder.max_batch_size = 1
    router.parameters["bucket_lens"].string_value = str(largest)
    router.parameters["bucket_max_batch"].string_value = f"{largest}:{encoder.max_batch_size}"
    # Without this project's admission control too: a baseline serves late rather than refusing.
    del router.parameters["admission"]
    router.dynamic_batching.ClearField("default_queue_policy")
    header = ("Benchmark baseline written by `python -m tools bench goodput`.",)
    return [
        GeneratedModel(model.name, router, header, "embed_model", ROUTER_VERSIONS),
        GeneratedModel(model.encoder_name(largest), encoder, header, "encoder_model", model.versions),
    ]


def _run_batches(encoders: list, batches: list[tuple]) -> float:
    """Seconds to run `batches` through `encoders` side by side (batch i on encoder i mod n)."""
    from concurrent.futures import ThreadPoolExecutor

    def lane(index: int) -> None:
        for ids, mask in batches[index::len(encoders)]:
            encoders[index].embed(ids, mask)

    started = time.perf_counter()
    with ThreadPoolExecutor(len(encoders)) as pool:  # ONNX Runtime releases the GIL while it runs
        list(pool.map(lane, range(len(encoders))))
    return time.perf_counter() - started


def measure_ceiling(texts: list[str], profile: LatencyProfile, bucket_lens: tuple[int, ...], prefix: str) -> dict:
    """Rows/s of the mix run in-process through ONNX Runtime, ideally bucketed, at the best batch sizes.

    Each bucket runs the better of two ways to use every core: one session whose thread
    pool spans all cores, or one single-threaded session per core run side by side.
    """
    from python_backends.common.tokenization import TextTokenizer
    from python_backends.embed.buckets import choose_bucket, pad_rows, truncate_tokens
    from python_backends.embed.encoder import EncoderConfig, OnnxEncoder

    tokenizer = TextTokenizer.from_file(DEFAULT_MODEL_REPOSITORY / "embed" / "1" / "tokenizer.json")
    rows_by_bucket: dict[int, list[list[int]]] = {}
    for ids in tokenizer.encode(texts):
        ids = truncate_tokens(ids, bucket_lens[-1])
        rows_by_bucket.setdefault(choose_bucket(len(ids), bucket_lens), []).append(ids)
    onnx_path = DEFAULT_MODEL_REPOSITORY / f"{prefix}{bucket_lens[0]}" / "1" / "model.onnx"
    cores = os.cpu_count() or 1
    per_bucket = {}
    total_s = 0.0
    for bucket_len, rows in sorted(rows_by_bucket.items()):
        name = f"{prefix}{bucket_len}"
        curve = profile.curve(name)
        best = max(curve.sizes, key=curve.throughput_rps)
        batches = [pad_rows(rows[start:start + best], bucket_len, tokenizer.pad_id)
                   for start in range(0, len(rows), best)]
        ways = {"one_session_all_cores": [OnnxEncoder(onnx_path, EncoderConfig(name, bucket_len, best))],
                "one_thread_per_core": [OnnxEncoder(onnx_path, EncoderConfig(name, bucket_len, best,
                                                                               intra_op_threads=1))
                                        for _ in range(cores)]}
        seconds = {}
        for way, encoders in ways.items():
            for encoder in encoders:  # warm-up
                encoder.embed(*batches[0])
            seconds[way] = _run_batches(encoders, batches)
        fastest = min(seconds, key=seconds.get)
        total_s += seconds[fastest]
        per_bucket[str(bucket_len)] = {"rows": len(rows), "batch_size": best, "way": fastest,
                                       "seconds": round(seconds[fastest], 3),
                                       "seconds_by_way": {way: round(t, 3) for way, t in seconds.items()}}
    return {"rows_per_s": len(texts) / total_s, "rows": len(texts), "buckets": per_bucket}


def cpu_breakdown(before: Mapping[str, float], after: Mapping[str, float], result: StepResult,
                  cores: int) -> dict[str, Any]:
    """Where one step's CPU went: ms per request sent, by part (the server process, each
    model's backend stubs, the load generator), and the share of the machine they used.

    Per request *sent*: a request refused at admission costs little, so under refusals the
    cost of a served request is higher than these figures.
    """
    spent = {part: max(seconds - before.get(part, 0.0), 0.0) for part, seconds in after.items()}
    spent["load_generator"] = result.client_cpu_s
    total_s = sum(spent.values())
    per_request = {part: round(seconds * 1000.0 / result.num_sent, 3) if result.num_sent else 0.0
                   for part, seconds in sorted(spent.items())}
    return {"cpu_ms_per_request": per_request,
            "cpu_ms_per_request_total": round(sum(per_request.values()), 3),
            "cpu_utilization": round(total_s / (result.duration_s * cores), 3) if result.duration_s else 0.0}


async def search_goodput(target: LoadTarget, options: GoodputOptions, log,
                         cpu_by_part: Callable[[], Mapping[str, float]] | None = None,
                         ) -> tuple[float, list[StepResult], list[dict[str, Any]]]:
    """The goodput search; with `cpu_by_part` (the local server's CPU seconds by part), each
    step's `cpu_breakdown` too (empty dicts without it)."""
    await run_open_loop(target, options.start_rps, min(3.0, options.step_s), seed=0)  # warm up, discarded
    search = RateSearch(options.start_rps, max_steps=options.max_steps, rel_tolerance=0.10)
    steps: list[StepResult] = []
    breakdowns: list[dict[str, Any]] = []
    cores = os.cpu_count() or 1
    seed = 1
    while (rate := search.next_rate()) is not None:
        before = cpu_by_part() if cpu_by_part else {}
        result = await run_open_loop(target, rate, options.step_s, seed=seed)
        breakdowns.append(cpu_breakdown(before, cpu_by_part(), result, cores) if cpu_by_part else {})
        seed += 1
        search.record(rate, result)
        steps.append(result)
        verdict = "pass" if search.passes(result) else "FAIL"
        log(f"    {rate:7.1f} rps offered: {result.goodput_fraction:6.1%} within SLO, {result.num_errors} errors, "
            f"{result.num_rejected} rejected, "
            f"p95 {result.p95_ms:7.1f} ms, {result.throughput_rps:6.1f} rps done  [{verdict}]")
        await asyncio.sleep(1.0)  # let queues drain between steps
    return search.best_rate, steps, breakdowns


def run_setup(setup: str, repository: Path, texts: list[str], slo_ms: float, options: GoodputOptions,
              log) -> dict:
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1")
    log(f"  {setup}: starting tritonserver on {repository.relative_to(REPO_ROOT)}")
    with TritonServer(config, log_path=BENCH_DIR / f"{setup}.log") as server:
        target = LoadTarget(grpc_url=server.grpc_url, model="embed", texts=tuple(texts), slo_ms=slo_ms,
                            http_url=server.http_url if options.protocol == "http" else None)
        goodput, steps, breakdowns = asyncio.run(search_goodput(target, options, log, server.cpu_seconds_by_part))
    log(f"  {setup}: goodput {goodput:.1f} rps")
    return {"goodput_rps": goodput, "repository": str(repository.relative_to(REPO_ROOT)),
            "steps": [{**flatten_step(step), **cpu} for step, cpu in zip(steps, breakdowns, strict=True)]}


def plot_goodput(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["setups"])
    values = [report["setups"][n]["goodput_rps"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["#999999", "#6c8ebf", "#2e7d32"][: len(names)])
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.1f}", ha="center", va="bottom")
    rounds = report.get("rounds", 1)
    if rounds > 1:  # each round's goodput beside its median bar
        for bar, name in zip(bars, names, strict=True):
            by_round = report["setups"][name].get("goodput_rps_by_round", [])
            ax.plot([bar.get_x() + bar.get_width() * 0.85] * len(by_round), by_round, "o", color="black",
                    markersize=3, label="one round" if name == names[0] else None)
    median = "median of rounds, " if rounds > 1 else ""
    ax.axhline(report["ceiling_rps"], color="black", linestyle="--",
               label=f"ceiling (in-process ONNX Runtime, {median}{report['ceiling_rps']:.1f})")
    ax.set_ylabel("goodput, requests/s (p95 within SLO, no errors)" + (f", median of {rounds} rounds"
                                                                          if rounds > 1 else ""), fontsize=8)
    ax.set_title(f"{report['workload']} mix, SLO p95 {report['slo_ms']:.0f} ms, {report['hardware']['description']}",
                 fontsize=9)
    ax.set_ylim(0, max([report["ceiling_rps"], *values]) * 1.3)  # room for the legend above the ceiling
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)




def goodput_options(quick: bool, step_s: float, start_rps: float, max_steps: int, repeats: int | None,
                    protocol: str) -> GoodputOptions:
    """The options of a run: the short form for the test suite (3 s steps, 4 rates, a small
    ceiling run, one round unless `repeats` is given), or the full one."""
    repeats = repeats if repeats is not None else (1 if quick else DEFAULT_REPEATS)
    if quick:
        return GoodputOptions(step_s=3.0, start_rps=start_rps, max_steps=4, num_texts=300, ceiling_rows=200,
                              repeats=repeats, protocol=protocol)
    return GoodputOptions(step_s=step_s, start_rps=start_rps, max_steps=max_steps, num_texts=2000,
                          ceiling_rows=1000, repeats=repeats, protocol=protocol)


def run_benchmark(spec: ServingSpec, profile: LatencyProfile, workload: Workload, setups: Sequence[str],
                  options: GoodputOptions, command: str, log: Callable[[str], None]) -> dict:
    """Every setup's goodput search and the ceiling, `options.repeats` rounds; the report.
    Raises `ServerError` when a server does not start or fails."""
    model = spec.models[0]
    hardware = detect_hardware(None)
    log(f"goodput benchmark on {hardware.description}; SLO p95 {model.slo_p95_ms:.0f} ms; workload {workload.name}")
    factory = TextFactory()
    texts = factory.texts_for(workload, options.num_texts)
    report: dict = {
        "hardware": hardware_report(hardware, details=True),
        "slo_ms": model.slo_p95_ms,
        "workload": workload.name,
        "criterion": "highest offered open-loop rate with >= 95% of requests within the SLO and no errors",
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": options.repeats,
        "load_generator": {"protocol": options.protocol, "on_the_measured_machine": True},
        "setups": {},
    }
    repositories = {}
    for setup in setups:
        plan = (embed_plan(spec, profile) if setup == "slo_bucketed"
                else padded_only_plan(spec, profile, setup == "default_batching"))
        repositories[setup] = build_repository(setup, without_tenant_quotas(plan, model.name))
    runs: dict[str, list[dict]] = {setup: [] for setup in setups}
    ceilings: list[dict] = []
    for round_index in range(options.repeats):
        if options.repeats > 1:
            log(f"round {round_index + 1} of {options.repeats}")
        for setup in setups:
            runs[setup].append(run_setup(setup, repositories[setup], texts, model.slo_p95_ms, options, log))
        log("  ceiling: the mix through ONNX Runtime in-process, ideal buckets, best batch sizes")
        ceilings.append(measure_ceiling(texts[: options.ceiling_rows], profile, model.bucket_lens,
                                        model.encoder_prefix))
        log(f"  ceiling: {ceilings[-1]['rows_per_s'] / workload.rows_per_request:.1f} rps")
    ceiling_by_round = [c["rows_per_s"] / workload.rows_per_request for c in ceilings]
    for setup, setup_runs in runs.items():
        by_round = [run["goodput_rps"] for run in setup_runs]
        report["setups"][setup] = {
            "goodput_rps": float(statistics.median(by_round)),
            "goodput_rps_by_round": by_round,
            "repository": setup_runs[0]["repository"],
            "steps": [{"round": index + 1, **step} for index, run in enumerate(setup_runs) for step in run["steps"]],
        }
    report["ceiling_rps"] = float(statistics.median(ceiling_by_round))
    report["ceiling_rps_by_round"] = [round(value, 1) for value in ceiling_by_round]
    report["ceiling"] = ceilings[median_index(ceiling_by_round)]  # the median round's detail
    log(f"  ceiling: median {report['ceiling_rps']:.1f} rps" + (f" (rounds {report['ceiling_rps_by_round']})"
                                                               if options.repeats > 1 else ""))
    goodputs = {name: data["goodput_rps_by_round"] for name, data in report["setups"].items()}
    if "slo_bucketed" in goodputs:
        ours = goodputs["slo_bucketed"]
        report["ratios"] = {
            "slo_bucketed_vs_ceiling": round(median_ratio(ours, ceiling_by_round), 3),
            "slo_bucketed_vs_ceiling_by_round": [round(r, 3) for r in round_ratios(ours, ceiling_by_round)],
        }
        for baseline in ("default_batching", "no_batching"):
            if baseline in goodputs and all(goodputs[baseline]):
                report["ratios"][f"slo_bucketed_vs_{baseline}"] = round(median_ratio(ours, goodputs[baseline]), 2)
        log(f"ratios (medians of the rounds' paired ratios): {report['ratios']}")
    return report
