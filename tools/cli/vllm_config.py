"""Write a model folder of Triton's vLLM backend for an LLM of the spec.

    python -m tools vllm-config llm --out vllm_repository --model-path /weights/SmolLM2-135M-Instruct
    python -m tools vllm-config llm --out vllm_repository --gpu-memory-utilization 0.45 --force

Writes DIR/NAME/config.pbtxt (backend "vllm", decoupled, vLLM's metrics on) and
DIR/NAME/VERSION/model.json (vLLM's engine arguments) from `[llm_models.NAME]`: the same
sequence, step and context limits, block size and dtype as the kit's engine, for Triton's vLLM
container (`nvcr.io/nvidia/tritonserver:24.10-vllm-python-py3`, vLLM 0.5.5) on a GPU node. The
KV cache is sized the way vLLM sizes it, by --gpu-memory-utilization: the fraction of the
whole GPU's memory the engine may take, weights and activations included; the KV cache gets
what is left. Then it prints what the vLLM model does differently from the kit's.

model.json names the weights by --model-path, as the GPU node will see them. Without it: the
spec's `source` folder, or, for a GGUF or the packaged SmolLM2, the Hugging Face folder
`build-models` makes from it in the model repository (vLLM 0.5.5 does not run those GGUF
files), each as a path on this machine.

A spec vLLM cannot serve that way (a static batching policy, device "cpu", a block size vLLM
does not take, a GGUF --model-path) is refused with one line naming each problem, and nothing
is written. An existing DIR/NAME is refused unless --force, which replaces only the two files;
a new folder appears whole or not at all. The guide: docs/vllm.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC, REPO_ROOT
from tools.repository.vllm_backend import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    VLLM_CONTAINER,
    VLLM_VERSION,
    VLLMConfigError,
    vllm_model,
    write_model_folder,
)
from tools.spec.serving import LLMModelSpec, SpecError, load_spec


def fraction(text: str) -> float:
    """An argparse type: a number within (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the spec's LLM ([llm_models.NAME]); the model keeps its name")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="model repository to write into: DIR/NAME/config.pbtxt and DIR/NAME/VERSION/model.json")
    parser.add_argument("--model-path", default=None, metavar="PATH",
                        help="the weights as the GPU node sees them: a Hugging Face folder (or a hub id where the node "
                             "may download); default: the spec's source folder, or the folder build-models makes in "
                             "the model repository for a GGUF or the packaged model, as on this machine")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=DEFAULT_GPU_MEMORY_UTILIZATION, metavar="F",
                        help="fraction of the whole GPU's memory the engine takes: weights, activations and, in what "
                             "is left, the KV cache (default: vLLM's %(default)s)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="replace the two files when DIR/NAME exists (other files there are kept)")


def is_converted(model: LLMModelSpec) -> bool:
    """Whether vLLM gets the folder `build-models` converts the model into: a GGUF file, or the
    packaged model (a GGUF too), which vLLM 0.5.5 does not run."""
    return model.source is None or model.source.name.lower().endswith(".gguf")


def default_model_path(model: LLMModelSpec) -> Path:
    """The weights on this machine: the spec's source folder, or the converted folder."""
    return DEFAULT_MODEL_REPOSITORY / model.name / str(max(model.versions)) if is_converted(model) else model.source


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    models = {m.name: m for m in spec.llm_models}
    if args.name not in models:
        what = "a bucketed model of" if any(m.name == args.name for m in spec.models) else "not a model of"
        print(f"error: {args.name!r} is {what} {spec.path}; its LLMs ([llm_models]): {', '.join(models) or 'none'}",
              file=sys.stderr)
        return 2
    model = models[args.name]
    model_path = args.model_path if args.model_path is not None else str(default_model_path(model))
    try:
        folder = vllm_model(model, model_path, args.gpu_memory_utilization)
        header = (f"Generated by `python -m tools vllm-config {model.name}` from {_spec_name(spec.path)} "
                  f"(sha256 {spec.sha256[:16]}) for Triton's vLLM backend:",
                  f"{VLLM_CONTAINER} (vLLM {VLLM_VERSION}). The engine's arguments are in "
                  f"{folder.version}/model.json.")
        written = write_model_folder(args.out, folder, header, force=args.force)
    except (VLLMConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {_shown(path)}")
    if args.model_path is None:
        missing = "" if Path(model_path).exists() else (
            " (not there yet: `python -m tools build-models` makes it)" if is_converted(model) else " (not there)")
        print(f"note: model.json names {model_path}{missing}, a path on this machine; --model-path sets the one on "
              "the GPU node")
    for note in folder.notes:
        print(f"note: {note}")
    return 0


def _spec_name(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
