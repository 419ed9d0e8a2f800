"""Generate every config.pbtxt from the serving spec and a measured latency profile.

Configs are built as `model_config_pb2.ModelConfig` messages and written with protobuf's
text format; each file starts with what it was generated from and why each batching knob
has its value. `--check` exits 1 when a config on disk differs from what the spec and
profile give (the test suite runs it); `--explain` prints every knob with its numbers, and
each bucketed model's edges against those derived for its workload (padded tokens per row).

An external model's config.pbtxt is the user's, in the user's repository: only its batching
fields (max_batch_size, dynamic_batching, instance_group) are written, under a `#|` header
saying why, and only those are compared by `--check`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.planning.buckets import compare_edges, explain_line
from tools.planning.derivation import InfeasibleSLO
from tools.repository.configs import (
    check,
    check_external,
    expected_files,
    explain,
    external_files,
    plan_all,
    sources,
    write_files,
)
from tools.spec.profile import ProfileError, load_profile
from tools.spec.serving import SpecError, load_spec
from tools.spec.workload import WorkloadError, load_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="latency profile (default: the spec's `profile`, profiles/cpu.json)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="repository to write into (default: %(default)s)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 if any config on disk differs from the generated one")
    mode.add_argument("--explain", action="store_true", help="write nothing; print every knob and its reasoning")


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
        profile = load_profile(args.profile or spec.profile)
        plan = plan_all(spec, profile, args.model_repository.resolve())
        edges = [explain_line(compare_edges(m, load_workload(m.workload)))
                 for m in spec.models if m.workload and args.explain]
    except (SpecError, ProfileError, InfeasibleSLO, WorkloadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    repository = args.model_repository.resolve()
    files = expected_files(plan, repository)
    users = external_files(plan)
    if args.explain:
        print(explain(plan, spec, profile))
        if edges:
            print("\nbucket edges (each model's workload; rows: share per bucket)", *edges, sep="\n  ")
        return 0
    if args.check:
        problems = check(files, repository) + check_external(plan)
        if problems:
            print("configs drift from the serving spec and profile; run `python -m tools gen-config`:",
                  file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 1
        print(f"{len(files) + len(users)} files match {sources(spec, profile)}")
        return 0
    written = write_files(files)
    for path in written:
        print(f"wrote {path.relative_to(repository)}")
    for path in write_files(users):
        print(f"wrote the batching fields of {path} (every other field as it was)")
        written.append(path)
    for model in plan:
        for warning in model.knobs.warnings if model.knobs else ():
            print(f"WARNING: {warning}", file=sys.stderr)
        unbuilt = [v for v in model.versions if model.files_of and not (repository / model.name / str(v) /
                                                                          "model.onnx").is_file()]
        if unbuilt:
            print(f"note: {model.name} has no model files yet (versions {', '.join(map(str, unbuilt))}); "
                  f"`python -m tools build-models` links {model.files_of}'s")
    print(f"{len(written)} file(s) written, {len(files) + len(users) - len(written)} unchanged")
    return 0
