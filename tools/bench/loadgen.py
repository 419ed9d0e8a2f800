"""Load generation against a Triton model: open loop (Poisson arrivals) and closed loop.

The pure part decides and summarises: arrival times, percentiles, one step's result, the
per-model server-side deltas from Triton's statistics API, the models a router calls (read
from its config, so any bucketed model's bucket models are measured with it), each distinct
request's inputs (texts, text pairs, or tensors), and the goodput search (`RateSearch`:
propose a rate, take its measured result back, decide whether it is done).
The async runners only send requests and record what happened, on one event loop: over
`tritonclient.grpc.aio` (one channel), or, with `LoadTarget.http_url`, over Triton's HTTP
endpoint with the lean keep-alive client of `tools.clients.http_infer`, which takes about half
the CPU per request from the machine under test (the server's statistics are still read
over gRPC). `run_one_at_a_time` sends a counted number of requests in turn; `send_in_turn`
sends pre-encoded HTTP requests, each to whichever model it names, one at a time (a router's
request beside the same rows sent straight to its bucket model).

Latency honesty: in open loop a request's latency runs from its *scheduled* send time, so
when the generator or the connection falls behind, that wait counts against the server
instead of silently slowing the offered load (no coordinated omission). Requests that
could not be sent at all (too many outstanding) are counted as errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from python_backends.common.regimes import REGIMES_PARAMETER, LingerRegimes
from python_backends.tensor.router import FIXED_BUCKET, bucket_model_name
from tools.clients.http_infer import (
    HttpInferClient,
    ProtocolError,
    WireTensor,
    bytes_tensor,
    encode_infer_request,
    error_message,
)
from tools.clients.retrying import Outcome, classify
from tools.clients.tls import client_tls_kwargs

Mode = Literal["open", "closed"]

# A router's config parameters that name the bucket models it calls over BLS (RouterParameters).
BUCKET_LENS_PARAMETER, PREFIX_PARAMETER = "bucket_lens", "encoder_prefix"
DEFAULT_PREFIX = "encoder_"  # RouterParameters' default, when a config leaves it out
MAX_ERROR_SAMPLES = 5
MAX_ERROR_CHARS = 300


# ---------------------------------------------------------------------------------------
# Pure: arrivals, percentiles, step summaries


def poisson_arrival_times(rate_rps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Send offsets (seconds from the step start) of a Poisson process at `rate_rps`.

    Open loop: the times are fixed in advance and do not depend on responses.
    """
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    times: list[float] = []
    now = rng.expovariate(rate_rps)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate_rps)
    return times


def duration_for_arrivals(rate_rps: float, num_arrivals: int, seed: int) -> float:
    """The step length at which `poisson_arrival_times(rate_rps, ..., Random(seed))`, and so
    `run_open_loop(..., seed=seed)`, sends exactly `num_arrivals` requests: halfway between the
    last of them and the next arrival of the same draw."""
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if num_arrivals < 1:
        raise ValueError(f"num_arrivals must be >= 1, got {num_arrivals}")
    rng = random.Random(seed)
    last = 0.0
    for _ in range(num_arrivals):
        last += rng.expovariate(rate_rps)
    return last + rng.expovariate(rate_rps) / 2


# Below this many samples a p95 is mostly the slowest one (of 7, 70% of the way from the second
# slowest to it; of 10, 45%): a server whose true p95 meets a target still has one of 7 past it
# 30% of the time (1 - 0.95^7), and one late answer then decides the figure.
MIN_P95_SAMPLES = 20


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class ServerTimes:
    """What one model did during a step, from deltas of Triton's statistics API.

    `queue_ms` is time waiting to be batched/scheduled, `compute_ms` time the model ran:
    together they separate "slow because waiting" from "slow because the model is slow".
    For a BLS router such as `embed`, compute includes waiting on the models it calls.
    """

    inference_count: int  # inferences (batch rows) completed in the step
    execution_count: int  # model executions (batches) in the step
    num_requests: int  # requests that succeeded (each may carry several rows)
    num_failed: int  # requests that failed inside the server
    mean_batch_size: float  # inference_count / execution_count; 0 when nothing ran
    queue_ms: float  # mean queue time per request
    compute_ms: float  # mean compute_input + compute_infer + compute_output per execution


