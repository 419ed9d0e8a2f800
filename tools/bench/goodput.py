"""The goodput benchmark: three setups of one model of the spec against the machine's ceiling.

`run_benchmark` builds a model repository per setup of the model (`no_batching`,
`default_batching`: one bucket of the largest length, or a fixed-shape model's one bucket,
`slo_bucketed`: the generated configs) under build/bench/, starts a tritonserver on each in
turn and searches for the highest open-loop rate that meets the SLO (`search_goodput`), then
runs the same rows through ONNX Runtime in-process for the ceiling (`measure_ceiling`: the
installed bucket graphs, fed the tensors the model's own router makes, run as its bucket
configs say), in rounds; it returns the report that `python -m tools bench goodput` writes to
results/goodput.json for `embed` (its --help says what each figure means). The rows follow the
model's workload (`tools.bench.payloads`): a text model's texts in its tokenizer's tokens, as
text pairs for a model that takes pairs; a tensor model's random tensors, of lengths on its
variable axis drawn from the mix (a fixed-shape model needs no workload). An external model (the
user's own Triton model, any backend) is served from a copy of its folder with the setup's
config (`tools.bench.harness.build_user_repository`; the user's repository is only read): the
baselines are the user's config with no dynamic batching or Triton's `dynamic_batching { }`
(`external_baseline`), slo_bucketed is the kit's router and the managed fields gen-config
derives; it has no ceiling (`EXTERNAL_CEILING_NOTE`). With slo_bucketed among the setups,
each round also sends the mix's short requests at light load on its server after the search
(`run_setup`'s `light_load`), and starts one more server whose bucket models do not linger
(`unbatched_plan`, `run_unbatched`): the same short requests one at a time, and the router's
requests in turn with the same rows sent straight to their bucket model (`routed_requests`),
for the router's latency overhead and CPU per request, and beside them a Python model that only
forwards (`forward_model`) for the part of the overhead any Python model pays. A mix other than the spec's is
benchmarked with its configs derived for it (`for_mix`) and written beside the default result
(`mix_results_path`). The round medians, paired ratios, the rows' bucket tensors, the short
requests' selection, the overhead arithmetic and the per-step CPU breakdown are pure.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.regimes import REGIMES_PARAMETER, LingerRegimes, express_model_name
from python_backends.embed.encoder import EncoderConfig, parse_encoder_config
from python_backends.embed.inline import INLINE_PARAMETER, InlinePolicy
from python_backends.embed.kinds import ModelKind
from python_backends.embed.router import EmbedRouter, RouterConfig, parse_router_config
from python_backends.tensor.bucket import TensorBucketConfig, parse_tensor_bucket_config
from python_backends.tensor.router import (
    FIXED_BUCKET,
    FIXED_SUFFIX,
    TensorRouter,
    TensorRouterConfig,
    parse_tensor_router_config,
)
from tools.bench.harness import (
    BENCH_DIR,
    build_repository,
    build_user_repository,
    detect_hardware,
    hardware_report,
    without_tenant_quotas,
)
from tools.bench.loadgen import (
    LoadTarget,
    RateSearch,
    StepResult,
    duration_for_arrivals,
    flatten_step,
    ns_count,
    percentile,
    run_one_at_a_time,
    run_open_loop,
    send_in_turn,
    split_host_port,
    wire_tensor,
)
from tools.bench.payloads import TensorPayload, TextPayload, model_payload
from tools.clients.http_infer import encode_infer_request
from tools.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.repository.configs import ROUTER_VERSIONS, GeneratedModel, bucket_curves, plan_embed_model
from tools.repository.external import parse_config
from tools.server.control import ServerControl
from tools.server.triton_server import ServerConfig, TritonServer, free_port
from tools.spec.buckets import derived_edges
from tools.spec.profile import LatencyProfile
from tools.spec.serving import BucketedModelSpec, ServingSpec
from tools.spec.workload import WORKLOAD_DIR, Workload, load_workload

SETUPS = ("no_batching", "default_batching", "slo_bucketed")
DEFAULT_MAX_BATCH = 32  # a common hand-picked max_batch_size: the "default knobs" baseline
PROTOCOLS = ("http", "grpc")
# An external model runs on the user's backend, which only the server loads: there is nothing
# to run in-process, and a ceiling measured through the server would be one more setup, not the
# hardware's limit. So the report says so rather than print a figure of another kind.
EXTERNAL_CEILING_NOTE = ("no ceiling for an external model: its backend runs only inside tritonserver, so "
                         "there is no in-process run to measure what the hardware can do without the server")
DEFAULT_REPEATS = 3  # rounds of the full goodput run: a median of three outvotes one lucky or unlucky search
# Light load: short requests at this share of the model's expected_rps, open loop; the target
# is their p50 within LIGHT_LOAD_TARGET_RATIO of the same requests sent one at a time unbatched.
LIGHT_LOAD_SHARE = 0.10
LIGHT_LOAD_TARGET_RATIO = 2.0
LIGHT_LOAD_REQUESTS = 100  # enough for a p50 and a rough p95 (--quick sends fewer)
LIGHT_LOAD_SEED = 7  # the arrivals' draw; any fixed seed, so a round's requests are known in advance
OVERHEAD_REQUESTS = 200  # of each kind, router and direct (--quick sends fewer)
ROUTER_OVERHEAD_TARGET_MS = 1.0  # the router's p50 latency over the same rows sent straight to the bucket
OVERHEAD_WARMUP_REQUESTS = 5  # of each kind, sent and discarded before the router measurements
# The server without linger: the bucket models as generated but with max_queue_delay 0 and no
# preferred batch sizes, so a request alone runs at once (the unbatched latency, the router's cost).
UNBATCHED_SETUP = "slo_bucketed_unbatched"
# On that server, the floor of the router's overhead: a Python model that only forwards.
FORWARD_MODEL = "bench_forward"
FORWARD_ADAPTER = "forward_model"  # python_backends/adapters/forward_model.py


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
    light_load_requests: int = LIGHT_LOAD_REQUESTS  # short requests at light load, and one at a time unbatched
    overhead_requests: int = OVERHEAD_REQUESTS  # router requests (and as many straight to a bucket) per measurement
    # Rounds that measure the light load and start the linger-free server (the first ones);
    # None: every round. The short form measures them once: a server start is 10-25 s on 2 cores.
    light_load_rounds: int | None = None
    # Light load sent unmeasured first, until the router has switched to its light regime
    # (`regime_settle_s`: 36 s for embed). The short form skips it: it checks the figures exist.
    regime_settle: bool = True


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


def model_plan(spec: ServingSpec, profile: LatencyProfile, model: BucketedModelSpec) -> list[GeneratedModel]:
    """The generated configs of one model alone, its router first, then its bucket models
    (the spec's other models, and the LLM, are benchmarked on their own)."""
    return plan_embed_model(model, spec, profile)


def without_light_regimes(router: mc.ModelConfig) -> mc.ModelConfig:
    """A copy of a router's config without its light-load regimes, for a benchmark copy whose
    bucket models do not linger: it has no light regime to switch to and no express model."""
    config = mc.ModelConfig()
    config.CopyFrom(router)
    if REGIMES_PARAMETER in config.parameters:
        express = LingerRegimes.from_json(config.parameters[REGIMES_PARAMETER].string_value).express
        del config.parameters[REGIMES_PARAMETER]
        keep_inline_limits(config, lambda target: target != express)
    return config


def keep_inline_limits(router: mc.ModelConfig, keep: Callable[[str], bool]) -> None:
    """Drop from a router's `inline_max_ms` the targets a benchmark copy no longer calls."""
    if INLINE_PARAMETER not in router.parameters:
        return
    policy = InlinePolicy.from_json(router.parameters[INLINE_PARAMETER].string_value)
    kept = {target: ms for target, ms in policy.max_ms_by_target.items() if keep(target)}
    router.parameters[INLINE_PARAMETER].string_value = replace(policy, max_ms_by_target=kept).to_json()


def padded_only_plan(spec: ServingSpec, profile: LatencyProfile, model: BucketedModelSpec,
                     batching: bool) -> list[GeneratedModel]:
    """The baselines: the router with a single bucket of the largest length, so every input is
    padded to it (256 tokens for `embed`); a fixed-shape tensor model keeps its one bucket; an
    external model is the user's own config with only its batcher changed (`external_baseline`)."""
    plan = {m.name: m for m in model_plan(spec, profile, model)}
    largest = model.bucket_lens[-1]
    router = without_light_regimes(plan[model.name].config)  # no lingering bucket models, no express model
    bucket = plan[model.encoder_name(largest)]
    encoder = mc.ModelConfig()
    encoder.CopyFrom(bucket.config)
    encoder.ClearField("dynamic_batching")
    if bucket.user_config is not None:
        encoder = external_baseline(parse_config(bucket.user_text, str(bucket.user_config)), bucket.name, batching)
    elif batching:
        encoder.max_batch_size = DEFAULT_MAX_BATCH
        encoder.dynamic_batching.SetInParent()  # `dynamic_batching { }`: Triton's defaults
    else:
        encoder.max_batch_size = 1
    # Triton refuses to load a model whose warm-up batch is larger than its max_batch_size.
    warmups = [warmup for warmup in encoder.model_warmup if warmup.batch_size <= encoder.max_batch_size]
    del encoder.model_warmup[:]
    encoder.model_warmup.extend(warmups)
    if largest != FIXED_BUCKET:  # a fixed-shape model's router names no bucket lengths
        router.parameters["bucket_lens"].string_value = str(largest)
    router.parameters["bucket_max_batch"].string_value = f"{largest}:{encoder.max_batch_size}"
    keep_inline_limits(router, lambda target: target == bucket.name)
    # Without this project's admission control too: a baseline serves late rather than refusing.
    del router.parameters["admission"]
    router.dynamic_batching.ClearField("default_queue_policy")
    header = ("Benchmark baseline written by `python -m tools bench goodput`.",)
    # The generated models' own adapters: the text or the tensor router and bucket backend.
    return [
        GeneratedModel(model.name, router, header, plan[model.name].adapter, ROUTER_VERSIONS),
        replace(bucket, config=encoder, header=header, knobs=None),
    ]


def external_baseline(user: mc.ModelConfig, name: str, batching: bool) -> mc.ModelConfig:
    """An external model's managed fields in a baseline, as the user wrote them but the batcher:
    the user's max_batch_size and instance_group, and no dynamic batching (`no_batching`: each
    request runs as it comes) or Triton's `dynamic_batching { }` (`default_batching`). The
    user's max_batch_size, not DEFAULT_MAX_BATCH: on a backend the kit does not know it may be
    the most the model takes (a TensorRT engine's build size), and it is the user's hand-picked
    value, which is what the baseline stands for."""
    config = mc.ModelConfig(name=name, max_batch_size=user.max_batch_size)
    config.instance_group.extend(user.instance_group)
    if batching:
        config.dynamic_batching.SetInParent()
    return config


def _run_batches(encoders: list, batches: list[dict[str, np.ndarray]]) -> float:
    """Seconds to run `batches` through `encoders` side by side (batch i on encoder i mod n)."""
    from concurrent.futures import ThreadPoolExecutor

    def lane(index: int) -> None:
        for batch in batches[index::len(encoders)]:
            encoders[index].run(batch)

    started = time.perf_counter()
    with ThreadPoolExecutor(len(encoders)) as pool:  # ONNX Runtime releases the GIL while it runs
        list(pool.map(lane, range(len(encoders))))
    return time.perf_counter() - started


def router_of(plan: Sequence[GeneratedModel], model: BucketedModelSpec) -> RouterConfig:
    """The model's router settings as its generated config gives them to the served router."""
    router = next(m for m in plan if m.name == model.name)
    return parse_router_config(model.name, {key: value.string_value for key, value in router.config.parameters.items()})


def bucket_configs(plan: Sequence[GeneratedModel], model: BucketedModelSpec) -> dict[int, EncoderConfig]:
    """Each bucket model's settings as the served backend reads them from its generated config
    (`parse_encoder_config` on Triton's JSON form of the config)."""
    configs = {m.name: m.config for m in plan}
    return {length: parse_encoder_config(MessageToDict(configs[model.encoder_name(length)],
                                                       preserving_proto_field_name=True))
            for length in model.bucket_lens}


def tensor_router_of(plan: Sequence[GeneratedModel], model: BucketedModelSpec) -> TensorRouterConfig:
    """A tensor model's router settings as its generated config gives them to the served router."""
    router = next(m for m in plan if m.name == model.name)
    return parse_tensor_router_config(model.name, {key: value.string_value
                                                   for key, value in router.config.parameters.items()})


def tensor_bucket_configs(plan: Sequence[GeneratedModel], model: BucketedModelSpec) -> dict[int, TensorBucketConfig]:
    """Each bucket model of a tensor model as its backend reads its generated config."""
    configs = {m.name: m.config for m in plan}
    return {length: parse_tensor_bucket_config(MessageToDict(configs[model.encoder_name(length)],
                                                             preserving_proto_field_name=True))
            for length in model.bucket_lens}


def tensor_bucket_rows(payload: TensorPayload, router: TensorRouter) -> dict[int, list[dict[str, np.ndarray]]]:
    """Every row's bucket tensors (each of one row, padded to its bucket on the variable axis) as
    the model's router makes them for its request, by bucket length (FIXED_BUCKET for a
    fixed-shape model)."""
    rows: dict[int, list[dict[str, np.ndarray]]] = {}
    for request in payload.requests:
        for chunk in router.prepare(request).chunks:
            num_rows = len(chunk.chunk.row_indices)
            rows.setdefault(chunk.chunk.bucket_len, []).extend(
                {name: array[index:index + 1] for name, array in chunk.tensors.items()} for index in range(num_rows))
    return rows


def bucket_key(bucket_len: int) -> str:
    """A bucket's key in the report: its length, or `fixed` for a fixed-shape model's one bucket."""
    return FIXED_SUFFIX if bucket_len == FIXED_BUCKET else str(bucket_len)


def bucket_rows(payload: TextPayload, router: EmbedRouter) -> dict[int, list[dict[str, np.ndarray]]]:
    """Every row's bucket tensors (each int64 [1, bucket length]) as the model's router makes
    them for a request of that one row, pair or query prefix included, by bucket length."""
    pairs = payload.pair_texts or (None,) * len(payload.texts)
    rows: dict[int, list[dict[str, np.ndarray]]] = {}
    for text, pair in zip(payload.texts, pairs, strict=True):
        prepared = router.prepare([text], None, raw_pairs=None if pair is None else [pair])
        for chunk in prepared.chunks:
            rows.setdefault(chunk.chunk.bucket_len, []).append(chunk.tensors)
    return rows


def stack_rows(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch of bucket rows: each tensor's rows stacked in order."""
    return {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}


def served_version(model: BucketedModelSpec) -> int:
    """The version that takes most of the unpinned traffic at start (the spec's `traffic`)."""
    return max(model.traffic, key=lambda version: (model.traffic[version], -version))


def text_router(plan: Sequence[GeneratedModel], model: BucketedModelSpec,
                repository: Path = DEFAULT_MODEL_REPOSITORY) -> EmbedRouter:
    """A text model's router as served: its generated settings and the tokenizer installed in
    `repository` (read from disk)."""
    from python_backends.common.tokenization import TextTokenizer

    tokenizer = TextTokenizer.from_file(repository / model.name / str(ROUTER_VERSIONS[0]) / "tokenizer.json")
    return EmbedRouter(router_of(plan, model), tokenizer)


@dataclass(frozen=True)
class BucketCall:
    """One chunk of a request as the router sends it on over BLS."""

    model_name: str  # the bucket model called
    bucket_len: int  # its length (FIXED_BUCKET for a fixed-shape model's one bucket)
    tensors: Mapping[str, np.ndarray]  # the bucket model's inputs by name, padded to bucket_len


@dataclass(frozen=True)
class RoutedRequest:
    """One request of the payload as a client sends it to the model's router, and the same rows
    as the router sends them on to its bucket models."""

    inputs: Mapping[str, np.ndarray]  # the router's inputs by name: TEXT (and TEXT_PAIR) [rows, 1], or tensors
    calls: tuple[BucketCall, ...]  # what the router sends on, chunk by chunk

    @property
    def bucket_lens(self) -> tuple[int, ...]:
        return tuple(call.bucket_len for call in self.calls)


def routed_requests(payload: TextPayload | TensorPayload, plan: Sequence[GeneratedModel], model: BucketedModelSpec,
                    repository: Path = DEFAULT_MODEL_REPOSITORY) -> list[RoutedRequest]:
    """Each request of the payload beside its bucket calls, made by the model's own router code
    (`text_router`, which reads the installed tokenizer, or `TensorRouter`): a text model's
    rows one a request, a tensor model's requests as the payload has them."""
    if isinstance(payload, TensorPayload):
        tensor_router = TensorRouter(tensor_router_of(plan, model))
        return [RoutedRequest(inputs=dict(request),
                              calls=tuple(BucketCall(chunk.model_name, chunk.chunk.bucket_len, chunk.tensors)
                                          for chunk in tensor_router.prepare(request).chunks))
                for request in payload.requests]
    router = text_router(plan, model, repository)
    pairs = payload.pair_texts or (None,) * len(payload.texts)
    routed = []
    for text, pair in zip(payload.texts, pairs, strict=True):
        inputs = {"TEXT": np.array([[text.encode()]], dtype=object)}
        if pair is not None:
            inputs["TEXT_PAIR"] = np.array([[pair.encode()]], dtype=object)
        prepared = router.prepare([text], None, raw_pairs=None if pair is None else [pair])
        routed.append(RoutedRequest(inputs=inputs, calls=tuple(BucketCall(chunk.model_name, chunk.chunk.bucket_len,
                                                                          chunk.tensors)
                                                               for chunk in prepared.chunks)))
    return routed


def short_request_indices(bucket_lens: Sequence[Sequence[int]]) -> list[int]:
    """The short requests: those whose every chunk goes to the smallest bucket that any request
    goes to (the smallest bucket of the model unless the mix sends it nothing), by index."""
    used = [min(lens) for lens in bucket_lens if lens]
    if not used:
        return []
    smallest = min(used)
    return [index for index, lens in enumerate(bucket_lens) if lens and set(lens) == {smallest}]


def payload_subset(payload: TextPayload | TensorPayload, indices: Sequence[int]) -> TextPayload | TensorPayload:
    """The payload's rows (a text model) or requests (a tensor model) at `indices`, in order."""
    if isinstance(payload, TensorPayload):
        return TensorPayload(tuple(payload.requests[index] for index in indices))
    pairs = tuple(payload.pair_texts[index] for index in indices) if payload.pair_texts else ()
    return TextPayload(tuple(payload.texts[index] for index in indices), pairs)


def forward_model(bucket: GeneratedModel, version: int, instances: int) -> GeneratedModel:
    """`FORWARD_MODEL`, the Python backend's floor in front of `bucket`: a Python model with the
    bucket model's inputs and outputs that passes each request to `version` of it over one BLS
    call and answers with its outputs (python_backends/adapters/forward_model.py), with as many
    instances as the router."""
    config = mc.ModelConfig(name=FORWARD_MODEL, backend="python", max_batch_size=bucket.config.max_batch_size)
    config.input.extend(bucket.config.input)
    config.output.extend(bucket.config.output)
    config.instance_group.add(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU)
    config.parameters["forward_to"].string_value = bucket.name
    config.parameters["forward_version"].string_value = str(version)
    header = (f"Benchmark instrument written by `python -m tools bench goodput`: the least a Python model in "
              f"front of {bucket.name} does (one BLS call, no other work), the floor of the router's overhead.",)
    return GeneratedModel(FORWARD_MODEL, config, header, FORWARD_ADAPTER, (1,))


def unbatched_plan(plan: Sequence[GeneratedModel], model: BucketedModelSpec,
                   floor_bucket: str | None = None) -> list[GeneratedModel]:
    """The plan with every bucket model's batcher made linger-free: max_queue_delay 0 and no
    preferred batch sizes (everything else as generated), so a request alone runs at once.
    Without lingers there is no light regime to serve: the router's `linger_regimes` and the
    express model are left out, so the router calls the bucket models a direct request calls.
    With `floor_bucket`, `forward_model` in front of it too (not for an external model, whose
    inputs are in the user's config)."""
    buckets = {model.encoder_name(length) for length in model.bucket_lens}
    out = []
    by_name = {generated.name: generated for generated in plan}
    floor = by_name.get(floor_bucket) if floor_bucket else None
    if floor is not None and floor.user_config is None:
        router_instances = sum(group.count for group in by_name[model.name].config.instance_group) or 1
        out.append(forward_model(floor, served_version(model), router_instances))
    for generated in plan:
        if generated.name == model.name:
            generated = replace(generated, config=without_light_regimes(generated.config))
        elif generated.name == express_model_name(model.encoder_prefix):
            continue
        if generated.name in buckets and generated.config.HasField("dynamic_batching"):
            config = mc.ModelConfig()
            config.CopyFrom(generated.config)
            config.dynamic_batching.max_queue_delay_microseconds = 0
            del config.dynamic_batching.preferred_batch_size[:]
            header = (*generated.header, "Benchmark copy without linger: max_queue_delay_microseconds 0 and no "
                      "preferred_batch_size (`bench goodput`'s unbatched latency and router overhead).")
            generated = replace(generated, config=config, header=header)
        out.append(generated)
    return out


def model_path(name: str, version: int) -> str:
    """A model's version as Triton's HTTP path names it (`/v2/models/<this>/infer`)."""
    return f"{name}/versions/{version}"


def router_request_bytes(host: str, model: str, request: RoutedRequest) -> bytes:
    """The HTTP request that sends `request` to the model's router."""
    return encode_infer_request(host, model, [wire_tensor(name, array) for name, array in request.inputs.items()])


def chunk_request_bytes(host: str, path: str, call: BucketCall) -> bytes:
    """The HTTP request that sends a chunk's bucket tensors to the model at `path` (`model_path`)."""
    return encode_infer_request(host, path, [wire_tensor(name, np.asarray(array))
                                             for name, array in call.tensors.items()])


def direct_request_bytes(host: str, version: int, call: BucketCall) -> bytes:
    """The HTTP request that sends a chunk straight to the version of its bucket model the router calls."""
    return chunk_request_bytes(host, model_path(call.model_name, version), call)


def forward_request_bytes(host: str, call: BucketCall) -> bytes:
    """The HTTP request that sends a chunk to `FORWARD_MODEL`, which passes it to its bucket model."""
    return chunk_request_bytes(host, model_path(FORWARD_MODEL, 1), call)


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float | None]:
    """p50 and p95 of some latencies (None of none)."""
    if not latencies_ms:
        return {"p50_ms": None, "p95_ms": None}
    return {"p50_ms": round(percentile(latencies_ms, 50), 3), "p95_ms": round(percentile(latencies_ms, 95), 3)}


def paired_difference(first: Sequence[float], second: Sequence[float], q: float) -> float:
    """The q-th percentile of `first[i] - second[i]`: what the first request of each pair (or
    triple) took over the second one, sent right after it with the same rows.

    Not the difference of the two percentiles: on a mix of bucket lengths the latencies are a
    mixture with gaps between the buckets, and a percentile that falls in a gap (embed_mix: half
    the requests are the shortest bucket's, so the p50 does) moves by several milliseconds for a
    small shift, which made a 1.6-1.9 ms overhead on one bucket's requests read 2.3-3.0 ms over
    the mix (2 x AMD EPYC, the same run)."""
    return round(percentile([a - b for a, b in zip(first, second, strict=True)], q), 3)


def interleaved_overhead(latencies_ms: Sequence[float | None]) -> dict[str, Any]:
    """The router's overhead from requests sent in turn, router then direct, pair by pair
    (`send_in_turn` of [router 1, direct 1, router 2, direct 2, ...]): p50 and p95 of the
    router's latency less the direct one's, pair by pair (`paired_difference`), over the pairs
    where both answered."""
    if len(latencies_ms) % 2:
        raise ValueError(f"expected router and direct requests in pairs, got {len(latencies_ms)} latencies")
    pairs = [(router, direct) for router, direct in zip(latencies_ms[0::2], latencies_ms[1::2], strict=True)
             if router is not None and direct is not None]
    if not pairs:
        return {"p50": None, "p95": None, "router_ms": latency_summary([]), "direct_ms": latency_summary([]),
                "num_pairs": 0}
    router = [pair[0] for pair in pairs]
    direct = [pair[1] for pair in pairs]
    return {"p50": paired_difference(router, direct, 50), "p95": paired_difference(router, direct, 95),
            "router_ms": latency_summary(router), "direct_ms": latency_summary(direct), "num_pairs": len(pairs)}


def floor_overhead(latencies_ms: Sequence[float | None]) -> dict[str, Any]:
    """The Python backend's floor beside the router's overhead, from requests sent in turn as
    triples: the router's request, the same rows to `FORWARD_MODEL`, then straight to the bucket
    model. Over the triples where all three answered, triple by triple (`paired_difference`):
    p50 and p95 of the forwarding model's latency less the direct one's (`p50`, `p95`), the same
    of the router's (`router_p50`, `router_p95`), and `own_p50`, of the router's less the
    forwarding model's: what the router's own work adds above the least a Python model in front
    of the bucket costs."""
    if len(latencies_ms) % 3:
        raise ValueError(f"expected router, forward and direct requests in triples, got {len(latencies_ms)}")
    triples = [triple for triple in zip(latencies_ms[0::3], latencies_ms[1::3], latencies_ms[2::3], strict=True)
               if None not in triple]
    if not triples:
        return {"p50": None, "p95": None, "router_p50": None, "router_p95": None, "own_p50": None, "num_triples": 0}
    router, forward, direct = ([triple[index] for triple in triples] for index in range(3))
    return {"p50": paired_difference(forward, direct, 50), "p95": paired_difference(forward, direct, 95),
            "router_p50": paired_difference(router, direct, 50), "router_p95": paired_difference(router, direct, 95),
            "own_p50": paired_difference(router, forward, 50), "forward_ms": latency_summary(forward),
            "direct_ms": latency_summary(direct), "num_triples": len(triples)}


STAGES = ("queue", "compute_input", "compute_infer", "compute_output")  # Triton's per-request stages


def stage_totals(statistics_json: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(count, ns) per stage of one model's Triton statistics (`/v2/models/<model>/stats`), its versions summed."""
    totals = {stage: (0, 0) for stage in STAGES}
    for version in statistics_json.get("model_stats") or ():
        stats = version.get("inference_stats") or {}
        for stage in STAGES:
            ns, count = ns_count(stats, stage)
            totals[stage] = (totals[stage][0] + count, totals[stage][1] + ns)
    return totals


def stage_means_ms(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """Mean ms per request of each stage between two `stage_totals` of one model."""
    means = {}
    for stage in STAGES:
        count = after[stage][0] - before[stage][0]
        means[stage] = round((after[stage][1] - before[stage][1]) / count / 1e6, 3) if count > 0 else 0.0
    return means


def server_split_ms(means: Mapping[str, Mapping[str, float]], router: str, bucket: str) -> dict[str, float | None]:
    """Where a Python model in front of `bucket` spends a request inside the server, in mean ms from
    Triton's statistics (`stage_means_ms` by model): `queue` in its scheduler, `input` and `output`
    moving its tensors, and `in_stub`, its compute less the bucket model's whole time (the BLS call
    it waits on): the Python stub's own work and its round trips. A Python model's statistics end
    when `execute` returns: a router that answered some of the requests from its worker threads
    (after `execute` returned) shows less compute than the bucket's, and `in_stub` is None."""
    bucket_ms = sum(means[bucket].values())
    in_stub = round(means[router]["compute_infer"] - bucket_ms, 3)
    return {"queue": means[router]["queue"], "input": means[router]["compute_input"],
            "in_stub": in_stub if in_stub >= 0 else None, "output": means[router]["compute_output"]}


def phase_cpu_ms(before: Mapping[str, float], after: Mapping[str, float], num_requests: int) -> dict[str, float]:
    """The server's CPU ms per request over one phase, by part (`TritonServer.cpu_seconds_by_part`)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    return {part: round(max(seconds - before.get(part, 0.0), 0.0) * 1000.0 / num_requests, 3)
            for part, seconds in sorted(after.items())}


def router_cpu_ms(router_phase: Mapping[str, float], direct_phase: Mapping[str, float],
                  bucket_models: Collection[str]) -> float:
    """The router path's extra server CPU per request: the router-only phase's CPU less the
    direct-only phase's (ms per request each, same count, same rows), over every part but the
    bucket models. Their stubs run the same batches in both phases, so their share would add
    only noise: the CPU clock's 10 ms ticks on each of their processes, and their idle polling
    over the router phase's longer run."""
    def outside(phase: Mapping[str, float]) -> float:
        return sum(ms for part, ms in phase.items() if part not in bucket_models)

    return round(outside(router_phase) - outside(direct_phase), 3)


def _median(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(float(statistics.median(present)), 3) if present else None


def light_load_report(rate_rps: float, short_bucket: str, light: Sequence[Mapping[str, Any]],
                      unbatched: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`light_load` of the report from each round's light-load step on the slo_bucketed server
    and its unbatched run (`p50_ms`, `p95_ms`, `num_requests`, `num_errors` each): medians of
    the rounds, the ratio the median of the rounds' paired ratios."""
    if len(light) != len(unbatched):
        raise ValueError(f"{len(light)} rounds of light load against {len(unbatched)} unbatched")
    ratios = [round(ours["p50_ms"] / alone["p50_ms"], 3) if ours["p50_ms"] and alone["p50_ms"] else None
              for ours, alone in zip(light, unbatched, strict=True)]
    return {
        "rate_rps": round(rate_rps, 3),
        "p50_ms": _median([r["p50_ms"] for r in light]),
        "p95_ms": _median([r["p95_ms"] for r in light]),
        "unbatched_p50_ms": _median([r["p50_ms"] for r in unbatched]),
        "unbatched_p95_ms": _median([r["p95_ms"] for r in unbatched]),
        "ratio": _median(ratios),
        "target_ratio": LIGHT_LOAD_TARGET_RATIO,
        "short_bucket": short_bucket,
        "rounds": len(light),
        "num_requests": [r["num_requests"] for r in light],
        "num_errors": sum(r["num_errors"] for r in light) + sum(r["num_errors"] for r in unbatched),
        "by_round": {"p50_ms": [r["p50_ms"] for r in light], "unbatched_p50_ms": [r["p50_ms"] for r in unbatched],
                     "ratio": ratios},
    }


def router_cost_report(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`router_overhead_ms`, `router_cpu_ms_per_request` and the `router_overhead` detail of the
    report from each round's unbatched run: medians of the rounds, the median round's detail."""
    overhead = [r["overhead"] for r in rounds]
    cpu = [r["router_cpu_ms_per_request"] for r in rounds]
    middle = rounds[median_index(cpu)]
    floors = [r["floor"] for r in rounds if r.get("floor")]
    floor = None
    if floors:
        floor = {key: _median([f[key] for f in floors]) for key in ("p50", "p95", "router_p50", "router_p95",
                                                                     "own_p50")}
        if all("server_ms" in f for f in floors):
            floor["server_ms"] = {side: {stage: _median([f["server_ms"][side][stage] for f in floors])
                                         for stage in floors[0]["server_ms"][side]} for side in ("router", "forward")}
        floor.update(bucket=floors[0]["bucket"], num_triples=[f["num_triples"] for f in floors],
                     by_round=[{key: f[key] for key in ("p50", "router_p50", "own_p50")} for f in floors],
                     how=("requests of that bucket sent in turn as triples: the router's, the same rows to a "
                          "Python model that only forwards them to the bucket model over one BLS call "
                          "(python_backends/adapters/forward_model.py), and straight to the bucket model; p50 "
                          "and p95 are the forwarding model's latency less the direct one's, router_* the "
                          "router's, own_p50 the router's less the forwarding model's; each a percentile of "
                          "the differences within the triples; server_ms, from Triton's statistics over the "
                          "triples (means): the router's and the forwarding model's queue, input, output, and "
                          "in_stub, their compute less the bucket model's whole time"))
    return {
        "router_overhead_ms": {"p50": _median([o["p50"] for o in overhead]),
                               "p95": _median([o["p95"] for o in overhead])},
        "router_cpu_ms_per_request": _median(cpu),
        "router_overhead": {
            "by_round": [{"p50": o["p50"], "p95": o["p95"]} for o in overhead],
            "router_ms": {key: _median([o["router_ms"][key] for o in overhead]) for key in ("p50_ms", "p95_ms")},
            "direct_ms": {key: _median([o["direct_ms"][key] for o in overhead]) for key in ("p50_ms", "p95_ms")},
            "target_p50_ms": ROUTER_OVERHEAD_TARGET_MS,
            "num_pairs": [o["num_pairs"] for o in overhead],
            "num_errors": sum(r["num_errors"] for r in rounds),
            "cpu_ms_per_request_by_round": cpu,
            "cpu_ms_per_request_router_phase": middle["cpu_router_phase"],
            "cpu_ms_per_request_direct_phase": middle["cpu_direct_phase"],
            "python_floor_ms": floor,
            "how": ("on a server whose bucket models do not linger (max_queue_delay 0, no preferred batch), "
                    "one request at a time over HTTP: a router request, then the same rows straight to the "
                    "bucket model version it calls, in turn; p50 and p95 of the router's latency less the "
                    "direct one's, pair by pair; CPU in separate router-only and direct-only "
                    "phases of as many requests: tritonserver and the router's stubs (the bucket models "
                    "run the same batches in both)"),
        },
    }


def measure_ceiling(payload: TextPayload | TensorPayload, profile: LatencyProfile, model: BucketedModelSpec,
                    plan: Sequence[GeneratedModel], repository: Path = DEFAULT_MODEL_REPOSITORY) -> dict:
    """Rows/s of the mix run in-process through ONNX Runtime, ideally bucketed, at the best batch sizes.

    The rows are bucketed by the model's own router code: tokenized with the router's installed
    tokenizer (`bucket_rows`), or a tensor model's checked and padded (`tensor_bucket_rows`);
    and run through the installed `model.onnx` of each bucket model in `repository` (of the
    version that serves the traffic) with its generated config's graph settings (inputs,
    outputs, pooling). Each bucket runs the better of two ways to use every core: one session
    whose thread pool spans all cores, or one single-threaded session per core run side by
    side; idle threads may spin (the ceiling has the machine to itself).
    """
    from python_backends.embed.encoder import OnnxEncoder
    from python_backends.tensor.bucket import OnnxTensorModel

    if isinstance(payload, TensorPayload):
        rows_by_bucket = tensor_bucket_rows(payload, TensorRouter(tensor_router_of(plan, model)))
        configs: Mapping[int, EncoderConfig | TensorBucketConfig] = tensor_bucket_configs(plan, model)
        runner: Callable = OnnxTensorModel
    else:
        rows_by_bucket = bucket_rows(payload, text_router(plan, model, repository))
        configs = bucket_configs(plan, model)
        runner = OnnxEncoder
    version = served_version(model)
    cores = os.cpu_count() or 1
    per_bucket = {}
    total_s = 0.0
    curves, _estimated = bucket_curves(model, profile)  # an edge derived for another mix may not be profiled
    files_from = {generated.name: generated.files_from for generated in plan if generated.files_from}
    for bucket_len, rows in sorted(rows_by_bucket.items()):
        name = model.encoder_name(bucket_len)
        folder = name if (repository / name).is_dir() else files_from.get(name, name)
        onnx_path = repository / folder / str(version) / "model.onnx"
        curve = curves[bucket_len]
        best = max(curve.sizes, key=curve.throughput_rps)
        batches = [stack_rows(rows[start:start + best]) for start in range(0, len(rows), best)]
        config = replace(configs[bucket_len], max_batch_size=best, allow_spinning=True)
        ways = {"one_session_all_cores": [runner(onnx_path, replace(config, intra_op_threads=0))],
                "one_thread_per_core": [runner(onnx_path, replace(config, intra_op_threads=1))
                                        for _ in range(cores)]}
        seconds = {}
        for way, encoders in ways.items():
            for encoder in encoders:  # warm-up
                encoder.run(batches[0])
            seconds[way] = _run_batches(encoders, batches)
        fastest = min(seconds, key=seconds.get)
        total_s += seconds[fastest]
        per_bucket[bucket_key(bucket_len)] = {"rows": len(rows), "batch_size": best, "way": fastest,
                                              "seconds": round(seconds[fastest], 3),
                                              "seconds_by_way": {way: round(t, 3) for way, t in seconds.items()}}
    num_rows = sum(len(rows) for rows in rows_by_bucket.values())
    return {"rows_per_s": num_rows / total_s, "rows": num_rows, "buckets": per_bucket}


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


def payload_fields(payload: TextPayload | TensorPayload) -> dict[str, Any]:
    """The payload as `LoadTarget` takes it: texts (and their pairs), or each request's tensors."""
    if isinstance(payload, TensorPayload):
        return {"texts": (), "tensors": payload.requests}
    return {"texts": payload.texts, "pair_texts": payload.pair_texts}


def regime_settle_s(plan: Sequence[GeneratedModel], model: BucketedModelSpec) -> float:
    """How long light load must run before the router serves it in its light regime (the rate
    window plus the hold of its `linger_regimes`, and a second), 0 for a router without regimes."""
    router = next(generated for generated in plan if generated.name == model.name)
    if REGIMES_PARAMETER not in router.config.parameters:
        return 0.0
    regimes = LingerRegimes.from_json(router.config.parameters[REGIMES_PARAMETER].string_value)
    return regimes.window_s + regimes.hold_s + 1.0


@dataclass(frozen=True)
class LightLoad:
    """What `run_setup` sends after its search, on the same server: the short requests open loop."""

    payload: TextPayload | TensorPayload  # the short requests (`short_request_indices`)
    rate_rps: float  # LIGHT_LOAD_SHARE of the model's expected_rps
    num_requests: int  # sent in all (the step's length is chosen for exactly this many)
    settle_s: float = 0.0  # light load sent first and not measured: the router's switch to its light regime


def step_figures(step: StepResult) -> dict[str, Any]:
    """A light-load or one-at-a-time step's figures for the report."""
    return {"p50_ms": None if step.p50_ms is None else round(step.p50_ms, 3),
            "p95_ms": None if step.p95_ms is None else round(step.p95_ms, 3),
            "num_requests": step.num_sent, "num_errors": step.num_errors + step.num_rejected}


def target_of(server: TritonServer, model: str, payload: TextPayload | TensorPayload, rows_per_request: int,
              slo_ms: float, options: GoodputOptions) -> LoadTarget:
    """The load generator's target on a started server, sending as `options.protocol` says."""
    return LoadTarget(grpc_url=server.grpc_url, model=model, **payload_fields(payload),
                      rows_per_request=rows_per_request, slo_ms=slo_ms,
                      http_url=server.http_url if options.protocol == "http" else None)


def run_setup(setup: str, repository: Path, model: str, payload: TextPayload | TensorPayload, rows_per_request: int,
              slo_ms: float, options: GoodputOptions, log, extra_repositories: tuple[Path, ...] = (), *,
              light_load: LightLoad | None = None) -> dict:
    """One setup's goodput search on a server of its own; with `light_load`, then the short
    requests at light load on the same server (the result's `light_load`)."""
    config = ServerConfig(model_repository=repository, extra_repositories=extra_repositories, http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1")
    log(f"  {setup}: starting tritonserver on {repository.relative_to(REPO_ROOT)}")
    light: dict[str, Any] | None = None
    with TritonServer(config, log_path=BENCH_DIR / f"{setup}.log") as server:
        target = target_of(server, model, payload, rows_per_request, slo_ms, options)
        goodput, steps, breakdowns = asyncio.run(search_goodput(target, options, log, server.cpu_seconds_by_part))
        if light_load is not None:
            short = target_of(server, model, light_load.payload, rows_per_request, slo_ms, options)
            if light_load.settle_s:  # after the search's peak rates, the router holds its peak regime a while
                log(f"  {setup}: {light_load.settle_s:.0f} s of light load first, for the router's light regime")
                asyncio.run(run_open_loop(short, light_load.rate_rps, light_load.settle_s, seed=LIGHT_LOAD_SEED + 1))
            duration_s = duration_for_arrivals(light_load.rate_rps, light_load.num_requests, LIGHT_LOAD_SEED)
            light = step_figures(asyncio.run(run_open_loop(short, light_load.rate_rps, duration_s,
                                                           seed=LIGHT_LOAD_SEED)))
            log(f"  {setup}: light load, {light['num_requests']} short requests at {light_load.rate_rps:g} rps: "
                f"p50 {light['p50_ms']} ms, p95 {light['p95_ms']} ms, {light['num_errors']} errors")
    log(f"  {setup}: goodput {goodput:.1f} rps")
    result = {"goodput_rps": goodput, "repository": str(repository.relative_to(REPO_ROOT)),
              "steps": [{**flatten_step(step), **cpu} for step, cpu in zip(steps, breakdowns, strict=True)]}
    return result if light is None else {**result, "light_load": light}


async def measure_unbatched(server: TritonServer, model: BucketedModelSpec, short: LoadTarget,
                            routed: Sequence[RoutedRequest], options: GoodputOptions,
                            floor_bucket: str | None = None) -> dict[str, Any]:
    """On the linger-free server: the short requests one at a time through the router, the
    router's requests in turn with the same rows straight to their bucket models, then the two
    kinds in separate phases for the server's CPU per request. With `floor_bucket` (the bucket
    `FORWARD_MODEL` forwards to), as many requests of that bucket again as triples: router,
    forwarding model, direct (`floor_overhead`)."""
    host = split_host_port(server.http_url)[0]
    version = served_version(model)
    single = [request for request in routed if len(request.calls) == 1]  # one bucket call: one direct request
    if not single:
        raise ValueError(f"{model.name}: no request of the mix goes to a single bucket model")
    count = options.overhead_requests
    chosen = [single[index % len(single)] for index in range(count)]
    router = [router_request_bytes(host, model.name, request) for request in chosen]
    direct = [direct_request_bytes(host, version, request.calls[0]) for request in chosen]
    warm = OVERHEAD_WARMUP_REQUESTS
    await send_in_turn(server.http_url, [item for pair in zip(router[:warm], direct[:warm], strict=True)
                                         for item in pair])
    unbatched = step_figures(await run_one_at_a_time(short, options.light_load_requests))
    turns = await send_in_turn(server.http_url, [item for pair in zip(router, direct, strict=True) for item in pair])
    before = server.cpu_seconds_by_part()
    router_phase = await send_in_turn(server.http_url, router)
    middle = server.cpu_seconds_by_part()
    direct_phase = await send_in_turn(server.http_url, direct)
    after = server.cpu_seconds_by_part()
    cpu_router, cpu_direct = phase_cpu_ms(before, middle, count), phase_cpu_ms(middle, after, count)
    errors = [*turns.errors, *router_phase.errors, *direct_phase.errors]
    floor = None
    in_bucket = [request for request in single if request.calls[0].model_name == floor_bucket]
    if in_bucket:
        picked = [in_bucket[index % len(in_bucket)] for index in range(count)]
        triples = [(router_request_bytes(host, model.name, request), forward_request_bytes(host, request.calls[0]),
                    direct_request_bytes(host, version, request.calls[0])) for request in picked]
        await send_in_turn(server.http_url, [item for triple in triples[:warm] for item in triple])
        control = ServerControl(server.http_url)
        watched = (model.name, FORWARD_MODEL, floor_bucket)
        before = {name: stage_totals(control.inference_statistics(name)) for name in watched}
        floor_turns = await send_in_turn(server.http_url, [item for triple in triples for item in triple])
        means = {name: stage_means_ms(before[name], stage_totals(control.inference_statistics(name)))
                 for name in watched}
        floor = {**floor_overhead(floor_turns.latencies_ms), "bucket": floor_bucket,
                 "server_ms": {"router": server_split_ms(means, model.name, floor_bucket),
                               "forward": server_split_ms(means, FORWARD_MODEL, floor_bucket)}}
        errors += floor_turns.errors
    return {"unbatched": unbatched, "overhead": interleaved_overhead(turns.latencies_ms), "floor": floor,
            "cpu_router_phase": cpu_router, "cpu_direct_phase": cpu_direct,
            "router_cpu_ms_per_request": router_cpu_ms(cpu_router, cpu_direct,
                                                       {model.encoder_name(length) for length in model.bucket_lens}),
            "num_errors": len(errors), "error_samples": sorted(set(errors))[:3]}


def run_unbatched(repository: Path, model: BucketedModelSpec, short: TextPayload | TensorPayload,
                  routed: Sequence[RoutedRequest], rows_per_request: int, options: GoodputOptions, log,
                  extra_repositories: tuple[Path, ...] = (), floor_bucket: str | None = None) -> dict[str, Any]:
    """Start the linger-free server (`unbatched_plan`'s repository) and `measure_unbatched` on it."""
    config = ServerConfig(model_repository=repository, extra_repositories=extra_repositories, http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1")
    log(f"  {UNBATCHED_SETUP}: starting tritonserver on {repository.relative_to(REPO_ROOT)}")
    with TritonServer(config, log_path=BENCH_DIR / f"{UNBATCHED_SETUP}.log") as server:
        target = target_of(server, model.name, short, rows_per_request, model.slo_p95_ms, options)
        result = asyncio.run(measure_unbatched(server, model, target, routed, options, floor_bucket))
    overhead, unbatched, floor = result["overhead"], result["unbatched"], result["floor"]
    log(f"  {UNBATCHED_SETUP}: short requests one at a time p50 {unbatched['p50_ms']} ms; router overhead "
        f"p50 {overhead['p50']} ms, p95 {overhead['p95']} ms over {overhead['num_pairs']} pairs; router path "
        f"{result['router_cpu_ms_per_request']} CPU ms per request; {result['num_errors']} errors"
        + (f" ({'; '.join(result['error_samples'])})" if result["error_samples"] else ""))
    if floor is not None:
        log(f"  {UNBATCHED_SETUP}: a Python model that only forwards to {floor['bucket']} adds p50 {floor['p50']} ms; "
            f"the router {floor['router_p50']} ms on the same requests, its own work {floor['own_p50']} ms of it")
    return result


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
    ceiling = report["ceiling_rps"]  # None for an external model (EXTERNAL_CEILING_NOTE)
    if rounds > 1:  # each round's goodput beside its median bar
        for bar, name in zip(bars, names, strict=True):
            by_round = report["setups"][name].get("goodput_rps_by_round", [])
            ax.plot([bar.get_x() + bar.get_width() * 0.85] * len(by_round), by_round, "o", color="black",
                    markersize=3, label="one round" if name == names[0] else None)
    median = "median of rounds, " if rounds > 1 else ""
    if ceiling is not None:
        ax.axhline(ceiling, color="black", linestyle="--",
                   label=f"ceiling (in-process ONNX Runtime, {median}{ceiling:.1f})")
    ax.set_ylabel("goodput, requests/s (p95 within SLO, no errors)" + (f", median of {rounds} rounds"
                                                                          if rounds > 1 else ""), fontsize=8)
    mix = f"{report['workload']} mix" if report["workload"] else "fixed-shape inputs"
    ax.set_title(f"{report.get('model', 'embed')}, {mix}, SLO p95 {report['slo_ms']:.0f} ms, "
                 f"{report['hardware']['description']}", fontsize=9)
    ax.set_ylim(0, max([ceiling or 0.0, *values, 1.0]) * 1.3)  # room for the legend above the ceiling
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)




def goodput_options(quick: bool, step_s: float, start_rps: float, max_steps: int, repeats: int | None,
                    protocol: str) -> GoodputOptions:
    """The options of a run: the short form for the test suite (3 s steps, 4 rates, a small
    ceiling run, a fifth of the light-load and router requests in the first round only, without
    waiting for the router's light regime, one round unless `repeats` is given), or the full one."""
    repeats = repeats if repeats is not None else (1 if quick else DEFAULT_REPEATS)
    if quick:
        return GoodputOptions(step_s=3.0, start_rps=start_rps, max_steps=4, num_texts=300, ceiling_rows=200,
                              repeats=repeats, protocol=protocol, light_load_requests=LIGHT_LOAD_REQUESTS // 5,
                              overhead_requests=OVERHEAD_REQUESTS // 5, light_load_rounds=1, regime_settle=False)
    return GoodputOptions(step_s=step_s, start_rps=start_rps, max_steps=max_steps, num_texts=2000,
                          ceiling_rows=1000, repeats=repeats, protocol=protocol)


def repo_relative(path: Path) -> str:
    """A path as the report names it: relative to the checkout where it lies inside it."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def resolve_mix(value: str, workload_dir: Path = WORKLOAD_DIR) -> Path:
    """A mix of `--mixes`: a workload file's path, or the name of one under `workload_dir`
    (`embed_long_tail` for loadtest/workloads/embed_long_tail.toml)."""
    if not value.strip():
        raise ValueError("an empty mix name")
    if "/" in value or value.endswith(".toml"):
        return Path(value)
    return workload_dir / f"{value}.toml"


def for_mix(model: BucketedModelSpec, workload_path: Path | None) -> BucketedModelSpec:
    """The model with its workload replaced, so that everything that reads it (the buckets'
    traffic shares and the configs derived from them, their headers) follows the mix; a model
    whose spec derives its bucket edges (`buckets = "derived"`) gets the edges derived for the
    mix (bucket lengths the profile did not measure are planned from estimated curves and run
    with the files of the nearest measured bucket: `tools.repository.configs.bucket_curves`)."""
    if workload_path is None:
        return model
    mixed = replace(model, workload=workload_path.resolve())
    if model.bucket_count:
        mixed = replace(mixed, bucket_lens=derived_edges(load_workload(workload_path), model.bucket_count,
                                                         model.max_length))
    return mixed


def mix_results_path(out: Path, mix: Path | None, default_mix: Path | None) -> Path:
    """Where one mix's report goes: `out` for the model's own workload (or a model without
    one), else beside it named by the mix's file (`results/goodput.embed_long_tail.json` beside
    `results/goodput.json`): the dot keeps it apart from `goodput_<model>.json`."""
    if mix is None or (default_mix is not None and mix.resolve() == default_mix.resolve()):
        return out
    return out.with_name(f"{out.stem}.{mix.stem}{out.suffix}")


def payload_text(model: BucketedModelSpec, workload: Workload | None) -> str:
    """What the requests are, for the log."""
    if not model.kind.is_text:
        if model.variable_axis is None:
            return "fixed-shape tensors, random values"
        return f"tensors of lengths on axis {model.variable_axis} from workload {workload.name if workload else '?'}"
    return f"workload {workload.name if workload else '?'}" + (" as text pairs" if model.pairs else "")


def run_benchmark(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, workload: Workload | None,
                  setups: Sequence[str], options: GoodputOptions, command: str, log: Callable[[str], None]) -> dict:
    """Every setup's goodput search of `model` and the ceiling, `options.repeats` rounds; the
    report. `workload` is the length mix (for a fixed-shape tensor model it may be None: one
    row a request). Raises `ServerError` when a server does not start or fails; `SpecError` (or
    `ProfileError`) when the model's configs cannot be generated, `SourceError` when its inputs
    cannot be read."""
    hardware = detect_hardware(None)
    log(f"goodput benchmark of {model.name} on {hardware.description}; SLO p95 {model.slo_p95_ms:.0f} ms; "
        + payload_text(model, workload))
    rows_per_request = workload.rows_per_request if workload is not None else 1
    payload = model_payload(model, workload, options.num_texts)
    plans = {setup: (model_plan(spec, profile, model) if setup == "slo_bucketed"
                     else padded_only_plan(spec, profile, model, setup == "default_batching"))
             for setup in dict.fromkeys((*setups, "slo_bucketed"))}  # the ceiling runs as the generated configs say
    report: dict = {
        "model": model.name,
        "hardware": hardware_report(hardware, details=True),
        "slo_ms": model.slo_p95_ms,
        "workload": workload.name if workload is not None else None,
        "workload_file": repo_relative(model.workload) if model.workload is not None else None,
        "criterion": "highest offered open-loop rate with >= 95% of requests within the SLO and no errors",
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": options.repeats,
        "load_generator": {"protocol": options.protocol, "on_the_measured_machine": True},
        "setups": {},
    }
    repositories = {setup: build_repository(setup, without_tenant_quotas(plans[setup], model.name))
                    for setup in setups}
    user_repositories = {setup: build_user_repository(setup, plans[setup]) for setup in setups}
    light_load = routed = floor_bucket = None
    if "slo_bucketed" in setups:  # its light load, then the linger-free server: one more start a round
        routed = routed_requests(payload, plans["slo_bucketed"], model)
        short_indices = short_request_indices([request.bucket_lens for request in routed])
        short_bucket = bucket_key(min(routed[short_indices[0]].bucket_lens))
        light_load = LightLoad(payload_subset(payload, short_indices), LIGHT_LOAD_SHARE * model.expected_rps,
                               options.light_load_requests,
                               regime_settle_s(plans["slo_bucketed"], model) if options.regime_settle else 0.0)
        floor_bucket = routed[short_indices[0]].calls[0].model_name  # the forwarding model's bucket
        unbatched = unbatched_plan(plans["slo_bucketed"], model, floor_bucket)
        if not any(generated.name == FORWARD_MODEL for generated in unbatched):
            floor_bucket = None
        repositories[UNBATCHED_SETUP] = build_repository(UNBATCHED_SETUP, without_tenant_quotas(unbatched, model.name))
        user_repositories[UNBATCHED_SETUP] = build_user_repository(UNBATCHED_SETUP, unbatched)
    in_process = model.kind is not ModelKind.EXTERNAL  # an external model's backend runs only in the server
    runs: dict[str, list[dict]] = {setup: [] for setup in setups}
    unbatched_runs: list[dict] = []
    ceilings: list[dict] = []
    for round_index in range(options.repeats):
        if options.repeats > 1:
            log(f"round {round_index + 1} of {options.repeats}")
        light_round = light_load is not None and (options.light_load_rounds is None
                                                  or round_index < options.light_load_rounds)
        for setup in setups:
            runs[setup].append(run_setup(setup, repositories[setup], model.name, payload,
                                         rows_per_request, model.slo_p95_ms, options, log,
                                         extra_repositories=user_repositories[setup],
                                         light_load=light_load if setup == "slo_bucketed" and light_round else None))
        if light_round and light_load is not None and routed is not None:
            unbatched_runs.append(run_unbatched(repositories[UNBATCHED_SETUP], model, light_load.payload, routed,
                                                rows_per_request, options, log,
                                                extra_repositories=user_repositories[UNBATCHED_SETUP],
                                                floor_bucket=floor_bucket))
        if not in_process:
            continue
        log("  ceiling: the mix through ONNX Runtime in-process, ideal buckets, best batch sizes")
        ceilings.append(measure_ceiling(payload.first_rows(options.ceiling_rows), profile, model,
                                        plans["slo_bucketed"]))
        log(f"  ceiling: {ceilings[-1]['rows_per_s'] / rows_per_request:.1f} rps")
    ceiling_by_round = [c["rows_per_s"] / rows_per_request for c in ceilings]
    for setup, setup_runs in runs.items():
        by_round = [run["goodput_rps"] for run in setup_runs]
        report["setups"][setup] = {
            "goodput_rps": float(statistics.median(by_round)),
            "goodput_rps_by_round": by_round,
            "repository": setup_runs[0]["repository"],
            "steps": [{"round": index + 1, **step} for index, run in enumerate(setup_runs) for step in run["steps"]],
        }
    if in_process:
        report["ceiling_rps"] = float(statistics.median(ceiling_by_round))
        report["ceiling_rps_by_round"] = [round(value, 1) for value in ceiling_by_round]
        report["ceiling"] = ceilings[median_index(ceiling_by_round)]  # the median round's detail
        log(f"  ceiling: median {report['ceiling_rps']:.1f} rps" + (f" (rounds {report['ceiling_rps_by_round']})"
                                                                   if options.repeats > 1 else ""))
    else:
        report.update(ceiling_rps=None, ceiling_rps_by_round=[], ceiling=None, ceiling_note=EXTERNAL_CEILING_NOTE)
        log(f"  ceiling: none ({EXTERNAL_CEILING_NOTE})")
    if light_load is not None:
        report["light_load"] = light_load_report(light_load.rate_rps, short_bucket,
                                                 [run["light_load"] for run in runs["slo_bucketed"]
                                                  if "light_load" in run],
                                                 [run["unbatched"] for run in unbatched_runs])
        report.update(router_cost_report(unbatched_runs))
        log(f"light load: {report['light_load']['p50_ms']} ms p50 at {light_load.rate_rps:g} rps against "
            f"{report['light_load']['unbatched_p50_ms']} ms unbatched; router overhead {report['router_overhead_ms']} "
            f"ms, {report['router_cpu_ms_per_request']} CPU ms per request (medians)")
    goodputs = {name: data["goodput_rps_by_round"] for name, data in report["setups"].items()}
    if "slo_bucketed" in goodputs:
        ours = goodputs["slo_bucketed"]
        report["ratios"] = {}
        if in_process:
            report["ratios"] = {
                "slo_bucketed_vs_ceiling": round(median_ratio(ours, ceiling_by_round), 3),
                "slo_bucketed_vs_ceiling_by_round": [round(r, 3) for r in round_ratios(ours, ceiling_by_round)],
            }
        for baseline in ("default_batching", "no_batching"):
            if baseline in goodputs and all(goodputs[baseline]):
                report["ratios"][f"slo_bucketed_vs_{baseline}"] = round(median_ratio(ours, goodputs[baseline]), 2)
        log(f"ratios (medians of the rounds' paired ratios): {report['ratios']}")
    return report
