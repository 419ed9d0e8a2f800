"""Every config.pbtxt of the model repository, built as a `model_config_pb2.ModelConfig` message.

`plan_all` turns the serving spec and a measured latency profile into one `GeneratedModel`
per model (its config, a header saying what it was generated from and why each batching
knob has its value, and the `model.py` shim of each version); `expected_files` renders
them with protobuf's text format, `check` compares them with the repository and `explain`
prints every knob with its numbers. An external model's config is the user's own, in the
user's repository: its plan holds the user's text and the derived managed fields, which
`external_files` merges in (`tools.repository.external`) and `check_external` compares. Only
`write_files` and `check` touch the disk; `python -m tools gen-config` drives them.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.quotas import TenantPolicy
from python_backends.common.regimes import REGIMES_PARAMETER, LingerRegimes
from python_backends.common.tenant_auth import AuthConfig, AuthMode
from python_backends.embed.encoder import EncoderParameters
from python_backends.embed.inline import INLINE_PARAMETER, InlinePolicy
from python_backends.embed.kinds import TOKEN_TYPE_IDS, ModelKind, bucket_inputs
from python_backends.embed.router import RouterParameters
from python_backends.llm.config import LLMInferParameters, LLMParameters
from python_backends.tensor.bucket import TensorBucketParameters
from python_backends.tensor.router import FIXED_BUCKET, TensorRouterConfig, TensorRouterParameters
from tools.paths import CHAT_WORKLOAD, DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.planning.derivation import (
    Admission,
    BatchingKnobs,
    BucketDemand,
    BucketFit,
    InfeasibleSLO,
    RouterPlan,
    SharedLoad,
    admission_target_ms,
    derive_admission,
    derive_inline,
    derive_knobs,
    derive_router,
    plan_shared_batches,
    plan_slo_fit,
    preferred_batch,
)
from tools.planning.llm_limits import (
    ChatShape,
    LLMCost,
    LLMLimitsError,
    chat_shapes_of,
    gpu_limits,
    mean_context_tokens,
)
from tools.planning.regimes import derive_express, derive_regimes, unbatched_capacity_rps
from tools.planning.search import apply_tuned
from tools.repository.external import MANAGED_FIELDS, loaded_versions, managed_drift, merge_managed
from tools.repository.sources import (
    ExternalModel,
    ServedGraph,
    SourceError,
    TensorGraph,
    served_external,
    served_graph,
    served_tensors,
)
from tools.spec.profile import LatencyCurve, LatencyProfile, curve_at_length
from tools.spec.serving import BucketedModelSpec, HardwareLimits, LLMModelSpec, ServingSpec, SpecError
from tools.spec.workload import load_chat_workload, load_workload

ROUTING_FILE = "routing.json"  # the live version split, in the router's model folder (rollout writes it)

SHIM = '''"""Triton entry point of `{name}`; the adapter is `python_backends.adapters.{adapter}`."""

from python_backends.adapters.{adapter} import TritonPythonModel

__all__ = ["TritonPythonModel"]
'''


# The `llm` model's tensors: what clients send (all optional) and what every response carries.
LLM_INPUTS = (
    ("text_input", mc.TYPE_STRING, [1]),  # a raw prompt, or
    ("messages", mc.TYPE_STRING, [1]),  # a chat as JSON [{"role": ..., "content": ...}]
    ("max_tokens", mc.TYPE_INT32, [1]),
    ("temperature", mc.TYPE_FP32, [1]),
    ("top_p", mc.TYPE_FP32, [1]),
    ("seed", mc.TYPE_INT64, [1]),
    ("stop", mc.TYPE_STRING, [-1]),
    ("stream", mc.TYPE_BOOL, [1]),
)
LLM_INFER_SUFFIX = "_infer"
LLM_OUTPUTS = (
    ("text_output", mc.TYPE_STRING, [1]),  # a delta when streaming, else the whole text
    ("finish_reason", mc.TYPE_STRING, [1]),  # "" until the last response: stop, length or cancelled
    ("prompt_tokens", mc.TYPE_INT32, [1]),
    ("completion_tokens", mc.TYPE_INT32, [1]),
)


@dataclass(frozen=True)
class GeneratedModel:
    """One model folder's generated files."""

    name: str  # Triton model name = folder name
    config: mc.ModelConfig  # the config message
    header: tuple[str, ...]  # comment lines written above the config
    adapter: str  # python_backends.adapters module the model.py shim imports
    versions: tuple[int, ...]  # version folders that get the shim
    knobs: BatchingKnobs | None = None  # derived knobs (bucket models)
    user_config: Path | None = None  # an external model: its config.pbtxt in the user's repository
    user_text: str = ""  # an external model: that file's text when planned
    files_from: str = ""  # a bucket the profile did not measure: the measured bucket whose model files it can run
    files_of: str = ""  # the model whose version folders hold the same model files (the express model: a bucket's)

    def config_text(self) -> str:
        if self.user_config is not None:  # the user's config with the managed fields of `config`
            return merge_managed(self.user_text, self.config, str(self.user_config), self.header)
        comments = "".join(f"# {line}\n" if line else "#\n" for line in self.header)
        return comments + text_format.MessageToString(self.config)

    def shim_text(self) -> str:
        return SHIM.format(name=self.name, adapter=self.adapter)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def provenance(spec: ServingSpec, profile: LatencyProfile) -> tuple[str, ...]:
    return (
        "Generated by `python -m tools gen-config`. Do not edit: change the serving spec or",
        "re-profile, then regenerate (`--check` fails on any difference).",
        f"  spec:    {_relative(spec.path)} (sha256 {spec.sha256[:16]})",
        f"  profile: {_relative(profile.path) if profile.path else '?'} (sha256 {profile.sha256[:16]}), "
        f"measured {profile.measured_at} on {profile.hardware.description}",
    )


def _tensor(target, name: str, data_type: int, dims: list[int]) -> None:
    tensor = target.add()
    tensor.name = name
    tensor.data_type = data_type
    tensor.dims.extend(dims)