@dataclass(frozen=True)
class StepResult:
    """One load step: what was offered, what came back, and what the server saw."""

    mode: Mode  # "open" (Poisson arrivals at offered_rps) or "closed" (fixed concurrency)
    offered_rps: float | None  # open loop: the target arrival rate; None in closed loop
    concurrency: int | None  # closed loop: requests kept in flight; None in open loop
    duration_s: float  # wall time from the first send to the last response (drain included)
    num_sent: int  # requests offered: ok + errors (including ones the generator could not send)
    num_ok: int  # successful responses
    num_errors: int  # failed, timed out, or never sent
    num_within_slo: int  # successful responses no slower than the SLO
    p50_ms: float | None  # latency percentiles of successful requests; None when none succeeded
    p95_ms: float | None  # (open loop: measured from the scheduled send time)
    p99_ms: float | None  # ditto
    throughput_rps: float  # successful responses per second of duration_s
    goodput_fraction: float  # (ok and within SLO) / sent; 0 when nothing was sent
    slo_ms: float  # the latency SLO the step was judged against
    send_lag_p99_ms: float  # p99 of (actual - scheduled) send time: the generator's own lateness
    client_cpu_s: float = 0.0  # CPU seconds the generator process spent in the step (its own cost)
    error_samples: tuple[str, ...] = ()  # the most frequent distinct error messages, with counts
    server: dict[str, ServerTimes] = field(default_factory=dict)  # model -> its server-side times
    num_rejected: int = 0  # turned away on purpose (server busy, over quota): SLO misses, not failures

    @property
    def load(self) -> float:
        """The load knob of the step: offered rps (open) or concurrency (closed)."""
        return float(self.offered_rps if self.mode == "open" else self.concurrency or 0)


def summarize_step(
    *,
    mode: Mode,
    load: float,
    duration_s: float,
    latencies_ms: Sequence[float],
    errors: Sequence[str],
    slo_ms: float,
    send_lags_ms: Sequence[float] = (),
    client_cpu_s: float = 0.0,
    server: Mapping[str, ServerTimes] | None = None,
    rejections: Sequence[str] = (),
) -> StepResult:
    """A StepResult from raw measurements: one latency per successful request, one message
    per failed (or unsent) request and per request the server turned away on purpose
    (`rejections`: admission control or a quota; they count as sent and not within the SLO,
    but not as errors). `load` is the offered rps (open) or concurrency (closed)."""
    if mode not in ("open", "closed"):
        raise ValueError(f"mode must be 'open' or 'closed', got {mode!r}")
    num_ok = len(latencies_ms)
    num_sent = num_ok + len(errors) + len(rejections)
    num_within_slo = sum(1 for latency in latencies_ms if latency <= slo_ms)
    counts = Counter(message[:MAX_ERROR_CHARS] for message in [*errors, *rejections])
    samples = tuple(f"{message} (x{count})" for message, count in counts.most_common(MAX_ERROR_SAMPLES))
    return StepResult(
        mode=mode,
        offered_rps=float(load) if mode == "open" else None,
        concurrency=int(load) if mode == "closed" else None,
        duration_s=duration_s,
        num_sent=num_sent,
        num_ok=num_ok,
        num_errors=len(errors),
        num_within_slo=num_within_slo,
        p50_ms=percentile(latencies_ms, 50) if latencies_ms else None,
        p95_ms=percentile(latencies_ms, 95) if latencies_ms else None,
        p99_ms=percentile(latencies_ms, 99) if latencies_ms else None,
        throughput_rps=num_ok / duration_s if duration_s > 0 else 0.0,
        goodput_fraction=num_within_slo / num_sent if num_sent else 0.0,
        slo_ms=slo_ms,
        send_lag_p99_ms=percentile(send_lags_ms, 99) if send_lags_ms else 0.0,
        client_cpu_s=client_cpu_s,
        error_samples=samples,
        server=dict(server or {}),
        num_rejected=len(rejections),
    )


