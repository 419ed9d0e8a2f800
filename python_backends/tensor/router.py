"""The router of a `tensor` model: check a request's tensors, pick the bucket of its variable
axis, pad to it and plan the chunks the bucket models serve; put their outputs back together.

A tensor model is any ONNX graph with a free batch axis. Its inputs are declared (name, Triton
data type, the dims after the batch axis with -1 where free, and for each input that carries
the variable axis a padding value). With a declared variable axis (an audio length, an image
width; an index into the dims after the batch axis) the bucket models are `<prefix><length>`,
one per length on that axis, and a request goes to the smallest that holds it, padded with each
input's pad value, as a text goes to the smallest token bucket: short inputs never pay for long
ones. The graph must make padding harmless itself (a frame mask, as the audio model's); the
router only pads. Without a variable axis there is one bucket model, `<prefix>fixed` (or the
model `fixed_model` names: an external model of the user's own repository), and dynamic
batching alone.

One request is one array per input, so all its rows share one length on the variable axis and
the whole request goes to one bucket, cut into chunks of the bucket model's max batch.
Outputs come back as the bucket models give them: an output with a free axis keeps the
bucket's length there (the router does not cut it back).

The service calls `TensorRouter.prepare` (after it has parsed the request options), sends each
`PreparedChunk` to its bucket model over BLS, and passes the per-chunk outputs to
`TensorRouter.reassemble`. Pure: numpy in, numpy out, no Triton imports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import numpy as np
from pydantic import PlainSerializer, PlainValidator, ValidationInfo, model_validator

from python_backends.common.errors import InvalidInput
from python_backends.common.params import AuthParameter, ModelParameters, PositiveInt, TenantsParameter
from python_backends.common.quotas import UNLIMITED, TenantPolicy
from python_backends.common.regimes import LingerRegimes, RegimesParameter
from python_backends.common.tenant_auth import AUTH_OFF, AuthConfig
from python_backends.embed.admission import ADMIT_ALL, AdmissionPolicy
from python_backends.embed.buckets import Chunk, choose_bucket, reassemble
from python_backends.embed.inline import InlineParameter, InlinePolicy, check_inline
from python_backends.embed.pooling import pad_axis
from python_backends.embed.router import (
    DEFAULT_ROUTING_FILE,
    AdmissionParameter,
    BucketMaxBatch,
    PreparedChunk,
    PreparedRequest,
    RequestOptions,
    RoutingFile,
    VersionWeights,
    check_regimes,
)
from python_backends.embed.routing import RoutingTable

# The bucket key of a model without a variable axis: its one bucket model, its row cost in
# the admission policy, its max batch in `bucket_max_batch`, its metric label.
FIXED_BUCKET = 0
FIXED_SUFFIX = "fixed"  # that bucket model's name: <prefix>fixed
NO_VARIABLE_AXIS = -1  # parameter variable_axis when the model has none

# Triton data type -> numpy dtype: the types a tensor model's inputs and outputs may have.
# BF16 has no numpy dtype and a string tensor cannot be padded: neither is served here.
TRITON_TO_NUMPY = {
    "TYPE_BOOL": np.dtype(np.bool_),
    "TYPE_UINT8": np.dtype(np.uint8),
    "TYPE_UINT16": np.dtype(np.uint16),
    "TYPE_UINT32": np.dtype(np.uint32),
    "TYPE_UINT64": np.dtype(np.uint64),
    "TYPE_INT8": np.dtype(np.int8),
    "TYPE_INT16": np.dtype(np.int16),
    "TYPE_INT32": np.dtype(np.int32),
    "TYPE_INT64": np.dtype(np.int64),
    "TYPE_FP16": np.dtype(np.float16),
    "TYPE_FP32": np.dtype(np.float32),
    "TYPE_FP64": np.dtype(np.float64),
}
_NUMPY_TO_TRITON = {dtype: name for name, dtype in TRITON_TO_NUMPY.items()}


def triton_type(name: str) -> str:
    """`TYPE_FP32` from `TYPE_FP32` or `FP32`; ValueError for a type a tensor model cannot take."""
    full = name if name.startswith("TYPE_") else f"TYPE_{name}"
    if full not in TRITON_TO_NUMPY:
        raise ValueError(f"data type {name!r} is not one of {', '.join(t[5:] for t in TRITON_TO_NUMPY)}")
    return full


def type_name(dtype: np.dtype) -> str:
    """How Triton's clients name a numpy dtype (FP32, INT64, BYTES...), for error messages."""
    if dtype == np.dtype(object) or dtype.kind in "SU":
        return "BYTES"
    full = _NUMPY_TO_TRITON.get(dtype)
    return full[5:] if full else str(dtype)


