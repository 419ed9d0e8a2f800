"""A sweep of load against a served model: latency percentiles, throughput and goodput per step.

`sweep` measures each level in turn (Poisson arrival rates in the open loop, requests in
flight in the closed one) or the rates a `RateSearch` proposes, through the load generator
(`tools.bench.loadgen`), which also reads Triton's statistics API for queue and compute
time per step. `check_server` checks the server over gRPC (and HTTP) before the sweep;
`write_results` writes the steps as JSON or CSV. The rest is pure: the request
parameters split into Triton request fields, the text input found in model metadata, the
progress lines and the results document. `python -m tools sweep` drives it.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.bench.loadgen import (
    LoadTarget,
    RateSearch,
    StepResult,
    default_stats_models,
    flatten_step,
    ready_models_index,
    run_closed_loop,
    run_open_loop,
    split_host_port,
    step_to_dict,
)
from tools.clients.tls import client_tls_kwargs

DEFAULT_RATES = (5.0, 10.0, 20.0)
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
NUM_TEXTS = 1000  # distinct payloads per sweep, cycled
CONNECT_TIMEOUT_S = 5.0
# Request parameters that are fields of a Triton request rather than KServe parameters.
PRIORITY_KEY, TIMEOUT_KEY = "priority", "timeout"


class SweepError(RuntimeError):
    """The sweep cannot run (server unreachable, model not ready); the message says why."""


# ------------------------------------------------------------------ pure helpers


def split_parameters(parameters: Mapping[str, Any]) -> tuple[dict[str, Any], int, int | None]:
    """(KServe parameters, priority, timeout_us): `priority` and `timeout` are fields of
    a Triton request, which tritonclient refuses as plain parameters."""
    rest = {key: value for key, value in parameters.items() if key not in (PRIORITY_KEY, TIMEOUT_KEY)}
    return rest, int(parameters.get(PRIORITY_KEY, 0)), parameters.get(TIMEOUT_KEY)


def pick_text_input(metadata: Mapping[str, Any]) -> str:
    """The name of the model's one BYTES input of shape [-1, 1] (from model metadata JSON)."""
    candidates = [entry["name"] for entry in metadata.get("inputs", [])
                  if entry.get("datatype") == "BYTES" and [int(d) for d in entry.get("shape", [])] == [-1, 1]]
    if len(candidates) != 1:
        found = [(e.get("name"), e.get("datatype"), e.get("shape")) for e in metadata.get("inputs", [])]
        raise SweepError(f"model {metadata.get('name')!r} needs exactly one BYTES input of shape [-1, 1] to sweep; "
                         f"it has {found} (if one of them takes text, name it with --input)")
    return candidates[0]


def step_label(result: StepResult) -> str:
    return f"{result.offered_rps:g} rps" if result.mode == "open" else f"concurrency {result.concurrency}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_step(result: StepResult) -> str:
    """One progress line: latency, throughput, errors, generator cost, server queue vs compute."""
    client_cpu = result.client_cpu_s / result.duration_s if result.duration_s else 0.0
    line = (f"{step_label(result):>16}: p50 {_ms(result.p50_ms)}  p95 {_ms(result.p95_ms)}  "
            f"p99 {_ms(result.p99_ms)} ms | {result.throughput_rps:.1f} ok/s | goodput "
            f"{result.goodput_fraction:.0%} | errors {result.num_errors} | client cpu {client_cpu:.0%}")
    busy = [(model, times) for model, times in result.server.items() if times.execution_count]
    if busy:
        line += "\n" + " " * 18 + "server queue/compute ms (batch): " + ", ".join(
            f"{model} {times.queue_ms:.1f}/{times.compute_ms:.1f} ({times.mean_batch_size:.1f})"
            for model, times in busy)
    if result.error_samples:
        line += "\n" + " " * 18 + "errors: " + "; ".join(result.error_samples)
    return line


def results_document(results: Sequence[StepResult], command: str, url: str, model: str, mode: str, slo_ms: float,
                     duration_s: float, parameters: Mapping[str, Any], search: RateSearch | None,
                     workload_name: str) -> dict[str, Any]:
    return {
        "command": command,
        "url": url,
        "model": model,
        "mode": mode,
        "slo_ms": slo_ms,
        "workload": workload_name,
        "duration_s": duration_s,
        "parameters": parameters,
        "best_rate_rps": search.best_rate if search else None,
        "steps": [step_to_dict(r) for r in results],
    }


def write_results(path: Path, document: Mapping[str, Any], results: Sequence[StepResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(document, indent=2) + "\n")
        return
    rows = [flatten_step(r) for r in results]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------ running


async def check_server(target: LoadTarget, input_name: str | None) -> LoadTarget:
    """Reachable server, ready model, its text input and the models to read stats of."""
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException

    async with grpcclient.InferenceServerClient(target.grpc_url, **client_tls_kwargs(target.tls_ca)) as client:
        try:
            await client.is_server_live(client_timeout=CONNECT_TIMEOUT_S)
        except InferenceServerException as err:
            raise SweepError(f"cannot reach tritonserver over gRPC at {target.grpc_url} ({err.message()}); "
                             "is it running (python -m tools serve) and is --url its gRPC port?") from None
        index = await ready_models_index(client)
        if not await client.is_model_ready(target.model):
            ready = sorted({e["name"] for e in index})
            raise SweepError(f"model {target.model!r} is not ready on {target.grpc_url} (ready: {ready})")
        if input_name is None:
            input_name = pick_text_input(await client.get_model_metadata(target.model, as_json=True))
    if target.http_url is not None:
        check_http(target.http_url)
    return replace(target, input_name=input_name,
                   stats_models=target.stats_models or tuple(default_stats_models(target.model, index)))


def check_http(url: str) -> None:
    """The HTTP endpoint answers as a live Triton server."""
    from tools.server.control import ControlError, ServerControl

    host, port = split_host_port(url)
    try:
        live = ServerControl(f"{host}:{port}", timeout_s=CONNECT_TIMEOUT_S).is_server_live()
    except ControlError as err:
        raise SweepError(f"cannot reach tritonserver over HTTP at {url} ({err.__cause__ or err}); "
                         "is --http-url its HTTP port?") from None
    if not live:
        raise SweepError(f"tritonserver at {url} is not live (/v2/health/live did not answer 200)")


async def sweep(target: LoadTarget, mode: str, levels: Sequence[float], duration_s: float, warmup_s: float,
                seed: int, search: RateSearch | None, log: Callable[[str], None]) -> list[StepResult]:
    """Measure each level (rates in the open loop, requests in flight in the closed one) for
    `duration_s`, or, with `search`, the rates it proposes; a warm-up of `warmup_s` first."""
    async def measure(level: float, duration_s: float) -> StepResult:
        if mode == "open":
            return await run_open_loop(target, level, duration_s, seed=seed)
        return await run_closed_loop(target, int(level), duration_s)

    first = search.start_rps if search is not None else levels[0]
    if warmup_s > 0:
        log(f"warm-up: {warmup_s:g} s at {first:g} {'rps' if mode == 'open' else 'in flight'}")
        await measure(first, warmup_s)
    results = []
    if search is not None:
        while (rate := search.next_rate()) is not None:
            result = await measure(rate, duration_s)
            search.record(rate, result)
            results.append(result)
            verdict = "pass" if search.passes(result) else "FAIL"
            log(f"{format_step(result)}\n{'':18}-> {verdict}")
    else:
        for level in levels:
            result = await measure(level, duration_s)
            results.append(result)
            log(format_step(result))
    return results
