"""Add your own model: an ONNX file, a Hugging Face folder or an LLM, served like the built-in ones.

  python -m tools add-model rerank --hf-dir /models/my-cross-encoder
  python -m tools add-model chat --llm /models/Qwen2.5-0.5B-Instruct
  python -m tools add-model chat --llm /models/qwen2.5-0.5b-instruct-q4_k_m.gguf
  python -m tools add-model search --onnx /models/encoder.onnx --tokenizer /models/tokenizer.json \\
      --pooling cls --query-prefix "query: "
  python -m tools add-model search --version 2 --onnx /models/encoder-v2.onnx
  python -m tools add-model audio --onnx /models/audio.onnx --variable-axis 0 --pad features=0 \\
      --pad frame_mask=0 --buckets 128,256,512 --workload frames.toml --tolerance 0.001
  python -m tools add-model scorer --external /srv/triton-models/user_scorer
  python -m tools add-model scorer --version 2 --external /srv/triton-models/user_scorer

An ONNX graph whose inputs are token ids and an attention mask is a text model (text-encoder
or text-classifier); any other graph with a dynamic batch axis is a tensor model, bucketed
along its one free axis (--variable-axis) with each input padded by its --pad value, or, with
fixed shapes, served by dynamic batching alone.

Reads the model (an ONNX graph's inputs and outputs, a Hugging Face folder's config.json),
writes its `[models.NAME]` table into the serving spec (the file's comments kept) and prints
what it read from the model and what it had to choose (defaults to check: buckets, SLO,
rates, workload, pooling when the model does not say). Then it makes the model's folders in
the repository (a router `NAME/1` and one bucket model per length, `NAME_<length>/<version>`)
and builds its files there: the graph (a Hugging Face folder is exported to ONNX and checked
against PyTorch; an ONNX file is copied as it is) with a MANIFEST.json, and the tokenizer. No
other model's files are touched. With --version, the model gets another version from the new
file, with no traffic until `python -m tools rollout NAME --to VERSION` moves it.

With --external REPOSITORY/MODEL, a model that already lives in your own Triton repository
(any backend the server has) is served behind a router named NAME (which must differ from
MODEL): its config.pbtxt is read (backend, inputs, outputs, printed) and never written here;
`gen-config` later writes only its batching fields (max_batch_size, dynamic_batching,
instance_group). Only the router's folder `NAME/1` is made in the kit's repository; `serve`
and `profile` serve your repository beside it. With --version, the version is a folder of
your model that you made yourself (e.g. a copy of 1 as 2).

With --llm, a decoder-only model that `transformers` loads (a Hugging Face folder with its
weights and tokenizer, or a GGUF file) is served on the kit's continuous-batching engine as
NAME (streaming) and NAME_infer (plain infer), with its own chat template and end-of-sequence
tokens: its `[llm_models.NAME]` table is written (the context and KV-cache cost read from
the model; the engine's limits and the SLOs defaults to check), its folders made, and its
files built there (one safetensors file, the tokenizer), checked against `transformers`.

Nothing is half-written: a model that cannot be served as described (inputs that are not a
text model's, a fixed batch axis, a pooling the output does not allow, a missing tokenizer)
is refused with one line naming the file, and the spec and the repository stay as they were.
Next: `python -m tools profile --model NAME`, then `python -m tools gen-config`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tomllib
from pathlib import Path

from python_backends.embed.kinds import ModelKind
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.repository.add_model import (
    AddModelError,
    complete,
    describe_external,
    describe_hf,
    describe_llm,
    describe_onnx,
    relative_to,
    spec_with_external_version,
    spec_with_llm_model,
    spec_with_model,
    spec_with_version,
)
from tools.repository.build import (
    BuildError,
    LLMTargets,
    Targets,
    build_bucketed,
    build_llm,
    find_targets,
    install_tokenizer,
)
from tools.repository.configs import LLM_INFER_SUFFIX, SHIM
from tools.repository.sources import SourceError, served_external, served_graph, served_tensors, tokenizer_path
from tools.spec.buckets import DERIVED
from tools.spec.serving import SpecError, load_spec, parse_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the model's name: what clients call (its bucket models are NAME_<length>)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--onnx", type=Path, metavar="FILE", help="an ONNX graph with a dynamic batch axis")
    source.add_argument("--hf-dir", type=Path, metavar="DIR",
                        help="a Hugging Face folder: config.json, *.safetensors, tokenizer.json")
    source.add_argument("--llm", type=Path, metavar="DIR_OR_GGUF",
                        help="a decoder-only LLM: a Hugging Face folder (config.json, weights, tokenizer) or a "
                             ".gguf file, served on the continuous-batching engine")
    source.add_argument("--external", type=Path, metavar="REPOSITORY/MODEL",
                        help="a model of your own Triton repository (its folder, holding config.pbtxt), on any "
                             "backend: served behind a router named NAME; its files are never written here")
    parser.add_argument("--version", type=int, default=None,
                        help="add this version to a model the spec has (no traffic until a rollout)")
    parser.add_argument("--kind", choices=[k.value for k in ModelKind if k is not ModelKind.EXTERNAL], default=None,
                        help="text-encoder, text-classifier or tensor (default: read from the model)")
    parser.add_argument("--variable-axis", type=int, default=None, metavar="AXIS",
                        help="tensor models: the axis after the batch axis whose length varies (default: the one "
                             "free axis, if there is one)")
    parser.add_argument("--pad", action="append", default=[], metavar="INPUT=VALUE",
                        help="tensor models: the value that pads INPUT along the variable axis (default 0)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="tensor and external models: largest output difference a new version may show "
                             "(default 0.001)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json for an ONNX file (default: one beside the file)")
    parser.add_argument("--pooling", choices=("none", "mean", "cls", "last"), default=None,
                        help="how a per-token output becomes one vector per row (default: mean, printed to check)")
    parser.add_argument("--output", default=None, help="the graph output to serve when it has several")
    parser.add_argument("--labels", default=None, help="classifier label names by logit index, comma-separated")
    parser.add_argument("--pairs", action="store_true", help="classifier rows are text pairs (a cross-encoder)")
    parser.add_argument("--query-prefix", default=None, help='put before each query text, e.g. "query: "')
    parser.add_argument("--document-prefix", default=None, help='put before each document text, e.g. "passage: "')
    parser.add_argument("--buckets", default=None, help="bucket lengths in tokens, comma-separated, or 'derived': "
                                                        "those that pad the workload's rows least (default: "
                                                        "powers of two to the model's length, at most 256)")
    parser.add_argument("--bucket-count", type=int, default=None, metavar="N",
                        help="with --buckets derived: the most buckets to derive (default 5)")
    parser.add_argument("--slo-ms", type=float, default=None, help="p95 latency target (default: 200)")
    parser.add_argument("--expected-rps", type=float, default=None, help="normal requests/s (default: 20)")
    parser.add_argument("--peak-rps", type=float, default=None, help="peak requests/s (default: 50)")
    parser.add_argument("--workload", type=Path, default=None,
                        help="length mix of the requests (default: loadtest/workloads/embed_mix.toml)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="where the model's folders go (default: %(default)s)")


def overrides(args: argparse.Namespace, root: Path) -> dict[str, object]:
    """The spec keys the command line sets."""
    table: dict[str, object] = {}
    for option, key in (("slo_ms", "slo_p95_ms"), ("expected_rps", "expected_rps"), ("peak_rps", "peak_rps"),
                        ("query_prefix", "query_prefix"), ("document_prefix", "document_prefix")):
        if getattr(args, option) is not None:
            table[key] = getattr(args, option)
    if args.workload is not None:
        table["workload"] = relative_to(args.workload, root)
    if args.labels:
        table["labels"] = [label.strip() for label in args.labels.split(",")]
    if args.pairs:
        table["pairs"] = True
    if args.bucket_count is not None:
        table["bucket_count"] = args.bucket_count
    return table


# Options about a model's graph, tokenizer or buckets: an external model has none of them.
NOT_EXTERNAL = {"kind": "--kind", "variable_axis": "--variable-axis", "pad": "--pad", "tokenizer": "--tokenizer",
                "pooling": "--pooling", "output": "--output", "labels": "--labels", "pairs": "--pairs",
                "query_prefix": "--query-prefix", "document_prefix": "--document-prefix", "buckets": "--buckets",
                "bucket_count": "--bucket-count", "workload": "--workload"}


def external_spec_text(args: argparse.Namespace, spec_path: Path, text: str) -> tuple[str, list[str], list[str]]:
    """The spec with the external model (or its new version), and the notes to print."""
    given = [option for key, option in NOT_EXTERNAL.items() if getattr(args, key) not in (None, False, [])]
    if given:
        raise AddModelError(f"{', '.join(given)} do(es) not apply to an external model (--external): its tensors "
                            "come from its config.pbtxt and it has one bucket, itself")
    folder = args.external.resolve()
    if args.version is not None:
        version = folder / str(args.version)
        if not version.is_dir():
            raise AddModelError(f"{version} not found: make the version's folder in your repository first "
                                f"(e.g. a copy of {folder / '1'})")
        return (spec_with_external_version(text, args.name, args.version),
                [f"version {args.version}: {version}"], [])
    described = describe_external(folder, relative_to(folder.parent, spec_path.parent), tolerance=args.tolerance)
    complete(described, max_length=None, buckets=None, tokenizer=None, overrides=overrides(args, spec_path.parent))
    comment = (f" {args.name}: added by `python -m tools add-model --external`; check the values it chose (see its "
               "output)")
    return spec_with_model(text, args.name, described.table, comment), described.inferred, described.guessed


def new_spec_text(args: argparse.Namespace, spec_path: Path) -> tuple[str, list[str], list[str]]:
    """The spec with the model (or its new version), and the notes to print."""
    root = spec_path.parent
    text = spec_path.read_text()
    if args.external is not None:
        return external_spec_text(args, spec_path, text)
    artifact = (args.onnx or args.hf_dir).resolve()
    if not artifact.exists():
        raise AddModelError(f"{artifact} does not exist")
    source = relative_to(artifact, root)
    if args.version is not None:
        return spec_with_version(text, args.name, args.version, source), [f"version {args.version}: {source}"], []
    if args.onnx is not None:
        described = describe_onnx(artifact, kind=args.kind, pooling=args.pooling, output=args.output,
                                  variable_axis=args.variable_axis, pad=parse_pads(args.pad),
                                  tolerance=args.tolerance)
        tokenizer = None
        if described.table["kind"] != ModelKind.TENSOR.value:
            tokenizer = args.tokenizer or artifact.with_name("tokenizer.json")
            if not tokenizer.is_file():
                raise AddModelError(f"{tokenizer} not found: name the model's tokenizer.json with --tokenizer")
    else:
        described = describe_hf(artifact, kind=args.kind, pooling=args.pooling)
        tokenizer = args.tokenizer
    described.table["source"] = source
    if args.pairs and "inputs" in described.table and "token_types" not in described.table["inputs"]:
        raise AddModelError(f"{artifact}: --pairs needs a graph that takes token type ids")
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets and args.buckets != DERIVED else args.buckets
    complete(described, max_length=None, buckets=buckets,
             tokenizer=Path(relative_to(tokenizer, root)) if tokenizer else None, overrides=overrides(args, root))
    comment = f" {args.name}: added by `python -m tools add-model`; check the values it chose (see its output)"
    return spec_with_model(text, args.name, described.table, comment), described.inferred, described.guessed


def parse_pads(pads: list[str]) -> dict[str, float]:
    values = {}
    for item in pads:
        name, sep, value = item.partition("=")
        try:
            values[name.strip()] = float(value)
        except ValueError:
            raise AddModelError(f"--pad {item!r} is not INPUT=VALUE with a number") from None
        if not sep or not name.strip():
            raise AddModelError(f"--pad {item!r} is not INPUT=VALUE")
    return values


def make_folders(repository: Path, name: str, buckets: list[str], versions: tuple[int, ...],
                 kind: ModelKind) -> list[Path]:
    """The model's version folders with their model.py shims; the folders it made (to undo)."""
    made = []
    router, bucket_adapter = (("embed_model", "encoder_model") if kind.is_text else
                              ("tensor_router_model", "tensor_bucket_model"))
    for model, model_versions, adapter in ((name, (1,), router),
                                           *((bucket, versions, bucket_adapter) for bucket in buckets)):
        for version in model_versions:
            folder = repository / model / str(version)
            if (folder / "model.py").is_file():
                continue
            top = repository / model
            made.append(folder if top.exists() else top)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.py").write_text(SHIM.format(name=model, adapter=adapter))
    return made


