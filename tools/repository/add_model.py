"""Adding a user's model to the kit: what the spec should say about it, read from its files.

`describe_onnx`, `describe_hf` and `describe_external` turn what an ONNX graph's signature, a
Hugging Face folder's config or a Triton model's config.pbtxt says into the model's
`[models.NAME]` table (`describe_llm`: a generative model's folder or GGUF file into its
`[llm_models.NAME]` table), with a note for every value that was read from the model (`inferred`)
and every value the model does not say, chosen by a rule the user should check (`guessed`):
`python -m tools add-model` prints both. `spec_with_model` writes the table into the spec's
text (tomlkit keeps the file's comments), or adds a version to a model that is already there
(`spec_with_version`; `spec_with_external_version` for an external model, whose versions are
folders of the user's repository). Pure but for reading the model's own files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tomlkit
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.embed.kinds import ModelKind
from tools.repository.external import ExternalConfigError, parse_config
from tools.repository.graph import Graph, GraphError, read_graph
from tools.repository.hf_export import HfExportError, inspect_hf_dir

# Graph input names that mean the kit's tensors, most specific first.
IDS_NAMES = ("input_ids", "ids", "input_ids:0", "tokens")
MASK_NAMES = ("attention_mask", "mask", "input_mask", "attention_mask:0")
TYPE_NAMES = ("token_type_ids", "segment_ids", "token_types", "type_ids")
# Graph outputs in order of preference when a graph has several.
ENCODER_OUTPUTS = ("sentence_embedding", "embedding", "embeddings", "pooler_output", "last_hidden_state")
CLASSIFIER_OUTPUTS = ("logits", "scores", "score")
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
DEFAULT_TOLERANCE = 1e-3  # a tensor or external model's drift gate until the user says otherwise
DEFAULT_TABLE = {  # what a new model's service gets until the user says otherwise
    "slo_p95_ms": 200,
    "expected_rps": 20,
    "peak_rps": 50,
    "workload": "loadtest/workloads/embed_mix.toml",
    "max_request_rows": 64,
    "max_router_instances": 8,
    "max_text_bytes": 65536,
}


class AddModelError(ValueError):
    """The model cannot be added as asked; the message names the file or the option."""


@dataclass
class Described:
    """A model's spec table and how each value was found."""

    table: dict[str, object]  # the [models.NAME] keys
    inferred: list[str] = field(default_factory=list)  # "key = value: read from ..."
    guessed: list[str] = field(default_factory=list)  # "key = value: a default; ..."


def _pick(names: Sequence[str], candidates: Sequence[str]) -> str | None:
    lowered = {name.lower(): name for name in names}
    return next((lowered[c] for c in candidates if c in lowered), None)


def buckets_up_to(max_length: int | None) -> list[int]:
    """Powers of two from 16 up to the model's length (256 at most: longer inputs are rare and
    slow; the user adds buckets the traffic needs)."""
    limit = min(max_length or 256, 256)
    buckets = [b for b in DEFAULT_BUCKETS if b <= limit]
    return buckets or [limit]


def describe_tensor(path: Path, graph: Graph, *, variable_axis: int | None, pad: dict[str, float],
                    tolerance: float | None) -> Described:
    """The spec table of a tensor model: the variable axis (declared, or the one free axis the
    inputs share), a padding value for each input that carries it, the drift tolerance."""
    described = Described(table={"kind": ModelKind.TENSOR.value, "source": str(path)})
    table = described.table
    free = {t.name: [axis - 1 for axis in t.free_axes] for t in graph.inputs}
    unknown = sorted(set(pad) - set(free))
    if unknown:
        raise AddModelError(f"{path}: --pad names inputs {unknown} the graph does not have (its inputs: "
                            f"{sorted(free)})")
    described.inferred.append("inputs " + ", ".join(f"{t.name} {t.type_name} {t.dims}" for t in graph.inputs)
                              + ": the graph's")
    if variable_axis is None:
        axes = {axis for axes in free.values() for axis in axes}
        if len(axes) > 1:
            raise AddModelError(f"{path}: inputs have free axes {free} (after the batch axis); say which one is "
                                "bucketed with --variable-axis")
        variable_axis = next(iter(axes), None)
        if variable_axis is not None:
            described.guessed.append(f"variable_axis = {variable_axis}: the one free axis after the batch axis")
    if variable_axis is not None:
        table["variable_axis"] = variable_axis
        carriers = [name for name, axes in free.items() if variable_axis in axes]
        pads = {name: float(pad.get(name, 0.0)) for name in carriers}
        table["pad"] = pads
        guessed = [name for name in carriers if name not in pad]
        if guessed:
            described.guessed.append(f"pad = 0.0 for {guessed}: the value the graph must ignore on padded "
                                     "positions (--pad NAME=VALUE)")
    _tolerance(described, tolerance)
    return described


