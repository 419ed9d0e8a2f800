"""A user's local Hugging Face directory, described and exported to ONNX.

`inspect_hf_dir` says what a folder holds (`HfModel`: the architecture, a guess at the serving
kind, label names, whether the model takes token-type ids, its longest input, where the
tokenizer and the weights are) from config.json alone, so that `add-model --hf-dir` answers
in milliseconds whatever the model's size; `describe_config` is the pure part, a config dict
in, an `HfModel` out. `export_hf` loads the model with transformers from the folder (nothing
is downloaded), exports it with torch.onnx (opset 17, dynamic batch and sequence axes),
optionally folding the pooling and L2 normalisation into the graph, and checks the graph
with onnxruntime against the PyTorch module before it is put at `out_path`, so that nothing
half-written or wrong is left there. `inspect_hf_dir` reads the folder; `export_hf` reads it
and writes `out_path` (through a temporary file beside it). Errors are `HfExportError`, one
line naming the folder and the file or field at fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPSET = 17
MIN_EXPORT_COSINE = 0.9999  # hidden states and embeddings, per vector (measured on BERT: 1 - 1e-13)
MAX_LOGIT_DIFF = 1e-3  # classifier logits, largest absolute difference (measured on BERT: 3e-8)
POOLINGS = ("mean", "cls", "last")
TEXT_ENCODER = "text-encoder"
TEXT_CLASSIFIER = "text-classifier"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Heads that generate text: such a model is served by the LLM engine, not as an encoder.
GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForSeq2SeqLM")
# Models whose position ids start after the padding id (RoBERTa's scheme): pad_token_id + 1
# of the max_position_embeddings rows are never used by a real token.
PADDING_OFFSET_MODEL_TYPES = frozenset({
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "data2vec-text", "ibert",
    "longformer", "luke", "mpnet", "markuplm", "lilt", "layoutlmv3", "xmod", "esm",
})


class HfExportError(ValueError):
    """A Hugging Face directory the kit cannot export, or an export that fails its check; the
    message is one line naming the folder and the file at fault."""


@dataclass(frozen=True)
class HfModel:
    """What a Hugging Face directory holds, read from its config.json (weights not loaded)."""

    path: Path  # the directory
    model_type: str  # config.json's model_type ("bert", "roberta", ...)
    architectures: tuple[str, ...]  # config.json's architectures; may be empty
    kind: str  # the serving kind it looks like: "text-classifier" or "text-encoder"
    num_labels: int  # the classifier's number of logits; 0 for an encoder
    labels: tuple[str, ...]  # label names in id order; () when the config has only LABEL_0.. defaults
    uses_token_types: bool  # the model has a token-type embedding of more than one row (pairs)
    max_length: int | None  # the longest input in tokens, special tokens included; None when unsaid
    hidden_size: int  # the width of the per-token hidden states
    tokenizer: Path  # the fast tokenizer file
    weights: Path  # model.safetensors, or the index of sharded safetensors


@dataclass(frozen=True)
class ExportCheck:
    """How the exported graph compares with the PyTorch module on the check batch."""

    worst_cosine: float  # lowest cosine between an output vector of the graph and of PyTorch
    max_abs_diff: float  # largest absolute difference over all outputs
    output_name: str  # the graph's output: logits, last_hidden_state or embedding


def describe_config(path: Path, config: dict[str, Any], tokenizer: Path, weights: Path) -> HfModel:
    """The HfModel of a folder whose config.json parsed to `config`; HfExportError for a model
    the kit does not serve as an encoder. Pure: no file is read."""
    where = path / CONFIG_FILE
    architectures = tuple(str(name) for name in config.get("architectures") or ())
    generative = [name for name in architectures if name.endswith(GENERATIVE_SUFFIXES)]
    if generative or config.get("is_decoder") is True:
        named = generative[0] if generative else f"{config.get('model_type', '?')} decoder"
        raise HfExportError(f"{where}: {named} generates text, it is not an encoder; serve it as an LLM "
                            "instead (the llm model), not as a text-encoder or text-classifier")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HfExportError(f"{where}: no model_type (is this a transformers config?)")
    hidden_size = next((config[key] for key in ("hidden_size", "dim", "d_model") if key in config), None)
    if not isinstance(hidden_size, int) or hidden_size <= 0:
        raise HfExportError(f"{where}: no hidden_size (nor dim, d_model) giving the width of the hidden states")
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    labels: tuple[str, ...] = ()
    num_labels = 0
    if classifier:
        id2label = config.get("id2label") or {}
        try:
            by_id = {int(key): str(name) for key, name in id2label.items()}
        except (AttributeError, ValueError):
            raise HfExportError(f"{where}: id2label is not a map of label ids to names") from None
        num_labels = int(config.get("num_labels") or len(by_id) or 2)
        if sorted(by_id) != list(range(num_labels)) and by_id:
            raise HfExportError(f"{where}: id2label has ids {sorted(by_id)}, not 0..{num_labels - 1}")
        names = tuple(by_id[index] for index in range(len(by_id)))
        if names != tuple(f"LABEL_{index}" for index in range(len(names))):
            labels = names
    max_length = config.get("max_position_embeddings")
    if isinstance(max_length, int) and model_type in PADDING_OFFSET_MODEL_TYPES:
        max_length -= int(config.get("pad_token_id") or 0) + 1
    return HfModel(
        path=path,
        model_type=model_type,
        architectures=architectures,
        kind=TEXT_CLASSIFIER if classifier else TEXT_ENCODER,
        num_labels=num_labels,
        labels=labels,
        uses_token_types=int(config.get("type_vocab_size") or 0) > 1,
        max_length=max_length if isinstance(max_length, int) and max_length > 0 else None,
        hidden_size=hidden_size,
        tokenizer=tokenizer,
        weights=weights,
    )


def inspect_hf_dir(path: Path) -> HfModel:
    """What the Hugging Face directory at `path` holds; HfExportError naming the missing or bad
    file when the kit cannot export it."""
    path = Path(path)
    if not path.is_dir():
        raise HfExportError(f"{path}: not a directory (a Hugging Face model folder with config.json, "
                            f"{TOKENIZER_FILE} and {SAFETENSORS_FILE})")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise HfExportError(f"{path}: no {CONFIG_FILE} (save the model with save_pretrained)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HfExportError(f"{config_path}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise HfExportError(f"{config_path}: not a JSON object")
    tokenizer = path / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise HfExportError(f"{path}: no {TOKENIZER_FILE}; the kit needs the fast tokenizer file (save it with "
                            "AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(folder))")
    weights = next((path / name for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX) if (path / name).is_file()), None)
    if weights is None:
        found = [name for name in PYTORCH_BIN_FILES if (path / name).is_file()]
        why = f"{found[0]} is not read" if found else "no weights file"
        raise HfExportError(f"{path}: no {SAFETENSORS_FILE} ({why}); convert the weights with "
                            "model.save_pretrained(folder, safe_serialization=True)")
    return describe_config(path, config, tokenizer, weights)


def _export_module(torch, model, *, classifier: bool, pooling: str | None, normalize: bool, uses_token_types: bool):
    """The module torch.onnx traces: the model with the pooling folded in."""

    class Exported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if uses_token_types:
                inputs["token_type_ids"] = token_type_ids
            outputs = self.model(**inputs)
            if classifier:
                return outputs.logits
            hidden = outputs.last_hidden_state
            if pooling is None:
                return hidden
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            if pooling == "mean":
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            elif pooling == "cls":
                pooled = hidden[:, 0, :]
            else:
                # The last position the mask marks real, whichever side is padded: the largest
                # position index among the real tokens (no arange: the sequence axis is dynamic),
                # picked by a one-hot sum, which keeps the width static in the graph (a gather
                # indexed by it leaves the exported output [batch, ?]).
                positions = torch.ones_like(attention_mask).cumsum(dim=1) - 1
                last = (positions * attention_mask).argmax(dim=1, keepdim=True)
                pooled = (hidden * (positions == last).unsqueeze(-1).to(hidden.dtype)).sum(dim=1)
            if normalize:
                # F.normalize's value, written out: its expand_as leaves the exported width unknown.
                pooled = pooled / pooled.norm(p=2, dim=1, keepdim=True).clamp(min=1e-12)
            return pooled

    return Exported().eval()


def _check_batch(torch, vocab_size: int, pad_id: int, uses_token_types: bool) -> dict[str, Any]:
    """Rows of two lengths, one padded on the right and one on the left, so that dynamic axes,
    masking and last-token pooling on either padding side are exercised (the export's sample
    is [2, 8]; this is [3, 24])."""
    generator = torch.Generator().manual_seed(0)
    low = min(1000, vocab_size // 2)
    ids = torch.randint(low, vocab_size, (3, 24), dtype=torch.int64, generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[2, :14] = 0
    ids[mask == 0] = pad_id
    batch = {"input_ids": ids, "attention_mask": mask}
    if uses_token_types:
        types = torch.zeros_like(ids)
        types[:, 12:] = 1  # a pair: the second member's tokens
        batch["token_type_ids"] = types * mask
    return batch


def _compare(exported, reference) -> tuple[float, float]:
    """(worst cosine over the last axis's vectors, largest absolute difference)."""
    import numpy as np

    a = exported.reshape(-1, exported.shape[-1]).astype(np.float64)
    b = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    cosine = float(np.min(np.sum(a * b, axis=1) / norms)) if a.size else 1.0
    return cosine, float(np.max(np.abs(a - b))) if a.size else 0.0


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _onnx_export(torch, where: Path, module, path: Path, input_names: list[str], output_name: str,
                 output_axes: dict[int, str]) -> None:
    """torch.onnx.export (TorchScript tracing, opset 17) on a [2, 8] sample, every input's batch
    and sequence axes dynamic; a failure (an operator opset 17 lacks, a model the tracer cannot
    follow) as one HfExportError line."""
    sample = tuple(torch.zeros(2, 8, dtype=torch.int64) if name == "token_type_ids"
                   else torch.ones(2, 8, dtype=torch.int64) for name in input_names)
    dynamic_axes = {**{name: {0: "batch", 1: "sequence"} for name in input_names}, output_name: output_axes}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # The tracer warns about every shape-dependent Python branch in transformers; the
            # check against PyTorch is what tells whether the graph is right.
            warnings.simplefilter("ignore")
            torch.onnx.export(module, sample, str(path), input_names=input_names, output_names=[output_name],
                              dynamic_axes=dynamic_axes, opset_version=OPSET, dynamo=False)
    except RuntimeError as error:  # torch.onnx's OnnxExporterError and tracer errors are RuntimeErrors
        raise HfExportError(f"{where}: torch.onnx cannot export the model: {_first_line(error)}") from None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load-time notices (unused head weights, a newly initialised pooler of an
    encoder saved without one) go to the logger at warning level; the check decides."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def export_hf(hf_dir: Path, out_path: Path, *, pooling: str | None = None, normalize: bool = False,
              token_types: bool | None = None) -> ExportCheck:
    """Export the model in `hf_dir` to the ONNX file `out_path` and check it against PyTorch.

    Inputs `input_ids`, `attention_mask` (and `token_type_ids` when `token_types`; None: when the
    model has more than one token type; False: the model sees type 0 everywhere, as a single
    text does, and the graph takes no such input), INT64
    [batch, sequence]. Output: a classifier's `logits` [batch, num_labels]; an encoder's
    `last_hidden_state` [batch, sequence, hidden] when `pooling` is None, else `embedding`
    [batch, hidden] pooled in the graph ("mean" over the attention mask, "cls" the first token,
    "last" the last real token on either padding side), L2-normalised with `normalize`.
    HfExportError when the folder cannot be exported or the graph fails its check; then
    `out_path` is left as it was."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModel, AutoModelForSequenceClassification

    model_info = inspect_hf_dir(hf_dir)
    out_path = Path(out_path)
    classifier = model_info.kind == TEXT_CLASSIFIER
    if pooling is not None and pooling not in POOLINGS:
        raise HfExportError(f"{model_info.path}: unknown pooling {pooling!r}; one of: {', '.join(POOLINGS)}, "
                            "or None for the raw last_hidden_state")
    if classifier and (pooling is not None or normalize):
        raise HfExportError(f"{model_info.path}: a classifier ({', '.join(model_info.architectures)}) outputs "
                            "logits; pooling and normalize apply to encoders only")
    if normalize and pooling is None:
        raise HfExportError(f"{model_info.path}: normalize needs a pooling (mean, cls or last) to normalise")
    config = json.loads((model_info.path / CONFIG_FILE).read_text())
    loader = AutoModelForSequenceClassification if classifier else AutoModel
    try:
        with _quiet_transformers():
            model = loader.from_pretrained(str(model_info.path), local_files_only=True, attn_implementation="eager")
    except (OSError, ValueError, KeyError, SafetensorError) as error:
        raise HfExportError(f"{model_info.path}: transformers cannot load the model: {_first_line(error)}") from None
    takes_types = model_info.uses_token_types if token_types is None else token_types
    if takes_types and not model_info.uses_token_types:
        raise HfExportError(f"{model_info.path}: the model has one token type (type_vocab_size), so it cannot tell a "
                            "pair's members apart: export it without token_type_ids")
    model = model.float().eval()
    module = _export_module(torch, model, classifier=classifier, pooling=pooling, normalize=normalize,
                            uses_token_types=takes_types)
    input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if takes_types else [])
    if classifier:
        output_name, output_axes = "logits", {0: "batch"}
    elif pooling is None:
        output_name, output_axes = "last_hidden_state", {0: "batch", 1: "sequence"}
    else:
        output_name, output_axes = "embedding", {0: "batch"}
    check = _check_batch(torch, int(config.get("vocab_size") or 1000), int(config.get("pad_token_id") or 0),
                         takes_types)
    with torch.no_grad():
        reference = module(*(check[name] for name in input_names)).numpy()  # before export: it may alter the module
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and moved over it once checked: a failed export leaves nothing.
    staging = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        _onnx_export(torch, model_info.path, module, staging, input_names, output_name, output_axes)
        session = ort.InferenceSession(str(staging), providers=["CPUExecutionProvider"])
        (exported,) = session.run(None, {name: check[name].numpy() for name in input_names})
        worst_cosine, max_abs_diff = _compare(np.asarray(exported), reference)
        if classifier and not max_abs_diff <= MAX_LOGIT_DIFF:
            raise HfExportError(f"{model_info.path}: the exported graph disagrees with PyTorch (largest logit "
                                f"difference {max_abs_diff:.2e} > {MAX_LOGIT_DIFF}); nothing written to {out_path}")
        if not classifier and not worst_cosine >= MIN_EXPORT_COSINE:
            raise HfExportError(f"{model_info.path}: the exported graph disagrees with PyTorch (cosine "
                                f"{worst_cosine:.6f} < {MIN_EXPORT_COSINE}); nothing written to {out_path}")
        staging.replace(out_path)
    finally:
        staging.unlink(missing_ok=True)
    return ExportCheck(worst_cosine, max_abs_diff, output_name)
