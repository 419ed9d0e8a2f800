"""Where a bucketed model's versions come from, and what graph its bucket models run.

A version's `source` in the serving spec is an ONNX file, a Hugging Face folder
(config.json, safetensors weights, tokenizer.json) or `package:<module>`, a folder a pip
package ships (the built-in MiniLM). `served_graph` says what the bucket models of a model
run and what they answer, from the spec and the source, without loading weights:

- from a Hugging Face folder the kit exports the graph itself (build-models), folding the
  encoder's pooling and normalisation into it: the graph answers `embedding` (or a
  classifier's `logits`) and the backend passes it through;
- an ONNX file is the user's graph as it is: its signature is read (`graph.read_graph`), the
  spec's input names are checked against it, and a per-token output ([rows, tokens, width])
  is pooled by the backend with the spec's pooling.

A tensor model's source is an ONNX file; `served_tensors` reads its inputs and outputs (types,
dims after the batch axis with -1 where free) and checks them against the declared variable
axis and padding values.

An external model lives in the user's own Triton repository; `served_external` reads its
config.pbtxt (its tensors, batch axis and version folders), since there is no graph to read.

Every version of a model must agree on that (the bucket models' parameters hold for all their
versions). Errors are `SourceError`, one line naming the spec's model and the file or field.
Reads files; decides nothing about batching.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from python_backends.embed.kinds import INPUT_IDS, TOKEN_TYPE_IDS, ModelKind
from python_backends.embed.pooling import Pooling
from python_backends.tensor.router import TensorSpec
from tools.repository.external import ExternalConfigError, parse_config
from tools.repository.graph import GraphError, TensorInfo, read_graph
from tools.spec.serving import PACKAGE_SOURCE, BucketedModelSpec

HF_OUTPUTS = {ModelKind.TEXT_ENCODER: "embedding", ModelKind.TEXT_CLASSIFIER: "logits"}  # the kit's exports
HF_INPUTS = {INPUT_IDS: "input_ids", "ATTENTION_MASK": "attention_mask", TOKEN_TYPE_IDS: "token_type_ids"}


class SourceError(ValueError):
    """A model's source cannot be served as the spec says; the message names the model and the file."""


@dataclass(frozen=True)
class ServedGraph:
    """What every bucket model of one spec model runs and answers."""

    exported: bool  # build-models exports the graph from a Hugging Face folder (else: the user's ONNX file)
    onnx_inputs: dict[str, str]  # the kit's input tensor -> the graph's input name
    onnx_output: str  # the graph output read
    pooling: Pooling  # applied by the backend (none when the graph pools)
    normalize: bool  # applied by the backend
    output_dim: int  # width of one answered row (embedding size, or number of logits)


def resolve(source: str, root: Path) -> Path:
    """The file or folder a source names: `package:<module>` is the folder the installed module
    ships its model in (its `get_model_path()`, else the module's own folder); a path is taken
    relative to `root` (the spec's folder)."""
    if not source.startswith(PACKAGE_SOURCE):
        return (root / source).resolve()
    module_name = source[len(PACKAGE_SOURCE):].strip()
    if importlib.util.find_spec(module_name) is None:
        raise SourceError(f"source {source!r}: the package module {module_name!r} is not installed")
    module = importlib.import_module(module_name)
    if hasattr(module, "get_model_path"):
        return Path(module.get_model_path())
    return Path(module.__file__).parent


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def tokenizer_path(model: BucketedModelSpec, version: int | None = None) -> Path:
    """The tokenizer.json the router tokenizes with: the spec's, else the source folder's."""
    if model.tokenizer is not None:
        return model.tokenizer
    version = model.versions[0] if version is None else version
    path = resolve(model.source_of(version), model.root)
    if is_hf_folder(path):
        return path / "tokenizer.json"
    raise SourceError(f"[models.{model.name}]: version {version}'s source {path.name} is an ONNX file; name its "
                      "tokenizer.json with `tokenizer`")


def _hf_graph(model: BucketedModelSpec, path: Path) -> ServedGraph:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SourceError(f"[models.{model.name}]: {path / 'config.json'} cannot be read: {err}") from None
    if model.kind is ModelKind.TEXT_ENCODER:
        if model.pooling is Pooling.NONE:
            raise SourceError(f"[models.{model.name}]: {path} is a Hugging Face encoder whose output has one vector "
                              "per token; set pooling (mean, cls or last) to serve one vector per row")
        dim = config.get("hidden_size") or config.get("d_model")
    else:
        labels = config.get("id2label") or {}
        dim = config.get("num_labels") or len(labels) or None
    if not isinstance(dim, int) or dim < 1:
        raise SourceError(f"[models.{model.name}]: {path / 'config.json'} gives no output width "
                          f"({'hidden_size' if model.kind is ModelKind.TEXT_ENCODER else 'num_labels / id2label'})")
    inputs = {tensor: HF_INPUTS[tensor] for tensor in model.onnx_inputs}
    return ServedGraph(exported=True, onnx_inputs=inputs, onnx_output=HF_OUTPUTS[model.kind], pooling=Pooling.NONE,
                       normalize=False, output_dim=dim)