def step_to_dict(result: StepResult) -> dict[str, Any]:
    """Plain JSON-ready data (nested `server`)."""
    data = asdict(result)
    data["error_samples"] = list(result.error_samples)
    return data


def flatten_step(result: StepResult) -> dict[str, Any]:
    """One flat row for CSV: server times become `server.<model>.<field>` columns."""
    row = {key: value for key, value in step_to_dict(result).items() if key != "server"}
    row["error_samples"] = " | ".join(result.error_samples)
    for model, times in sorted(result.server.items()):
        for key, value in asdict(times).items():
            row[f"server.{model}.{key}"] = value
    return row


# ---------------------------------------------------------------------------------------
# Pure: server-side times from Triton's statistics API


def ns_count(stats: Mapping[str, Any], name: str) -> tuple[int, int]:
    """(ns, count) of one duration entry of Triton's statistics JSON; (0, 0) where it is left out."""
    # gRPC JSON (MessageToJson) writes int64 as strings and leaves out zero fields.
    entry = stats.get(name) or {}
    return int(entry.get("ns", 0)), int(entry.get("count", 0))


def batch_compute_ns(model_stats: Mapping[str, Any], batch_size: int | None = None) -> tuple[int, int]:
    """(compute ns, executions) from a model's batch_stats, at one batch size or all of them.

    Compute is input + infer + output; batch_stats counts executions, where inference_stats
    would charge each request the full time of the batch it ran in.
    """
    total_ns = executions = 0
    for batch in model_stats.get("batch_stats") or ():
        if batch_size is not None and int(batch["batch_size"]) != batch_size:
            continue
        for part in ("compute_input", "compute_infer", "compute_output"):
            total_ns += ns_count(batch, part)[0]
        executions += ns_count(batch, "compute_infer")[1]
    return total_ns, executions


def _model_counters(model_stats: Mapping[str, Any]) -> Counter[str]:
    inference = model_stats.get("inference_stats") or {}
    queue_ns, queue_count = ns_count(inference, "queue")
    _, success_count = ns_count(inference, "success")
    _, fail_count = ns_count(inference, "fail")
    exec_ns, exec_count = batch_compute_ns(model_stats)
    return Counter({
        "inference_count": int(model_stats.get("inference_count", 0)),
        "execution_count": int(model_stats.get("execution_count", 0)),
        "success_count": success_count,
        "fail_count": fail_count,
        "queue_ns": queue_ns,
        "queue_count": queue_count,
        "exec_compute_ns": exec_ns,
        "exec_compute_count": exec_count,
    })


def _counters_by_model(stats: Mapping[str, Any]) -> dict[str, Counter[str]]:
    # Versions of one model are summed: the sweep drives a model by name.
    by_model: dict[str, Counter[str]] = {}
    for model_stats in stats.get("model_stats") or ():
        by_model.setdefault(model_stats["name"], Counter()).update(_model_counters(model_stats))
    return by_model


def server_times_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, ServerTimes]:
    """Per-model ServerTimes between two `get_inference_statistics(as_json=True)` answers.

    A model absent from `before` (loaded during the step) counts from zero; a counter that
    went backwards (the model was reloaded and its statistics reset) counts from zero too.
    """
    old = _counters_by_model(before)
    times: dict[str, ServerTimes] = {}
    for model, new_counters in _counters_by_model(after).items():
        base = old.get(model, Counter())
        delta = {key: value - base[key] if value >= base[key] else value for key, value in new_counters.items()}
        inferences, executions = delta["inference_count"], delta["execution_count"]
        times[model] = ServerTimes(
            inference_count=inferences,
            execution_count=executions,
            num_requests=delta["success_count"],
            num_failed=delta["fail_count"],
            mean_batch_size=inferences / executions if executions else 0.0,
            queue_ms=delta["queue_ns"] / delta["queue_count"] / 1e6 if delta["queue_count"] else 0.0,
            compute_ms=(delta["exec_compute_ns"] / delta["exec_compute_count"] / 1e6
                        if delta["exec_compute_count"] else 0.0),
        )
    return times


