"""A generative model of the serving spec as a model folder of Triton's vLLM backend.

Triton 24.10 (tritonserver 2.51, the release the kit fixes for GPU nodes) ships its vLLM
backend in its own container, `nvcr.io/nvidia/tritonserver:24.10-vllm-python-py3`, with vLLM
0.5.5. A model of that backend is a folder holding `config.pbtxt` (`backend: "vllm"`) and, in
its version folder, `model.json`: keyword arguments of vLLM's `AsyncEngineArgs`, passed to the
engine as they are. `vllm_model` turns one `[llm_models.NAME]` of the spec into both, with the
limits the kit's own engine runs under, and refuses a spec vLLM cannot serve that way;
`VLLMModel.notes` says what the vLLM model does differently. The config is a
`model_config_pb2.ModelConfig` message written with protobuf's text format, with every field
the backend's `auto_complete_config` would add written out, so the file reads the same with
auto-complete on or off.

Everything here is pure except `write_model_folder`, which writes the two files;
`python -m tools vllm-config` drives both.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tools.spec.serving import LLMModelSpec

VLLM_VERSION = "0.5.5"  # vLLM in Triton's 24.10 vLLM container (server build.py, TRITON_VERSION_MAP["2.51.0"])
VLLM_CONTAINER = "nvcr.io/nvidia/tritonserver:24.10-vllm-python-py3"
ENGINE_ARGS_FILE = "model.json"  # the file the backend reads from the version folder
VLLM_BLOCK_SIZES = (8, 16, 32, 128, 256, 512, 1024, 2048)  # vLLM 0.5.5's --block-size choices
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's own default
# spec dtype -> vLLM's: auto is bfloat16, as the kit's engine picks on a GPU (vLLM's own auto: float16 for fp32)
GPU_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
METRICS_PARAMETER = "REPORT_CUSTOM_METRICS"  # "yes": the backend exports vLLM's vllm:* metrics on :8002

# The backend's tensors in 24.10 (its `auto_complete_config`): name, type, dims, optional.
VLLM_INPUTS = (
    ("text_input", mc.TYPE_STRING, [1], False),  # the prompt, raw: no chat template is applied
    ("stream", mc.TYPE_BOOL, [1], True),  # true: one response per text delta
    ("sampling_parameters", mc.TYPE_STRING, [1], True),  # JSON of vLLM SamplingParams (max_tokens, ...)
    ("exclude_input_in_output", mc.TYPE_BOOL, [1], True),  # unstreamed answers start with the prompt unless true
)
VLLM_OUTPUTS = (
    ("text_output", mc.TYPE_STRING, [-1]),  # a delta when streaming, else the whole text
)


class VLLMConfigError(ValueError):
    """The spec's model cannot be served by the vLLM backend as described; the message names
    the model and each offending value."""


@dataclass(frozen=True)
class VLLMModel:
    """One model folder of the vLLM backend."""

    name: str  # Triton model name = folder name
    version: int  # the version folder holding model.json
    config: mc.ModelConfig  # config.pbtxt
    engine_args: dict[str, object]  # model.json: vLLM AsyncEngineArgs keyword -> value
    notes: tuple[str, ...]  # what this model does differently from the kit's engine

    def config_text(self, header: tuple[str, ...] = ()) -> str:
        """config.pbtxt: `header` as comment lines, then the message in protobuf's text format."""
        comments = "".join(f"# {line}\n" if line else "#\n" for line in header)
        return comments + text_format.MessageToString(self.config)

    def model_json(self) -> str:
        return json.dumps(self.engine_args, indent=2) + "\n"

    def files(self, header: tuple[str, ...] = ()) -> dict[str, str]:
        """Path inside the model folder -> text."""
        return {"config.pbtxt": self.config_text(header), f"{self.version}/{ENGINE_ARGS_FILE}": self.model_json()}


