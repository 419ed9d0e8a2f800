"""Sweep load against a served model: latency percentiles, throughput and goodput per step.

Open loop (`--mode open`) sends requests at Poisson arrival times for each rate in
`--rates`, never waiting for earlier answers, and measures latency from each request's
scheduled send time; `--search START` instead looks for the highest rate that meets the
SLO (doubling, then bisection). Closed loop (`--mode closed`) keeps each `--concurrency`
level of requests in flight.

What a request carries is read from the model's metadata, as perf_analyzer does: texts for a
model with one BYTES input of shape [-1, 1], text pairs for one with TEXT and TEXT_PAIR (a
reranker), following the length mix of the model's workload in the serving spec (else
`--workload`), written in the model's own tokens; for any other model, its inputs made from
their declared types and shapes (`--input-data random`, `zeros`, or a sample file in
perf_analyzer's `--input-data` JSON form, which also gives texts). Every step also reads
Triton's statistics API, so queue time (waiting to be batched) and compute time per
execution are shown for the model and, for a bucketed model's router, its bucket models.

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

from tools.bench.inputs import Fill, parse_fill
from tools.bench.loadgen import LoadTarget, RateSearch, plot_sweep, split_host_port
from tools.bench.payloads import model_factory, texts_for
from tools.bench.sweep import (
    DEFAULT_CONCURRENCY,
    DEFAULT_RATES,
    NUM_TEXTS,
    PRIORITY_KEY,
    TIMEOUT_KEY,
    ModelInputs,
    SweepError,
    check_server,
    results_document,
    split_parameters,
    sweep,
    tensor_requests,
    write_results,
)
from tools.clients.tls import TlsConfigError, add_ca_argument, check_pem
from tools.paths import DEFAULT_SPEC
from tools.repository.sources import SourceError
from tools.spec.serving import BucketedModelSpec, SpecError, load_spec
from tools.spec.workload import DEFAULT_WORKLOAD, Workload, load_workload


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
    parser.add_argument("--model", default="embed",
                        help="model to send requests to: any model the server has (default: %(default)s)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC,
                        help="serving spec: a model of it is sent texts of its workload's length mix, counted in "
                             "its tokenizer's tokens (default: %(default)s)")
    parser.add_argument("--input", default=None, metavar="NAME",
                        help="send single texts to this BYTES input of shape [-1,1] (default: found from the model "
                             "metadata: its one such input, or TEXT and TEXT_PAIR as pairs)")
    parser.add_argument("--input-data", type=parse_fill, default=None, metavar="random|zeros|FILE",
                        help="make the requests from the model's declared inputs instead of texts: random values, "
                             "zeros, or the samples of FILE in perf_analyzer's --input-data JSON form "
                             '({"data": [{"INPUT": [...]}, ...]}, which may give texts too) '
                             "(default: texts for a model that takes them, else random)")
    parser.add_argument("--variable-len", type=positive_int, default=None, metavar="N",
                        help="with made inputs: the size of every free axis after the batch axis (a sequence "
                             "length, an image width)")
    parser.add_argument("--rows", type=positive_int, default=None, metavar="N",
                        help="rows per request (default: the workload's rows_per_request for texts, else 1)")
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
    parser.add_argument("--workload", type=Path, default=None,
                        help="workload TOML with the text length mix (default: the model's workload in the spec, "
                             "else loadtest/workloads/embed_mix.toml)")
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
    if args.input is not None and args.input_data is not None:
        print("error: --input sends texts of the workload, --input-data makes every input; give one of them",
              file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    spec_model = next((model for model in spec.models if model.name == args.model), None)
    # A fixed-shape tensor model has no length mix; the default one is then read and unused.
    workload_path = args.workload or (spec_model.workload if spec_model is not None else None) or DEFAULT_WORKLOAD
    try:
        workload = load_workload(workload_path)
    except (OSError, ValueError) as err:
        print(f"error: workload {workload_path}: {err}", file=sys.stderr)
        return 2
    try:
        if args.grpc_tls_ca is not None:
            check_pem(args.grpc_tls_ca, "gRPC TLS CA certificate")
    except TlsConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    search = RateSearch(args.search, min_goodput=args.min_goodput, max_steps=args.max_steps,
                        min_rps=min(0.5, args.search)) if args.search else None
    from tritonclient.utils import InferenceServerException

    try:
        inputs, stats_models = asyncio.run(check_server(args.url, args.model, input_name=args.input,
                                                        tls_ca=args.grpc_tls_ca, http_url=args.http_url))
        payload, payload_name = _payload(args, inputs, spec_model, workload)
        parameters, priority, timeout_us = split_parameters(args.parameters)
        target = LoadTarget(grpc_url=args.url, model=args.model, slo_ms=args.slo_ms, parameters=parameters,
                            priority=priority, timeout_us=timeout_us, request_timeout_s=args.request_timeout,
                            tls_ca=args.grpc_tls_ca, http_url=args.http_url, stats_models=stats_models, **payload)
        where = f"{args.http_url} over HTTP" if args.http_url else args.url
        print(f"sweeping {args.model} at {where} ({args.mode} loop, {payload_name}, SLO {args.slo_ms:g} ms, "
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
                                    args.duration, args.parameters, search, payload_name)
        write_results(args.out, document, results)
        print(f"results: {args.out}", flush=True)
    plot = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if plot is not None:
        title = f"{args.model}, {args.mode} loop, {payload_name}"
        print(f"plot: {plot_sweep(results, args.slo_ms, plot, title)}", flush=True)
    return 0


def _payload(args: argparse.Namespace, inputs: ModelInputs, spec_model: BucketedModelSpec | None,
             workload: Workload) -> tuple[dict[str, Any], str]:
    """The LoadTarget fields of what the requests carry, and its name for the results: the
    workload's texts (or pairs) for a text model, else tensors made from the declared inputs."""
    if inputs.text is not None and args.input_data is None:
        try:
            factory = model_factory(spec_model)
        except SourceError as err:
            raise SweepError(str(err)) from None
        texts = texts_for(factory, workload, NUM_TEXTS, pairs=inputs.pair is not None)
        fields: dict[str, Any] = {"texts": texts.texts, "input_name": inputs.text,
                                  "rows_per_request": args.rows or workload.rows_per_request}
        if inputs.pair is not None:
            fields.update(pair_texts=texts.pair_texts, pair_input_name=inputs.pair)
        return fields, workload.name + (" pairs" if inputs.pair is not None else "")
    fill = args.input_data if args.input_data is not None else Fill.RANDOM
    rows = args.rows or (workload.rows_per_request if inputs.text is not None else 1)
    tensors = tensor_requests(inputs, fill, rows, variable_len=args.variable_len, seed=args.seed)
    return {"texts": (), "tensors": tensors}, str(fill)
