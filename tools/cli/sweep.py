"""Sweep load against a served model: latency percentiles, throughput and goodput per step.

Open loop (`--mode open`) sends requests at Poisson arrival times for each rate in
`--rates`, never waiting for earlier answers, and measures latency from each request's
scheduled send time; `--search START` instead looks for the highest rate that meets the
SLO (doubling, then bisection). Closed loop (`--mode closed`) keeps each `--concurrency`
level of requests in flight. Texts follow a workload's length mix. Every step also reads
Triton's statistics API, so queue time (waiting to be batched) and compute time per
execution are shown for the model and, for `embed`, its bucket encoders.

Example:
  python -m tools sweep --mode open --rates 10,20,40,80 --duration 10 --slo-ms 100 --out build/sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.bench.loadgen import LoadTarget, RateSearch, plot_sweep, split_host_port
from tools.bench.sweep import (
    DEFAULT_CONCURRENCY,
    DEFAULT_RATES,
    NUM_TEXTS,
    PRIORITY_KEY,
    TIMEOUT_KEY,
    SweepError,
    check_server,
    results_document,
    split_parameters,
    sweep,
    write_results,
)
from tools.clients.tls import TlsConfigError, add_ca_argument, check_pem
from tools.spec.workload import DEFAULT_WORKLOAD, TextFactory, load_workload


def log(message: str) -> None:
    print(message, flush=True)


def command_line() -> str:
    """How this sweep was started, for the results file."""
    return "python -m tools sweep " + shlex.join(sys.argv[1:] if sys.argv[1:2] != ["sweep"] else sys.argv[2:])


# ------------------------------------------------------------------ argument types


def _number(kind: type, check: Callable[[Any], bool], requirement: str) -> Callable[[str], Any]:
    """An argparse type: parse `kind`, then check the bound; errors say what was expected."""
    what = "an integer" if kind is int else "a number"

    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}") from None
        if not check(number):
            raise argparse.ArgumentTypeError(f"{value} must be {requirement}")
        return number

    return parse


positive_float = _number(float, lambda x: x > 0, "> 0")
non_negative_float = _number(float, lambda x: x >= 0, ">= 0")
fraction = _number(float, lambda x: 0 <= x <= 1, "in [0, 1]")
positive_int = _number(int, lambda x: x >= 1, ">= 1")


def _comma_list(parse: Callable[[str], Any], what: str) -> Callable[[str], tuple[Any, ...]]:
    def parse_list(value: str) -> tuple[Any, ...]:
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {value!r}")
        return tuple(parse(item) for item in items)

    return parse_list


rate_list = _comma_list(positive_float, "rates in requests/s (e.g. 5,10,20)")
concurrency_list = _comma_list(positive_int, "concurrency levels (e.g. 1,2,4,8)")


def results_path(value: str) -> Path:
    path = Path(value)
    if path.suffix.lower() not in (".json", ".csv"):
        raise argparse.ArgumentTypeError(f"{value}: the results file must end in .json or .csv")
    return path


def http_endpoint(value: str) -> str:
    try:
        split_host_port(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--http-url: {err}") from None
    return value


def png_path(value: str) -> Path:
    path = Path(value)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{value}: the plot must be a .png file")
    return path


def request_parameters(value: str) -> dict[str, str | int | float | bool]:
    """A JSON object of request parameters; values must be strings, numbers or booleans."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--parameters is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"--parameters must be a JSON object, got {value}")
    for key, item in data.items():
        if not isinstance(item, str | int | float | bool):
            raise argparse.ArgumentTypeError(
                f"--parameters: {key!r} must be a string, number or boolean, got {json.dumps(item)}")
    for key in (PRIORITY_KEY, TIMEOUT_KEY):
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 0):
            raise argparse.ArgumentTypeError(f"--parameters: {key!r} must be a non-negative integer")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint host:port (default: %(default)s)")
    add_ca_argument(parser)
    parser.add_argument("--http-url", type=http_endpoint, default=None, metavar="HOST:PORT",
                        help="send the requests to Triton's HTTP endpoint instead, with a lean keep-alive client "
                             "(about half the gRPC client's CPU per request: less taken from a server on the "
                             "same machine); the server's statistics still come over gRPC (--url); plaintext only")
    parser.add_argument("--model", default="embed", help="model to send requests to (default: %(default)s)")
    parser.add_argument("--input", default=None, metavar="NAME",
                        help="the model's BYTES input of shape [-1,1] (default: found from the model metadata)")
    parser.add_argument("--mode", choices=("open", "closed"), default="open",
                        help="open: Poisson arrivals at fixed rates; closed: fixed requests in flight "
                             "(default: %(default)s)")
    parser.add_argument("--rates", type=rate_list, default=None, metavar="RPS,...",
                        help=f"open loop: arrival rates per step, requests/s "
                             f"(default: {','.join(f'{r:g}' for r in DEFAULT_RATES)})")
    parser.add_argument("--search", type=positive_float, default=None, metavar="START_RPS",
                        help="open loop: instead of --rates, search for the highest rate meeting the SLO, "
                             "doubling from START_RPS then bisecting")
    parser.add_argument("--min-goodput", type=fraction, default=0.95, metavar="FRACTION",
                        help="with --search: a rate passes when this share of requests is ok within the SLO "
                             "and no request failed (default: %(default)s)")
    parser.add_argument("--max-steps", type=positive_int, default=8,
                        help="with --search: most steps to measure (default: %(default)s)")
    parser.add_argument("--concurrency", type=concurrency_list, default=None, metavar="N,...",
                        help=f"closed loop: requests in flight per step "
                             f"(default: {','.join(map(str, DEFAULT_CONCURRENCY))})")
    parser.add_argument("--duration", type=positive_float, default=10.0, metavar="SECONDS",
                        help="length of each step (default: %(default)s)")
    parser.add_argument("--warmup", type=non_negative_float, default=3.0, metavar="SECONDS",
                        help="unmeasured load at the first step's level before measuring, 0 = none "
                             "(default: %(default)s)")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD,
                        help="workload TOML with the text length mix (default: loadtest/workloads/embed_mix.toml)")
    parser.add_argument("--slo-ms", type=positive_float, default=100.0,
                        help="latency SLO in ms; goodput counts successful requests within it (default: %(default)s)")
    parser.add_argument("--parameters", type=request_parameters, default={}, metavar="JSON",
                        help='request parameters, e.g. \'{"tenant_token": "eyJhbGciOi...", "priority": 1}\'; '
                             "priority and timeout (us) become Triton's request fields")
    parser.add_argument("--request-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                        help="client deadline per request; a later answer counts as an error (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: %(default)s)")
    parser.add_argument("--out", type=results_path, default=None, metavar="PATH",
                        help="write the per-step results here (.json or .csv)")
    parser.add_argument("--plot", type=png_path, default=None, metavar="PNG",
                        help="latency vs throughput plot (default: next to --out, with .png; none without --out)")


def run(args: argparse.Namespace) -> int:
    if args.mode == "closed" and (args.rates or args.search):
        print("error: --rates and --search are for --mode open; use --concurrency with --mode closed",
              file=sys.stderr)
        return 2
    if args.mode == "open" and args.concurrency:
        print("error: --concurrency is for --mode closed; use --rates with --mode open", file=sys.stderr)
        return 2
    if args.rates and args.search:
        print("error: give either --rates or --search, not both", file=sys.stderr)
        return 2
    try:
        workload = load_workload(args.workload)
    except (OSError, ValueError) as err:
        print(f"error: workload {args.workload}: {err}", file=sys.stderr)
        return 2
    try:
        if args.grpc_tls_ca is not None:
            check_pem(args.grpc_tls_ca, "gRPC TLS CA certificate")
    except TlsConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    texts = TextFactory().texts_for(workload, NUM_TEXTS)
    parameters, priority, timeout_us = split_parameters(args.parameters)
    target = LoadTarget(grpc_url=args.url, model=args.model, texts=tuple(texts), slo_ms=args.slo_ms,
                        rows_per_request=workload.rows_per_request, parameters=parameters, priority=priority,
                        timeout_us=timeout_us, request_timeout_s=args.request_timeout, tls_ca=args.grpc_tls_ca,
                        http_url=args.http_url)
    search = RateSearch(args.search, min_goodput=args.min_goodput, max_steps=args.max_steps,
                        min_rps=min(0.5, args.search)) if args.search else None
    from tritonclient.utils import InferenceServerException

    try:
        target = asyncio.run(check_server(target, args.input))
        where = f"{args.http_url} over HTTP" if args.http_url else args.url
        print(f"sweeping {args.model} at {where} ({args.mode} loop, {workload.name}, SLO {args.slo_ms:g} ms, "
              f"{args.duration:g} s per step); server stats of {', '.join(target.stats_models)}", flush=True)
        levels = (args.rates or DEFAULT_RATES) if args.mode == "open" else (args.concurrency or DEFAULT_CONCURRENCY)
        results = asyncio.run(sweep(target, args.mode, levels, args.duration, args.warmup, args.seed, search, log))
    except SweepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except InferenceServerException as err:  # the statistics API failed mid-sweep
        print(f"error: tritonserver at {args.url} failed during the sweep: {err.message()}", file=sys.stderr)
        return 2
    if search is not None:
        print(f"highest rate meeting the SLO: {search.best_rate:g} rps "
              f"(goodput >= {search.min_goodput:.0%}, no errors)", flush=True)
    if args.out is not None:
        document = results_document(results, command_line(), args.url, args.model, args.mode, args.slo_ms,
                                    args.duration, args.parameters, search, workload.name)
        write_results(args.out, document, results)
        print(f"results: {args.out}", flush=True)
    plot = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if plot is not None:
        title = f"{args.model}, {args.mode} loop, {workload.name}"
        print(f"plot: {plot_sweep(results, args.slo_ms, plot, title)}", flush=True)
    return 0
