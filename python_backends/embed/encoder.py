"""A bucket model: the user's ONNX graph in ONNX Runtime at one fixed sequence length.

The backend stacks the batch Triton formed, feeds the kit's tensors (`INPUT_IDS`,
`ATTENTION_MASK`, `TOKEN_TYPE_IDS`) to the graph under its own input names, runs it once,
pools the per-token output when the graph does not pool itself (`pooling`, with the
attention mask), L2-normalises when the spec asks, and splits the result back per request.
A graph that build-models exported from a Hugging Face folder pools inside the graph
already (`pooling` none); a raw export (`last_hidden_state`) is pooled here. The bucketed
model's express model (`python_backends.common.regimes`) runs here too, with the length free
(dims -1, parameter `free_length`): Triton batches only requests of one shape, so each batch
it forms still holds rows of one bucket's length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from python_backends.common.params import CountInt, Flag, ModelParameters, NameList, NameMap
from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS
from python_backends.embed.pooling import Pooling, l2_normalise, pool

# What the kit's bucket tensors are called in a graph exported from Hugging Face.
DEFAULT_ONNX_INPUTS = {INPUT_IDS: "input_ids", ATTENTION_MASK: "attention_mask", TOKEN_TYPE_IDS: "token_type_ids"}
DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
# Rows in each batch Triton formed (label model): the batch sizes a bucket really runs at,
# which Triton's own counters give only as a mean (inference_count / execution_count).
BATCH_ROWS_HISTOGRAM = ("embed_bucket_batch_rows", "Rows in each batch Triton formed for a bucket model")


@dataclass(frozen=True)
class EncoderConfig:
    """Settings of one bucket encoder model, from its config.pbtxt."""

    model_name: str  # Triton model name, for error messages
    seq_len: int | None  # the bucket length: dims of INPUT_IDS / ATTENTION_MASK; None: free (the express model)
    max_batch_size: int  # Triton's batch limit for this bucket
    inputs: tuple[str, ...] = (INPUT_IDS, ATTENTION_MASK)  # the config's input tensors
    output: str = "EMBEDDING"  # the config's output tensor
    onnx_inputs: Mapping[str, str] = field(  # the kit's input tensor -> the graph's input name
        default_factory=lambda: {INPUT_IDS: "input_ids", ATTENTION_MASK: "attention_mask"})
    onnx_output: str = "embedding"  # the graph output read
    pooling: Pooling = Pooling.NONE  # how per-token vectors become one per row; none: the graph pools
    normalize: bool = False  # scale each output row to unit length
    intra_op_threads: int = 0  # ONNX Runtime intra-op threads; 0 lets ONNX Runtime choose
    providers: tuple[str, ...] = DEFAULT_PROVIDERS  # wanted execution providers, in order of preference
    allow_spinning: bool = True  # idle ONNX Runtime threads spin-wait (fast, but burns shared cores)
    cpu_nice: int = 0  # nice value the model's threads run at (`python_backends.common.cpu_priority`)


class EncoderParameters(ModelParameters):
    """A bucket encoder's config.pbtxt parameters (gen-config writes them through this class)."""

    intra_op_threads: CountInt = 0  # ONNX Runtime intra-op threads; 0 lets ONNX Runtime choose
    allow_spinning: Flag = True  # idle ONNX Runtime threads spin-wait
    cpu_nice: CountInt = 0  # nice value of the model's threads (`python_backends.common.cpu_priority`)
    execution_providers: NameList = ()  # wanted execution providers in order; empty: DEFAULT_PROVIDERS
    onnx_inputs: NameMap = DEFAULT_ONNX_INPUTS  # the kit's input tensor -> the graph's input name
    onnx_output: str = "embedding"  # the graph output the model answers with
    pooling: str = "none"  # none (the graph pools), mean, cls or last
    normalize: Flag = False  # L2-normalise each output row
    free_length: Flag = False  # the express model: rows of any bucket length (dims -1)


def parse_encoder_config(model_config: Mapping[str, Any]) -> EncoderConfig:
    """Validate the parsed config.pbtxt (Triton's JSON form); errors name the model."""
    name = model_config.get("name", "?")
    inputs = {tensor["name"]: tensor for tensor in model_config.get("input", [])}
    for required in (INPUT_IDS, ATTENTION_MASK):
        if required not in inputs:
            raise ValueError(f"model '{name}': config has no input {required}")
    params = {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}
    parameters = EncoderParameters.from_parameters(name, params)
    dims = [int(d) for d in inputs[INPUT_IDS].get("dims", [])]
    if parameters.free_length and dims != [-1]:
        raise ValueError(f"model '{name}': with free_length, {INPUT_IDS} dims must be [-1] (any length), got {dims}")
    if not parameters.free_length and (len(dims) != 1 or dims[0] < 2):
        raise ValueError(f"model '{name}': {INPUT_IDS} dims must be one fixed length >= 2, got {dims} (-1 only "
                         "with the parameter free_length, as the express model has it)")
    for other, tensor in inputs.items():
        other_dims = [int(d) for d in tensor.get("dims", [])]
        if other_dims != dims:
            raise ValueError(f"model '{name}': {other} dims {other_dims} differ from {INPUT_IDS} dims {dims}")
    outputs = [tensor["name"] for tensor in model_config.get("output", [])]
    if len(outputs) != 1:
        raise ValueError(f"model '{name}': config must have exactly one output, got {outputs}")
    max_batch_size = int(model_config.get("max_batch_size", 0))
    if max_batch_size < 1:
        raise ValueError(f"model '{name}': max_batch_size must be >= 1 so Triton can batch it")
    unmapped = sorted(set(inputs) - set(parameters.onnx_inputs))
    if unmapped:
        raise ValueError(f"model '{name}': parameter onnx_inputs names no graph input for {unmapped}")
    try:
        pooling = Pooling.parse(parameters.pooling)
    except ValueError as err:
        raise ValueError(f"model '{name}': parameter pooling: {err}") from None
    return EncoderConfig(
        model_name=name,
        seq_len=None if parameters.free_length else dims[0],
        max_batch_size=max_batch_size,
        inputs=tuple(inputs),
        output=outputs[0],
        onnx_inputs={tensor: parameters.onnx_inputs[tensor] for tensor in inputs},
        onnx_output=parameters.onnx_output,
        pooling=pooling,
        normalize=parameters.normalize,
        intra_op_threads=parameters.intra_op_threads,
        providers=parameters.execution_providers or DEFAULT_PROVIDERS,
        allow_spinning=parameters.allow_spinning,
        cpu_nice=parameters.cpu_nice,
    )