def called_models(model_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The bucket models a router model calls over BLS, from its config (Triton's JSON form,
    `get_model_config(as_json=True)["config"]`): `encoder_prefix` + each of `bucket_lens`, and
    the express model its `linger_regimes` names; a tensor router without a variable axis calls
    its one model (`fixed_model`, an external model, else `<prefix>fixed`). Empty for a model
    that does its work itself."""
    parameters = model_config.get("parameters") or {}

    def value(key: str) -> str:
        return (parameters.get(key) or {}).get("string_value", "")

    lens = value(BUCKET_LENS_PARAMETER)
    prefix = value(PREFIX_PARAMETER) or DEFAULT_PREFIX
    if not lens.strip() and value("fixed_model"):
        return (value("fixed_model"),)
    regimes = value(REGIMES_PARAMETER)
    express = (LingerRegimes.from_json(regimes).express,) if regimes else ()
    if not lens.strip() and value("inputs"):  # a tensor router: its one fixed-shape bucket model
        return (bucket_model_name(prefix, FIXED_BUCKET), *express)
    return (*(f"{prefix}{length.strip()}" for length in lens.split(",") if length.strip()), *express)


def default_stats_models(model: str, repository_index: Sequence[Mapping[str, Any]],
                         called: Sequence[str] = ()) -> list[str]:
    """The model itself plus the ready ones among the models it calls (`called_models`), from
    the repository index JSON: [{"name":..., "state": "READY"}, ...]."""
    ready = {entry["name"] for entry in repository_index if entry.get("state") == "READY"}
    return [model, *sorted(ready & set(called))]


# ---------------------------------------------------------------------------------------
# Pure: the goodput search


class RateSearch:
    """Highest open-loop rate that still meets the SLO, found by doubling then bisection.

    A generator with feedback: `next_rate()` proposes a rate (None when done), the caller
    measures it and hands the result to `record()`. A rate passes when its goodput fraction
    is at least `min_goodput` and it had at most `max_errors` errors; a caller that judges
    its steps by other criteria (the LLM benchmark: finished share, failures, TTFT and TPOT
    p95) hands its verdict to `record_verdict()` instead. Doubling from
    `start_rps` runs until the first failure; then the bracket between the highest pass and
    the lowest failure is bisected until it is within `rel_tolerance` of the failing rate.
    If the start rate already fails, the search halves downwards (not below `min_rps`).
    """

    def __init__(self, start_rps: float, *, min_goodput: float = 0.95, max_errors: int = 0,
                 rel_tolerance: float = 0.10, max_steps: int = 12, min_rps: float = 0.5,
                 max_rps: float = math.inf):
        if not start_rps > 0:
            raise ValueError(f"start_rps must be > 0, got {start_rps}")
        if not 0 <= min_goodput <= 1:
            raise ValueError(f"min_goodput must be in [0, 1], got {min_goodput}")
        if max_errors < 0:
            raise ValueError(f"max_errors must be >= 0, got {max_errors}")
        if not 0 < rel_tolerance < 1:
            raise ValueError(f"rel_tolerance must be in (0, 1), got {rel_tolerance}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if not 0 < min_rps <= start_rps <= max_rps:
            raise ValueError(f"need 0 < min_rps <= start_rps <= max_rps, got {min_rps}, {start_rps}, {max_rps}")
        self.start_rps = start_rps
        self.min_goodput = min_goodput
        self.max_errors = max_errors
        self.rel_tolerance = rel_tolerance
        self.max_steps = max_steps
        self.min_rps = min_rps
        self.max_rps = max_rps
        self.history: list[tuple[float, bool]] = []  # (rate, passed) in measurement order
        self._highest_pass: float | None = None
        self._lowest_fail: float | None = None

    def passes(self, result: StepResult) -> bool:
        return result.goodput_fraction >= self.min_goodput and result.num_errors <= self.max_errors

    def record(self, rate: float, result: StepResult) -> None:
        self.record_verdict(rate, self.passes(result))

    def record_verdict(self, rate: float, passed: bool) -> None:
        """Take back a measured rate judged by the caller: whether it met the SLO."""
        self.history.append((rate, passed))
        if passed:
            self._highest_pass = rate if self._highest_pass is None else max(self._highest_pass, rate)
        else:
            self._lowest_fail = rate if self._lowest_fail is None else min(self._lowest_fail, rate)

    def next_rate(self) -> float | None:
        if len(self.history) >= self.max_steps:
            return None
        low, high = self._highest_pass, self._lowest_fail
        if low is None and high is None:
            return self.start_rps
        if high is None:  # everything so far passed: double, up to max_rps
            assert low is not None
            return None if low >= self.max_rps else min(low * 2, self.max_rps)
        if low is None:  # everything so far failed: halve
            lower = high / 2
            return None if lower < self.min_rps else lower
        if low >= high:
            # A pass above a failure: the measurements disagree (noise near capacity).
            # Bisecting would not converge; stop and report the highest pass.
            return None
        if (high - low) / high <= self.rel_tolerance:
            return None
        return (low + high) / 2

    @property
    def done(self) -> bool:
        return self.next_rate() is None

    @property
    def best_rate(self) -> float:
        """Highest passing rate measured; 0 when none passed."""
        return self._highest_pass or 0.0


# ---------------------------------------------------------------------------------------
# Runners (I/O): tritonclient.grpc.aio, or tools.clients.http_infer for the requests


@dataclass(frozen=True)
class LoadTarget:
    """What to send where, and how to judge it.

    A request carries texts (rows of one BYTES input), text pairs (`pair_texts` beside
    `texts`, a second BYTES input with the same rows), or, for a model that does not take
    texts, `tensors`: each distinct request's inputs as arrays.
    """

    grpc_url: str  # host:port of Triton's gRPC endpoint
    model: str  # model to call
    texts: tuple[str, ...]  # payload texts, cycled in order; empty with `tensors`
    slo_ms: float  # latency SLO a successful request must meet to count as goodput
    input_name: str = "TEXT"  # the model's BYTES input, shape [rows, 1]
    rows_per_request: int = 1  # consecutive texts sent as the rows of one request
    pair_texts: tuple[str, ...] = ()  # each text's pair partner (same index), sent as `pair_input_name`; () = none
    pair_input_name: str = "TEXT_PAIR"  # the model's second BYTES input, shape [rows, 1], when pairs are sent
    # Instead of texts: each distinct request's inputs by name, batch axis first, cycled in order.
    tensors: tuple[Mapping[str, np.ndarray], ...] = field(default=(), compare=False)
    parameters: Mapping[str, str | int | float | bool] = field(default_factory=dict)  # KServe request parameters
    priority: int = 0  # Triton request priority (0 = the model's default level)
    timeout_us: int | None = None  # Triton request queue timeout, microseconds
    stats_models: tuple[str, ...] = ()  # models whose server stats to collect; empty = default_stats_models
    tls_ca: Path | None = None  # gRPC over TLS trusting this CA certificate; None = plaintext
    request_timeout_s: float = 30.0  # client-side deadline per request; a late answer is an error
    max_outstanding: int = 2048  # open loop: requests in flight before new ones count as unsent errors
    http_url: str | None = None  # host:port of Triton's HTTP endpoint: send the requests there; None = over gRPC

    def __post_init__(self) -> None:
        if bool(self.texts) == bool(self.tensors):
            raise ValueError("LoadTarget needs one kind of payload: at least one text, or tensors (not both)")
        if self.pair_texts and len(self.pair_texts) != len(self.texts):
            raise ValueError(f"pair_texts must pair each of the {len(self.texts)} texts, got {len(self.pair_texts)}")
        for index, inputs in enumerate(self.tensors):
            rows = {name: array.shape[0] if array.ndim else None for name, array in inputs.items()}
            if not rows or len(set(rows.values())) != 1 or None in rows.values() or 0 in rows.values():
                raise ValueError(f"tensors[{index}] must give every input the same number of rows >= 1 on "
                                 f"axis 0, got {rows}")
        if self.rows_per_request < 1:
            raise ValueError(f"rows_per_request must be >= 1, got {self.rows_per_request}")
        if not self.slo_ms > 0:
            raise ValueError(f"slo_ms must be > 0, got {self.slo_ms}")
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {self.max_outstanding}")
        if self.http_url is not None:
            split_host_port(self.http_url)


def split_host_port(url: str) -> tuple[str, int]:
    """`host:port` (an `http://` prefix allowed, an IPv6 host in brackets) as (host, port);
    ValueError naming the URL otherwise."""
    rest = url.removeprefix("http://").rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port for the HTTP endpoint, got {url!r}")
    return host.strip("[]"), int(port)


def _cycled_rows(texts: Sequence[str], rows: int) -> list[list[bytes]]:
    return [[texts[(index * rows + row) % len(texts)].encode() for row in range(rows)]
            for index in range(max(1, len(texts) // rows))]


def request_rows(target: LoadTarget) -> list[list[bytes]]:
    """The rows of each distinct request: consecutive texts, `rows_per_request` at a time,
    cycling until every text has been sent once (at least one request)."""
    return _cycled_rows(target.texts, target.rows_per_request)


def request_pair_rows(target: LoadTarget) -> list[list[bytes]]:
    """The second members of each request's pairs, row for row beside `request_rows` (the
    text at the same index of `pair_texts`); empty when the target sends no pairs."""
    return _cycled_rows(target.pair_texts, target.rows_per_request) if target.pair_texts else []


def request_inputs(target: LoadTarget) -> list[dict[str, np.ndarray]]:
    """Each distinct request's inputs by name: texts (and their pairs) as BYTES [rows, 1]
    (numpy object arrays of bytes), or the target's tensors."""
    if target.tensors:
        return [dict(inputs) for inputs in target.tensors]
    requests = [{target.input_name: np.array(rows, dtype=object).reshape(len(rows), 1)}
                for rows in request_rows(target)]
    for inputs, rows in zip(requests, request_pair_rows(target), strict=False):
        inputs[target.pair_input_name] = np.array(rows, dtype=object).reshape(len(rows), 1)
    return requests


