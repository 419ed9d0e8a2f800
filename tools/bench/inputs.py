"""Request inputs made from a model's declared tensors, for the profiler and the sweep of any model.

What perf_analyzer does with `--input-data random|zero|FILE`: `make_inputs` gives one batch of
every input, filled with seeded random values, with zeros, or with the samples of a JSON file
in perf_analyzer's `--input-data` form, which `load_input_data` reads and checks:

    {"data": [{"IMAGE": [0.1, 0.2, ...], "LENGTHS": {"content": [3, 5], "shape": [2]}}, ...]}

Each entry of "data" is one sample: one row of every input, the batch axis left out. A tensor's
value is a flat row-major list, `{"b64": "..."}` (its raw little-endian bytes; BYTES elements
each prefixed by their length as a 4-byte little-endian integer), or `{"content": <either>,
"shape": [...]}` giving the row's shape, which a free axis needs unless its size is known
otherwise. `batch_inputs` cycles samples into a batch, rows stacked in order.

Shapes: the tensors are `tools.repository.graph.TensorInfo` as `read_graph` gives them, the
batch axis first (axis 0, free: the kit batches along it); a row is `shape[1:]`. Sizes for the
other free axes (a sequence length, an image width) are given by axis index in that same shape
(`axis_sizes`, e.g. {2: 224}; it applies to every tensor free on that axis), or one
`variable_len` for any free axis not named. A sample file's shapes leave the batch axis out, as
perf_analyzer's do.

Types: Triton's data types map to numpy through `tritonclient.utils.triton_to_np_dtype` (BYTES
is numpy `object` holding `bytes`, BF16 is `ml_dtypes.bfloat16`). Random fill: integers in
[0, high) with `high` per tensor (an id input needs its vocabulary size; the default, 2, is safe
for any index or mask), floats standard normal, booleans fair coin flips, BYTES short lowercase
ASCII strings. Everything here is pure except `load_input_data` and `make_inputs` given a file,
which read it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import string
import struct
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from tools.repository.graph import TensorInfo

DEFAULT_INT_HIGH = 2  # random integers are drawn from [0, high): 0 and 1 are valid for any index or mask
MAX_RANDOM_TEXT = 16  # random BYTES elements are 1 to this many ASCII letters
_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)


class Fill(StrEnum):
    """How `make_inputs` fills tensors when no sample file is given."""

    RANDOM = "random"
    ZEROS = "zeros"


class InputDataError(ValueError):
    """A sample file or an input request the declared tensors do not fit; one line, naming where."""


def wire_type(tensor: TensorInfo) -> str:
    """The tensor's type as Triton's protocol spells it: FP32, INT64, BYTES (config's TYPE_STRING)."""
    name = tensor.type_name.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def numpy_dtype(tensor: TensorInfo) -> np.dtype:
    dtype = triton_to_np_dtype(wire_type(tensor))
    if dtype is None:
        raise InputDataError(f"{tensor.name}: no numpy type for {tensor.type_name}")
    return np.dtype(dtype)


def parse_fill(raw: str) -> Fill | Path:
    """A command line's `random`, `zeros` (or perf_analyzer's `zero`), or a sample file's path."""
    if raw in ("zero", Fill.ZEROS):
        return Fill.ZEROS
    return Fill.RANDOM if raw == Fill.RANDOM else Path(raw)


def _declared(tensor: TensorInfo) -> tuple[int | None, ...]:
    """The row shape the tensor declares (its shape after the batch axis)."""
    if not tensor.shape or tensor.shape[0] is not None:
        raise InputDataError(f"{tensor.name}: shape {_shape_text(tensor.shape)} has no free batch axis first "
                             "(tensors are given with the batch axis, as read_graph reads them)")
    return tensor.shape[1:]


def _known_sizes(tensor: TensorInfo, axis_sizes: Mapping[int, int] | None,
                 variable_len: int | None) -> tuple[int | None, ...]:
    """The row shape with every free axis sized that `axis_sizes` or `variable_len` sizes; None where neither does."""
    if 0 in (axis_sizes or {}):
        raise InputDataError("axis 0 is the batch axis: its size is the batch size, not an axis size")
    sizes = []
    for axis, size in enumerate(_declared(tensor), start=1):
        if size is None:
            size = (axis_sizes or {}).get(axis, variable_len)
            if size is not None and size < 1:
                raise InputDataError(f"{tensor.name}: axis {axis} must be given a size >= 1, got {size}")
        sizes.append(size)
    return tuple(sizes)


def row_shape(tensor: TensorInfo, axis_sizes: Mapping[int, int] | None = None,
              variable_len: int | None = None) -> tuple[int, ...]:
    """The shape of one row of `tensor`, every free axis sized."""
    sizes = _known_sizes(tensor, axis_sizes, variable_len)
    unknown = [axis for axis, size in enumerate(sizes, start=1) if size is None]
    if unknown:
        raise InputDataError(f"{tensor.name}: axis {unknown[0]} of {_shape_text(tensor.shape)} is free: give its "
                             "size (axis_sizes or variable_len)")
    return tuple(int(size) for size in sizes)


def make_inputs(tensors: Sequence[TensorInfo], batch_size: int, *, fill: Fill | str | Path = Fill.RANDOM,
                axis_sizes: Mapping[int, int] | None = None, variable_len: int | None = None,
                high: Mapping[str, int] | None = None,
                seed: int | np.random.Generator = 0) -> dict[str, np.ndarray]:
    """One batch of every tensor: name -> array of shape (batch_size, *row). `fill` is a `Fill`
    or a sample file (then `batch_inputs` of its samples from the first)."""
    if batch_size < 1:
        raise InputDataError(f"batch size must be >= 1, got {batch_size}")
    fill = parse_fill(fill) if isinstance(fill, str) else fill
    if isinstance(fill, Path):
        return batch_inputs(load_input_data(fill, tensors, axis_sizes=axis_sizes, variable_len=variable_len),
                            batch_size)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    unknown = set(high or {}) - {t.name for t in tensors}
    if unknown:
        raise InputDataError(f"high given for {', '.join(sorted(unknown))}, which the model does not take "
                             f"(its inputs: {', '.join(t.name for t in tensors)})")
    batch = {}
    for tensor in tensors:
        shape = (batch_size, *row_shape(tensor, axis_sizes, variable_len))
        if fill is Fill.ZEROS:
            batch[tensor.name] = _zeros(tensor, shape)
        else:
            batch[tensor.name] = _random(tensor, shape, rng, (high or {}).get(tensor.name, DEFAULT_INT_HIGH))
    return batch


def _zeros(tensor: TensorInfo, shape: tuple[int, ...]) -> np.ndarray:
    dtype = numpy_dtype(tensor)
    return np.full(shape, b"", dtype=object) if dtype == np.object_ else np.zeros(shape, dtype=dtype)


def _random(tensor: TensorInfo, shape: tuple[int, ...], rng: np.random.Generator, high: int) -> np.ndarray:
    dtype = numpy_dtype(tensor)
    if dtype == np.object_:
        lengths = rng.integers(1, MAX_RANDOM_TEXT + 1, size=shape)
        texts = [_LETTERS[rng.integers(0, len(_LETTERS), size=n)].tobytes() for n in lengths.ravel()]
        return np.array(texts, dtype=object).reshape(shape)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        if not 1 <= high <= np.iinfo(dtype).max + 1:
            raise InputDataError(f"{tensor.name}: high {high} is outside [1, {np.iinfo(dtype).max + 1}] "
                                 f"for {tensor.type_name}")
        return rng.integers(0, high, size=shape, dtype=dtype)
    return rng.standard_normal(shape).astype(dtype)


def load_input_data(path: Path, tensors: Sequence[TensorInfo], *, axis_sizes: Mapping[int, int] | None = None,
                    variable_len: int | None = None) -> list[dict[str, np.ndarray]]:
    """The samples of a perf_analyzer `--input-data` JSON file, each name -> one row, checked
    against the declared tensors; an InputDataError names the file, the entry and the tensor."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputDataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputDataError(f"{path}: not a JSON file: {err}") from None
    return samples_from_json(document, tensors, source=str(path), axis_sizes=axis_sizes, variable_len=variable_len)


def samples_from_json(document: object, tensors: Sequence[TensorInfo], *, source: str = "input data",
                      axis_sizes: Mapping[int, int] | None = None,
                      variable_len: int | None = None) -> list[dict[str, np.ndarray]]:
    """`load_input_data` of a document already parsed (`source` names it in errors)."""
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputDataError(f'{source}: needs a non-empty "data" list, as perf_analyzer\'s --input-data '
                             'reads: {"data": [{"INPUT": [...]}, ...]}')
    names = [t.name for t in tensors]
    known = {t.name: _known_sizes(t, axis_sizes, variable_len) for t in tensors}  # checks the arguments first
    samples = []
    for index, entry in enumerate(entries):
        where = f"{source}: data[{index}]"
        if not isinstance(entry, dict):
            kind = "a list (a sequence stream)" if isinstance(entry, list) else type(entry).__name__
            raise InputDataError(f"{where} is {kind}; each entry must be one object of tensors")
        extra = [name for name in entry if name not in names]
        if extra:
            raise InputDataError(f"{where}: {extra[0]} is not an input of the model (its inputs: {', '.join(names)})")
        sample = {}
        for tensor in tensors:
            if tensor.name not in entry:
                raise InputDataError(f"{where}: no tensor {tensor.name} (the model's inputs: {', '.join(names)})")
            try:
                sample[tensor.name] = _row(tensor, entry[tensor.name], known[tensor.name])
            except InputDataError as err:
                raise InputDataError(f"{where}: {tensor.name}: {err}") from None
        samples.append(sample)
    return samples


def _row(tensor: TensorInfo, value: object, known: tuple[int | None, ...]) -> np.ndarray:
    """One sample's row of `tensor` from its JSON value; `known`: the row's sizes known without it."""
    shape = None
    if isinstance(value, dict) and "b64" not in value:
        unknown = set(value) - {"content", "shape"}
        if "content" not in value or unknown:
            raise InputDataError('give a list, {"b64": ...}, or {"content": ..., "shape": [...]}')
        content, shape = value["content"], value.get("shape")
    else:
        content = value
    flat = _elements(tensor, content)
    declared = tensor.shape[1:]
    if shape is not None:
        if (not isinstance(shape, list) or any(type(size) is not int or size < 0 for size in shape)
                or len(shape) != len(declared)
                or any(d is not None and d != size for d, size in zip(declared, shape, strict=True))):
            raise InputDataError(f"shape {shape} contradicts the declared {_shape_text(declared)}")
        sizes = tuple(shape)
    else:
        sizes = _infer(known, flat.size)
    if math.prod(sizes) != flat.size:
        raise InputDataError(f"has {flat.size} elements; shape {list(sizes)} takes {math.prod(sizes)}")
    return flat.reshape(sizes)


def _infer(sizes: tuple[int | None, ...], num_elements: int) -> tuple[int, ...]:
    """Sizes of a row given without a shape: one free axis left unsized is what the count makes it."""
    unknown = [axis for axis, size in enumerate(sizes) if size is None]
    if not unknown:
        return tuple(int(s) for s in sizes)
    known = math.prod(s for s in sizes if s is not None)
    if len(unknown) > 1 or not known or num_elements % known:
        raise InputDataError(f"{num_elements} elements do not fill the declared {_shape_text(sizes)}; "
                             'give its "shape"')
    return tuple(num_elements // known if s is None else s for s in sizes)


def _elements(tensor: TensorInfo, content: object) -> np.ndarray:
    """The flat elements of one row: from a row-major list or base64 bytes."""
    dtype = numpy_dtype(tensor)
    if isinstance(content, dict):
        if set(content) != {"b64"} or not isinstance(content["b64"], str):
            raise InputDataError('binary content must be {"b64": "<base64 text>"}')
        try:
            raw = base64.b64decode(content["b64"], validate=True)
        except binascii.Error as err:
            raise InputDataError(f"b64 is not base64: {err}") from None
        if dtype == np.object_:
            try:
                return deserialize_bytes_tensor(raw)
            except struct.error:
                raise InputDataError("b64 BYTES content must be elements each prefixed by a 4-byte length") from None
        if len(raw) % dtype.itemsize:
            raise InputDataError(f"b64 holds {len(raw)} bytes, not a whole number of {tensor.type_name} "
                                 f"elements ({dtype.itemsize} bytes each)")
        return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)
    if not isinstance(content, list):
        raise InputDataError(f"content must be a flat list or {{\"b64\": ...}}, got {type(content).__name__}")
    return _from_list(tensor, dtype, content)


def _from_list(tensor: TensorInfo, dtype: np.dtype, values: list) -> np.ndarray:
    if dtype == np.object_:
        wrong = next((v for v in values if not isinstance(v, str)), None)
        if wrong is not None:
            raise InputDataError(f"{tensor.type_name} elements must be strings, got {wrong!r}")
        return np.array([v.encode() for v in values], dtype=object)
    if dtype == np.bool_:
        accepted, what = (bool,), "true or false"
    elif np.issubdtype(dtype, np.integer):
        accepted, what = (int,), "integers"
    else:
        accepted, what = (int, float), "numbers"
    wrong = next((v for v in values if type(v) not in accepted), None)
    if wrong is not None:
        raise InputDataError(f"{tensor.type_name} elements must be {what} in a flat list, got {wrong!r}")
    if np.issubdtype(dtype, np.integer) and values:
        info = np.iinfo(dtype)
        out = next((v for v in values if not info.min <= v <= info.max), None)
        if out is not None:
            raise InputDataError(f"{out} is outside {tensor.type_name}'s range [{info.min}, {info.max}]")
    return np.array(values, dtype=dtype)


def batch_inputs(samples: Sequence[Mapping[str, np.ndarray]], batch_size: int,
                 start: int = 0) -> dict[str, np.ndarray]:
    """A batch of `batch_size` rows taken from `samples` in turn, from sample `start` on and
    round again from the first (perf_analyzer's round-robin): name -> rows stacked."""
    if not samples:
        raise InputDataError("no samples to batch")
    if batch_size < 1:
        raise InputDataError(f"batch size must be >= 1, got {batch_size}")
    picked = [(start + i) % len(samples) for i in range(batch_size)]
    batch = {}
    for name in samples[0]:
        first = samples[picked[0]][name]
        for index in picked[1:]:
            if samples[index][name].shape != first.shape:
                raise InputDataError(
                    f"samples {picked[0]} and {index} give {name} shapes {list(first.shape)} and "
                    f"{list(samples[index][name].shape)}: samples of different free-axis lengths cannot share "
                    "a batch (use batch size 1, or samples of one length)")
        batch[name] = np.stack([samples[index][name] for index in picked])
    return batch


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if size is None else str(size) for size in shape) + "]"