def encoder_config(name: str, seq_len: int, knobs: BatchingKnobs, hardware: HardwareLimits,
                   versions: tuple[int, ...], graph: ServedGraph, kind: ModelKind, *,
                   free_length: bool = False) -> mc.ModelConfig:
    """A bucket model: the graph at one sequence length, with the derived batching knobs. With
    `free_length`, the express model: any length (dims -1), warmed up at `seq_len`."""
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=knobs.max_batch_size)
    config.version_policy.specific.versions.extend(versions)
    inputs = bucket_inputs(TOKEN_TYPE_IDS in graph.onnx_inputs)
    for tensor in inputs:
        _tensor(config.input, tensor, mc.TYPE_INT64, [-1 if free_length else seq_len])
    _tensor(config.output, kind.output, mc.TYPE_FP32, [graph.output_dim])
    _batching(config, knobs, hardware)
    add_encoder_warmup(config, seq_len, inputs)
    parameters = EncoderParameters(intra_op_threads=hardware.intra_op_threads, allow_spinning=hardware.ort_spinning,
                                   cpu_nice=hardware.compute_nice,
                                   onnx_inputs=graph.onnx_inputs, onnx_output=graph.onnx_output,
                                   pooling=graph.pooling.value, normalize=graph.normalize,
                                   **({"free_length": True} if free_length else {}))
    for key, text in parameters.to_parameters().items():
        config.parameters[key].string_value = text
    return config


def add_encoder_warmup(config: mc.ModelConfig, seq_len: int, inputs: tuple[str, ...] = bucket_inputs(False)) -> None:
    """Warm-up batches Triton runs before a version reports ready: one row, and a full batch,
    so the first real requests (and a rollout's first canary step) do not pay for cold start.
    All-zero ids and mask: the graphs and the backend's pooling take a row without real tokens
    (the mean's divisor is clamped, as sentence-transformers does)."""
    for batch_size in sorted({1, config.max_batch_size}):
        warmup = config.model_warmup.add(name=f"zeros_batch_{batch_size}", batch_size=batch_size, count=1)
        for name in sorted(inputs):
            warmup.inputs[name].data_type = mc.TYPE_INT64
            warmup.inputs[name].dims.append(seq_len)
            warmup.inputs[name].zero_data = True


def _batching(config: mc.ModelConfig, knobs: BatchingKnobs, hardware: HardwareLimits) -> None:
    """A bucket model's derived dynamic batching, queue policy and instances."""
    batching = config.dynamic_batching
    if knobs.preferred_batch_size > 1:
        batching.preferred_batch_size.append(knobs.preferred_batch_size)
    batching.max_queue_delay_microseconds = knobs.max_queue_delay_us
    policy = batching.default_queue_policy
    policy.timeout_action = mc.ModelQueuePolicy.REJECT
    policy.default_timeout_microseconds = knobs.default_timeout_us  # 0: no timeout
    # A request may shorten it (the router's deadlines); Triton takes the shorter of the two only
    # where the queue has a timeout of its own.
    policy.allow_timeout_override = knobs.default_timeout_us > 0
    policy.max_queue_size = knobs.max_queue_size
    group = config.instance_group.add()
    group.count = knobs.instance_count
    group.kind = mc.ModelInstanceGroup.Kind.Value(hardware.instance_kind)


def tensor_layout(model: BucketedModelSpec, tensors: TensorGraph, bucket_max_batch: dict[int, int]
                  ) -> TensorRouterConfig:
    """The tensor router's view of the model (what checks a request and sizes each bucket's inputs)."""
    return TensorRouterConfig(inputs=tensors.inputs, outputs=tensors.outputs, variable_axis=model.variable_axis,
                              bucket_lens=model.bucket_lens, bucket_max_batch=bucket_max_batch,
                              encoder_prefix=model.encoder_prefix, fixed_model=model.external_model)


def tensor_bucket_config(name: str, bucket_len: int, knobs: BatchingKnobs, hardware: HardwareLimits,
                         versions: tuple[int, ...], layout: TensorRouterConfig, *,
                         free_length: bool = False) -> mc.ModelConfig:
    """A tensor model's bucket model: the graph's own tensors, the variable axis fixed to the
    bucket. With `free_length`, the express model: the axis free as declared, warmed up at `bucket_len`."""
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=knobs.max_batch_size)
    config.version_policy.specific.versions.extend(versions)
    for spec in layout.inputs:
        dims = spec.dims if free_length else layout.bucket_dims(spec, bucket_len)
        _tensor(config.input, spec.name, mc.DataType.Value(spec.data_type), list(dims))
    for spec in layout.outputs:
        _tensor(config.output, spec.name, mc.DataType.Value(spec.data_type), list(spec.dims))
    _batching(config, knobs, hardware)
    for batch_size in sorted({1, config.max_batch_size}):
        warmup = config.model_warmup.add(name=f"zeros_batch_{batch_size}", batch_size=batch_size, count=1)
        for spec in layout.inputs:
            warmup.inputs[spec.name].data_type = mc.DataType.Value(spec.data_type)
            warmup.inputs[spec.name].dims.extend(layout.bucket_dims(spec, bucket_len))
            warmup.inputs[spec.name].zero_data = True
    parameters = TensorBucketParameters(intra_op_threads=hardware.intra_op_threads,
                                        allow_spinning=hardware.ort_spinning, cpu_nice=hardware.compute_nice)
    for key, text in parameters.to_parameters().items():
        config.parameters[key].string_value = text
    return config


def external_config(name: str, knobs: BatchingKnobs, hardware: HardwareLimits) -> mc.ModelConfig:
    """An external model's managed fields (`tools.repository.external.MANAGED_FIELDS`): the derived
    batch size, dynamic batching and instances of the spec's hardware kind. No parameters: the
    model's backend is the user's, and its thread settings with it."""
    config = mc.ModelConfig(name=name, max_batch_size=knobs.max_batch_size)
    _batching(config, knobs, hardware)
    return config


ROUTER_VERSIONS = (1,)  # the router itself has one version; the encoder versions are what roll out