def _onnx_graph(model: BucketedModelSpec, path: Path) -> ServedGraph:
    where = f"[models.{model.name}]"
    try:
        graph = read_graph(path)
        graph.verify_batchable()
        for name in model.onnx_inputs.values():
            graph.input(name)
        output = graph.output(model.onnx_output) if model.onnx_output else None
    except GraphError as err:
        raise SourceError(f"{where}: {err}") from None
    if output is None:
        if len(graph.outputs) != 1:
            raise SourceError(f"{where}: {path.name} has outputs {[t.name for t in graph.outputs]}; name the one to "
                              "serve with `output`")
        output = graph.outputs[0]
    extra = sorted({t.name for t in graph.inputs} - set(model.onnx_inputs.values()))
    if extra:
        raise SourceError(f"{where}: {path.name} also takes inputs {extra}, which the spec's [inputs] does not map "
                          "(ids, mask, token_types)")
    per_token = len(output.shape) == 3
    if model.kind is ModelKind.TEXT_ENCODER and per_token and model.pooling is Pooling.NONE:
        raise SourceError(f"{where}: output {output.name!r} of {path.name} has one vector per token "
                          f"{list(output.shape)}; set pooling (mean, cls or last)")
    if not per_token and model.pooling is not Pooling.NONE:
        raise SourceError(f"{where}: pooling {model.pooling.value!r} needs a per-token output [rows, tokens, width]; "
                          f"{output.name!r} of {path.name} is {list(output.shape)} (set pooling = \"none\")")
    if len(output.shape) not in (2, 3) or output.shape[-1] is None:
        raise SourceError(f"{where}: output {output.name!r} of {path.name} has shape {list(output.shape)}; a "
                          f"{model.kind.value} needs [rows, width] (or [rows, tokens, width]) with a fixed width")
    return ServedGraph(exported=False, onnx_inputs=dict(model.onnx_inputs), onnx_output=output.name,
                       pooling=model.pooling, normalize=model.normalize, output_dim=int(output.shape[-1]))


def served_graph(model: BucketedModelSpec) -> ServedGraph:
    """What the model's bucket models run (one answer for all its versions)."""
    graphs = {}
    for version in model.versions:
        path = resolve(model.source_of(version), model.root)
        if is_hf_folder(path):
            graph = _hf_graph(model, path)
        elif path.is_file():
            graph = _onnx_graph(model, path)
        else:
            raise SourceError(f"[models.{model.name}]: source of version {version} ({model.source_of(version)}) "
                              f"is neither an ONNX file nor a Hugging Face folder: {path} "
                              f"{'has no config.json' if path.is_dir() else 'does not exist'}")
        graphs[version] = graph
    first = graphs[model.versions[0]]
    for version, graph in graphs.items():
        if graph != first:
            raise SourceError(f"[models.{model.name}]: version {version} serves {graph}, version "
                              f"{model.versions[0]} {first}; every version of a model must take the same inputs "
                              "and answer the same output (add a model under another name instead)")
    if model.kind is ModelKind.TEXT_CLASSIFIER and model.labels and len(model.labels) != first.output_dim:
        raise SourceError(f"[models.{model.name}]: {len(model.labels)} labels for a graph with "
                          f"{first.output_dim} logits")
    return first


@dataclass(frozen=True)
class TensorGraph:
    """What a tensor model's router takes and its bucket models answer (the graph's own tensors)."""

    inputs: tuple[TensorSpec, ...]  # dims after the batch axis, -1 where free; pad values declared
    outputs: tuple[TensorSpec, ...]


def _spec(tensor: TensorInfo, pad: float | None = None) -> TensorSpec:
    dims = tuple(-1 if size is None else int(size) for size in tensor.shape[1:])
    return TensorSpec(tensor.name, tensor.type_name, dims, pad)


