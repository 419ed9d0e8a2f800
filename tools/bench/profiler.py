"""The measurements behind a latency profile, on a tritonserver in explicit model-control mode.

For each bucket model of the serving spec, `measure_bucket` loads a probing config (one
version, no dynamic batching) and reads c(b), the compute time of one execution at batch
sizes 1, 2, 4, ..., from Triton's per-batch-size statistics, until a batch costs more than
half the SLO; `measure_overhead` times single-row requests through the router, minus the
bucket's c(1). An external model is probed the same way, loaded with its own config but for
the probing fields (`probe_external_config`), with random rows of its declared tensors.
Everything here talks to the server through the client it is given; `python -m tools profile`
starts the server, saves the profile and prints it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.embed.admission import ADMIT_ALL
from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS, ModelKind
from python_backends.tensor.router import TensorRouterConfig
from tools.bench.loadgen import batch_compute_ns
from tools.planning.derivation import Admission, BatchingKnobs, RouterPlan
from tools.repository.configs import (
    encoder_config,
    external_config,
    router_config,
    tensor_bucket_config,
    tensor_layout,
    tensor_router_config,
)
from tools.repository.external import merged_config
from tools.repository.graph import TensorInfo
from tools.repository.sources import (
    ExternalModel,
    ServedGraph,
    SourceError,
    served_external,
    served_graph,
    served_tensors,
    tokenizer_path,
)
from tools.spec.profile import LatencyCurve, ModelProfile, Overhead
from tools.spec.serving import BucketedModelSpec, HardwareLimits, ServingSpec, SpecError

MAX_PROBE_BATCH = 128
WARMUP_EXECUTIONS = 2


def probe_knobs(name: str, max_batch: int) -> BatchingKnobs:
    return BatchingKnobs(model_name=name, max_batch_size=max_batch, preferred_batch_size=1, max_queue_delay_us=0,
                         default_timeout_us=0, max_queue_size=0, instance_count=1)


def profiled_version(model: BucketedModelSpec) -> int:
    """The encoder version whose c(b) the profile records: the one serving most unpinned traffic
    (the lowest of a tie), else the first. Its curve sets every version's knobs; a cheaper
    version (INT8) then runs with room to spare, never over its budget."""
    if model.traffic:
        return min(model.traffic, key=lambda version: (-model.traffic[version], version))
    return model.versions[0]


def profiling_router_config(model: BucketedModelSpec, spec: ServingSpec, bucket_max_batch: dict[int, int],
                            graph: ServedGraph | None, layout: TensorRouterConfig | None = None):
    """The router as the overhead probe runs it: one instance and no admission bound, since the
    probe sends one request at a time and measures the router's own cost, not its refusals."""
    plan, admission = RouterPlan(instance_count=1, max_concurrent_requests=1), Admission(ADMIT_ALL, 0)
    if graph is not None:
        return router_config(model, spec, bucket_max_batch, plan, admission=admission, graph=graph)
    return tensor_router_config(model, spec, replace(layout, bucket_max_batch=bucket_max_batch), plan, admission)


def probe_external_config(external: ExternalModel, name: str, knobs: BatchingKnobs, hardware: HardwareLimits,
                          version: int) -> mc.ModelConfig:
    """An external model as the probe loads it: the user's config (backend, tensors, parameters,
    warm-up) with the probing batch size and one instance, the one version profiled, and no
    dynamic batching (the caller clears it)."""
    config = merged_config(external.config, external_config(name, knobs, hardware))
    config.name = name
    config.version_policy.Clear()
    config.version_policy.specific.versions.append(version)
    return config


def vocab_size(model: BucketedModelSpec) -> int:
    """Token ids the model's tokenizer can produce: the profiler's random ids stay below it."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path(model))).get_vocab_size()


def probe_rows(rng: np.random.Generator, batch: int, seq_len: int, vocab: int,
               token_types: bool) -> dict[str, np.ndarray]:
    """A full-length batch of random token ids (every position real), as the bucket model takes it."""
    ids = rng.integers(min(1000, vocab // 2), vocab, size=(batch, seq_len), dtype=np.int64)
    tensors = {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids)}
    if token_types:
        tensors[TOKEN_TYPE_IDS] = np.zeros_like(ids)
    return tensors


def load_with_config(client, config, control_headers: Mapping[str, str] | None = None) -> None:
    client.load_model(config.name, config=json_format.MessageToJson(config, preserving_proto_field_name=True),
                      headers=dict(control_headers or {}))


def infer_inputs(arrays: Mapping[str, np.ndarray]) -> list:
    """The HTTP client's inputs for arrays by name (BYTES for object arrays)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, values in arrays.items():
        inputs.append(httpclient.InferInput(name, list(values.shape), np_to_triton_dtype(values.dtype)))
        inputs[-1].set_data_from_numpy(values)
    return inputs


