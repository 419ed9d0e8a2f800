"""Benchmarks against a real tritonserver, each with its baselines in the same run.

`goodput`: the highest offered request rate (open loop, Poisson arrivals) at which at
least 95% of requests finish within the SLO and none fail, for three setups of one model of
the serving spec (`--model`, default `embed`: a text encoder, a text classifier or a tensor
model) on its workload's length mix: texts (text pairs for a model that takes pairs), or for
a tensor model random tensors of each input's type whose length on the variable axis follows
the mix (an input of one value per position, a mask, is all ones); a fixed-shape tensor model
needs no workload (one row a request unless --workload gives rows_per_request), nor does an
external model (the user's own Triton model: its config.pbtxt's fixed-shape inputs):
  no_batching       one bucket model, every input padded to the largest bucket (256 tokens
                    for embed; a fixed-shape model's one bucket), no dynamic batching
  default_batching  one bucket model, inputs padded to the largest bucket, Triton's dynamic
                    batching with default knobs
  slo_bucketed      this project's buckets with SLO-derived configs (router + bucket models)
plus the ceiling: the same mix run straight through ONNX Runtime in-process, ideally
bucketed at the best measured batch sizes (what this hardware can do at all).
An external model is called through the router in every setup; its baselines are the user's
own config.pbtxt (max_batch_size and instance_group as written) without dynamic batching and
with Triton's `dynamic_batching { }`; slo_bucketed merges the fields gen-config derives. Its
backend runs only inside tritonserver, so it has no ceiling: `ceiling_rps` is null and
`ceiling_note` says why. Each setup serves a copy of the model's folder under build/bench/
(files hard-linked, config.pbtxt written fresh); the user's repository is never written.
The model must be installed in model_repository/ (build-models, add-model) and profiled.
The machine's speed drifts while the searches run (shared hosts), so the full run repeats
the setups and the ceiling in rounds (`--repeats`, default 3), each round's ceiling measured
right after its searches, and reports medians: each setup's median goodput, the median
ceiling, and the median of the rounds' paired ratios (a round's goodput over the same
round's ceiling), with every round's figures beside them.
Every setup runs without the router's per-tenant quotas (one anonymous tenant sends all
the load; quotas are `bench overload`'s subject); admission and queue bounds stay.
With slo_bucketed among the setups, each round also measures (medians in the report):
  light_load        after its search, on the slo_bucketed server: the mix's short requests
                    (those of the smallest bucket) open loop at 10% of the model's
                    expected_rps (100 of them; --quick fewer, in its first round only),
                    after as much light load unmeasured as the router takes to switch to its
                    light regime (its linger_regimes: rate window + hold; not with --quick):
                    p50_ms, p95_ms; and
                    unbatched_p50_ms, the same requests one at a time through the router on
                    a server whose bucket models do not linger (max_queue_delay 0, no
                    preferred batch; one more server start a round); ratio = p50 / unbatched
  router_overhead_ms  on that server, one request at a time over HTTP, in turn: the router's
                    request, then the same rows straight to the bucket model version it calls
                    (200 pairs, --quick fewer); p50 and p95 of the router's latency less the
                    direct one's, pair by pair; and python_floor_ms: as many requests of the
                    short bucket in turn as triples, the router's, the same rows to a Python
                    model that only forwards them to the bucket model (bench_forward), and
                    straight: what any Python model in front costs, and the router's own work
  router_cpu_ms_per_request  tritonserver's and the router's CPU per request in a router-only
                    phase less theirs in a direct-only phase of as many requests (the bucket
                    models run the same batches in both)
The mix sets both the requests and the configs: `--workload FILE` derives the configs for
FILE's length mix as if the spec named it, and `--mixes A,B,C` runs the whole benchmark once
per mix, each with its own configs. The model's own mix writes --out; another mix writes
OUT_STEM.MIX.json beside it (results/goodput.embed_long_tail.json for
loadtest/workloads/embed_long_tail.toml), so results/goodput.json stays the spec's mix.
The load generator runs on the same machine, so its own CPU per request is taken from the
server it measures (the ceiling pays none): by default it sends over Triton's HTTP endpoint
with a lean keep-alive client (`tools.clients.http_infer`, about half of tritonclient's gRPC
cost per request in this open loop); `--protocol grpc` measures through tritonclient's
gRPC client instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tools.batch.pg_server import LocalPostgres
from tools.bench import batch as bench_batch
from tools.bench import derivation as bench_derivation
from tools.bench import goodput as bench_goodput
from tools.bench import llm as bench_llm
from tools.bench import overload as bench_overload
from tools.bench import signals as bench_signals
from tools.bench.harness import measured_goodput, write_json, write_report
from tools.bench.payloads import find_model
from tools.bench.transformers_cb import PeerError
from tools.cli._options import command_line
from tools.clients.tenant_token import KeysError, tenant_parameters
from tools.paths import DEFAULT_SPEC, REPO_ROOT
from tools.planning.derivation import InfeasibleSLO
from tools.repository.sources import SourceError
from tools.server.triton_server import ServerError
from tools.spec.profile import ProfileError, load_profile
from tools.spec.serving import SpecError, load_spec
from tools.spec.workload import DEFAULT_WORKLOAD, load_chat_workload, load_workload


def log(message: str) -> None:
    print(message, flush=True)


def comma_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (help_text, description, add, run_benchmark) in BENCHMARKS.items():
        benchmark = sub.add_parser(name, help=help_text, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        add(benchmark)
        benchmark.set_defaults(benchmark_run=run_benchmark)


def run(args: argparse.Namespace) -> int:
    return args.benchmark_run(args)


# ------------------------------------------------------------------ goodput


def add_goodput_arguments(parser: argparse.ArgumentParser) -> None:
    setups = bench_goodput.SETUPS
    parser.add_argument("--model", default="embed",
                        help="the spec's model to benchmark, by name ([models.NAME]: a text encoder, a text "
                             "classifier, a tensor model or an external model, which has no ceiling) "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON; a PNG plot is written beside it (default: results/goodput.json for "
                             "embed, results/goodput_NAME.json for another model)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--profile", type=Path, default=None, help="latency profile (default: the spec's)")
    parser.add_argument("--workload", type=Path, default=None,
                        help="length mix, in tokens or positions on a tensor model's variable axis: the requests "
                             "follow it and the configs are derived for it (each bucket's traffic share), as if "
                             "the spec named it; the result goes beside --out, named by the mix, unless it is the "
                             "model's own (default: the model's workload in the spec; a fixed-shape model without "
                             "one sends one row a request)")
    parser.add_argument("--mixes", type=comma_list, default=None, metavar="MIX,...",
                        help="run the whole benchmark once per mix, each with its configs derived for it: workload "
                             "files, or names of files in loadtest/workloads/ (embed_mix,embed_long_tail,"
                             "embed_bimodal); the model's own mix writes --out, another OUT_STEM.MIX.json beside it "
                             "(results/goodput.embed_long_tail.json)")
    parser.add_argument("--setups", default=",".join(setups),
                        help=f"comma-separated subset of {', '.join(setups)} (default: all)")
    parser.add_argument("--step-seconds", type=float, default=10.0, help="load per measured rate (default: 10)")
    parser.add_argument("--start-rps", type=float, default=4.0, help="first rate of each search (default: 4)")
    parser.add_argument("--max-steps", type=int, default=11, help="measured rates per setup at most (default: 11)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of every search and the ceiling, each round's ceiling right after its "
                             "searches; medians are reported (default: 3, with --quick 1)")
    parser.add_argument("--protocol", choices=bench_goodput.PROTOCOLS, default="http",
                        help="how the load generator sends requests: http, a lean keep-alive client on "
                             "Triton's HTTP endpoint (least CPU taken from the server it measures), or grpc, "
                             "tritonclient's gRPC client (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="short form for the test suite: 3 s steps, 4 rates per setup, small ceiling run, "
                             "one round unless --repeats is given")


def run_goodput(args: argparse.Namespace) -> int:
    setups = comma_list(args.setups)
    unknown = sorted(set(setups) - set(bench_goodput.SETUPS))
    if unknown or not setups:
        print(f"error: unknown setups {unknown}; choose from {', '.join(bench_goodput.SETUPS)}", file=sys.stderr)
        return 2
    options = bench_goodput.goodput_options(args.quick, args.step_seconds, args.start_rps, args.max_steps,
                                            args.repeats, args.protocol)
    if options.repeats < 1:
        print(f"error: --repeats must be >= 1, got {options.repeats}", file=sys.stderr)
        return 2
    if args.mixes is not None and args.workload is not None:
        print("error: --workload and --mixes: give the mix with one of them", file=sys.stderr)
        return 2
    if args.mixes is not None and not args.mixes:
        print("error: --mixes needs at least one workload file or name", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        model = find_model(spec, args.model)
        profile = load_profile(args.profile or spec.profile)
        mix_paths = ([bench_goodput.resolve_mix(mix) for mix in args.mixes] if args.mixes is not None
                     else [args.workload or model.workload])
        # Each mix's file is read before any server starts: a typo fails at once, not an hour in.
        mixes = [(path, load_workload(path) if path is not None else None) for path in mix_paths]
    except (SpecError, ProfileError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or goodput_results(model.name)
    outs = [bench_goodput.mix_results_path(out, path, model.workload) for path, _ in mixes]
    if len(set(outs)) < len(outs):
        print(f"error: --mixes names one mix twice (result files {', '.join(map(str, outs))})", file=sys.stderr)
        return 2
    for path, workload in mixes:
        mix_out = bench_goodput.mix_results_path(out, path, model.workload)
        try:
            report = bench_goodput.run_benchmark(spec, bench_goodput.for_mix(model, path), profile, workload, setups,
                                                 options, command_line(), log)
        except ServerError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except (SpecError, ProfileError, SourceError, InfeasibleSLO) as err:  # its configs or texts cannot be made
            print(f"error: {err}", file=sys.stderr)
            return 2
        write_report(report, mix_out, bench_goodput.plot_goodput, log)
    return 0


def goodput_results(model: str) -> Path:
    """Where a model's goodput report goes by default: results/goodput.json for the built-in
    `embed` (what `bench overload` and `bench signals` read), results/goodput_<model>.json else."""
    return Path("results/goodput.json") if model == "embed" else Path(f"results/goodput_{model}.json")


# ------------------------------------------------------------------ llm


# The fixed-rate options' defaults, full and --quick (options given explicitly win).
LLM_FIXED_DEFAULTS = {"rate": (2.0, 1.0), "duration": (180.0, 6.0), "warmup": (60.0, 1.0),
                      "drain_timeout": (900.0, 240.0)}


def add_llm_arguments(parser: argparse.ArgumentParser) -> None:
    setups = bench_llm.ALL_SETUPS
    full, quick = bench_llm.FULL, bench_llm.QUICK
    fixed_full = {name: values[0] for name, values in LLM_FIXED_DEFAULTS.items()}
    fixed_quick = {name: values[1] for name, values in LLM_FIXED_DEFAULTS.items()}
    parser.add_argument("--out", type=Path, default=Path("results/llm.json"),
                        help="result JSON; a PNG plot is written beside it (default: %(default)s)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC,
                        help="serving spec: the engine, and the ttft_p95_ms and tpot_p95_ms the goodput search "
                             "judges by (default: %(default)s)")
    parser.add_argument("--model", default="llm", help="the spec's [llm_models.<name>] to run (default: %(default)s)")
    parser.add_argument("--workload", type=Path, default=bench_llm.DEFAULT_CHAT_WORKLOAD,
                        help="chat workload (default: %(default)s)")
    parser.add_argument("--setups", default=",".join(setups),
                        help=f"comma-separated subset of {','.join(setups)}; {bench_llm.PEER} is transformers' own "
                             "continuous batching in-process, measured saturated only (its virtualenv is made under "
                             "build/ with pip the first time) (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help=f"short form for the test suite: {fixed_quick['duration']:g} s at "
                             f"{fixed_quick['rate']:g} req/s at the fixed rate (the first {fixed_quick['warmup']:g} s "
                             f"warm-up), one {quick.step_s:g} s goodput step at {quick.start_rps:g} req/s, "
                             f"{quick.saturate_warmup_s + quick.saturate_s:g} s of closed loop at "
                             f"{quick.concurrency} streams, {quick.limit_steps} decode-limit steps; options given "
                             "explicitly still apply")
    fixed = parser.add_argument_group("the fixed-rate comparison (open loop, the same arrivals for every setup)")
    fixed.add_argument("--rate", type=float, default=None,
                       help=f"arrivals per second (default: {fixed_full['rate']:g}: clients ask for about 110 "
                            "tokens/s, which the "
                            "continuous engine carries on 2 vCPU with p95 time to first token under 1 s also when "
                            "the machine runs slow; its capacity there was 165 to 290 tokens/s from one day to the "
                            "next)")
    fixed.add_argument("--duration", type=float, default=None,
                       help=f"seconds of arrivals per setup (default: {fixed_full['duration']:g})")
    fixed.add_argument("--warmup", type=float, default=None,
                       help="seconds at the start left out of the steady-state figures: about the longest answer's "
                            f"time, for the in-flight work to stop growing (default: {fixed_full['warmup']:g})")
    fixed.add_argument("--drain-timeout", type=float, default=None,
                       help="seconds to wait for the last requests after arrivals stop; requests still running then "
                            f"are cancelled and counted unfinished (default: {fixed_full['drain_timeout']:g}; static "
                            "batching took 310 s at 2.0 req/s and over 600 s at 3.75)")
    fixed.add_argument("--seed", type=int, default=0,
                       help="seed of the arrivals and request mix, at the fixed rate and in each goodput step "
                            "(default: %(default)s)")
    capacity = parser.add_argument_group("capacity (each engine setup on the same server after the fixed rate)")
    capacity.add_argument("--search-start-rps", type=float, default=None,
                          help="the goodput search's first rate; it doubles while a rate passes, then bisects to "
                               f"{full.rel_tolerance * 100:.0f}%% (default: {full.start_rps:g})")
    capacity.add_argument("--search-min-rps", type=float, default=None,
                          help="the search's lowest rate: a setup that fails there has goodput 0 "
                               f"(default: {full.min_rps:g})")
    capacity.add_argument("--search-max-steps", type=int, default=None,
                          help=f"rates measured per setup at most (default: {full.max_steps})")
    capacity.add_argument("--step-seconds", type=float, default=None,
                          help="arrivals per goodput step; a low rate's step lasts long enough for about "
                               f"{full.min_step_requests} requests (default: {full.step_s:g})")
    capacity.add_argument("--step-warmup", type=float, default=None,
                          help="seconds at the start of a goodput step whose requests are not judged "
                               f"(default: {full.step_warmup_s:g})")
    capacity.add_argument("--concurrency", type=int, default=None,
                          help="closed-loop streams for the saturated tokens/s, each sending its next request when "
                               "its last finished (default: a quarter more than the engine's max_num_seqs, so "
                               "requests always wait for its batch slots)")
    capacity.add_argument("--saturate-seconds", type=float, default=None,
                          help=f"closed-loop seconds whose tokens count (default: {full.saturate_s:g})")
    capacity.add_argument("--saturate-warmup", type=float, default=None,
                          help="closed-loop seconds before tokens count: the first prefills, and the "
                               "long answers gathering in the batch (default: "
                               f"{full.saturate_warmup_s:g})")
    capacity.add_argument("--limit-steps", type=int, default=None,
                          help=f"timed steps of each of the decode limit's bursts (default: {full.limit_steps})")
    capacity.add_argument("--hold-rounds", type=int, default=None,
                          help="rounds of the stream-hold comparison on the continuous setup's server, each a "
                               "closed loop on a copy of the model that sends every token, then one on the model "
                               f"as served (default: {full.hold_rounds}; with --quick {quick.hold_rounds}: the copy "
                               "costs an engine load)")


# --option -> CapacityOptions field
LLM_CAPACITY_OPTIONS = {"search_start_rps": "start_rps", "search_min_rps": "min_rps", "search_max_steps": "max_steps",
                        "step_seconds": "step_s", "step_warmup": "step_warmup_s", "concurrency": "concurrency",
                        "saturate_seconds": "saturate_s", "saturate_warmup": "saturate_warmup_s",
                        "limit_steps": "limit_steps", "hold_rounds": "hold_rounds"}


def llm_options(args: argparse.Namespace) -> bench_llm.CapacityOptions:
    """The capacity options: --quick's or the full run's, with those given explicitly on top.
    ValueError names what is out of bounds."""
    given = {field: getattr(args, option) for option, field in LLM_CAPACITY_OPTIONS.items()
             if getattr(args, option) is not None}
    return dataclasses.replace(bench_llm.QUICK if args.quick else bench_llm.FULL, **given)


def run_llm(args: argparse.Namespace) -> int:
    setups = comma_list(args.setups)
    if not setups or set(setups) - set(bench_llm.ALL_SETUPS):
        print(f"error: --setups takes a subset of {', '.join(bench_llm.ALL_SETUPS)}, got {args.setups!r}",
              file=sys.stderr)
        return 2
    if "continuous" not in setups and bench_llm.PEER in setups:
        print(f"error: {bench_llm.PEER} is measured against continuous: --setups needs continuous too",
              file=sys.stderr)
        return 2
    for name, (full, quick) in LLM_FIXED_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if not (args.rate > 0 and args.duration > 0):
        print("error: --rate and --duration must be > 0", file=sys.stderr)
        return 2
    if not 0 <= args.warmup < args.duration:
        print(f"error: --warmup must be >= 0 and shorter than --duration ({args.duration:g} s)", file=sys.stderr)
        return 2
    try:
        options = llm_options(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        profile = load_profile(spec.profile)
        workload = load_chat_workload(args.workload)
        llm = next((m for m in spec.llm_models if m.name == args.model), None)
        if llm is None:
            raise SpecError(f"{spec.path}: no [llm_models.{args.model}]")
    except (SpecError, ProfileError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        report = bench_llm.run_benchmark(spec, profile, llm, workload, setups, args.rate, args.duration, args.warmup,
                                         args.drain_timeout, args.seed, command_line(), log, options)
    except (ServerError, PeerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_report(report, args.out, bench_llm.plot, log)
    return 0


# ------------------------------------------------------------------ overload

OVERLOAD_PARTS = (*bench_overload.OVERLOAD_PHASES, "refusals", "isolation", "crash")


def add_overload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("results/overload.json"),
                        help="result JSON (default: %(default)s)")
    parser.add_argument("--goodput-rps", type=float, default=None,
                        help="goodput to overload at 3x and 10x (default: slo_bucketed in results/goodput.json)")
    parser.add_argument("--parts", default=",".join(OVERLOAD_PARTS),
                        help="comma-separated subset of overload (3x goodput), overload_10x, refusals (the "
                             "server's CPU per refused request), isolation, crash (default: all)")
    parser.add_argument("--steady-rps", type=float, default=10.0, help="tenant B's rate (default: %(default)s)")
    parser.add_argument("--flood-rps", type=float, default=60.0,
                        help="tenant A's rate of 256-token texts (default: %(default)s)")
    parser.add_argument("--crash-rps", type=float, default=30.0, help="traffic during the kill (default: %(default)s)")
    parser.add_argument("--victim", default="encoder_16", help="model whose instance is killed (default: %(default)s)")
    quick = bench_overload.QUICK
    parser.add_argument("--quick", action="store_true",
                        help=f"short form for the test suite: {quick.overload_s:g} s of overload at 3x, "
                             f"{quick.overload_10x_s:g} s at 10x, {quick.refusals_s:g} s of refusals, "
                             f"{quick.isolation_s:g} s isolation phases, {quick.crash_s:g} s crash phases")


def run_overload(args: argparse.Namespace) -> int:
    parts = comma_list(args.parts)
    unknown = sorted(set(parts) - set(OVERLOAD_PARTS))
    if unknown or not parts:
        print(f"error: unknown parts {unknown}; choose from {', '.join(OVERLOAD_PARTS)}", file=sys.stderr)
        return 2
    try:
        spec = load_spec(DEFAULT_SPEC)
        workload = load_workload(DEFAULT_WORKLOAD)
        # Every tenant's token, signed with the spec's keys before the server starts reading them.
        credentials = tenant_parameters(spec, bench_overload.benchmark_tenants())
    except (SpecError, KeysError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    goodput_rps = args.goodput_rps or measured_goodput()
    if {"overload", "overload_10x", "refusals"} & set(parts) and not goodput_rps:
        print("error: no measured goodput; run `python -m tools bench goodput` or pass --goodput-rps",
              file=sys.stderr)
        return 2
    durations = bench_overload.QUICK if args.quick else bench_overload.FULL
    try:
        report = bench_overload.run_benchmark(spec, workload, credentials, parts, goodput_rps, args.steady_rps,
                                              args.flood_rps, args.crash_rps, args.victim, durations,
                                              command_line(), log)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_json(report, args.out)
    log(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------ batch


def engine_list(value: str) -> tuple[str, ...]:
    engines = tuple(comma_list(value))
    unknown = [engine for engine in engines if engine not in bench_batch.ENGINES]
    if not engines or unknown:
        raise argparse.ArgumentTypeError(
            f"engines are a comma-separated subset of {', '.join(bench_batch.ENGINES)}, got {value!r}")
    return engines


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("results/batch.json"),
                        help="result JSON (default: %(default)s)")
    parser.add_argument("--items", type=int, default=2000, help="texts per run (default 2000)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setup, alternating (default 2)")
    parser.add_argument("--rows", type=int, default=4, help="rows per Triton request in both setups (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="batch API workers (default 2)")
    parser.add_argument("--max-in-flight", type=int, default=8, help="requests in flight per worker (default 8)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="direct client's requests in flight (default: workers x max-in-flight)")
    parser.add_argument("--engines", type=engine_list, default=bench_batch.ENGINES, metavar="ENGINE,...",
                        help="queue engines to run the batch API on: sqlite, postgres (a local PostgreSQL this "
                             "bench starts) (default: both)")
    parser.add_argument("--quick", action="store_true", help="short form for the test suite: 300 items, 1 round")


def run_batch(args: argparse.Namespace) -> int:
    items, rounds = (300, 1) if args.quick else (args.items, args.rounds)
    if items < 1 or rounds < 1 or args.rows < 1 or args.workers < 1 or args.max_in_flight < 1:
        print("error: --items, --rounds, --rows, --workers and --max-in-flight must be >= 1", file=sys.stderr)
        return 2
    concurrency = args.concurrency or args.workers * args.max_in_flight
    try:
        spec = load_spec(DEFAULT_SPEC)
        workload = load_workload(DEFAULT_WORKLOAD)
    except (SpecError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with contextlib.ExitStack() as stack:
            postgres_url = None
            if "postgres" in args.engines:
                pg_dir = Path(tempfile.mkdtemp(prefix="bench-batch-pg-"))
                stack.callback(shutil.rmtree, pg_dir, True)
                # PostgreSQL's defaults (fsync on): the figure is what a durable queue costs.
                postgres_url = stack.enter_context(LocalPostgres(pg_dir, port=0)).url
            report, medians = bench_batch.run_benchmark(spec, workload, args.engines, items, rounds, args.rows,
                                                        args.workers, args.max_in_flight, concurrency,
                                                        command_line(), log, postgres_url=postgres_url)
    except RuntimeError as err:  # ServerError, or a PostgreSQL that would not start
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_json(report, args.out)
    log(f"{bench_batch.summary(medians)}; wrote {args.out}")
    return 0


# ------------------------------------------------------------------ signals


def add_signals_arguments(parser: argparse.ArgumentParser) -> None:
    scenarios = bench_signals.SCENARIOS
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "data" / "metrics",
                        help="folder for <scenario>.jsonl (default: %(default)s)")
    parser.add_argument("--scenarios", default=",".join(scenarios),
                        help=f"comma-separated subset of {', '.join(scenarios)} (default: all)")
    parser.add_argument("--goodput-rps", type=float, default=None,
                        help="the measured goodput the overload doubles (default: results/goodput.json)")


def run_signals(args: argparse.Namespace) -> int:
    scenarios = comma_list(args.scenarios)
    unknown = sorted(set(scenarios) - set(bench_signals.SCENARIOS))
    if unknown or not scenarios:
        print(f"error: unknown scenarios {unknown}; choose from {', '.join(bench_signals.SCENARIOS)}",
              file=sys.stderr)
        return 2
    goodput_rps = args.goodput_rps or measured_goodput()
    if "overload" in scenarios and not goodput_rps:
        print("error: no measured goodput; run `python -m tools bench goodput` or pass --goodput-rps", file=sys.stderr)
        return 2
    spec = load_spec(DEFAULT_SPEC)
    try:
        credentials = tenant_parameters(spec, bench_signals.recorder_tenants())
    except KeysError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        bench_signals.record(spec, scenarios, args.out, goodput_rps, credentials, log)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ derivation


def add_derivation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=[], metavar="NAME",
                        help="a model of the spec to measure (repeatable; default: embed)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON, a PNG beside it, the search's and tune's reports in its folder; a "
                             "model measured before keeps its entry, with the hardware and time of its run, "
                             "unless measured again "
                             "(default: results/derivation.json; with --quick build/bench/derivation/)")
    parser.add_argument("--search-budget-min", type=float, default=60.0,
                        help="the structured search's budget per model (default: %(default)s)")
    parser.add_argument("--tune-budget-min", type=float, default=15.0,
                        help="tune's budget per model (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="final rounds of the derived, tuned and search-best configurations, in turn; "
                             "medians are reported (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="the short form for the test suite: one-minute budgets, short points, one round, "
                             "a short profile; results go to build/ unless --out is given")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted run: its profile (and the time it took) and the search's "
                             "points so far are kept, the search goes on within what is left of its budget, "
                             "tune and the final rounds run again")


def derivation_profile(spec_path: Path, quick: bool) -> Callable:
    """The derivation's measuring: `python -m tools profile --model NAME` into a copy of the
    spec's profile under build/bench/derivation/, as a user would run it; the fresh profile."""
    from tools.cli import profile as profile_cli

    def measure(model) -> object:
        spec = load_spec(spec_path)
        out = bench_derivation.DERIVATION_DIR / f"profile_{model.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.profile, out)
        parser = argparse.ArgumentParser()
        profile_cli.add_arguments(parser)
        argv = ["--spec", str(spec_path), "--model", model.name, "--out", str(out)]
        if quick:
            argv += ["--time-per-point", "0.2", "--overhead-requests", "20"]
        if profile_cli.run(parser.parse_args(argv)) != 0:
            raise ServerError(f"profiling {model.name} failed (its output is above)")
        return load_profile(out)

    return measure


