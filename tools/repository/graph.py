"""What an ONNX graph takes and gives: input and output names, Triton data types and shapes.

`read_graph` reads the graph's signature only (initializers and external weight files are not
loaded), so that a user's model of any size is described in milliseconds; `Graph` is plain
data, and `Graph.verify_batchable` says, in one line naming the file, why a graph cannot be
served with dynamic batching. This module reads the file; nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from tritonclient.grpc import model_config_pb2 as mc

# ONNX element type -> Triton data type (the types Triton's ONNX Runtime backend serves).
ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: mc.TYPE_FP32,
    onnx.TensorProto.FLOAT16: mc.TYPE_FP16,
    onnx.TensorProto.BFLOAT16: mc.TYPE_BF16,
    onnx.TensorProto.DOUBLE: mc.TYPE_FP64,
    onnx.TensorProto.INT8: mc.TYPE_INT8,
    onnx.TensorProto.INT16: mc.TYPE_INT16,
    onnx.TensorProto.INT32: mc.TYPE_INT32,
    onnx.TensorProto.INT64: mc.TYPE_INT64,
    onnx.TensorProto.UINT8: mc.TYPE_UINT8,
    onnx.TensorProto.UINT16: mc.TYPE_UINT16,
    onnx.TensorProto.UINT32: mc.TYPE_UINT32,
    onnx.TensorProto.UINT64: mc.TYPE_UINT64,
    onnx.TensorProto.BOOL: mc.TYPE_BOOL,
    onnx.TensorProto.STRING: mc.TYPE_STRING,
}


class GraphError(ValueError):
    """A graph the kit cannot serve as asked; the message names the file and the reason."""


@dataclass(frozen=True)
class TensorInfo:
    """One input or output of the graph."""

    name: str
    data_type: int  # a model_config_pb2 TYPE_* value
    shape: tuple[int | None, ...]  # every axis, the batch axis first; None where the graph leaves it free

    @property
    def type_name(self) -> str:
        return mc.DataType.Name(self.data_type)

    @property
    def dims(self) -> list[int]:
        """The shape after the batch axis as config.pbtxt writes it: -1 for a free axis."""
        return [-1 if size is None else size for size in self.shape[1:]]

    @property
    def free_axes(self) -> tuple[int, ...]:
        """Axes after the batch axis the graph leaves free (a sequence length, an image width)."""
        return tuple(axis for axis, size in enumerate(self.shape) if axis > 0 and size is None)


@dataclass(frozen=True)
class Graph:
    """The signature of one ONNX graph."""

    path: Path
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    def input(self, name: str) -> TensorInfo:
        return _named(self.path, "input", name, self.inputs)

    def output(self, name: str) -> TensorInfo:
        return _named(self.path, "output", name, self.outputs)

    def batch_axis_is_free(self) -> bool:
        """Every input and output has a first axis the graph leaves free: dynamic batching can
        stack requests along it."""
        return all(t.shape and t.shape[0] is None for t in (*self.inputs, *self.outputs))

    def verify_batchable(self) -> None:
        """Raise GraphError unless Triton can batch this graph along its first axis."""
        fixed = [f"{t.name} {_shape_text(t.shape)}" for t in (*self.inputs, *self.outputs)
                 if not t.shape or t.shape[0] is not None]
        if fixed:
            raise GraphError(f"{self.path}: no dynamic batch axis: {', '.join(fixed)} "
                             "(export with a symbolic first axis, e.g. torch.onnx.export(..., "
                             "dynamic_axes={name: {0: 'batch'}}))")


def _named(path: Path, what: str, name: str, tensors: tuple[TensorInfo, ...]) -> TensorInfo:
    for tensor in tensors:
        if tensor.name == name:
            return tensor
    raise GraphError(f"{path}: no {what} named {name!r}; the graph's {what}s: "
                     + ", ".join(t.name for t in tensors))


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if size is None else str(size) for size in shape) + "]"


def _tensor(path: Path, value: onnx.ValueInfoProto) -> TensorInfo:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise GraphError(f"{path}: {value.name} is not a tensor (sequences and maps are not served)")
    data_type = ONNX_TO_TRITON.get(tensor_type.elem_type)
    if data_type is None:
        raise GraphError(f"{path}: {value.name} has element type "
                         f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}, which Triton does not serve")
    if not tensor_type.HasField("shape"):
        raise GraphError(f"{path}: {value.name} has no shape in the graph")
    # A named (dim_param) or unnamed axis is free; a dim_value > 0 is fixed.
    shape = tuple(dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None
                  for dim in tensor_type.shape.dim)
    return TensorInfo(value.name, data_type, shape)


def read_graph(path: Path) -> Graph:
    """The signature of the ONNX graph at `path`; GraphError when it is missing or not ONNX."""
    path = Path(path)
    if not path.is_file():
        raise GraphError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # onnx raises DecodeError, ValueError or OSError by file
        raise GraphError(f"{path}: not an ONNX model ({error})") from error
    initializers = {init.name for init in model.graph.initializer}
    # Older exporters list the weights among the inputs too; they are not fed by clients.
    inputs = tuple(_tensor(path, value) for value in model.graph.input if value.name not in initializers)
    outputs = tuple(_tensor(path, value) for value in model.graph.output)
    if not inputs or not outputs:
        raise GraphError(f"{path}: the graph has no {'inputs' if not inputs else 'outputs'}")
    return Graph(path, inputs, outputs)