def _router_base(model: BucketedModelSpec, spec: ServingSpec, router: RouterPlan,
                 admission: Admission) -> mc.ModelConfig:
    """What every router's config has: its queue by tenant tier, instances, one version."""
    config = mc.ModelConfig(name=model.name, backend="python", max_batch_size=model.max_request_rows)
    config.version_policy.specific.versions.extend(ROUTER_VERSIONS)
    batching = config.dynamic_batching
    # The router's queue orders requests by tenant tier and hands each to an instance as it
    # comes (a preferred size of 1, no linger): the instance passes it to a worker at once,
    # so nothing is gained by waiting for company.
    batching.preferred_batch_size.append(1)
    batching.priority_levels = len(spec.tiers)
    batching.default_priority_level = spec.tier(spec.default_tier).priority
    # A full router queue turns requests away in C++, before any Python runs: it only fills
    # when the router's instances stall, and then it bounds the wait before admission.
    batching.default_queue_policy.max_queue_size = admission.max_queue_size
    group = config.instance_group.add()
    group.count = router.instance_count
    group.kind = mc.ModelInstanceGroup.KIND_CPU  # the router's checks are CPU work on every node
    return config


def tensor_router_config(model: BucketedModelSpec, spec: ServingSpec, layout: TensorRouterConfig,
                         router: RouterPlan, admission: Admission,
                         regimes: LingerRegimes | None = None, inline: InlinePolicy | None = None) -> mc.ModelConfig:
    """A tensor model's router: the graph's inputs (the variable axis free) in, its outputs back."""
    config = _router_base(model, spec, router, admission)
    for tensor in layout.inputs:
        _tensor(config.input, tensor.name, mc.DataType.Value(tensor.data_type), list(tensor.dims))
    for tensor in layout.outputs:
        _tensor(config.output, tensor.name, mc.DataType.Value(tensor.data_type), list(tensor.dims))
    _tensor(config.output, "VERSION", mc.TYPE_INT32, [1])
    parameters = TensorRouterParameters(
        inputs=layout.inputs, outputs=layout.outputs,
        **({"variable_axis": model.variable_axis, "bucket_lens": model.bucket_lens}
           if model.variable_axis is not None else {}),
        bucket_max_batch=layout.bucket_max_batch, encoder_prefix=model.encoder_prefix,
        **({"fixed_model": model.external_model} if model.external_model else {}),
        version_weights=model.traffic, routing_file=ROUTING_FILE, tenants=spec.tenant_policy(),
        admission=admission.policy, tenant_auth=spec.auth_config(),
        max_concurrent_requests=router.max_concurrent_requests,
        **({REGIMES_PARAMETER: regimes} if regimes is not None else {}),
        **({INLINE_PARAMETER: inline} if inline is not None else {}))
    for key, text in parameters.to_parameters().items():
        config.parameters[key].string_value = text
    return config


def router_config(model: BucketedModelSpec, spec: ServingSpec, bucket_max_batch: dict[int, int],
                  router: RouterPlan, admission: Admission, graph: ServedGraph,
                  regimes: LingerRegimes | None = None, inline: InlinePolicy | None = None) -> mc.ModelConfig:
    """A text model's router: TEXT (and TEXT_PAIR) in; the bucket output, TOKENS, VERSION (and LABEL) back."""
    config = _router_base(model, spec, router, admission)
    _tensor(config.input, "TEXT", mc.TYPE_STRING, [1])
    if model.pairs:
        _tensor(config.input, "TEXT_PAIR", mc.TYPE_STRING, [1])  # a pair's second text, when the rows are pairs
        config.input[-1].optional = True
    _tensor(config.output, model.kind.output, mc.TYPE_FP32, [graph.output_dim])
    _tensor(config.output, "TOKENS", mc.TYPE_INT32, [1])
    _tensor(config.output, "VERSION", mc.TYPE_INT32, [1])  # the model version that served the row
    if model.labels:
        _tensor(config.output, "LABEL", mc.TYPE_STRING, [1])  # the name of the row's largest logit
    # Through the schema the router reads them back with, so neither side can drift.
    parameters = RouterParameters(
        bucket_lens=model.bucket_lens, encoder_prefix=model.encoder_prefix, bucket_max_batch=bucket_max_batch,
        max_text_bytes=model.max_text_bytes, version_weights=model.traffic, routing_file=ROUTING_FILE,
        tenants=spec.tenant_policy(), admission=admission.policy, tenant_auth=spec.auth_config(),
        max_concurrent_requests=router.max_concurrent_requests, kind=model.kind,
        **{key: value for key, value in (("token_types", TOKEN_TYPE_IDS in graph.onnx_inputs),
                                         ("query_prefix", model.query_prefix),
                                         ("document_prefix", model.document_prefix), ("labels", model.labels),
                                         ("pairs", model.pairs), (REGIMES_PARAMETER, regimes),
                                         (INLINE_PARAMETER, inline))
           if value})  # what a plain encoder leaves out
    for key, text in parameters.to_parameters().items():
        config.parameters[key].string_value = text
    return config


def llm_config(model: LLMModelSpec, tenants: TenantPolicy, auth: AuthConfig) -> mc.ModelConfig:
    """The decoupled `llm` model: one engine instance that batches per iteration itself, so
    Triton's own batcher stays off (max_batch_size 0) and every request goes straight in."""
    config = mc.ModelConfig(name=model.name, backend="python", max_batch_size=0)
    config.version_policy.specific.versions.extend(model.versions)
    config.model_transaction_policy.decoupled = True
    for name, data_type, dims in LLM_INPUTS:
        _tensor(config.input, name, data_type, dims)
        config.input[-1].optional = True  # text_input or messages; the rest have defaults
    for name, data_type, dims in LLM_OUTPUTS:
        _tensor(config.output, name, data_type, dims)
    group = config.instance_group.add()
    group.count = 1  # one engine owns the KV cache; it batches internally
    group.kind = mc.ModelInstanceGroup.KIND_CPU
    # Through the schema the engine reads them back with, so neither side can drift.
    parameters = LLMParameters(
        batching=model.batching, kv_cache_mb=model.kv_cache_mb, block_size=model.block_size,
        max_num_seqs=model.max_num_seqs, max_num_batched_tokens=model.max_num_batched_tokens,
        max_model_len=model.max_model_len, default_max_tokens=model.default_max_tokens, num_threads=model.threads,
        device=model.device, dtype=model.dtype, stream_hold_ms=model.stream_hold_ms, tenants=tenants,
        tenant_auth=auth)
    for key, text in parameters.to_parameters().items():
        config.parameters[key].string_value = text
    return config