def wire_tensor(name: str, array: np.ndarray) -> WireTensor:
    """An input array as the HTTP binary tensor extension sends it."""
    from tritonclient.utils import np_to_triton_dtype

    datatype = np_to_triton_dtype(array.dtype)
    if datatype == "BYTES":
        data = bytes_tensor([item if isinstance(item, bytes) else str(item).encode() for item in array.ravel()])
    else:
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return WireTensor(name, datatype, tuple(array.shape), data)


def http_parameters(target: LoadTarget) -> dict[str, object]:
    """The HTTP request's `parameters`: the target's own, plus Triton's `priority` and
    `timeout` (gRPC carries those as request fields)."""
    parameters: dict[str, object] = dict(target.parameters)
    if target.priority:
        parameters["priority"] = target.priority
    if target.timeout_us is not None:
        parameters["timeout"] = target.timeout_us
    return parameters


def _build_inputs(target: LoadTarget) -> list[list[Any]]:
    """One prepared gRPC input list per distinct request (serialised once, reused)."""
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    prepared = []
    for inputs in request_inputs(target):
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        prepared.append(tensors)
    return prepared


class _Sender:
    """Sends one request and records its outcome; shared by both loops."""

    def __init__(self, client: Any, target: LoadTarget, http: HttpInferClient | None = None):
        from tritonclient.utils import InferenceServerException

        self._exception = InferenceServerException
        self.client = client
        self.http = http
        self.target = target
        if http is None:
            self.inputs: list[Any] = _build_inputs(target)
        else:
            parameters = http_parameters(target)
            self.inputs = [encode_infer_request(http.host, target.model,
                                                [wire_tensor(name, array) for name, array in inputs.items()],
                                                parameters)
                           for inputs in request_inputs(target)]
        self.next_index = 0
        self.latencies_ms: list[float] = []
        self.errors: list[str] = []
        self.rejections: list[str] = []
        self.send_lags_ms: list[float] = []

    def take_inputs(self) -> Any:
        inputs = self.inputs[self.next_index % len(self.inputs)]
        self.next_index += 1
        return inputs

    async def send(self, scheduled: float) -> None:
        """One request; latency counts from `scheduled` (perf_counter seconds)."""
        inputs = self.take_inputs()
        self.send_lags_ms.append((time.perf_counter() - scheduled) * 1e3)
        if self.http is not None:
            await self._send_http(inputs, scheduled)
            return
        try:
            await self.client.infer(
                self.target.model, inputs, parameters=dict(self.target.parameters) or None,
                priority=self.target.priority, timeout=self.target.timeout_us,
                client_timeout=self.target.request_timeout_s,
            )
        except self._exception as err:
            self._failed(err.status(), err.message() or "")
            return
        self.latencies_ms.append((time.perf_counter() - scheduled) * 1e3)

    async def _send_http(self, request: bytes, scheduled: float) -> None:
        assert self.http is not None
        try:
            status, body = await self.http.post(request, self.target.request_timeout_s)
        except TimeoutError:
            self.errors.append(f"deadline exceeded: no answer within {self.target.request_timeout_s:g} s")
            return
        except (OSError, EOFError, ProtocolError) as err:  # EOFError: asyncio.IncompleteReadError
            self.errors.append(f"connection: {type(err).__name__}: {err}")
            return
        if status != 200:
            self._failed(str(status), error_message(body))
            return
        self.latencies_ms.append((time.perf_counter() - scheduled) * 1e3)

    def _failed(self, status: str | None, text: str) -> None:
        message = f"{status or 'error'}: {text}"
        if classify(status, text) is Outcome.REJECTED:
            self.rejections.append(message)
        else:
            self.errors.append(message)


