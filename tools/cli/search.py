"""Search the batching knobs of one model for the best goodput, phase by phase, within a budget.

What is measured of each point, and where:
  every point's goodput is `bench goodput`'s criterion (the highest offered open-loop rate
  with >= 95% of requests within the SLO and no errors) on the model's workload mix, on one
  tritonserver that reloads the changed models between points (build/bench/search/MODEL);
  the configs are gen-config's own with the point's knobs written over the derived ones.
  Every point measured (its knobs, goodput and seconds) goes to --out after each one, with a
  plot beside it; a run started again with the same --out resumes: the points measured
  before are not measured again (the same model, spec, profile measurements and measuring
  options, else it refuses; --restart starts over). The budget is this run's.

Examples:
  python -m tools search embed --budget-min 45
  python -m tools search embed --quick --budget-min 2 --out build/search_embed.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.bench.payloads import ModelLookupError, find_model
from tools.bench.search import QUICK, ResumeError, SearchOptions, run_search
from tools.cli._options import add_point_measuring, command_line, positive_int
from tools.paths import DEFAULT_SPEC
from tools.planning import search as search_policy
from tools.planning.derivation import InfeasibleSLO
from tools.repository.sources import SourceError
from tools.server.triton_server import ServerError
from tools.spec.profile import ProfileError, load_profile
from tools.spec.serving import SpecError, load_spec

EXPLAINED_BY = search_policy
TOP_K = 2  # 2 per bucket: embed's five bucket models make 32 joint configurations
POINTS_PER_BUCKET = 4


def log(message: str) -> None:
    print(message, flush=True)


def measuring_options(args: argparse.Namespace) -> SearchOptions:
    if args.quick:
        return QUICK
    return SearchOptions(step_s=args.step_seconds, max_steps=args.max_steps, protocol=args.protocol)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_point_measuring(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="the report: every point measured, as JSON, a PNG beside it; resumed when it exists "
                             "(default: results/search_MODEL.json)")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help=f"candidates each bucket model keeps from phase 1 for the joint phase (default: "
                             f"{TOP_K}; with --quick 1)")
    parser.add_argument("--points-per-bucket", type=positive_int, default=None,
                        help=f"phase-1 points of each bucket model at most, the most promising first (default: "
                             f"{POINTS_PER_BUCKET}; with --quick 1)")
    parser.add_argument("--restart", action="store_true", help="measure from scratch, overwriting --out")


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec or DEFAULT_SPEC)
        model = find_model(spec, args.model)
        profile = load_profile(args.profile or spec.profile)
    except (SpecError, ProfileError, ModelLookupError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or Path(f"results/search_{model.name}.json")
    points_per_bucket = args.points_per_bucket or (1 if args.quick else POINTS_PER_BUCKET)
    top_k = args.top_k or (1 if args.quick else TOP_K)
    try:
        report = run_search(spec, model, profile, measuring_options(args), args.budget_min * 60, top_k,
                            points_per_bucket, out, args.restart, command_line(), log)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (ResumeError, SpecError, ProfileError, SourceError, InfeasibleSLO, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log(f"wrote {out} ({len(report['points'])} points, {report['measure_s'] / 60:.1f} min measuring) and "
        f"{out.with_suffix('.png')}")
    return 0