def _tolerance(described: Described, tolerance: float | None) -> None:
    described.table["tolerance"] = tolerance if tolerance is not None else DEFAULT_TOLERANCE
    if tolerance is None:
        described.guessed.append(f"tolerance = {DEFAULT_TOLERANCE:g}: the largest output difference a new version "
                                 "may show against the old before a rollout rolls back (--tolerance)")


def _tensors_text(tensors) -> str:
    return ", ".join(f"{t.name} {mc.DataType.Name(t.data_type)[5:]} {list(t.dims)}" for t in tensors)


def describe_external(folder: Path, repository: str, *, tolerance: float | None) -> Described:
    """The spec table of a model of the user's own Triton repository (`folder`, written in the
    spec as `repository`), from its config.pbtxt: its backend and tensors are printed, the
    kit's service keys chosen. Its files are only read."""
    path = folder / "config.pbtxt"
    if not folder.is_dir():
        raise AddModelError(f"{folder} is not a folder: --external takes REPOSITORY/MODEL, the model's folder in "
                            "your Triton repository")
    if not path.is_file():
        raise AddModelError(f"{path} not found: the kit reads the model's tensors from its config.pbtxt")
    try:
        config = parse_config(path.read_text(), str(path))
    except ExternalConfigError as err:
        raise AddModelError(str(err)) from None
    described = Described(table={"kind": ModelKind.EXTERNAL.value, "repository": repository, "model": folder.name})
    backend = config.backend or config.platform or "?"
    described.inferred += [
        f"backend {backend!r}, max_batch_size {config.max_batch_size} (gen-config derives it): {path}",
        f"inputs {_tensors_text(config.input)}; outputs {_tensors_text(config.output)}: its config",
    ]
    _tolerance(described, tolerance)
    return described


