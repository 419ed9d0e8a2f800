"""A sweep of load against a served model: latency percentiles, throughput and goodput per step.

`sweep` measures each level in turn (Poisson arrival rates in the open loop, requests in
flight in the closed one) or the rates a `RateSearch` proposes, through the load generator
(`tools.bench.loadgen`), which also reads Triton's statistics API for queue and compute
time per step. `check_server` checks the server over gRPC (and HTTP) before the sweep;
`write_results` writes the steps as JSON or CSV; `tensor_requests` reads a sample file
when given one. The rest is pure: the request parameters split into Triton request fields,
what to send found in the model's metadata (`pick_inputs`: its text input, a text pair's
two inputs, or, for a model that does not take texts, every input with its type and shape),
the progress lines and the results document. `python -m tools sweep` drives it.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from tools.bench.inputs import Fill, InputDataError, batch_inputs, load_input_data, make_inputs, wire_type
from tools.bench.loadgen import (
    LoadTarget,
    RateSearch,
    StepResult,
    default_stats_models,
    flatten_step,
    ready_models_index,
    router_calls,
    run_closed_loop,
    run_open_loop,
    split_host_port,
    step_to_dict,
)
from tools.clients.tls import client_tls_kwargs
from tools.repository.graph import TensorInfo

DEFAULT_RATES = (5.0, 10.0, 20.0)
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
NUM_TEXTS = 1000  # distinct payloads per sweep, cycled
NUM_TENSOR_REQUESTS = 16  # distinct random tensor requests per sweep, cycled (each is encoded once)
TEXT_INPUT, PAIR_INPUT = "TEXT", "TEXT_PAIR"  # a text-pair classifier's inputs (the kit's router)
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


@dataclass(frozen=True)
class ModelInputs:
    """What the sweep sends a model, from its metadata."""

    text: str | None  # the BYTES [-1, 1] input texts go to; None: the model does not take texts
    pair: str | None  # the BYTES [-1, 1] input of each text's pair partner; None: single texts
    tensors: tuple[TensorInfo, ...]  # every input as declared (batch axis first), for sample files and tensors


def metadata_tensors(metadata: Mapping[str, Any]) -> tuple[TensorInfo, ...]:
    """The model's inputs from its metadata JSON (`get_model_metadata(as_json=True)`): a free
    axis (-1) is None, BYTES is the config's TYPE_STRING."""
    tensors = []
    for entry in metadata.get("inputs", []):
        datatype = entry.get("datatype", "")
        try:
            data_type = mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")
        except ValueError:
            raise SweepError(f"model {metadata.get('name')!r}: input {entry.get('name')!r} has data type "
                             f"{datatype!r}, which the sweep cannot make") from None
        shape = tuple(None if int(size) < 0 else int(size) for size in entry.get("shape", []))
        tensors.append(TensorInfo(entry["name"], data_type, shape))
    return tuple(tensors)


def _describe(tensor: TensorInfo) -> str:
    shape = ", ".join("-1" if size is None else str(size) for size in tensor.shape)
    return f"{tensor.name} ({wire_type(tensor)} [{shape}])"


def pick_inputs(metadata: Mapping[str, Any], text_input: str | None = None) -> ModelInputs:
    """What to send: texts to the model's one BYTES input of shape [-1, 1] (or `text_input`),
    pairs to a model with both TEXT and TEXT_PAIR, else tensors made from every input."""
    tensors = metadata_tensors(metadata)
    texts = [t.name for t in tensors if t.type_name == "TYPE_STRING" and t.shape == (None, 1)]
    name = metadata.get("name")
    if text_input is not None:
        if text_input not in texts:
            raise SweepError(f"--input {text_input}: model {name!r} has no BYTES input {text_input} of shape [-1, 1]; "
                             f"it takes {', '.join(map(_describe, tensors)) or 'no inputs'}")
        return ModelInputs(text_input, None, tensors)
    if TEXT_INPUT in texts and PAIR_INPUT in texts:
        return ModelInputs(TEXT_INPUT, PAIR_INPUT, tensors)
    if len(texts) == 1:
        return ModelInputs(texts[0], None, tensors)
    if texts:
        raise SweepError(f"model {name!r} takes several texts ({', '.join(texts)}); name the one to send with --input")
    if not tensors:
        raise SweepError(f"model {name!r} declares no inputs in its metadata; the sweep has nothing to send")
    return ModelInputs(None, None, tensors)


def tensor_requests(inputs: ModelInputs, fill: Fill | Path, rows: int, *, variable_len: int | None = None,
                    num_requests: int = NUM_TENSOR_REQUESTS, seed: int = 0) -> tuple[dict[str, np.ndarray], ...]:
    """The distinct requests of a tensor sweep, `rows` rows each: random or zero tensors of the
    declared types and shapes (every free axis after the batch axis `variable_len` long), or the
    samples of a file in perf_analyzer's `--input-data` JSON form, taken in turn. A SweepError
    says why the inputs cannot be made."""
    try:
        if isinstance(fill, Path):
            samples = load_input_data(fill, inputs.tensors, variable_len=variable_len)
            count = max(1, min(num_requests, len(samples) // rows))
            return tuple(batch_inputs(samples, rows, start=index * rows) for index in range(count))
        rng = np.random.default_rng(seed)
        count = num_requests if fill is Fill.RANDOM else 1  # zeros are all alike
        return tuple(make_inputs(inputs.tensors, rows, fill=fill, variable_len=variable_len, seed=rng)
                     for _ in range(count))
    except InputDataError as err:
        hint = " (--variable-len N sizes every free axis)" if "is free" in str(err) else ""
        raise SweepError(f"{err}{hint}") from None


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


async def check_server(grpc_url: str, model: str, *, input_name: str | None = None, tls_ca: Path | None = None,
                       http_url: str | None = None) -> tuple[ModelInputs, tuple[str, ...]]:
    """Reachable server and ready model; what to send it (`pick_inputs` of its metadata) and
    the models to read stats of (the model and, for a router, the ready models it calls)."""
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException

    async with grpcclient.InferenceServerClient(grpc_url, **client_tls_kwargs(tls_ca)) as client:
        try:
            await client.is_server_live(client_timeout=CONNECT_TIMEOUT_S)
        except InferenceServerException as err:
            raise SweepError(f"cannot reach tritonserver over gRPC at {grpc_url} ({err.message()}); "
                             "is it running (python -m tools serve) and is --url its gRPC port?") from None
        index = await ready_models_index(client)
        if not await client.is_model_ready(model):
            ready = sorted({e["name"] for e in index})
            raise SweepError(f"model {model!r} is not ready on {grpc_url} (ready: {ready})")
        inputs = pick_inputs(await client.get_model_metadata(model, as_json=True), input_name)
        stats_models = default_stats_models(model, index, await router_calls(client, model))
    if http_url is not None:
        check_http(http_url)
    return inputs, tuple(stats_models)


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