def _pad_fits(value: object, dtype: np.dtype) -> bool:
    """Whether `value` is a number `dtype` holds exactly (0.5 is no INT64 pad, -1 no UINT8 one)."""
    if dtype == np.bool_:
        return value in (0, 1) and not isinstance(value, float)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if dtype.kind == "f":
        return True
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return False
    limits = np.iinfo(dtype)
    return limits.min <= int(value) <= limits.max


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a tensor model, as the router and its bucket models take it."""

    name: str  # the graph's own tensor name, which is also the Triton tensor name
    data_type: str  # Triton data type, e.g. TYPE_FP32
    dims: tuple[int, ...]  # the shape after the batch axis; -1 where free
    pad_value: float | int | None = None  # what pads the variable axis (inputs that carry it)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tensor needs a name")
        object.__setattr__(self, "data_type", triton_type(self.data_type))
        dims = tuple(self.dims)
        if any(isinstance(size, bool) or not isinstance(size, int | np.integer) or (size < 1 and size != -1)
               for size in dims):
            raise ValueError(f"tensor '{self.name}': dims must be sizes >= 1 or -1 (free), got {list(dims)}")
        object.__setattr__(self, "dims", tuple(int(size) for size in dims))
        if self.pad_value is not None and not _pad_fits(self.pad_value, self.dtype):
            raise ValueError(f"tensor '{self.name}': pad {self.pad_value!r} does not fit {self.type_name}")

    @property
    def dtype(self) -> np.dtype:
        return TRITON_TO_NUMPY[self.data_type]

    @property
    def type_name(self) -> str:
        return self.data_type[5:]

    @property
    def shape_text(self) -> str:
        """The full shape as a client sees it, batch axis first: `[-1, -1, 40]`."""
        return str([-1, *self.dims])

    def has_axis(self, axis: int | None) -> bool:
        """Whether this tensor carries the variable axis `axis` (a free dim there)."""
        return axis is not None and axis < len(self.dims) and self.dims[axis] == -1

    def to_json(self) -> dict[str, object]:
        entry: dict[str, object] = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        if self.pad_value is not None:
            entry["pad"] = self.pad_value
        return entry


def bucket_model_name(prefix: str, bucket_len: int) -> str:
    """The bucket model of a length on the variable axis (`<prefix><len>`), or the one bucket
    model of a tensor model without a variable axis (`<prefix>fixed`, key FIXED_BUCKET)."""
    return f"{prefix}{FIXED_SUFFIX if bucket_len == FIXED_BUCKET else bucket_len}"


def validate_axis_buckets(bucket_lens: Sequence[int]) -> tuple[int, ...]:
    """The lengths on a variable axis, ascending; ValueError when unusable. Unlike token
    buckets a length of 1 is fine: no special tokens need room."""
    if not bucket_lens:
        raise ValueError("at least one bucket length is required with a variable axis")
    for length in bucket_lens:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"bucket lengths must be integers >= 1, got {length!r}")
    ordered = tuple(sorted(bucket_lens))
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"bucket lengths must be distinct, got {list(bucket_lens)}")
    return ordered


@dataclass(frozen=True)
class TensorRouterConfig:
    """Settings of a tensor model's router, read from its config.pbtxt `parameters`
    (`TensorRouterParameters`). The field names the service reads are those of the embed
    router's `RouterConfig`."""

    inputs: tuple[TensorSpec, ...]  # what a request sends, in the order errors check them
    outputs: tuple[TensorSpec, ...]  # what the bucket models answer, and the router with them
    variable_axis: int | None = None  # index into the dims after the batch axis; None: no bucketing
    bucket_lens: tuple[int, ...] = (FIXED_BUCKET,)  # lengths on the variable axis, ascending; (0,) without one
    bucket_max_batch: Mapping[int, int] = field(default_factory=lambda: {FIXED_BUCKET: 1})  # bucket -> max batch
    encoder_prefix: str = "encoder_"  # bucket model name = prefix + length, or prefix + "fixed"
    fixed_model: str = ""  # the one bucket's model when it is not prefix + "fixed" (an external model)
    default_routing: RoutingTable = field(default_factory=lambda: RoutingTable({1: 1.0}))  # split with no routing file
    routing_file: str = DEFAULT_ROUTING_FILE  # the live split, relative to the model's folder unless absolute
    tenants: TenantPolicy = UNLIMITED  # tiers and quotas of tenants (spec [tenants])
    admission: AdmissionPolicy = ADMIT_ALL  # how much work may be in flight (derived from the profile)
    auth: AuthConfig = AUTH_OFF  # how a request proves its tenant (spec [tenants.auth])
    max_concurrent_requests: int = 32  # requests one instance serves at once (its worker threads)
    linger_regimes: LingerRegimes | None = None  # when the express model serves lingering buckets; None: never
    inline: InlinePolicy = field(default_factory=InlinePolicy)  # how long a call served on execute's thread may take

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        for what, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [spec.name for spec in specs]
            if not names:
                raise ValueError(f"a tensor model needs at least one of its {what}")
            if len(set(names)) != len(names):
                raise ValueError(f"{what} names must be distinct, got {names}")
        axis = self.variable_axis
        if self.fixed_model and axis is not None:
            raise ValueError(f"fixed_model {self.fixed_model!r} names the one bucket of a model without a variable "
                             f"axis; this one is bucketed along axis {axis}")
        if axis is None:
            if tuple(self.bucket_lens) != (FIXED_BUCKET,):
                raise ValueError(f"bucket lengths {list(self.bucket_lens)} need a variable axis; "
                                 "a model without one has a single bucket")
        else:
            if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
                raise ValueError(f"variable axis must be an index >= 0 into the dims after the batch axis, "
                                 f"got {axis!r}")
            object.__setattr__(self, "bucket_lens", validate_axis_buckets(list(self.bucket_lens)))
            carriers = self.carriers
            if not carriers:
                raise ValueError(f"no input has a free dim (-1) at variable axis {axis}: "
                                 + ", ".join(f"{spec.name} {list(spec.dims)}" for spec in self.inputs))
            for spec in carriers:
                if spec.pad_value is None:
                    raise ValueError(f"input '{spec.name}' carries variable axis {axis} but declares no pad value")
        missing = [bucket for bucket in self.bucket_lens if bucket not in self.bucket_max_batch]
        if missing:
            hint = " (a model without a variable axis has the one bucket 0: '0:N')" if FIXED_BUCKET in missing else ""
            raise ValueError(f"bucket_max_batch has no limit for buckets {missing}{hint}")
        for bucket in self.bucket_lens:
            if self.bucket_max_batch[bucket] < 1:
                raise ValueError(f"bucket_max_batch for bucket {bucket} must be >= 1")
        if self.fixed_model and self.linger_regimes is not None:
            raise ValueError(f"parameter linger_regimes: the external model {self.fixed_model!r} has no express model "
                             "(its backend is the user's)")
        buckets = [self.model_for(bucket) for bucket in self.bucket_lens]
        check_regimes(self.linger_regimes, buckets)
        check_inline(self.inline, buckets + ([self.linger_regimes.express] if self.linger_regimes else []))

    @property
    def carriers(self) -> tuple[TensorSpec, ...]:
        """The inputs that carry the variable axis (padded to the bucket); the rest pass through."""
        return tuple(spec for spec in self.inputs if spec.has_axis(self.variable_axis))

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    @property
    def max_length(self) -> int:
        """The longest variable axis a request may have (the largest bucket)."""
        return self.bucket_lens[-1]

    def model_for(self, bucket_len: int) -> str:
        if bucket_len == FIXED_BUCKET and self.fixed_model:
            return self.fixed_model
        return bucket_model_name(self.encoder_prefix, bucket_len)

    def bucket_dims(self, spec: TensorSpec, bucket_len: int) -> tuple[int, ...]:
        """An input's dims in the config of bucket `bucket_len`: the variable axis fixed to the
        bucket's length where the input carries it, everything else as declared."""
        if not spec.has_axis(self.variable_axis):
            return spec.dims
        dims = list(spec.dims)
        dims[self.variable_axis] = bucket_len
        return tuple(dims)