def vllm_model(model: LLMModelSpec, model_path: str,
               gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> VLLMModel:
    """The vLLM backend's model folder for `model`, loading the weights at `model_path` (a
    Hugging Face folder as the GPU node sees it, or a hub id where the node may download).

    The engine's limits are the spec's: `max_num_seqs`, `max_num_batched_tokens` (tokens per
    step), `max_model_len`, `block_size`, and the dtype (`auto` is bfloat16, as the kit's
    engine picks on a GPU; vLLM's own `auto` would pick float16 for float32 weights, such as
    the folder `build-models` makes). A sequence that runs out of KV blocks is preempted and
    recomputed, as on the kit's engine. vLLM 0.5.5 cannot chunk prefills and share cached
    prefixes at once (its model runner raises on the first prefix hit of a chunked prefill), so:
    a step budget under `max_model_len` needs chunked prefill, and prefix caching stays off;
    a budget that holds a whole prompt keeps prefix caching on, and prompts are prefilled
    whole in steps of their own.

    The KV budget: vLLM takes none in bytes. At start it loads the weights, runs one step of
    `max_num_batched_tokens` to measure peak activations, and gives the KV cache what is left
    of `gpu_memory_utilization` x the GPU's whole memory:

        KV bytes = gpu_memory_utilization x GPU memory - (weights + peak activations)

    The fraction is of the whole GPU, not of what is free: whatever else runs on the GPU (a
    second vLLM model, the kit's own `llm` engine) must fit in the rest, and CUDA graphs
    (captured after the KV cache is allocated) take memory outside it. The spec's
    `kv_cache_mb` is an absolute budget, the kit engine's admission limit; it is not carried
    over. To give vLLM about the same cache, choose the fraction with that formula: the
    weights and activations are the model's and the GPU's, which the spec does not know.
    vLLM's only absolute setting, `num_gpu_blocks_override`, skips the memory check (vLLM
    keeps it for testing preemption) and is not written.

    Refused, in one error naming each problem: a static batching policy (vLLM batches
    continuously only), a spec pinning the engine to the CPU (the container is a CUDA build),
    a block size vLLM 0.5.5 does not take, a GGUF file (vLLM 0.5.5 loads GGUF only for Llama
    and Qwen2 models, experimentally, and runs no unquantized GGUF tensor in its linear layers:
    serve a Hugging Face folder, such as the one `build-models` makes from a GGUF), and a
    fraction outside (0, 1].
    """
    where = f"[llm_models.{model.name}]"
    problems = []
    if model.batching != "continuous":
        problems.append(f"batching = {model.batching!r}: vLLM batches continuously only (the static policies are "
                        "the kit's benchmark baselines); use \"continuous\"")
    if model.device == "cpu":
        problems.append("device = \"cpu\": the vLLM container serves on GPUs; use \"auto\" or \"cuda\"")
    if model.block_size not in VLLM_BLOCK_SIZES:
        problems.append(f"block_size = {model.block_size}: vLLM {VLLM_VERSION} takes one of "
                        f"{', '.join(map(str, VLLM_BLOCK_SIZES))}")
    if not model_path.strip():
        problems.append("the model path is empty")
    elif model_path.lower().endswith(".gguf"):
        problems.append(f"model {model_path} is a GGUF file: vLLM {VLLM_VERSION} loads GGUF only for Llama and Qwen2 "
                        "models, experimentally, and cannot run its unquantized tensors; serve a Hugging Face "
                        "folder (`python -m tools build-models` makes one from the GGUF: model_repository/"
                        f"{model.name}/{max(model.versions)})")
    if not 0 < gpu_memory_utilization <= 1:
        problems.append(f"gpu_memory_utilization = {gpu_memory_utilization:g}: a fraction of the GPU's memory, "
                        "within (0, 1]")
    if problems:
        raise VLLMConfigError(f"{where} cannot be served by Triton's vLLM backend: " + "; ".join(problems))

    chunked = model.max_num_batched_tokens < model.max_model_len
    version = max(model.versions)
    engine_args: dict[str, object] = {
        "model": model_path,
        "dtype": GPU_DTYPES[model.dtype],
        "max_model_len": model.max_model_len,
        "max_num_seqs": model.max_num_seqs,
        "max_num_batched_tokens": model.max_num_batched_tokens,
        "block_size": model.block_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": not chunked,
        "preemption_mode": "recompute",
        "disable_log_stats": False,  # the engine's stats feed the vllm:* metrics
        "disable_log_requests": True,  # one log line per request otherwise
    }
    return VLLMModel(name=model.name, version=version, config=vllm_config(model.name, version),
                     engine_args=engine_args, notes=_notes(model, version, gpu_memory_utilization, chunked))


def vllm_config(name: str, version: int) -> mc.ModelConfig:
    """config.pbtxt of a vLLM model: decoupled (one response per delta), Triton's batcher off
    (the engine batches per step), one instance that owns the GPUs it is given (KIND_MODEL),
    and vLLM's metrics exported."""
    config = mc.ModelConfig(name=name, backend="vllm", max_batch_size=0)
    config.version_policy.specific.versions.append(version)
    for tensor_name, data_type, dims, optional in VLLM_INPUTS:
        config.input.add(name=tensor_name, data_type=data_type, dims=dims, optional=optional)
    for tensor_name, data_type, dims in VLLM_OUTPUTS:
        config.output.add(name=tensor_name, data_type=data_type, dims=dims)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_MODEL)
    config.model_transaction_policy.decoupled = True
    config.parameters[METRICS_PARAMETER].string_value = "yes"
    return config