def llm_infer_config(model: LLMModelSpec) -> mc.ModelConfig:
    """`<llm>_infer`: the same model through plain infer, which Triton does not offer for
    decoupled models; it forwards each request to the engine and answers once."""
    config = mc.ModelConfig(name=f"{model.name}{LLM_INFER_SUFFIX}", backend="python", max_batch_size=0)
    for name, data_type, dims in LLM_INPUTS:
        if name != "stream":
            _tensor(config.input, name, data_type, dims)
            config.input[-1].optional = True
    for name, data_type, dims in LLM_OUTPUTS:
        _tensor(config.output, name, data_type, dims)
    group = config.instance_group.add()
    group.count = 1  # execute returns at once; worker threads wait on the engine
    group.kind = mc.ModelInstanceGroup.KIND_CPU
    parameters = LLMInferParameters(target_model=model.name, max_in_flight=4 * model.max_num_seqs)
    for key, text in parameters.to_parameters().items():
        config.parameters[key].string_value = text
    return config


def auth_header(spec: ServingSpec) -> str:
    """One line for a config header: how this model learns who a request is from."""
    auth = spec.tenant_auth
    if auth is None:
        return "tenant_auth: off: the `tenant` parameter is trusted as sent (spec [tenants.auth] mode = \"off\")"
    who = (f"a request without one is the tenant `anonymous`, tier {auth.anonymous_tier}"
           if auth.mode is AuthMode.ANONYMOUS else "a request without one is refused")
    return (f"tenant_auth: {auth.mode.value}: a tenant token (HMAC-signed, keys in {_relative(auth.keys_file)}, "
            f"re-read within 1 s of a change) names the tenant; {who}")