def batch_rows_buckets(max_batch_size: int) -> list[float]:
    """Histogram edges for formed batch sizes: powers of two below `max_batch_size`, then
    the limit itself, so a full batch lands in a bucket of its own."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    edges = [float(1 << i) for i in range(max_batch_size.bit_length()) if (1 << i) < max_batch_size]
    return [*edges, float(max_batch_size)]


def pick_providers(wanted: Sequence[str], available: Sequence[str]) -> list[str]:
    """The wanted providers this ONNX Runtime build has, in the wanted order; CPU as last resort."""
    chosen = [provider for provider in wanted if provider in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def split_rows(stacked: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Split a batch output back into one array per request, `sizes[i]` rows each."""
    if sum(sizes) != stacked.shape[0]:
        raise ValueError(f"batch has {stacked.shape[0]} rows but requests sum to {sum(sizes)}")
    return np.split(stacked, np.cumsum(sizes)[:-1].tolist()) if sizes else []


def open_session(onnx_path: str | Path, config):
    """An ONNX Runtime session for a bucket model's graph, with the config's threads, spinning and
    providers (`config`: an `EncoderConfig` or a tensor bucket's config, which share those fields).
    FileNotFoundError names the model and says how to build the file."""
    import onnxruntime as ort  # imported here so the pure helpers load without it

    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"model '{config.model_name}': {onnx_path} not found; "
                                "run `python -m tools build-models`")
    options = ort.SessionOptions()
    if config.intra_op_threads:
        options.intra_op_num_threads = config.intra_op_threads
    if not config.allow_spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = pick_providers(config.providers, ort.get_available_providers())
    return ort.InferenceSession(str(onnx_path), options, providers=providers)


def batch_rows_metric(pb, model_name: str, version: str, max_batch_size: int):
    """The histogram of rows per formed batch of one bucket model version (`BATCH_ROWS_HISTOGRAM`):
    (its family, which must outlive the metric, and the metric)."""
    name, text = BATCH_ROWS_HISTOGRAM
    family = pb.MetricFamily(name=name, description=text, kind=pb.MetricFamily.HISTOGRAM)
    return family, family.Metric(labels={"model": model_name, "version": version},
                                 buckets=batch_rows_buckets(max_batch_size))


def finish_rows(output: np.ndarray, attention_mask: np.ndarray, config: EncoderConfig) -> np.ndarray:
    """The graph's output as the model answers it: pooled by the mask when the graph gives one
    vector per token, L2-normalised when asked, float32."""
    rows = pool(output, attention_mask, config.pooling)
    return l2_normalise(rows) if config.normalize else rows


class OnnxEncoder:
    """Runs the user's graph on the kit's bucket tensors."""

    def __init__(self, onnx_path: str | Path, config: EncoderConfig):
        self.session = open_session(onnx_path, config)
        self.providers = self.session.get_providers()
        graph_inputs = {tensor.name for tensor in self.session.get_inputs()}
        graph_outputs = {tensor.name for tensor in self.session.get_outputs()}
        missing = sorted(set(config.onnx_inputs.values()) - graph_inputs)
        if missing or config.onnx_output not in graph_outputs:
            raise ValueError(f"model '{config.model_name}': {onnx_path} has inputs {sorted(graph_inputs)} and "
                             f"outputs {sorted(graph_outputs)}; the config names inputs "
                             f"{sorted(config.onnx_inputs.values())} and output {config.onnx_output!r}")
        self.config = config

    def run(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """The model's answer for a padded batch: the kit's input tensors by name, int64 [rows, length]."""
        feeds = {self.config.onnx_inputs[name]: tensors[name].astype(np.int64, copy=False)
                 for name in self.config.inputs}
        (output,) = self.session.run([self.config.onnx_output], feeds)
        return finish_rows(output, tensors[ATTENTION_MASK], self.config)

    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """FP32 rows of a padded batch of ids and mask (token type ids all zero where the graph takes them)."""
        tensors = {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask}
        if TOKEN_TYPE_IDS in self.config.inputs:
            tensors[TOKEN_TYPE_IDS] = np.zeros_like(input_ids)
        return self.run(tensors)