# --- config parameters ------------------------------------------------------------------------

INPUTS_REQUIRED = ("parameter inputs is required: a JSON list of "
                   '{"name", "data_type", "dims", "pad"} (e.g. [{"name": "features", "data_type": "TYPE_FP32", '
                   '"dims": [-1, 40], "pad": 0}])')
OUTPUTS_REQUIRED = 'parameter outputs is required: a JSON list of {"name", "data_type", "dims"}'
_ENTRY_KEYS = {"inputs": ("name", "data_type", "dims", "pad"), "outputs": ("name", "data_type", "dims")}


def _parse_specs(value: object, info: ValidationInfo) -> tuple[TensorSpec, ...]:
    """A JSON list of tensor entries (or the specs themselves); errors name the entry."""
    what = info.field_name
    if isinstance(value, list | tuple) and all(isinstance(spec, TensorSpec) for spec in value):
        return tuple(value)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"parameter {what} is not JSON: {err}") from None
    if not isinstance(value, list):
        raise ValueError(f"parameter {what} must be a JSON list of tensors, got {value!r}")
    specs = []
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ValueError(f"parameter {what} entry {index} is not an object: {entry!r}")
        unknown = sorted(set(entry) - set(_ENTRY_KEYS[what]))
        missing = [key for key in ("name", "data_type", "dims") if key not in entry]
        if unknown or missing:
            raise ValueError(f"parameter {what} entry {index} has "
                             + (f"unknown keys {unknown}" if unknown else f"no {', '.join(missing)}")
                             + f"; the keys are {', '.join(_ENTRY_KEYS[what])}")
        if not isinstance(entry["dims"], list) or not isinstance(entry["name"], str):
            raise ValueError(f"parameter {what} entry {index}: name must be a string and dims a list")
        try:
            specs.append(TensorSpec(entry["name"], str(entry["data_type"]), tuple(entry["dims"]), entry.get("pad")))
        except ValueError as err:
            raise ValueError(f"parameter {what} entry {index}: {err}") from None
    return tuple(specs)