def _notes(model: LLMModelSpec, version: int, gpu_memory_utilization: float, chunked: bool) -> tuple[str, ...]:
    notes = [f"KV cache: what is left of {gpu_memory_utilization:g} of the GPU's memory after the weights and peak "
             f"activations, not the spec's {model.kv_cache_mb:g} MB"]
    if chunked:
        notes.append(f"prefix caching off: the step budget ({model.max_num_batched_tokens} tokens) is under "
                     f"max_model_len ({model.max_model_len}), so prompts are prefilled in chunks, and vLLM "
                     f"{VLLM_VERSION} cannot chunk prefills and share cached prefixes at once")
    else:
        notes.append("prefills are not chunked: each prompt is prefilled whole in a step without decodes (vLLM "
                     f"{VLLM_VERSION} cannot chunk prefills and share cached prefixes at once)")
    notes.append(f"a request without max_tokens in its sampling_parameters gets vLLM's 16 tokens, not the spec's "
                 f"{model.default_max_tokens}")
    if len(model.versions) > 1:
        notes.append(f"serves version {version} only of versions {', '.join(map(str, model.versions))}: each version "
                     "would start an engine of its own, with its own share of the GPU")
    notes.append("no tenant authentication, token quotas or llm_* metrics: they are the kit's `llm` model's "
                 "(docs/vllm.md says what a front model needs)")
    return tuple(notes)


def write_model_folder(out: Path, model: VLLMModel, header: tuple[str, ...] = (), force: bool = False) -> list[Path]:
    """Write `out/NAME/config.pbtxt` and `out/NAME/VERSION/model.json`; return the paths written.

    A new folder is written whole under a temporary name in `out` and renamed into place, so a
    failure leaves no half folder. An existing folder is refused unless `force`, which replaces
    the two files (each written beside its final name, then renamed over it) and leaves any
    other file of the folder as it is.
    """
    folder = out / model.name
    files = model.files(header)
    if folder.exists() and not force:
        raise VLLMConfigError(f"{folder} exists; --force replaces its config.pbtxt and "
                              f"{model.version}/{ENGINE_ARGS_FILE}")
    if folder.exists() and not folder.is_dir():
        raise VLLMConfigError(f"{folder} exists and is not a folder")
    if folder.exists():
        for relative, text in files.items():
            _replace(folder / relative, text)
        return [folder / relative for relative in files]
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=f".{model.name}-"))
    try:
        for relative, text in files.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_text(text)
        staging.chmod(0o755)  # mkdtemp makes it 0700
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [folder / relative for relative in files]


def _replace(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