def llm_cost(model: LLMModelSpec, repository: Path) -> LLMCost:
    """The model's size and KV shape, from its newest built version folder."""
    from safetensors import safe_open

    from python_backends.llm.config import REQUIRED_FILES

    folder = repository / model.name / str(max(model.versions))
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        raise SpecError(f"[llm_models.{model.name}]: {folder} is not built; a GPU profile sizes the engine from the "
                        "model's files: run `python -m tools build-models` first")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as weights:
        count = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
    return LLMCost(num_parameters=count, num_layers=int(text["num_hidden_layers"]),
                   num_kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=int(text.get("head_dim") or text["hidden_size"] // heads))


def chat_shapes(path: Path = CHAT_WORKLOAD) -> list[ChatShape]:
    """The chat workload's kinds, as far as their context lengths go."""
    return chat_shapes_of(load_chat_workload(path))


def hardware_llm_model(model: LLMModelSpec, profile: LatencyProfile,
                       repository: Path | None) -> tuple[LLMModelSpec, tuple[str, ...]]:
    """The model as the profile's hardware runs it, and why: the spec's limits on a CPU; on a
    GPU, CUDA with the limits `gpu_limits` derives from the GPU's memory (`llm_limits`)."""
    hardware = profile.hardware
    if hardware.kind != "gpu" or model.device == "cpu":
        return model, ()
    memory_gb = hardware.details.get("gpu_memory_gb")
    if not memory_gb:
        raise SpecError(f"profile {profile.path}: a GPU profile must record gpu_memory_gb (re-run "
                        "`python -m tools profile` on the GPU node)")
    cost = llm_cost(model, repository or DEFAULT_MODEL_REPOSITORY)
    try:
        limits = gpu_limits(cost, int(float(memory_gb) * (1 << 30)), mean_context_tokens(chat_shapes()),
                            model.max_model_len, model.dtype)
    except LLMLimitsError as err:
        raise SpecError(f"[llm_models.{model.name}] on {hardware.description}: {err}") from None
    derived = replace(model, device=limits.device, dtype=limits.dtype, kv_cache_mb=limits.kv_cache_mb,
                      max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens)
    return derived, (f"On {hardware.description} (derived from its memory, not the spec's CPU values):",
                     *limits.reasons)


def plan_llm_model(model: LLMModelSpec, spec: ServingSpec, profile: LatencyProfile,
                   repository: Path | None = None) -> list[GeneratedModel]:
    model, hardware_lines = hardware_llm_model(model, profile, repository)
    if model.batching == "continuous":
        policy = (f"Continuous batching: up to {model.max_num_seqs} sequences and {model.max_num_batched_tokens} "
                  "tokens per step (prefill chunks + decodes),",
                  f"admitted while the {model.kv_cache_mb:g} MB KV cache has blocks of {model.block_size} tokens free")
    else:
        policy = (f"Static batching (the benchmark baseline): batches of up to {model.max_num_seqs} sequences",
                  "form when the last batch has finished and run to completion")
    if model.stream_hold_ms:
        why = "the TPOT target" if model.stream_hold_ms == model.tpot_p95_ms else "the spec's stream_hold_ms"
        policy = (*policy, f"Streams: while requests wait, a stream's tokens are held up to "
                  f"{model.stream_hold_ms:g} ms ({why}) and sent together; its first and last token at once")
    tiers = "; ".join(f"{t.name}: {t.llm_tokens_per_s:g} tokens/s, burst {t.llm_token_burst:g}"
                      if t.llm_tokens_per_s else f"{t.name}: no quota" for t in spec.tiers)
    header = (*provenance(spec, profile), "", *policy,
              f"tenants: generated-token quota of each tenant by tier ({tiers}); a request reserves its max_tokens",
              "(at most the burst) and gets back what it did not generate when it finishes.",
              auth_header(spec), *hardware_lines)
    infer_header = (*provenance(spec, profile), "",
                    f"Plain (unary) infer for {model.name!r}: forwards each request to its engine and answers once")
    config = llm_config(model, spec.tenant_policy(), spec.auth_config())
    return [GeneratedModel(name=model.name, config=config, header=header, adapter="llm_model", versions=model.versions),
            GeneratedModel(name=f"{model.name}{LLM_INFER_SUFFIX}", config=llm_infer_config(model),
                           header=infer_header, adapter="llm_infer_model", versions=(1,))]


def bucket_intro(model: BucketedModelSpec, bucket_len: int, share: float) -> tuple[str, ...]:
    """The first lines of a bucket model's header: what its inputs are and its traffic share."""
    if model.kind is ModelKind.EXTERNAL:
        return (f"The external model `{model.external_model}` of `{model.name}`, in {_relative(model.repository)}: "
                "every input has a fixed shape,", "so every request batches with every other; all its traffic.")
    if model.kind.is_text:
        what = (f"Length bucket {bucket_len} of `{model.name}`: inputs padded to exactly {bucket_len} tokens, so every",
                "batch holds rows of one shape.")
    elif model.variable_axis is not None:
        what = (f"Bucket {bucket_len} of `{model.name}`: inputs padded to exactly {bucket_len} on axis "
                f"{model.variable_axis} (after the batch axis),", "so every batch holds rows of one shape.")
    else:
        return (f"The bucket model of `{model.name}`: every input has a fixed shape, so every request batches "
                "with every other;", "all its traffic.")
    return (*what[:-1], f"{what[-1]} Traffic share from the workload {_relative(model.workload)}: {share:.1%},")


def router_intro(model: BucketedModelSpec) -> tuple[str, ...]:
    if model.kind.is_text:
        return (f"`{model.name}`: the public entry point. Tokenizes, picks the smallest bucket per row and calls",
                "that bucket's model over BLS. No linger here: batches form at the bucket models.")
    if model.kind is ModelKind.EXTERNAL:
        return (f"`{model.name}`: the public entry point. Checks each input's type and shape (a 400 naming the input",
                f"otherwise) and calls the external model `{model.external_model}` over BLS. No linger here.")
    return (f"`{model.name}`: the public entry point. Checks each input's type and shape (a 400 naming the input",
            "otherwise), pads to the smallest bucket that holds the request and calls it over BLS. No linger here.")


def tensors_text(tensors: TensorGraph, external: ExternalModel | None = None) -> str:
    described = ", ".join(f"{s.name} {s.type_name} {list(s.dims)}" + (f" pad {s.pad_value:g}" if s.pad_value is not None
                                                                        else "") for s in tensors.inputs)
    origin = "the model's own ONNX graph" if external is None else f"the user's {external.backend} model"
    return f"{origin} (inputs {described}; outputs {', '.join(s.name for s in tensors.outputs)})"


def versions_text(model: BucketedModelSpec) -> list[str]:
    if model.kind is ModelKind.EXTERNAL:  # the user's version folders: the kit builds none of them
        return [str(v) for v in model.versions]
    return [f"{v} ({model.precision_of(v)})" for v in model.versions]


def external_provenance(spec: ServingSpec, profile: LatencyProfile) -> tuple[str, ...]:
    """The first lines of the kit's header in an external model's own config.pbtxt."""
    return (
        f"`python -m tools gen-config` wrote {', '.join(MANAGED_FIELDS)} of this config, derived as below;",
        "every other field is yours, kept as you wrote it. Change the serving spec or re-profile and",
        "regenerate rather than editing those three (`gen-config --check` fails when they differ).",
        *provenance(spec, profile)[2:],
    )


def verify_versions_load(model: BucketedModelSpec, external: ExternalModel, spec: ServingSpec) -> None:
    """The user's version_policy (a field the kit leaves alone) must have Triton load every version
    the spec serves, or the router would call a version that a restarted server never loaded."""
    loaded = loaded_versions(external.config, external.folders)
    missing = [v for v in model.versions if v not in loaded]
    if missing:
        wanted = ", ".join(map(str, model.versions))
        raise SpecError(f"{spec.path}: [models.{model.name}]: {external.path}: version_policy loads version(s) "
                        f"{sorted(loaded)} of the folders {list(external.folders)}, not {missing}, which the spec "
                        f"serves; write `version_policy: {{ specific: {{ versions: [{wanted}] }} }}` there "
                        "(gen-config writes only the batching fields)")


def graph_text(graph: ServedGraph) -> str:
    """What a bucket model runs, in a header line."""
    origin = ("the graph build-models exported from the Hugging Face folder" if graph.exported
              else "the model's own ONNX graph")
    inputs = ", ".join(f"{tensor} -> {name}" for tensor, name in graph.onnx_inputs.items())
    done = [f"pooled ({graph.pooling.value}) by the backend"] if graph.pooling.value != "none" else []
    done += ["L2-normalised by the backend"] if graph.normalize else []
    return (f"{origin} (inputs {inputs}; output {graph.onnx_output!r}, {graph.output_dim} wide"
            + (f", {' and '.join(done)}" if done else "") + ")")


def _lanes_text(hardware: HardwareLimits, lanes: int, cpu_count: int, external: bool = False) -> str:
    if hardware.kind == "cpu" and hardware.intra_op_threads and external:
        return (f"{lanes} lanes: {cpu_count} cores, {hardware.intra_op_threads} per instance as [hardware.cpu] "
                "intra_op_threads says; the kit does not set your backend's threads")
    if hardware.kind == "cpu" and hardware.intra_op_threads:
        return (f"{lanes} lanes: {cpu_count} cores, {hardware.intra_op_threads} "
                f"ONNX Runtime thread{'s' if hardware.intra_op_threads > 1 else ''} per instance")
    return "one lane: every batch uses the whole device"


def bucket_curves(model: BucketedModelSpec, profile: LatencyProfile
                  ) -> tuple[dict[int, LatencyCurve], dict[int, tuple[str, str]]]:
    """c(b) of each bucket, by length, and for each bucket the profile did not measure, how it was
    estimated instead (`curve_at_length` from the lengths of this model's buckets it did measure)
    and the measured bucket nearest in length (whose files a benchmark copy can run it with), so
    that edges derived from a new workload can be planned before they are profiled. A
    ProfileError when the profile measured none of the model's lengths."""
    curves: dict[int, LatencyCurve] = {}
    estimated: dict[int, tuple[str, str]] = {}
    measured = profile.curves_by_length(
        name for name in profile.models
        if name.startswith(model.encoder_prefix) and name[len(model.encoder_prefix):].isdigit())
    for length in model.bucket_lens:
        name = model.encoder_name(length)
        if name in profile.models or length == FIXED_BUCKET or not measured:
            curves[length] = profile.curve(name)  # its measured curve, or the ProfileError that says to profile
            continue
        curves[length] = curve_at_length(measured, length)
        nearest = min(measured, key=lambda measured_length: abs(measured_length - length))
        estimated[length] = (f"c(b) of {name} is estimated from the lengths the profile measured "
                             f"({', '.join(str(n) for n in sorted(measured))}); run `python -m tools profile` "
                             "to measure it", model.encoder_name(nearest))
    return curves, estimated


def plan_embed_model(model: BucketedModelSpec, spec: ServingSpec, profile: LatencyProfile) -> list[GeneratedModel]:
    """Derive and build the router and bucket configs of one embedding model."""
    hardware = spec.hardware.get(profile.hardware.kind)
    if hardware is None:
        raise SpecError(f"{spec.path}: no [hardware.{profile.hardware.kind}] limits for profile "
                        f"'{profile.hardware.name}'")
    measured_threads = profile.hardware.details.get("intra_op_threads")
    if measured_threads is not None and int(measured_threads) != hardware.intra_op_threads:
        where = _relative(profile.path) if profile.path else "in use"
        raise SpecError(f"{spec.path}: [hardware.{hardware.kind}] intra_op_threads = {hardware.intra_op_threads}, "
                        f"but profile {where} was measured with {measured_threads} thread(s) per instance, so "
                        "its c(b) does not hold; re-run `python -m tools profile`")
    external = None
    try:
        if model.kind is ModelKind.EXTERNAL:
            graph, external = None, served_external(model)
            tensors = external.tensors
        else:
            graph, tensors = (served_graph(model), None) if model.kind.is_text else (None, served_tensors(model))
    except SourceError as err:
        raise SpecError(f"{spec.path}: {err}") from None
    if external is not None:
        verify_versions_load(model, external, spec)
    workload = load_workload(model.workload) if model.workload is not None else None
    shares = workload.bucket_shares(model.bucket_lens) if workload is not None else {model.bucket_lens[0]: 1.0}
    overhead = profile.overhead_for(model.name)
    rows = workload.rows_per_request if workload is not None else 1
    lanes = hardware.lanes(profile.hardware.cpu_count)
    generated: list[GeneratedModel] = []
    bucket_max_batch: dict[int, int] = {}
    curves, estimated = bucket_curves(model, profile)
    slo_fit = plan_slo_fit(model.name, {
        b: BucketFit(model.encoder_name(b), shares[b], model.slo_p95_ms, overhead.p95_ms, curves[b].at(1))
        for b in model.bucket_lens})
    try:
        latency_target_ms = admission_target_ms(curves, model.slo_p95_ms, overhead.p95_ms, slo_fit.budget_buckets)
    except ValueError as err:
        raise InfeasibleSLO(f"{model.name}: {err}") from None
    demands = {}
    for bucket_len in model.bucket_lens:
        name = model.encoder_name(bucket_len)
        demands[bucket_len] = BucketDemand(
            model_name=name,
            slo_p95_ms=model.slo_p95_ms,
            overhead_ms=overhead.p95_ms,
            expected_rps=model.expected_rps * rows * shares[bucket_len],
            peak_rps=model.peak_rps * rows * shares[bucket_len],
            max_instances=hardware.max_instances,
            lanes=lanes,
            queue_timeout=model.queue_timeouts,
            latency_target_ms=latency_target_ms,
            best_effort=bucket_len in slo_fit.best_effort,
        )
    # The buckets share one device: plan the batches peak traffic needs across all of them.
    # On a CPU the router path runs on the same cores, so its measured CPU per request is
    # part of the load at peak.
    router_cpu_ms = overhead.cpu_ms if hardware.kind == "cpu" and overhead.cpu_ms is not None else 0.0
    base_utilization = model.peak_rps * router_cpu_ms / 1000.0 / lanes
    shared, utilization = plan_shared_batches(
        [SharedLoad(d.model_name, d.peak_rps, curve, preferred_batch(d, curve))
         for b, d in demands.items() for curve in [curves[b]]],
        max_utilization=demands[model.bucket_lens[0]].max_utilization,
        lanes=lanes,
        base_utilization=base_utilization,
    )
    router_share = (f"; the router path takes {base_utilization:.0%} of it ({router_cpu_ms:.2f} CPU ms per request)"
                    if base_utilization else "")
    device_text = _lanes_text(hardware, lanes, profile.hardware.cpu_count, external is not None)
    for bucket_len in model.bucket_lens:
        demand = replace(demands[bucket_len], shared_batch=shared[demands[bucket_len].model_name])
        name = demand.model_name
        knobs = derive_knobs(demand, curves[bucket_len])
        if bucket_len in slo_fit.warnings:
            knobs = replace(knobs, warnings=(slo_fit.warnings[bucket_len], *knobs.warnings))
        # Knobs `python -m tools tune` measured to do better replace the derived ones, with a reason.
        knobs, tuned_lines = apply_tuned(knobs, profile.tuned.get(model.name), model.name, model.slo_p95_ms,
                                         curves[bucket_len], {model.encoder_name(b) for b in model.bucket_lens})
        bucket_max_batch[bucket_len] = knobs.max_batch_size
        header = (
            *(provenance(spec, profile) if external is None else external_provenance(spec, profile)),
            "",
            *bucket_intro(model, bucket_len, shares[bucket_len]),
            f"expected {demand.expected_rps:.2f} rows/s, peak {demand.peak_rps:.2f} rows/s; "
            f"SLO p95 {model.slo_p95_ms:.0f} ms, overhead o = {overhead.p95_ms:.1f} ms (p95). The buckets share",
            f"the device ({device_text}): at peak, with the planned batches, it is "
            f"{utilization:.0%} busy{router_share}.",
            f"Versions {', '.join(versions_text(model))}: each has its own "
            "instances and batcher, so versions never share a batch.",
            f"{model.kind.value}: {graph_text(graph) if graph is not None else tensors_text(tensors, external)}.",
            "",
            *(f"{knob}: {reason}" for knob, reason in knobs.reasons.items()),
            *tuned_lines,
            "timeout_action: REJECT (the protobuf default, so not written below)",
            *(f"WARNING: {w}" for w in knobs.warnings),
            *((f"ESTIMATED: {estimated[bucket_len][0]}",) if bucket_len in estimated else ()),
        )
        if external is not None:
            generated.append(GeneratedModel(name=name, config=external_config(name, knobs, hardware), header=header,
                                            adapter="", versions=(), knobs=knobs, user_config=external.path,
                                            user_text=external.text))
            continue
        generated.append(GeneratedModel(
            name=name,
            config=(encoder_config(name, bucket_len, knobs, hardware, model.versions, graph, model.kind)
                    if graph is not None else
                    tensor_bucket_config(name, bucket_len, knobs, hardware, model.versions,
                                         tensor_layout(model, tensors, {b: 1 for b in model.bucket_lens}))),
            header=header,
            adapter="encoder_model" if graph is not None else "tensor_bucket_model",
            versions=model.versions,
            knobs=knobs,
            files_from=estimated[bucket_len][1] if bucket_len in estimated else "",
        ))
    knobs_by_bucket = {b: next(g.knobs for g in generated if g.name == model.encoder_name(b))
                       for b in model.bucket_lens}
    try:
        admission = derive_admission(
            curves, {b: knobs.preferred_batch_size for b, knobs in knobs_by_bucket.items()},
            lanes, model.slo_p95_ms, overhead.p95_ms, model.peak_rps, slo_fit.budget_buckets,
            # Deadlines go to the queues that take a request's timeout (those with one of their own).
            batch_ms={b: curves[b].at(knobs.max_batch_size) for b, knobs in knobs_by_bucket.items()
                      if knobs.default_timeout_us > 0})
    except ValueError as err:
        raise InfeasibleSLO(f"{model.name}: {err}") from None
    router = derive_router(model.peak_rps, model.slo_p95_ms, profile.hardware.cpu_count, model.max_router_instances,
                           admission.policy)
    capacity_rps = unbatched_capacity_rps(
        {d.model_name: shares[b] for b, d in demands.items()}, {d.model_name: curves[b] for b, d in demands.items()},
        rows, lanes, router_cpu_ms, demands[model.bucket_lens[0]].max_utilization)
    if external is not None:
        regimes, regimes_reason = None, (f"none: the external model {model.external_model} gets no express model "
                                         "(its backend is the user's), so its linger holds at every rate")
    else:
        regimes, regimes_reason = derive_regimes(
            {g.name: g.knobs.max_queue_delay_us for g in generated if g.knobs is not None}, capacity_rps,
            model.peak_rps, instances=router.instance_count, express=model.express_name)
    if regimes is not None:
        generated.append(plan_express(model, spec, profile, regimes, generated, hardware, lanes, graph, tensors))
    # A lone row's compute at each model the router calls; the express model's is its slowest bucket's.
    call_ms = {model.encoder_name(b): curves[b].at(1) for b in model.bucket_lens}
    if regimes is not None:
        call_ms[regimes.express] = max(curves[b].at(1) for b in model.bucket_lens
                                       if model.encoder_name(b) in regimes.peak_us)
    inline, inline_reason = derive_inline(call_ms, overhead.p95_ms, model.slo_p95_ms)
    router_header = (
        *provenance(spec, profile),
        "",
        *router_intro(model),
        f"Priority levels = tenant tiers: {', '.join(f'{t.name}={t.priority}' for t in spec.tiers)} "
        f"(default {spec.default_tier}).",
        "tenants: each tenant's quota by tier (" + "; ".join(
            f"{t.name}: {t.requests_per_s:g} req/s, burst {t.burst:g}" if t.requests_per_s else f"{t.name}: no quota"
            for t in spec.tiers) + "), enforced across the router's instances before tokenizing.",
        auth_header(spec),
        "bucket_max_batch: each bucket's derived max_batch_size; larger requests are sent in chunks.",
        "preferred_batch_size 1, no linger: the router's queue orders requests by tenant tier and hands",
        "each to an instance as it comes; the instance passes it to a worker at once, so nothing is gained",
        "by waiting for company, and a request never waits for another request's slower bucket.",
        *(f"{knob}: {reason}" for knob, reason in router.reasons.items()),
        *(f"{knob}: {reason}" for knob, reason in admission.reasons.items()),
        "A request refused by either gets UNAVAILABLE (HTTP 503) at once instead of a late answer.",
        f"version_weights: the encoder version split at start (spec `traffic`); {ROUTING_FILE} in this folder,",
        "when present, overrides it live (`python -m tools rollout` writes it); a request may pin `version`.",
        f"{REGIMES_PARAMETER}: {regimes_reason}.",
        f"{INLINE_PARAMETER}: {inline_reason}.",
    )
    router_model = (router_config(model, spec, bucket_max_batch, router, admission, graph, regimes, inline)
                    if graph is not None else
                    tensor_router_config(model, spec, tensor_layout(model, tensors, bucket_max_batch), router,
                                         admission, regimes, inline))
    generated.insert(0, GeneratedModel(
        name=model.name,
        config=router_model,
        header=router_header,
        adapter="embed_model" if graph is not None else "tensor_router_model",
        versions=ROUTER_VERSIONS,
    ))
    return generated


def plan_express(model: BucketedModelSpec, spec: ServingSpec, profile: LatencyProfile, regimes: LingerRegimes,
                 buckets: list[GeneratedModel], hardware: HardwareLimits, lanes: int, graph: ServedGraph | None,
                 tensors: TensorGraph | None) -> GeneratedModel:
    """The express model: the lingering buckets' graph and versions with the length free and no
    linger; the router sends it their rows in the light regime (`linger_regimes`)."""
    by_name = {generated.name: generated for generated in buckets}
    lingering = {length: by_name[model.encoder_name(length)].knobs for length in model.bucket_lens
                 if model.encoder_name(length) in regimes.peak_us}
    name, shortest = regimes.express, min(lingering)
    knobs = derive_express(name, lingering, lanes)
    header = (
        *provenance(spec, profile),
        "",
        f"The express model of `{model.name}`: the graph of its bucket models with the length free, so it takes",
        f"the rows of {', '.join(k.model_name for _, k in sorted(lingering.items()))} padded as for their bucket "
        "(Triton batches requests of one shape",
        "only, so a batch still holds one bucket's rows). Those buckets linger for a batch that fills only near peak;",
        f"the router sends their rows here instead while its arrival rate is light (`{REGIMES_PARAMETER}` in",
        f"{model.name}/config.pbtxt), so that a request at light load runs at once instead of waiting the linger out.",
        f"Versions {', '.join(versions_text(model))}, the model files of the bucket models'; warm-up at "
        f"{shortest}, the shortest bucket it serves.",
        "Not profiled: a batch of one bucket's rows costs here what it costs in that bucket model.",
        "",
        *(f"{knob}: {reason}" for knob, reason in knobs.reasons.items()),
        "timeout_action: REJECT (the protobuf default, so not written below)",
    )
    if graph is not None:
        config = encoder_config(name, shortest, knobs, hardware, model.versions, graph, model.kind, free_length=True)
    else:
        config = tensor_bucket_config(name, shortest, knobs, hardware, model.versions,
                                      tensor_layout(model, tensors, {b: 1 for b in model.bucket_lens}),
                                      free_length=True)
    return GeneratedModel(name=name, config=config, header=header,
                          adapter="encoder_model" if graph is not None else "tensor_bucket_model",
                          versions=model.versions, knobs=knobs, files_of=model.encoder_name(shortest))


def plan_all(spec: ServingSpec, profile: LatencyProfile, repository: Path | None = None) -> list[GeneratedModel]:
    plan = [generated for model in spec.models for generated in plan_embed_model(model, spec, profile)]
    return plan + [generated for model in spec.llm_models
                   for generated in plan_llm_model(model, spec, profile, repository)]


def expected_files(plan: list[GeneratedModel], repository: Path) -> dict[Path, str]:
    """The kit's own files in `repository` (external models' configs are `external_files`)."""
    files: dict[Path, str] = {}
    for model in plan:
        if model.user_config is not None:
            continue
        files[repository / model.name / "config.pbtxt"] = model.config_text()
        for version in model.versions:
            files[repository / model.name / str(version) / "model.py"] = model.shim_text()
    return files


def external_files(plan: list[GeneratedModel]) -> dict[Path, str]:
    """Each external model's config.pbtxt with the derived managed fields merged in."""
    return {model.user_config: model.config_text() for model in plan if model.user_config is not None}


def check_external(plan: list[GeneratedModel]) -> list[str]:
    """The managed fields of external models' configs that differ from the derived ones (the
    rest of those files is the user's: never compared)."""
    return [problem for model in plan if model.user_config is not None
            for problem in managed_drift(model.user_text, model.config, str(model.user_config))]


def check(files: dict[Path, str], repository: Path) -> list[str]:
    """Differences between the generated files and the repository, as readable messages."""
    problems = []
    for path, text in files.items():
        if not path.is_file():
            problems.append(f"{path.relative_to(repository)}: missing")
            continue
        current = path.read_text()
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "on disk", "generated",
                                        lineterm="", n=1)
            problems.append(f"{path.relative_to(repository)}: differs\n" + "\n".join(list(diff)[:40]))
    known = {path.parent.name for path in files if path.name == "config.pbtxt"}
    for config in sorted(repository.glob("*/config.pbtxt")):
        if config.parent.name not in known:
            problems.append(f"{config.relative_to(repository)}: not produced by the spec (remove it or add it)")
    return problems


ROUTER_KNOBS = ("tenants", "tenant_auth", "bucket_max_batch", "instance_count", "max_concurrent_requests",
                "admission", "admission_bound", "max_queue_size", "version_weights", "linger_regimes", "inline_max_ms")


def explain(plan: list[GeneratedModel], spec: ServingSpec, profile: LatencyProfile) -> str:
    lines = [f"spec {_relative(spec.path)}, profile {profile.hardware.name} "
             f"({profile.hardware.description}, measured {profile.measured_at})"]
    for model in plan:
        if model.knobs is None:
            # The router: its knobs are explained in its header, one "knob: reason" line each.
            reasons = [line for line in model.header if line.split(":", 1)[0] in ROUTER_KNOBS]
            if reasons:
                lines.append(f"\n{model.name}")
                lines += [f"  {line}" for line in reasons]
            continue
        k = model.knobs
        lines.append(f"\n{model.name}")
        values = {
            "max_batch_size": k.max_batch_size,
            "preferred_batch_size": k.preferred_batch_size,
            "max_queue_delay_microseconds": k.max_queue_delay_us,
            "default_timeout_microseconds": k.default_timeout_us,
            "max_queue_size": k.max_queue_size,
            "instance_count": k.instance_count,
        }
        for knob, value in values.items():
            lines.append(f"  {knob:<30} {value:>8}   {k.reasons[knob]}")
        lines += [f"  WARNING: {w}" for w in k.warnings]
    return "\n".join(lines)


def sources(spec: ServingSpec, profile: LatencyProfile) -> str:
    """What the configs are generated from: "<spec> + <profile>", relative to the repository root."""
    return f"{_relative(spec.path)} + {_relative(profile.path)}"


def write_files(files: dict[Path, str]) -> list[Path]:
    """Write every file whose text differs from what is on disk; the paths written."""
    written = []
    for path, text in files.items():
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