async def _server_stats(client: Any) -> dict[str, Any]:
    return await client.get_inference_statistics("", as_json=True)


async def ready_models_index(client: Any) -> list[dict[str, str]]:
    """The ready models, shaped as repository index entries. Read from the statistics endpoint
    (it lists every ready model): the repository index is an admin endpoint, behind the admin key."""
    stats = await _server_stats(client)
    return [{"name": entry["name"], "state": "READY"} for entry in stats.get("model_stats", [])]


async def router_calls(client: Any, model: str) -> tuple[str, ...]:
    """The models `model` calls (`called_models` of its config, read from the server); none
    when the server has no such model (its requests then fail, and count as errors)."""
    from tritonclient.utils import InferenceServerException

    try:
        config = await client.get_model_config(model, as_json=True)
    except InferenceServerException:
        return ()
    return called_models(config.get("config", config))


async def resolve_stats_models(client: Any, target: LoadTarget) -> list[str]:
    if target.stats_models:
        return list(target.stats_models)
    return default_stats_models(target.model, await ready_models_index(client),
                                await router_calls(client, target.model))


async def _measure(target: LoadTarget, mode: Mode, load: float, drive) -> StepResult:
    import tritonclient.grpc.aio as grpcclient

    http_client = HttpInferClient(*split_host_port(target.http_url)) if target.http_url else contextlib.nullcontext()
    async with grpcclient.InferenceServerClient(target.grpc_url, **client_tls_kwargs(target.tls_ca)) as client, \
            http_client as http:
        models = await resolve_stats_models(client, target)
        sender = _Sender(client, target, http)
        before = await _server_stats(client)
        cpu_start, start = time.process_time(), time.perf_counter()
        await drive(sender, start)
        duration_s = time.perf_counter() - start
        client_cpu_s = time.process_time() - cpu_start
        after = await _server_stats(client)
    server = {model: times for model, times in server_times_delta(before, after).items() if model in models}
    return summarize_step(mode=mode, load=load, duration_s=duration_s, latencies_ms=sender.latencies_ms,
                          errors=sender.errors, slo_ms=target.slo_ms, send_lags_ms=sender.send_lags_ms,
                          client_cpu_s=client_cpu_s, server=server, rejections=sender.rejections)