def _parse_axis(value: object) -> int:
    try:
        axis = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value))
    except ValueError:
        raise ValueError(f"parameter variable_axis={value!r} is not an integer") from None
    if axis < NO_VARIABLE_AXIS:
        raise ValueError(f"parameter variable_axis={axis} must be >= 0, or -1 for none")
    return axis


def _parse_axis_buckets(value: object) -> tuple[int, ...]:
    if not isinstance(value, str):
        return tuple(value)
    try:
        return tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"parameter bucket_lens={value!r} is not a comma list of lengths") from None


TensorSpecs = Annotated[tuple[TensorSpec, ...], PlainValidator(_parse_specs),
                        PlainSerializer(lambda specs: json.dumps([spec.to_json() for spec in specs]), return_type=str)]
VariableAxis = Annotated[int, PlainValidator(_parse_axis), PlainSerializer(str, return_type=str)]
AxisBucketLens = Annotated[tuple[int, ...], PlainValidator(_parse_axis_buckets),
                           PlainSerializer(lambda lens: ",".join(str(b) for b in lens), return_type=str)]


class TensorRouterParameters(ModelParameters):
    """A tensor model router's config.pbtxt parameters (gen-config writes them through this class)."""

    required_help: ClassVar[Mapping[str, str]] = {"inputs": INPUTS_REQUIRED, "outputs": OUTPUTS_REQUIRED}

    inputs: TensorSpecs  # JSON list of {name, data_type, dims (after the batch axis), pad}
    outputs: TensorSpecs  # JSON list of {name, data_type, dims}
    variable_axis: VariableAxis = NO_VARIABLE_AXIS  # index into the dims after the batch axis; -1: none
    bucket_lens: AxisBucketLens = ()  # lengths on the variable axis; empty without one
    bucket_max_batch: BucketMaxBatch = {}  # bucket length -> its model's max_batch_size; `0:N` without an axis
    encoder_prefix: str = "encoder_"  # bucket model name = prefix + length, or prefix + "fixed"
    fixed_model: str = ""  # the one bucket's model, when not prefix + "fixed" (an external model)
    version_weights: VersionWeights = RoutingTable({1: 1.0})  # the split when there is no routing file
    routing_file: RoutingFile = DEFAULT_ROUTING_FILE  # the live split, relative to the model's folder
    tenants: TenantsParameter = UNLIMITED  # tiers and quotas of tenants
    admission: AdmissionParameter = ADMIT_ALL  # how much work may be in flight
    tenant_auth: AuthParameter = AUTH_OFF  # how a request proves its tenant
    max_concurrent_requests: PositiveInt = 32  # requests one instance serves at once
    linger_regimes: RegimesParameter = None  # JSON: when the express model serves the lingering buckets
    inline_max_ms: InlineParameter = InlinePolicy()  # JSON: each target's limit on a call served inline

    @model_validator(mode="after")
    def _consistent(self) -> TensorRouterParameters:
        if self.variable_axis == NO_VARIABLE_AXIS and self.bucket_lens:
            raise ValueError(f"parameter bucket_lens={','.join(map(str, self.bucket_lens))} needs a variable_axis; "
                             "leave it empty for a model without one")
        config = self.router_config()  # the config's own checks
        no_cost = sorted(set(config.bucket_lens) - set(self.admission.row_cost_ms))
        if self.admission.max_work_ms > 0 and no_cost:
            raise ValueError(f"parameter admission has no row cost for buckets {no_cost}")
        return self

    def router_config(self) -> TensorRouterConfig:
        axis = None if self.variable_axis == NO_VARIABLE_AXIS else self.variable_axis
        return TensorRouterConfig(
            inputs=self.inputs, outputs=self.outputs, variable_axis=axis,
            bucket_lens=self.bucket_lens if axis is not None else (FIXED_BUCKET,),
            bucket_max_batch=self.bucket_max_batch, encoder_prefix=self.encoder_prefix, fixed_model=self.fixed_model,
            default_routing=self.version_weights, routing_file=self.routing_file, tenants=self.tenants,
            admission=self.admission, auth=self.tenant_auth, max_concurrent_requests=self.max_concurrent_requests,
            linger_regimes=self.linger_regimes, inline=self.inline_max_ms)