def describe_onnx(path: Path, *, kind: str | None = None, pooling: str | None = None,
                  output: str | None = None, variable_axis: int | None = None,
                  pad: dict[str, float] | None = None, tolerance: float | None = None) -> Described:
    """The spec table of an ONNX model: a text model when its inputs are token ids and an
    attention mask (input names matched to the kit's tensors, the output, the kind and pooling
    from the output's shape: a per-token output is pooled), else a tensor model."""
    try:
        graph: Graph = read_graph(path)
        graph.verify_batchable()
    except GraphError as err:
        raise AddModelError(str(err)) from None
    names = [t.name for t in graph.inputs]
    ids, mask, types = _pick(names, IDS_NAMES), _pick(names, MASK_NAMES), _pick(names, TYPE_NAMES)
    unknown = sorted(set(names) - {ids, mask, types})
    is_text = ids is not None and mask is not None and not unknown
    if kind == ModelKind.TENSOR or (kind is None and not is_text):
        described = describe_tensor(path, graph, variable_axis=variable_axis, pad=pad or {}, tolerance=tolerance)
        if kind is None:
            described.guessed.insert(0, f"kind = 'tensor': inputs {names} are not token ids and a mask (--kind)")
        return described
    if not is_text:
        raise AddModelError(f"{path}: inputs {names} are not a text model's (token ids and an attention mask"
                            f"{', and token type ids' if types else ''}); add it with --kind tensor")
    outputs = [t.name for t in graph.outputs]
    if output is not None:
        try:
            chosen = graph.output(output)
        except GraphError as err:
            raise AddModelError(str(err)) from None
    else:
        name = _pick(outputs, CLASSIFIER_OUTPUTS if kind == ModelKind.TEXT_CLASSIFIER else
                     (*ENCODER_OUTPUTS, *CLASSIFIER_OUTPUTS)) or (outputs[0] if len(outputs) == 1 else None)
        if name is None:
            raise AddModelError(f"{path}: outputs {outputs}; say which to serve with --output")
        chosen = graph.output(name)
    described = Described(table={})
    table = described.table
    per_token = len(chosen.shape) == 3
    if kind is None:
        kind = ModelKind.TEXT_CLASSIFIER if chosen.name.lower() in CLASSIFIER_OUTPUTS else ModelKind.TEXT_ENCODER
        described.guessed.append(f"kind = {kind.value!r}: from the output's name {chosen.name!r} "
                                 "(--kind to choose)")
    else:
        kind = ModelKind.parse(kind)
    table["kind"] = kind.value
    table["source"] = str(path)
    inputs = {"ids": ids, "mask": mask, **({"token_types": types} if types else {})}
    table["inputs"] = inputs
    described.inferred.append(f"inputs = {inputs}: the graph's inputs")
    if len(outputs) > 1 or output is not None:
        table["output"] = chosen.name
    described.inferred.append(f"output {chosen.name!r} {list(chosen.shape)}: the graph's")
    if kind is ModelKind.TEXT_ENCODER:
        if per_token:
            table["pooling"] = pooling or "mean"
            if pooling is None:
                described.guessed.append("pooling = 'mean': the graph answers one vector per token; the model card "
                                         "says which pooling it was trained with (--pooling mean, cls or last)")
        elif pooling not in (None, "none"):
            raise AddModelError(f"{path}: --pooling {pooling} needs a per-token output; {chosen.name!r} is "
                                f"{list(chosen.shape)}, pooled already")
    elif per_token:
        raise AddModelError(f"{path}: a text-classifier answers logits [rows, labels]; {chosen.name!r} is "
                            f"{list(chosen.shape)}")
    return described


def describe_hf(path: Path, *, kind: str | None = None, pooling: str | None = None) -> Described:
    """The spec table of a Hugging Face folder, from its config.json (build-models exports it)."""
    try:
        info = inspect_hf_dir(path)
    except HfExportError as err:
        raise AddModelError(str(err)) from None
    described = Described(table={})
    table = described.table
    found = ModelKind.parse(info.kind)
    if kind is not None and ModelKind.parse(kind) is not found:
        raise AddModelError(f"{path}: its architecture {', '.join(info.architectures)} is a {found.value}, "
                            f"not a {kind}")
    table["kind"] = found.value
    table["source"] = str(path)
    described.inferred.append(f"kind = {found.value!r}: its architecture {', '.join(info.architectures)}")
    if found is ModelKind.TEXT_ENCODER:
        table["pooling"] = pooling or "mean"
        table["normalize"] = True
        if pooling is None:
            described.guessed.append("pooling = 'mean', normalize = true: sentence-transformers' usual; the model "
                                     "card says which (--pooling mean, cls or last)")
    elif info.labels:
        table["labels"] = list(info.labels)
        described.inferred.append(f"labels = {list(info.labels)}: its id2label")
    if found is ModelKind.TEXT_CLASSIFIER and info.uses_token_types:
        table["pairs"] = True
        table["inputs"] = {"token_types": "token_type_ids"}
        described.inferred.append("pairs = true: it has token types to tell a pair's members apart "
                                  "(a cross-encoder)")
    if info.max_length:
        table["max_length"] = info.max_length
        described.inferred.append(f"max_length = {info.max_length}: its position embeddings")
    return described


LLM_TABLE = {  # what a new generative model gets until the user says otherwise
    "versions": [1],
    "batching": "continuous",
    "block_size": 16,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 256,
    "default_max_tokens": 128,
    "ttft_p95_ms": 1000,
    "tpot_p95_ms": 400,
    "threads": 0,
}
LLM_MAX_MODEL_LEN = 2048  # a new model's context unless its own is shorter
LLM_KV_TOKENS = 8192  # tokens of context the default KV budget holds across the running sequences
LLM_KV_BYTES = 4  # the budget is sized for float32 (CPU); bfloat16 holds twice the tokens in it