async def run_open_loop(target: LoadTarget, rate_rps: float, duration_s: float, seed: int = 0) -> StepResult:
    """Poisson arrivals at `rate_rps` for `duration_s`, each sent without waiting for
    earlier ones; then wait for the stragglers (bounded by the per-request deadline)."""
    arrivals = poisson_arrival_times(rate_rps, duration_s, random.Random(seed))

    async def drive(sender: _Sender, start: float) -> None:
        in_flight: set[asyncio.Task[None]] = set()
        for offset in arrivals:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= target.max_outstanding:
                # The server (or this generator) is this far behind: sending more would
                # only hide it. Count the request as failed instead of delaying it.
                sender.errors.append(f"not sent: {len(in_flight)} requests outstanding "
                                     f"(max_outstanding={target.max_outstanding})")
                continue
            task = asyncio.create_task(sender.send(start + offset))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)

    return await _measure(target, "open", rate_rps, drive)


async def run_closed_loop(target: LoadTarget, concurrency: int, duration_s: float) -> StepResult:
    """`concurrency` workers, each sending its next request as soon as the last one answers,
    for `duration_s`; latency counts from each send."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")

    async def drive(sender: _Sender, start: float) -> None:
        deadline = start + duration_s

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await sender.send(time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    return await _measure(target, "closed", concurrency, drive)


async def run_one_at_a_time(target: LoadTarget, num_requests: int) -> StepResult:
    """`num_requests` requests, each sent as soon as the last one answered (a closed loop of
    concurrency 1, counted rather than timed); latency counts from each send."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")

    async def drive(sender: _Sender, start: float) -> None:
        for _ in range(num_requests):
            await sender.send(time.perf_counter())

    return await _measure(target, "closed", 1, drive)