def parse_tensor_router_config(model_name: str, parameters: Mapping[str, str]) -> TensorRouterConfig:
    """Build the router config from config.pbtxt string parameters; errors name the model."""
    return TensorRouterParameters.from_parameters(model_name, parameters).router_config()


# --- requests -----------------------------------------------------------------------------------


def num_padded_positions(chunk: Chunk) -> int:
    """Positions a chunk sends on the variable axis, padding included (rows x bucket length);
    rows for the fixed bucket. With `PreparedChunk.num_real_tokens` it gives the padding share."""
    return len(chunk.row_indices) * (chunk.bucket_len if chunk.bucket_len != FIXED_BUCKET else 1)


class TensorRouter:
    """Turns a request's tensors into bucket chunks and the chunks' outputs into the answer."""

    def __init__(self, config: TensorRouterConfig):
        self.config = config

    def prepare(self, tensors: Mapping[str, np.ndarray], options: RequestOptions | None = None) -> PreparedRequest:
        """Check a request's tensors (InvalidInput naming the input otherwise), pad the variable
        axis to the smallest bucket that holds it and cut the rows into the bucket's max batch.

        `token_counts` of the result holds each row's length on the variable axis (1 per row
        without one), `num_real_tokens` of a chunk the sum of those over its rows.
        """
        config = self.config
        arrays = self._checked(tensors)
        num_rows = int(arrays[config.inputs[0].name].shape[0])
        length = self._length(arrays)
        if length is None:
            bucket, padded = FIXED_BUCKET, arrays
        else:
            bucket = choose_bucket(length, config.bucket_lens)
            axis = config.variable_axis + 1  # the request's arrays have the batch axis first
            padded = {spec.name: pad_axis(arrays[spec.name], axis, bucket, spec.pad_value)
                      if spec.has_axis(config.variable_axis) else arrays[spec.name] for spec in config.inputs}
        # All rows share one length, so the plan is consecutive slices of one bucket (what
        # `buckets.plan_chunks` would give, which also has no key for the fixed bucket).
        limit = config.bucket_max_batch[bucket]
        row_length = 1 if length is None else length
        chunks = []
        for start in range(0, num_rows, limit):
            stop = min(start + limit, num_rows)
            chunks.append(PreparedChunk(
                chunk=Chunk(bucket, tuple(range(start, stop))),
                model_name=config.model_for(bucket),
                tensors={name: np.ascontiguousarray(array[start:stop]) for name, array in padded.items()},
                num_real_tokens=(stop - start) * row_length,
            ))
        return PreparedRequest(options=options if options is not None else RequestOptions(),
                               token_counts=np.full(num_rows, row_length, dtype=np.int32),
                               num_truncated=0, chunks=chunks)

    def reassemble(self, prepared: PreparedRequest,
                   chunk_outputs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Every output in the request's row order: `chunk_outputs[k]` holds the outputs (by name)
        the bucket model gave for `prepared.chunks[k]`."""
        if len(chunk_outputs) != len(prepared.chunks):
            raise ValueError(f"{len(prepared.chunks)} chunks but {len(chunk_outputs)} answers")
        for prepared_chunk, outputs in zip(prepared.chunks, chunk_outputs, strict=True):
            missing = [name for name in self.config.output_names if name not in outputs]
            if missing:
                raise ValueError(f"bucket model {prepared_chunk.model_name} returned no output {missing}")
        num_rows = len(prepared.token_counts)
        return {name: reassemble(num_rows, prepared.chunk_plan, [outputs[name] for outputs in chunk_outputs])
                for name in self.config.output_names}

    def _checked(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The request's arrays by input name, each of the declared dtype and shape, all with the
        same number of rows (at least one)."""
        config = self.config
        takes = ", ".join(f"'{spec.name}'" for spec in config.inputs)
        for spec in config.inputs:
            if spec.name not in tensors:
                raise InvalidInput(f"missing input '{spec.name}'; this model takes {takes}")
        unknown = sorted(set(tensors) - {spec.name for spec in config.inputs})
        if unknown:
            raise InvalidInput(f"unknown input '{unknown[0]}'; this model takes {takes}")
        arrays = {}
        for spec in config.inputs:
            array = np.asarray(tensors[spec.name])
            if array.dtype != spec.dtype:
                raise InvalidInput(f"input '{spec.name}' has data type {type_name(array.dtype)}; "
                                   f"the model takes {spec.type_name}")
            if array.ndim != len(spec.dims) + 1:
                raise InvalidInput(f"input '{spec.name}' has shape {list(array.shape)}; the model takes "
                                   f"{spec.shape_text} (rank {len(spec.dims) + 1})")
            for axis, size in enumerate(spec.dims, start=1):
                if size != -1 and array.shape[axis] != size:
                    raise InvalidInput(f"input '{spec.name}' has size {array.shape[axis]} on axis {axis}; "
                                       f"the model takes {size} there (shape {spec.shape_text})")
            arrays[spec.name] = array
        first, *others = config.inputs
        num_rows = arrays[first.name].shape[0]
        for spec in others:
            if arrays[spec.name].shape[0] != num_rows:
                raise InvalidInput(f"inputs disagree on the row count: '{first.name}' has {num_rows} rows, "
                                   f"'{spec.name}' {arrays[spec.name].shape[0]}")
        if num_rows == 0:
            raise InvalidInput(f"input '{first.name}' has no rows; send at least one")
        return arrays

    def _length(self, arrays: Mapping[str, np.ndarray]) -> int | None:
        """The request's length on the variable axis (None without one), checked against the buckets."""
        config = self.config
        if config.variable_axis is None:
            return None
        axis = config.variable_axis + 1
        first, *others = config.carriers
        length = int(arrays[first.name].shape[axis])
        for spec in others:
            if arrays[spec.name].shape[axis] != length:
                raise InvalidInput(f"inputs disagree on the length of axis {axis}: '{first.name}' has {length}, "
                                   f"'{spec.name}' {arrays[spec.name].shape[axis]}")
        if length == 0:
            raise InvalidInput(f"input '{first.name}' has size 0 on axis {axis}; send at least one position")
        if length > config.max_length:
            raise InvalidInput(f"input '{first.name}' has size {length} on axis {axis}; "
                               f"the limit is {config.max_length}")
        return length