# Options of the bucketed models: a generative model has none of them.
NOT_LLM = {**NOT_EXTERNAL, "tolerance": "--tolerance", "slo_ms": "--slo-ms", "expected_rps": "--expected-rps",
           "peak_rps": "--peak-rps", "version": "--version"}


def undo(err: Exception, spec_path: Path, original: str, made: list[Path]) -> int:
    """Put the spec back and remove the folders made, after a build that failed."""
    spec_path.write_text(original)
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"error: {err}; the spec and the repository are as they were", file=sys.stderr)
    return 1


def print_notes(inferred: list[str], guessed: list[str]) -> None:
    for line in inferred:
        print(f"  read from the model: {line}")
    for line in guessed:
        print(f"  chosen, check it:    {line}")


def add_llm(args: argparse.Namespace, spec_path: Path, repository: Path) -> int:
    """Write the LLM's spec table, make its two folders and build its files, or nothing."""
    given = [option for key, option in NOT_LLM.items() if getattr(args, key) not in (None, False, [])]
    try:
        if given:
            raise AddModelError(f"{', '.join(given)} do(es) not apply to a generative model (--llm); set its "
                                "engine's limits and SLOs in its [llm_models] table")
        load_spec(spec_path)  # the spec as it is must be valid before it is changed
        artifact = args.llm.resolve()
        if not artifact.exists():
            raise AddModelError(f"{artifact} does not exist")
        described = describe_llm(artifact)
        described.table["source"] = relative_to(artifact, spec_path.parent)
        comment = (f" {args.name}: added by `python -m tools add-model --llm`; check the values it chose "
                   "(see its output)")
        text = spec_with_llm_model(spec_path.read_text(), args.name, described.table, comment)
        spec = parse_spec(tomllib.loads(text), spec_path)
    except (AddModelError, SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = next(m for m in spec.llm_models if m.name == args.name)
    original = spec_path.read_text()
    made = []
    for name, adapter in ((model.name, "llm_model"), (model.name + LLM_INFER_SUFFIX, "llm_infer_model")):
        top = repository / name
        if not top.exists():
            made.append(top)
        folder = top / "1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.py").write_text(SHIM.format(name=name, adapter=adapter))
    spec_path.write_text(text)
    try:
        dirs = tuple(repository / model.name / str(v) for v in model.versions)
        build_llm(Targets((), (LLMTargets(model, dirs),)), False, repository, lambda m: print(m, flush=True))
    except (BuildError, SpecError) as err:
        return undo(err, spec_path, original, made)
    print(f"added {model.name} (llm) to {spec_path.name}: {model.name} streams on the continuous-batching engine, "
          f"{model.name}{LLM_INFER_SUFFIX} answers plain infer")
    print_notes(described.inferred, described.guessed)
    print("next: python -m tools gen-config   then   make serve")
    return 0