def derivation_resume(model) -> tuple[object, float] | None:
    """The profile an interrupted run measured and the seconds it took, if it noted them."""
    import json

    record = bench_derivation.profiling_record(model.name)
    if not record.is_file():
        log(f"{model.name}: no interrupted run to resume ({record} is missing): measuring afresh")
        return None
    noted = json.loads(record.read_text())
    return load_profile(Path(noted["profile"])), float(noted["measure_s"])


def run_derivation(args: argparse.Namespace) -> int:
    import json

    from tools.bench.search import QUICK, ResumeError

    try:
        spec = load_spec(DEFAULT_SPEC)
        models = [find_model(spec, name) for name in (args.model or ["embed"])]
    except (SpecError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.search_budget_min <= 0 or args.tune_budget_min <= 0:
        print("error: --rounds must be >= 1 and the budgets > 0", file=sys.stderr)
        return 2
    options = bench_derivation.DerivationOptions(
        search_budget_s=args.search_budget_min * 60, tune_budget_s=args.tune_budget_min * 60, rounds=args.rounds)
    if args.quick:
        options = bench_derivation.DerivationOptions(search_budget_s=60, tune_budget_s=60, rounds=1, top_k=1,
                                                     points_per_bucket=1, points=QUICK, final=QUICK)
    report = bench_derivation.new_report(command_line(), options)
    args.out = args.out or (bench_derivation.DERIVATION_DIR / "derivation.json" if args.quick
                            else Path("results/derivation.json"))
    # The other models measured before keep their entries, each saying where and when it was measured.
    previous = json.loads(args.out.read_text()) if args.out.is_file() else None
    results_dir = args.out.parent
    measure_profile = derivation_profile(DEFAULT_SPEC, args.quick)
    resume = derivation_resume if args.resume else None
    measured_now: dict[str, dict] = {}
    for model in models:
        try:
            measured_now[model.name] = {
                **{key: report[key] for key in bench_derivation.PROVENANCE},
                **bench_derivation.run_model(spec, model, measure_profile, options, results_dir,
                                             command_line(), log, resume)}
        except ServerError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except (ResumeError, SpecError, ProfileError, SourceError, InfeasibleSLO, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        report["models"] = bench_derivation.merge_models(previous, measured_now)
        entry = report["models"][model.name]
        log(f"{model.name}: derived {entry['derived_goodput_rps']:.1f} req/s = {entry['derived_vs_search_best']:.0%} "
            f"of the search's best {entry['search_best_goodput_rps']:.1f} with {entry['derived_measure_share']:.0%} "
            f"of its measuring time; tuned {entry['tuned_goodput_rps']:.1f}")
        write_report(report, args.out, bench_derivation.plot_derivation, log)
    return 0


# benchmark -> (summary, --help text, its options, its run)
BENCHMARKS: dict[str, tuple[str, str | None, Callable[[argparse.ArgumentParser], None],
                            Callable[[argparse.Namespace], int]]] = {
    "goodput": ("goodput of no batching vs default batching vs SLO-bucketed", __doc__,
                add_goodput_arguments, run_goodput),
    "llm": ("LLM: continuous vs static batching: goodput, saturated tokens/s, decode limit, transformers' CB",
            bench_llm.__doc__,
            add_llm_arguments, run_llm),
    "overload": ("3x goodput overload, tenant isolation and crash recovery", bench_overload.__doc__,
                 add_overload_arguments, run_overload),
    "batch": ("batch API items/s against direct tritonclient calls", bench_batch.__doc__,
              add_batch_arguments, run_batch),
    "signals": ("record /metrics under steady, overload and fragmented traffic", bench_signals.__doc__,
                add_signals_arguments, run_signals),
    "derivation": ("derived knobs vs tune vs a structured search, with measuring times", bench_derivation.__doc__,
                   add_derivation_arguments, run_derivation),
}
