"""A bucket model of a `tensor` model: the user's ONNX graph in ONNX Runtime, on the batches
Triton forms.

The bucket model's config names the graph's own inputs and outputs (Triton names = graph
names), with the variable axis fixed to the bucket's length where the router pads it. At load
the graph is checked against the config (names, data types, ranks, fixed sizes, a free batch
axis), so a graph that does not fit fails the load with one line that lists every mismatch.
The express model (`python_backends.common.regimes`) runs here too: its config leaves the
variable axis free (-1) as the router declares it, and since Triton batches only requests of one
shape, each batch it forms still holds rows of one bucket's length. On a batch the backend stacks
the requests Triton formed, runs the graph once and splits every output back per request.
`OnnxTensorModel` opens the ONNX file (I/O); the rest is pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from python_backends.common.params import CountInt, Flag, ModelParameters, NameList
from python_backends.embed.encoder import DEFAULT_PROVIDERS, open_session, split_rows
from python_backends.tensor.router import TensorSpec

# Triton data type -> the type ONNX Runtime reports for a graph tensor (`NodeArg.type`).
ORT_TYPES = {
    "TYPE_BOOL": "tensor(bool)",
    "TYPE_UINT8": "tensor(uint8)",
    "TYPE_UINT16": "tensor(uint16)",
    "TYPE_UINT32": "tensor(uint32)",
    "TYPE_UINT64": "tensor(uint64)",
    "TYPE_INT8": "tensor(int8)",
    "TYPE_INT16": "tensor(int16)",
    "TYPE_INT32": "tensor(int32)",
    "TYPE_INT64": "tensor(int64)",
    "TYPE_FP16": "tensor(float16)",
    "TYPE_FP32": "tensor(float)",
    "TYPE_FP64": "tensor(double)",
}


@dataclass(frozen=True)
class TensorBucketConfig:
    """Settings of one bucket model of a tensor model, from its config.pbtxt."""

    model_name: str  # Triton model name, for error messages
    max_batch_size: int  # Triton's batch limit for this bucket
    inputs: tuple[TensorSpec, ...]  # the graph's inputs, dims as this bucket takes them
    outputs: tuple[TensorSpec, ...]  # the graph outputs the model answers with
    intra_op_threads: int = 0  # ONNX Runtime intra-op threads; 0 lets ONNX Runtime choose
    providers: tuple[str, ...] = DEFAULT_PROVIDERS  # wanted execution providers, in order of preference
    allow_spinning: bool = True  # idle ONNX Runtime threads spin-wait (fast, but burns shared cores)
    cpu_nice: int = 0  # nice value the model's threads run at (`python_backends.common.cpu_priority`)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)


class TensorBucketParameters(ModelParameters):
    """A tensor bucket model's config.pbtxt parameters: the ONNX Runtime settings, named as the
    text encoder's bucket models name them (`encoder.EncoderParameters`)."""

    intra_op_threads: CountInt = 0  # ONNX Runtime intra-op threads; 0 lets ONNX Runtime choose
    allow_spinning: Flag = True  # idle ONNX Runtime threads spin-wait
    cpu_nice: CountInt = 0  # nice value of the model's threads (`python_backends.common.cpu_priority`)
    execution_providers: NameList = ()  # wanted execution providers in order; empty: DEFAULT_PROVIDERS


def _specs(name: str, what: str, tensors: Sequence[Mapping[str, Any]]) -> tuple[TensorSpec, ...]:
    specs = []
    for tensor in tensors:
        try:
            specs.append(TensorSpec(tensor["name"], tensor.get("data_type", ""),
                                    tuple(int(size) for size in tensor.get("dims", []))))
        except (KeyError, ValueError) as err:
            raise ValueError(f"model '{name}': config {what} {tensor.get('name', '?')!r}: {err}") from None
    if not specs:
        raise ValueError(f"model '{name}': config has no {what}s")
    return tuple(specs)


def parse_tensor_bucket_config(model_config: Mapping[str, Any]) -> TensorBucketConfig:
    """Validate the parsed config.pbtxt (Triton's JSON form); errors name the model."""
    name = model_config.get("name", "?")
    max_batch_size = int(model_config.get("max_batch_size", 0))
    if max_batch_size < 1:
        raise ValueError(f"model '{name}': max_batch_size must be >= 1 so Triton can batch it")
    params = {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}
    parameters = TensorBucketParameters.from_parameters(name, params)
    return TensorBucketConfig(
        model_name=name,
        max_batch_size=max_batch_size,
        inputs=_specs(name, "input", model_config.get("input", [])),
        outputs=_specs(name, "output", model_config.get("output", [])),
        intra_op_threads=parameters.intra_op_threads,
        providers=parameters.execution_providers or DEFAULT_PROVIDERS,
        allow_spinning=parameters.allow_spinning,
        cpu_nice=parameters.cpu_nice,
    )