@dataclass(frozen=True)
class TurnResult:
    """What `send_in_turn` saw: one entry per request, in the order sent."""

    latencies_ms: tuple[float | None, ...]  # each request's latency; None where it failed
    errors: tuple[str, ...]  # the failed requests' messages, in order


async def send_in_turn(http_url: str, requests: Sequence[bytes], timeout_s: float = 30.0) -> TurnResult:
    """Send pre-encoded HTTP requests (`tools.clients.http_infer.encode_infer_request`, to any
    model) one at a time over one keep-alive connection, each as soon as the last one answered."""
    latencies: list[float | None] = []
    errors: list[str] = []
    async with HttpInferClient(*split_host_port(http_url), max_connections=1) as http:
        for request in requests:
            sent = time.perf_counter()
            try:
                status, body = await http.post(request, timeout_s)
            except (TimeoutError, OSError, EOFError, ProtocolError) as err:
                latencies.append(None)
                errors.append(f"{type(err).__name__}: {err}")
                continue
            if status != 200:
                latencies.append(None)
                errors.append(f"{status}: {error_message(body)}")
                continue
            latencies.append((time.perf_counter() - sent) * 1e3)
    return TurnResult(tuple(latencies), tuple(errors))


# ---------------------------------------------------------------------------------------
# Plot


def plot_sweep(results: Sequence[StepResult], slo_ms: float, path: str | Path, title: str) -> Path:
    """p50/p95/p99 latency against achieved throughput, with the SLO as a horizontal line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    points = sorted((r for r in results if r.p50_ms is not None), key=lambda r: r.throughput_rps)
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    throughput = [r.throughput_rps for r in points]
    for name, marker in (("p50_ms", "o"), ("p95_ms", "s"), ("p99_ms", "^")):
        axes.plot(throughput, [getattr(r, name) for r in points], marker=marker, label=name.split("_")[0])
    for r in points:  # label each point with its load knob
        knob = f"{r.offered_rps:g} rps" if r.mode == "open" else f"c={r.concurrency}"
        axes.annotate(knob, (r.throughput_rps, r.p99_ms or 0), textcoords="offset points", xytext=(3, 5),
                      fontsize=7, color="gray")
    axes.axhline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    axes.set_xlabel("achieved throughput (ok responses / s)")
    axes.set_ylabel("latency (ms)")
    axes.set_yscale("log")  # latency spans ms to seconds once a step overloads the server
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    # Label only the 2x and 5x minor ticks: all of them crowd the axis.
    axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else ""))
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path