def describe_llm(path: Path) -> Described:
    """The `[llm_models.NAME]` table of a decoder-only model `transformers` can load: a Hugging
    Face folder, or a GGUF file. Its context and KV-cache cost per token come from its config;
    the engine's limits and the SLOs are defaults to check."""
    import warnings

    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from python_backends.llm.model import ModelShape

    if path.is_file() and path.suffix != ".gguf":
        raise AddModelError(f"{path}: --llm takes a Hugging Face folder or a .gguf file")
    where = {"gguf_file": path.name} if path.is_file() else {}
    folder = path.parent if path.is_file() else path
    if not where and not (folder / "config.json").is_file():
        raise AddModelError(f"{path}: no config.json (save the model with save_pretrained)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True, **where)
        except (OSError, ValueError, KeyError) as err:
            raise AddModelError(f"{path}: transformers cannot read its config: {err}") from None
    architectures = getattr(config, "architectures", None) or []
    if (config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "is_encoder_decoder", False)
            or (architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures))):
        what = ", ".join(architectures) or f"model_type {config.model_type!r}"
        raise AddModelError(f"{path}: {what} is not a decoder-only causal language model (an encoder belongs "
                            "in --hf-dir)")
    if not where and not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise AddModelError(f"{path}: no tokenizer.json or tokenizer.model (save the tokenizer with save_pretrained)")
    shape = ModelShape.from_config(config)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * LLM_KV_BYTES
    max_model_len = min(LLM_MAX_MODEL_LEN, shape.max_position_embeddings)
    kv_cache_mb = -(-LLM_KV_TOKENS * per_token // (1 << 20))
    table: dict[str, object] = {"source": str(path), **LLM_TABLE, "kv_cache_mb": kv_cache_mb,
                                "max_model_len": max_model_len}
    table["default_max_tokens"] = min(int(LLM_TABLE["default_max_tokens"]), max_model_len // 2)
    described = Described(table=table)
    described.inferred.append(
        f"a {shape.model_type} decoder: {shape.num_layers} layers, {shape.num_kv_heads} KV heads of {shape.head_dim}, "
        f"{per_token // 1024} KiB of KV cache per token in float32, {shape.max_position_embeddings} positions")
    described.guessed.append(f"max_model_len = {max_model_len}: prompt plus output; the model's own context "
                             f"is {shape.max_position_embeddings}")
    described.guessed.append(f"kv_cache_mb = {kv_cache_mb}: {LLM_KV_TOKENS} tokens of context across the running "
                             "sequences, the admission limit; size it to the memory you give the engine")
    for key in ("max_num_seqs", "max_num_batched_tokens", "ttft_p95_ms", "tpot_p95_ms"):
        described.guessed.append(f"{key} = {table[key]!r}: a default; set your own")
    return described


def spec_with_llm_model(spec_text: str, name: str, table: dict[str, object], comment: str) -> str:
    """The spec text with `[llm_models.NAME]` added after the other generative models."""
    document = tomlkit.parse(spec_text)
    if name in document.get("models", {}) or name in document.get("llm_models", {}):
        raise AddModelError(f"a model named {name!r} is in the spec already; choose another name")
    llm_models = document.get("llm_models")
    if llm_models is None:
        llm_models = tomlkit.table(is_super_table=True)
        document["llm_models"] = llm_models
    new = tomlkit.table()
    new.add(tomlkit.comment(comment))
    for key, value in table.items():
        new.add(key, value)
    llm_models[name] = new
    return tomlkit.dumps(document)


def complete(described: Described, *, max_length: int | None, buckets: Sequence[int] | str | None,
             tokenizer: Path | None, overrides: dict[str, object]) -> Described:
    """The service keys the model does not say: buckets, SLO and rates, the workload (defaults
    the user should check, each noted), then what the command line gave."""
    table = described.table
    text = table["kind"] not in (ModelKind.TENSOR.value, ModelKind.EXTERNAL.value)
    bucketed = text or "variable_axis" in table
    if not bucketed:
        overrides = {key: value for key, value in overrides.items() if key != "workload"}
    elif table["kind"] == ModelKind.TENSOR.value and (not buckets or "workload" not in overrides):
        raise AddModelError(f"{table['source']}: a tensor model bucketed along axis {table['variable_axis']} needs "
                            "--buckets (lengths on that axis) and --workload (the mix of lengths the requests have)")
    if bucketed:
        if isinstance(buckets, str):  # "derived": the spec derives the edges from the workload when it is read
            chosen: list[int] | str = buckets
        else:
            chosen = list(buckets) if buckets else buckets_up_to(max_length or table.get("max_length"))  # type: ignore[arg-type]
        table["buckets"] = chosen
        if not buckets:
            described.guessed.append(f"buckets = {chosen}: powers of two to the model's length (at most 256); "
                                     "fit them to your traffic (--buckets)")
    if tokenizer is not None:
        table["tokenizer"] = str(tokenizer)
    defaults = {key: value for key, value in DEFAULT_TABLE.items()
                if (bucketed or key != "workload") and (text or key != "max_text_bytes")}
    for key, value in defaults.items():
        if key not in overrides:
            table[key] = value
            described.guessed.append(f"{key} = {value!r}: a default; set your own")
    table.update(overrides)
    return described


def relative_to(path: Path, root: Path) -> str:
    """`path` as the spec should write it: relative to the spec's folder when inside it."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path.resolve())


def spec_with_model(spec_text: str, name: str, table: dict[str, object], comment: str) -> str:
    """The spec text with `[models.NAME]` added after the other models (comments kept)."""
    document = tomlkit.parse(spec_text)
    models = document.get("models")
    if models is None:
        models = tomlkit.table(is_super_table=True)
        document["models"] = models
    if name in models or name in document.get("llm_models", {}):
        raise AddModelError(f"a model named {name!r} is in the spec already; add a version with --version, or "
                            "choose another name")
    new = tomlkit.table()
    new.add(tomlkit.comment(comment))
    for key, value in table.items():
        if isinstance(value, dict):
            inline = tomlkit.inline_table()
            inline.update(value)
            new.add(key, inline)
        else:
            new.add(key, value)
    models[name] = new
    return tomlkit.dumps(document)


def spec_with_version(spec_text: str, name: str, version: int, source: str) -> str:
    """The spec text with `version` of model `name` served from `source` (not yet given traffic:
    `tools rollout` moves it)."""
    document = tomlkit.parse(spec_text)
    models = document.get("models", {})
    if name not in models:
        raise AddModelError(f"the spec has no model {name!r} to add version {version} to; its models are "
                            f"{sorted(models)}")
    model = models[name]
    versions = [int(v) for v in model.get("versions", [1])]
    if version in versions:
        raise AddModelError(f"model {name!r} already has version {version}; its versions are {versions}")
    old = model["source"]
    sources = {str(v): str(old) for v in versions} if isinstance(old, str) else {str(k): v for k, v in old.items()}
    sources[str(version)] = source
    inline = tomlkit.inline_table()
    inline.update(sources)
    model["source"] = inline
    model["versions"] = [*versions, version]
    if "traffic" not in model:  # keep the split where it is: all on the first version until a rollout
        traffic = tomlkit.inline_table()
        traffic.update({str(versions[0]): 100})
        model["traffic"] = traffic
    return tomlkit.dumps(document)


def spec_with_external_version(spec_text: str, name: str, version: int) -> str:
    """The spec text with `version` of external model `name` served (its folder in the user's
    repository; no traffic until `tools rollout` moves it)."""
    document = tomlkit.parse(spec_text)
    models = document.get("models", {})
    if name not in models:
        raise AddModelError(f"the spec has no model {name!r} to add version {version} to; its models are "
                            f"{sorted(models)}")
    model = models[name]
    if model.get("kind") != ModelKind.EXTERNAL.value:
        raise AddModelError(f"model {name!r} is not an external model; add its version with --onnx or --hf-dir")
    versions = [int(v) for v in model.get("versions", [1])]
    if version in versions:
        raise AddModelError(f"model {name!r} already has version {version}; its versions are {versions}")
    model["versions"] = [*versions, version]
    if "traffic" not in model:  # keep the split where it is: all on the first version until a rollout
        traffic = tomlkit.inline_table()
        traffic.update({str(versions[0]): 100})
        model["traffic"] = traffic
    return tomlkit.dumps(document)