@dataclass(frozen=True)
class GraphTensor:
    """A graph input or output as ONNX Runtime reports it (`NodeArg`: name, type, shape)."""

    name: str
    type: str  # e.g. tensor(float)
    shape: Sequence[int | str | None] | None  # every axis, batch first; a str or None where free


def _tensor_mismatches(what: str, spec: TensorSpec, graph: Any) -> list[str]:
    problems = []
    if graph.type != ORT_TYPES[spec.data_type]:
        problems.append(f"{what} '{spec.name}' is {graph.type} in the graph, {spec.type_name} in the config")
    shape = graph.shape
    if shape is None:  # the graph does not say its rank: nothing more to compare
        return problems
    if len(shape) != len(spec.dims) + 1:
        problems.append(f"{what} '{spec.name}' has rank {len(shape)} in the graph; the config's dims "
                        f"{list(spec.dims)} make {len(spec.dims) + 1}")
        return problems
    if isinstance(shape[0], int):
        problems.append(f"{what} '{spec.name}' has a fixed batch axis ({shape[0]}) in the graph")
    for axis, (size, want) in enumerate(zip(shape[1:], spec.dims, strict=True), start=1):
        if isinstance(size, int) and size != want:
            problems.append(f"{what} '{spec.name}' axis {axis} is {size} in the graph, "
                            f"{'free' if want == -1 else want} in the config")
    return problems


def graph_mismatches(config: TensorBucketConfig, graph_inputs: Sequence[Any],
                     graph_outputs: Sequence[Any]) -> list[str]:
    """Every way the graph (ONNX Runtime's `get_inputs()` / `get_outputs()`, or `GraphTensor`s)
    differs from the config: inputs must be the graph's inputs exactly, outputs some of its
    outputs, each of the same type and rank, with a free batch axis and the config's sizes."""
    inputs = {tensor.name: tensor for tensor in graph_inputs}
    outputs = {tensor.name: tensor for tensor in graph_outputs}
    problems = [f"the graph has no input '{name}'" for name in config.input_names if name not in inputs]
    problems += [f"graph input '{name}' is not in the config" for name in inputs if name not in config.input_names]
    problems += [f"the graph has no output '{name}'" for name in config.output_names if name not in outputs]
    for spec in config.inputs:
        if spec.name in inputs:
            problems += _tensor_mismatches("input", spec, inputs[spec.name])
    for spec in config.outputs:
        if spec.name in outputs:
            problems += _tensor_mismatches("output", spec, outputs[spec.name])
    return problems


def stack_requests(input_names: Sequence[str],
                   requests: Sequence[Mapping[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[int]]:
    """One batch from the requests Triton formed (they share a shape but for the batch axis):
    each input concatenated along the batch axis, and each request's row count."""
    if not requests:
        raise ValueError("no requests to stack")
    sizes = [int(request[input_names[0]].shape[0]) for request in requests]
    stacked = {name: requests[0][name] if len(requests) == 1 else np.concatenate([r[name] for r in requests])
               for name in input_names}
    return stacked, sizes


def split_outputs(outputs: Mapping[str, np.ndarray], sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Every output of a batch split back per request, `sizes[i]` rows each."""
    parts = {name: split_rows(array, sizes) for name, array in outputs.items()}
    return [{name: rows[index] for name, rows in parts.items()} for index in range(len(sizes))]


class OnnxTensorModel:
    """Runs the user's graph on the batches Triton forms for one bucket."""

    def __init__(self, onnx_path: str | Path, config: TensorBucketConfig):
        self.session = open_session(onnx_path, config)
        self.providers = self.session.get_providers()
        problems = graph_mismatches(config, self.session.get_inputs(), self.session.get_outputs())
        if problems:
            raise ValueError(f"model '{config.model_name}': {onnx_path} does not fit the config: {'; '.join(problems)}")
        self.config = config

    def run(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every configured output of one batch, by name."""
        feeds = {name: tensors[name] for name in self.config.input_names}
        results = self.session.run(list(self.config.output_names), feeds)
        return dict(zip(self.config.output_names, results, strict=True))

    def run_requests(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """The outputs of each request of a batch Triton formed: stacked, run once, split back."""
        stacked, sizes = stack_requests(self.config.input_names, requests)
        return split_outputs(self.run(stacked), sizes)