def tensor_rows(layout: TensorRouterConfig, bucket_len: int, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of random rows of a tensor model's inputs at one bucket (`tools.bench.inputs`)."""
    from tools.bench.inputs import make_inputs

    infos = [TensorInfo(spec.name, mc.DataType.Value(spec.data_type),
                        (None, *(size if size > 0 else None for size in layout.bucket_dims(spec, bucket_len))))
             for spec in layout.inputs]
    return make_inputs(infos, batch, seed=seed)


def measure_bucket(client, name: str, seq_len: int, sizes: list[int], stop_ms: float, time_budget_s: float,
                   progress, vocab: int = 30522, token_types: bool = False,
                   make_rows: Callable[[int], dict[str, np.ndarray]] | None = None) -> ModelProfile:
    """c(b) of one bucket model; `make_rows(batch)` gives a tensor model's inputs (text models:
    random token ids the tokenizer can make)."""
    rng = np.random.default_rng(seq_len)
    compute_ms: dict[int, float] = {}
    executions: dict[int, int] = {}
    for batch in sizes:
        inputs = infer_inputs(make_rows(batch) if make_rows is not None else
                              probe_rows(rng, batch, seq_len, vocab, token_types))
        for _ in range(WARMUP_EXECUTIONS):
            client.infer(name, inputs)

        def compute_so_far(batch: int = batch) -> tuple[int, int]:
            return batch_compute_ns(client.get_inference_statistics(name)["model_stats"][0], batch)

        ns_before, count_before = compute_so_far()
        started = time.monotonic()
        reps = 0
        while reps < 3 or (reps < 30 and time.monotonic() - started < time_budget_s):
            client.infer(name, inputs)
            reps += 1
        ns_after, count_after = compute_so_far()
        if count_after - count_before < reps:  # statistics land just after each response
            time.sleep(0.2)
            ns_after, count_after = compute_so_far()
        compute_ms[batch] = (ns_after - ns_before) / max(count_after - count_before, 1) / 1e6
        executions[batch] = count_after - count_before
        progress.set_postfix_str(f"{name} b={batch}: {compute_ms[batch]:.1f} ms")
        progress.update(1)
        if compute_ms[batch] > stop_ms:
            progress.update(len(sizes) - sizes.index(batch) - 1)
            break
    return ModelProfile(seq_len=seq_len, curve=LatencyCurve(compute_ms), reps=executions)


def measure_overhead(client, model: BucketedModelSpec, bucket: str, c1_ms: float, num_requests: int,
                     cpu_seconds=None, request: Mapping[str, np.ndarray] | None = None) -> Overhead:
    """Router-path latency outside the bucket's compute, from single-row requests (`request`,
    else a short text); with `cpu_seconds` (the server's CPU so far) also the CPU each request
    costs outside the bucket model: the router stub, its checks (tokenization for text), BLS and
    Triton's own request handling."""
    request = request or {"TEXT": np.array([[b"a short query to time the router path"]], dtype=object)}
    text = infer_inputs(request)
    for _ in range(5):
        client.infer(model.name, text)

    def bucket_compute_ns() -> int:
        return batch_compute_ns(client.get_inference_statistics(bucket)["model_stats"][0])[0]

    compute_before = bucket_compute_ns()
    cpu_before = cpu_seconds() if cpu_seconds else 0.0
    latencies = []
    for _ in range(num_requests):
        started = time.perf_counter()
        client.infer(model.name, text)
        latencies.append((time.perf_counter() - started) * 1000.0)
    cpu_ms = None
    if cpu_seconds:
        time.sleep(0.2)  # statistics land just after each response
        # One ONNX Runtime thread per instance: the bucket's compute time is its CPU time.
        bucket_cpu_s = (bucket_compute_ns() - compute_before) / 1e9
        cpu_ms = max(cpu_seconds() - cpu_before - bucket_cpu_s, 0.0) / num_requests * 1000.0
    overheads = np.maximum(np.asarray(latencies) - c1_ms, 0.0)
    return Overhead(p50_ms=float(np.percentile(overheads, 50)), p95_ms=float(np.percentile(overheads, 95)),
                    cpu_ms=cpu_ms)


def profile_models(client, spec: ServingSpec, hardware_kind: str, time_budget_s: float, overhead_requests: int,
                   log, cpu_seconds=None, control_headers: Mapping[str, str] | None = None,
                   only: tuple[str, ...] = ()) -> tuple[dict[str, ModelProfile], dict[str, Overhead]]:
    """c(b) of every bucket model and the router overhead of every model of the spec (of the
    models named in `only`, when given)."""
    from tqdm import tqdm

    hardware = spec.hardware.get(hardware_kind)
    if hardware is None:
        raise SpecError(f"{spec.path}: no [hardware.{hardware_kind}] table")
    sizes = [2**i for i in range(MAX_PROBE_BATCH.bit_length()) if 2**i <= MAX_PROBE_BATCH]
    if hardware.kind != "cpu" or hardware.intra_op_threads != 1:
        cpu_seconds = None  # the bucket's compute time is its CPU time only for one thread on a CPU
    models: dict[str, ModelProfile] = {}
    overheads: dict[str, Overhead] = {}
    chosen = [m for m in spec.models if not only or m.name in only]
    unknown = sorted(set(only) - {m.name for m in spec.models})
    if unknown:
        raise SpecError(f"{spec.path}: no model {', '.join(unknown)} to profile; its models are "
                        f"{', '.join(m.name for m in spec.models)}")
    total = sum(len(sizes) * len(m.bucket_lens) for m in chosen)
    with tqdm(total=total, desc="profiling", unit="point", file=sys.stderr, dynamic_ncols=True) as progress:
        for model in chosen:
            external = None
            try:
                if model.kind.is_text:
                    graph, vocab, layout = served_graph(model), vocab_size(model), None
                else:
                    graph, vocab = None, 0
                    probe_limits = {b: MAX_PROBE_BATCH for b in model.bucket_lens}
                    external = served_external(model) if model.kind is ModelKind.EXTERNAL else None
                    tensors = external.tensors if external is not None else served_tensors(model)
                    layout = tensor_layout(model, tensors, probe_limits)
            except SourceError as err:
                raise SpecError(f"{spec.path}: {err}") from None
            # Beyond half the SLO a batch can never be used (o + 2·c(b) <= S); one point past it is enough.
            stop_ms = model.slo_p95_ms / 2
            for bucket_len in model.bucket_lens:
                name = model.encoder_name(bucket_len)
                # One version loaded, so that requests and statistics are both that version's.
                knobs, versions = probe_knobs(name, MAX_PROBE_BATCH), (profiled_version(model),)
                if external is not None:
                    config = probe_external_config(external, name, knobs, hardware, versions[0])
                elif graph is not None:
                    config = encoder_config(name, bucket_len, knobs, hardware, versions, graph, model.kind)
                else:
                    config = tensor_bucket_config(name, bucket_len, knobs, hardware, versions, layout)
                config.ClearField("dynamic_batching")  # one request = one execution of exactly b rows
                load_with_config(client, config, control_headers)
                models[name] = measure_bucket(
                    client, name, bucket_len, sizes, stop_ms, time_budget_s, progress, vocab,
                    graph is not None and TOKEN_TYPE_IDS in graph.onnx_inputs,
                    make_rows=None if layout is None else
                    (lambda batch, length=bucket_len, layout=layout: tensor_rows(layout, length, batch, seed=length)))
            limits = {b: MAX_PROBE_BATCH for b in model.bucket_lens}
            load_with_config(client, profiling_router_config(model, spec, limits, graph, layout), control_headers)
            first = model.encoder_name(model.bucket_lens[0])
            overhead = measure_overhead(client, model, first, models[first].curve.at(1), overhead_requests,
                                        cpu_seconds, None if layout is None else
                                        tensor_rows(layout, model.bucket_lens[0], 1))
            overheads[model.name] = overhead
            log(f"{model.name}: router overhead p50 {overhead.p50_ms:.2f} ms, p95 {overhead.p95_ms:.2f} ms"
                + (f", {overhead.cpu_ms:.2f} CPU ms per request" if overhead.cpu_ms is not None else
                   " (CPU per request not measured: needs a private server and one thread per CPU instance)"))
    return models, overheads