def _tensor_graph(model: BucketedModelSpec, path: Path) -> TensorGraph:
    where = f"[models.{model.name}]"
    if not path.is_file() or path.suffix != ".onnx":
        raise SourceError(f"{where}: a tensor model's source is an ONNX file; {path} is not one")
    try:
        graph = read_graph(path)
        graph.verify_batchable()
    except GraphError as err:
        raise SourceError(f"{where}: {err}") from None
    axis = model.variable_axis
    unknown = sorted(set(model.pad) - {t.name for t in graph.inputs})
    if unknown:
        raise SourceError(f"{where}: pad names inputs {unknown} that {path.name} does not have "
                          f"(its inputs: {[t.name for t in graph.inputs]})")
    inputs = []
    for tensor in graph.inputs:
        spec = _spec(tensor)
        free = [i for i, size in enumerate(spec.dims) if size == -1]
        carries = axis is not None and axis in free
        if [i for i in free if i != axis]:
            raise SourceError(f"{where}: input {tensor.name!r} of {path.name} has free axes {free} (after the batch "
                              f"axis){'' if axis is None else f' besides the variable axis {axis}'}; requests of "
                              "different shapes never batch: declare it as variable_axis, or export the graph "
                              "with a fixed size there")
        if carries and tensor.name not in model.pad:
            raise SourceError(f"{where}: input {tensor.name!r} carries the variable axis {axis}; give its padding "
                              f"value in pad (e.g. pad = {{ {tensor.name} = 0.0 }})")
        if not carries and tensor.name in model.pad:
            raise SourceError(f"{where}: pad gives a value for {tensor.name!r}, which has no free axis "
                              f"{axis} to pad")
        try:
            inputs.append(_spec(tensor, model.pad.get(tensor.name)) if carries else spec)
        except ValueError as err:
            raise SourceError(f"{where}: input {tensor.name!r}: {err}") from None
    if axis is not None and not any(spec.has_axis(axis) for spec in inputs):
        raise SourceError(f"{where}: no input of {path.name} has a free axis {axis} (after the batch axis) to "
                          f"bucket: {', '.join(f'{t.name} {list(t.shape)}' for t in graph.inputs)}")
    try:
        outputs = tuple(_spec(tensor) for tensor in graph.outputs)
    except ValueError as err:
        raise SourceError(f"{where}: {path.name}: {err}") from None
    return TensorGraph(tuple(inputs), outputs)


def served_tensors(model: BucketedModelSpec) -> TensorGraph:
    """A tensor model's inputs and outputs (one answer for all its versions)."""
    graphs = {version: _tensor_graph(model, resolve(model.source_of(version), model.root))
              for version in model.versions}
    first = graphs[model.versions[0]]
    for version, graph in graphs.items():
        if graph != first:
            raise SourceError(f"[models.{model.name}]: version {version} takes or answers other tensors than version "
                              f"{model.versions[0]}; every version of a model must have the same signature")
    return first


@dataclass(frozen=True)
class ExternalModel:
    """A model of the user's own Triton repository as its config.pbtxt declares it."""

    path: Path  # its config.pbtxt
    text: str  # that file's text as it is now
    config: mc.ModelConfig  # the same, parsed
    tensors: TensorGraph  # its inputs and outputs (dims after the batch axis)
    folders: tuple[int, ...]  # its numbered version folders, ascending

    @property
    def backend(self) -> str:
        return self.config.backend or self.config.platform or "?"


def _external_tensors(where: str, path: Path, tensors, what: str) -> tuple[TensorSpec, ...]:
    specs = []
    for tensor in tensors:
        field = f"{what} {tensor.name!r} of {path}"
        if tensor.dims and -1 in tensor.dims:
            raise SourceError(f"{where}: {field} has dims {list(tensor.dims)}; the kit serves an external model whose "
                              "shapes after the batch axis are fixed (requests of different shapes never batch)")
        if what == "input" and (tensor.allow_ragged_batch or tensor.is_shape_tensor):
            raise SourceError(f"{where}: {field} is a ragged or shape tensor, which the kit's router cannot check")
        try:
            specs.append(TensorSpec(tensor.name, mc.DataType.Name(tensor.data_type), tuple(tensor.dims)))
        except ValueError as err:
            raise SourceError(f"{where}: {field}: {err} (the router checks and batches numeric tensors)") from None
    if not specs:
        raise SourceError(f"{where}: {path} declares no {what}; write the model's inputs and outputs there (the kit "
                          "reads them from the config)")
    return tuple(specs)


def served_external(model: BucketedModelSpec) -> ExternalModel:
    """The external model's config, tensors and version folders; SourceError naming the file and
    field when the kit cannot put a router in front of it (a config that does not parse, names
    another model, has no batch axis, or shapes it cannot check; a spec version with no folder)."""
    where = f"[models.{model.name}]"
    folder = model.external_dir
    path = folder / "config.pbtxt"
    try:
        text = path.read_text()
        config = parse_config(text, str(path))
    except OSError as err:
        raise SourceError(f"{where}: {path} cannot be read: {err}") from None
    except ExternalConfigError as err:
        raise SourceError(f"{where}: {err}") from None
    if config.name and config.name != model.external_model:
        raise SourceError(f"{where}: {path}: name {config.name!r} is not its folder's name {model.external_model!r} "
                          "(Triton requires them to match)")
    if config.max_batch_size < 1:
        raise SourceError(f"{where}: {path}: max_batch_size is {config.max_batch_size}: the model has no batch axis, "
                          "so requests cannot be batched; the kit serves a model whose first dimension is the "
                          "batch (max_batch_size >= 1)")
    tensors = TensorGraph(_external_tensors(where, path, config.input, "input"),
                          _external_tensors(where, path, config.output, "output"))
    folders = tuple(sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()))
    missing = [v for v in model.versions if v not in folders]
    if missing:
        raise SourceError(f"{where}: version(s) {missing} of {model.external_model!r} have no folder in {folder} "
                          f"(its versions: {list(folders)})")
    return ExternalModel(path=path, text=text, config=config, tensors=tensors, folders=folders)