def run(args: argparse.Namespace) -> int:
    spec_path = args.spec.resolve()
    repository = args.model_repository.resolve()
    if args.llm is not None:
        return add_llm(args, spec_path, repository)
    try:
        load_spec(spec_path)  # the spec as it is must be valid before it is changed
        text, inferred, guessed = new_spec_text(args, spec_path)
        spec = parse_spec(tomllib.loads(text), spec_path)
        model = next(m for m in spec.models if m.name == args.name)
        if model.kind is ModelKind.EXTERNAL:
            served_external(model)
        elif model.kind.is_text:
            served_graph(model)
            tokenizer_path(model)
        else:
            served_tensors(model)
    except (AddModelError, SpecError, SourceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except tomllib.TOMLDecodeError as err:
        print(f"error: the spec with the model is not valid TOML: {err}", file=sys.stderr)
        return 2
    if model.kind is ModelKind.EXTERNAL:
        return add_external(spec_path, repository, model, text, inferred, guessed, args.version)
    original = spec_path.read_text()
    versions = (args.version,) if args.version is not None else model.versions
    made = make_folders(repository, model.name, list(model.bucket_names), versions, model.kind)
    spec_path.write_text(text)
    try:
        (targets,) = [t for t in find_targets(repository, load_spec(spec_path)).bucketed if t.model.name == model.name]
        log = lambda message: print(message, flush=True)  # noqa: E731
        install_tokenizer(targets, False, log)
        build_bucketed(targets, False, repository, log)
    except (BuildError, SpecError) as err:
        return undo(err, spec_path, original, made)
    print(f"added {model.name} ({model.kind.value}) to {spec_path.name}, versions "
          f"{', '.join(map(str, versions))}; bucket models {', '.join(model.bucket_names)}")
    print_notes(inferred, guessed)
    print(f"next: python -m tools profile --model {model.name}   then   python -m tools gen-config")
    return 0


def add_external(spec_path: Path, repository: Path, model, text: str, inferred: list[str], guessed: list[str],
                 version: int | None) -> int:
    """Write the spec and make the router's folder; the user's repository is only read."""
    if version is None:
        make_folders(repository, model.name, [], (1,), model.kind)
    spec_path.write_text(text)
    if version is None:
        print(f"added {model.name} (external) to {spec_path.name}: a router in {repository.name}/{model.name} "
              f"calling {model.external_model} of {model.repository} (its files are left as they are)")
    print_notes(inferred, guessed)
    if version is not None:
        print(f"next: python -m tools rollout {model.name} --to {version}  (a running server loads it; the model's "
              "own version_policy must load it at start too)")
        return 0
    print(f"next: python -m tools profile --model {model.name}   then   python -m tools gen-config (writes the "
          f"batching fields of {model.external_dir / 'config.pbtxt'})")
    return 0
