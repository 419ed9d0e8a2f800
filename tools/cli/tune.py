"""Tune the batching knobs of one model past the derived ones, within a budget, and write the winner.

What it measures and writes:
  the derived configuration first, then the neighbourhood of the best so far, each point's
  goodput measured as `bench goodput` measures it (>= 95% within the SLO, no errors, the
  model's workload mix) on one tritonserver that reloads the changed models between points.
  The winner goes into the profile's `tuned` section for the model, only the knobs that
  differ from the derived ones, with what it measured; then the configs are generated again
  (as `gen-config` does), each bucket config's header saying what was tuned, from what, and
  the goodput before and after. Tuning is optional: the derived configuration is the seed,
  and serving never needs a tuned entry. gen-config applies an entry while the spec's SLO for
  the model is the one it was tuned for; a re-profile of the model drops it. Every point
  goes to --out as it is measured (JSON, a PNG beside it). --dry-run measures and prints
  what it would write, and writes neither the profile nor the configs; --reset removes the
  model's entry and generates the configs again, measuring nothing.

Examples:
  python -m tools tune embed --budget-min 30
  python -m tools tune embed --quick --budget-min 2 --dry-run
  python -m tools tune embed --reset
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from tools.bench.payloads import ModelLookupError, find_model
from tools.bench.search import QUICK, SearchOptions, run_tune
from tools.cli._options import add_point_measuring, non_negative, positive_int
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.planning import search as search_policy
from tools.planning.derivation import InfeasibleSLO
from tools.planning.search import MIN_GAIN, TuneClimb, config_label
from tools.repository.configs import expected_files, external_files, plan_all, plan_embed_model, write_files
from tools.repository.sources import SourceError
from tools.server.triton_server import ServerError
from tools.spec.profile import LatencyProfile, ProfileError, TunedModel, load_profile, save_profile
from tools.spec.serving import BucketedModelSpec, ServingSpec, SpecError, load_spec

EXPLAINED_BY = search_policy
ROUNDS = 3  # the medians of three outvote one lucky or unlucky rate search, as in `bench goodput`
QUICK_ROUNDS = 2  # the short form still measures a replacement twice


def log(message: str) -> None:
    print(message, flush=True)


def command_line() -> str:
    """How this run was started: the tuned entry's `command` (where it was run is the profile's)."""
    return f"python -m tools {shlex.join(sys.argv[1:])}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_point_measuring(parser)
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help=f"results behind a replacement: a neighbour that measured better and the incumbent are "
                             f"measured again until each has this many, and medians decide (default: {ROUNDS}; "
                             f"with --quick {QUICK_ROUNDS})")
    parser.add_argument("--min-gain", type=non_negative, default=MIN_GAIN,
                        help="relative gain over the incumbent's median that a neighbour's median must show, the "
                             "noise of a rate search that stops within 10%% (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="repository whose configs are generated again (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="every point measured, as JSON, a PNG beside it (default: results/tune_MODEL.json)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="measure and print what would be written; write neither the profile nor the configs")
    mode.add_argument("--reset", action="store_true",
                      help="remove the model's tuned entry from the profile and generate the configs again")


def regenerate(spec: ServingSpec, profile: LatencyProfile, repository: Path) -> int:
    """gen-config's write: every config from the spec and the profile; the files written."""
    plan = plan_all(spec, profile)
    written = write_files(expected_files(plan, repository.resolve())) + write_files(external_files(plan))
    log(f"generated the configs again: {len(written)} file(s) written")
    return len(written)


def save_tuned(path: Path, model: str, entry: TunedModel | None) -> LatencyProfile:
    """The profile at `path` with `model`'s tuned entry set (or removed), saved; read again."""
    current = load_profile(path)
    tuned = {name: t for name, t in current.tuned.items() if name != model}
    if entry is not None:
        tuned[model] = entry
    save_profile(replace(current, tuned=tuned), path)
    return load_profile(path)


def header_lines(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, entry: TunedModel) -> list[str]:
    """What the bucket configs' headers would say about the entry."""
    plan = plan_embed_model(model, spec, replace(profile, tuned={**profile.tuned, model.name: entry}))
    return [f"{generated.name}: {line}" for generated in plan if generated.knobs is not None
            for line in generated.header if line.startswith("tuned by")]


def reset(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, repository: Path) -> int:
    if model.name not in profile.tuned:
        log(f"{profile.path} has no tuned entry for {model.name}: nothing to reset")
        return 0
    profile = save_tuned(profile.path, model.name, None)
    log(f"removed the tuned entry of {model.name} from {profile.path}")
    regenerate(spec, profile, repository)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec or DEFAULT_SPEC)
        model = find_model(spec, args.model)
        profile = load_profile(args.profile or spec.profile)
        if args.reset:
            return reset(spec, model, profile, args.model_repository)
    except (SpecError, ProfileError, ModelLookupError, InfeasibleSLO) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    options = QUICK if args.quick else SearchOptions(step_s=args.step_seconds, max_steps=args.max_steps,
                                                    protocol=args.protocol)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    out = args.out or Path(f"results/tune_{model.name}.json")
    command = command_line()
    try:
        report, climb = run_tune(spec, model, profile, options, args.budget_min * 60, rounds, args.min_gain, out,
                                 command, log)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (SpecError, ProfileError, SourceError, InfeasibleSLO, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log(f"wrote {out} ({len(report['points'])} points, {report['measure_s'] / 60:.1f} min measuring)")
    try:
        return conclude(spec, model, profile, climb, command, args.dry_run, args.model_repository)
    except (SpecError, ProfileError, InfeasibleSLO) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def conclude(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, climb: TuneClimb, command: str,
             dry_run: bool, repository: Path) -> int:
    """What a finished climb leaves: nothing when the derived configuration held; else the
    winner's tuned entry printed, and unless `dry_run` written to the profile and the configs
    generated again."""
    entry = climb.tuned_entry(command, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), model.slo_p95_ms)
    if entry is None:
        kept = (f"; the existing entry from {profile.tuned[model.name].tuned_at} stays (--reset removes it)"
                if model.name in profile.tuned else "")
        log(f"the derived configuration held ({climb.median(climb.seed):.1f} req/s, median of "
            f"{climb.count(climb.seed)}): no tuned entry written{kept}")
        return 0
    log(f"winner: {config_label(climb.incumbent)}; goodput {entry.derived_goodput_rps:.1f} -> "
        f"{entry.tuned_goodput_rps:.1f} req/s")
    for line in header_lines(spec, model, profile, entry):
        log(f"  {line}")
    if dry_run:
        log(f"--dry-run: {profile.path} and the configs are left as they were")
        return 0
    profile = save_tuned(profile.path, model.name, entry)
    log(f"wrote the tuned entry of {model.name} to {profile.path}")
    regenerate(spec, profile, repository)
    return 0
