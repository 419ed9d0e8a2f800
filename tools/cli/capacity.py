"""How many GPUs (replicas) for N requests per minute at model latency X and batch size Y.

  python -m tools capacity --rpm 60000 --latency-ms 12 --batch 32 --instances 2
  python -m tools capacity --rpm 6000 --profile profiles/cpu.json --model encoder_64           # best batch
  python -m tools capacity --rpm 6000 --profile profiles/cpu.json --model encoder_64 --batch 8 --json
  python -m tools capacity --replay run.jsonl.gz --model encoder_16    # the batches traffic really formed

With --replay, X and Y are what a recording of /metrics shows (`python -m tools top --record`):
the mean rows per batch the bucket model formed and the mean compute time of those
batches, and N is the rate it carried unless --rpm says otherwise. Beside it, the plan at
the preferred batch size of the served config, with the profile's c(b): the gap is what
thin batches cost, e.g. traffic fragmented over versions during a rollout.
"""

# The `capacity` command: reads a latency profile, the serving spec or a recording, and prints the
# plans of tools.planning.capacity, whose docstring --help shows before the text above.

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tools.observe.explain import knobs_from_repository, service_layout
from tools.observe.metrics import Window, read_recording
from tools.observe.scaling import observed_batches
from tools.paths import DEFAULT_MODEL_REPOSITORY
from tools.planning import capacity as planning
from tools.planning.capacity import (
    DEFAULT_UTILIZATION,
    Demand,
    Observed,
    Plan,
    best,
    candidates,
    observed_plans,
    plan,
)
from tools.spec.profile import LatencyCurve, load_profile
from tools.spec.serving import load_spec

EXPLAINED_BY = planning


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rpm", type=float, default=None,
                        help="demand N: requests per minute (required unless --replay gives the recorded rate)")
    parser.add_argument("--rows-per-request", type=float, default=1.0, help="rows one request carries (default 1)")
    parser.add_argument("--latency-ms", type=float, default=None,
                        help="X: milliseconds one batch of --batch rows takes (without --profile)")
    parser.add_argument("--batch", type=int, default=None,
                        help="Y: rows per batch; with --profile, omit it to pick the batch needing fewest replicas")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a latency profile (profiles/<hardware>.json): X is its measured c(Y) for --model")
    parser.add_argument("--model", default=None, help="the bucket model of --profile (e.g. encoder_64)")
    parser.add_argument("--instances", type=int, default=1,
                        help="batches one replica runs side by side (model instances per GPU; default 1)")
    parser.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION,
                        help=f"busy share to plan each replica for, (0, 1] (default {DEFAULT_UTILIZATION})")
    parser.add_argument("--slo-ms", type=float, default=None,
                        help="p95 SLO in ms: batches with o + 2 X above it are refused (default: serving.toml's "
                             "with --profile, none otherwise)")
    parser.add_argument("--overhead-ms", type=float, default=None,
                        help="o: ms outside the model (default: the profile's router overhead p95, else 0)")
    parser.add_argument("--gpu-hour-cost", type=float, default=None, help="USD per replica-hour: adds cost per 1M")
    parser.add_argument("--replay", type=Path, default=None,
                        help="a /metrics recording: X and Y as the --model's batches really were over its last "
                             "--window seconds, N its rate (unless --rpm)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of the recording to read (default 20)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _profile_inputs(args: argparse.Namespace) -> tuple[LatencyCurve, float | None, float]:
    if not args.model:
        raise ValueError("--profile needs --model (one of the profile's bucket models)")
    profile = load_profile(args.profile)
    curve = profile.curve(args.model)
    slo = args.slo_ms
    overhead = args.overhead_ms
    spec = load_spec()
    for model in spec.models:
        if args.model in {model.encoder_name(b) for b in model.bucket_lens}:
            slo = slo if slo is not None else model.slo_p95_ms
            if overhead is None and model.name in profile.overhead:
                overhead = profile.overhead_for(model.name).p95_ms
    return curve, slo, overhead or 0.0


def _print_plan(chosen: Plan, demand: Demand, table: Sequence[Plan | str], source: str) -> None:
    print(f"demand: N = {demand.requests_per_min:,.0f} requests/min x {demand.rows_per_request:g} rows "
          f"= R = {chosen.rows_per_s_needed:,.1f} rows/s; plan each replica at u = {demand.utilization:.0%} busy")
    print(f"per replica: T = instances x Y / X = {chosen.instances} x {chosen.batch:g} rows / "
          f"{chosen.latency_ms:.1f} ms = {chosen.rows_per_s_per_replica:,.1f} rows/s ({source})")
    print(chosen.formula(demand))
    plural = "" if chosen.replicas == 1 else "s"
    print(f"at {chosen.replicas} replica{plural}, each runs {chosen.utilization_at_replicas:.0%} busy")
    if demand.slo_p95_ms is not None:
        print(f"SLO check: o + 2 X = {demand.overhead_ms:.1f} + 2 x {chosen.latency_ms:.1f} = "
              f"{demand.overhead_ms + 2 * chosen.latency_ms:.1f} ms <= {demand.slo_p95_ms:.0f} ms")
    if chosen.cost_per_million_usd is not None:
        print(f"cost: {chosen.replicas} x replica-hour / ({demand.requests_per_min:,.0f} x 60 requests) x 1M "
              f"= ${chosen.cost_per_million_usd:,.2f} per million requests")
    if len(table) > 1:
        print("\nbatch   X ms   rows/s per replica   replicas")
        for entry in table:
            if isinstance(entry, Plan):
                mark = "  <- fewest replicas" if entry is chosen else ""
                print(f"{entry.batch:>5} {entry.latency_ms:>6.1f} {entry.rows_per_s_per_replica:>20,.1f} "
                      f"{entry.replicas:>10}{mark}")
            else:
                print(f"  {entry}")


def _replay_inputs(args: argparse.Namespace) -> tuple[Observed, LatencyCurve | None, float | None, float]:
    if not args.model:
        raise ValueError("--replay needs --model (a bucket model, e.g. encoder_16)")
    snapshots = read_recording(args.replay)
    end = snapshots[-1]
    start = next((s for s in reversed(snapshots) if end.at_s - s.at_s >= args.window), snapshots[0])
    knobs = knobs_from_repository([args.model], DEFAULT_MODEL_REPOSITORY).get(args.model)
    observed = observed_batches(Window(start, end), args.model, knobs.preferred_batch if knobs else None)
    spec = load_spec()
    layout = service_layout(args.model)
    curve, overhead = None, 0.0
    profile_path = args.profile or spec.profile
    if profile_path is not None and Path(profile_path).is_file():
        profile = load_profile(profile_path)
        curve = profile.models[args.model].curve if args.model in profile.models else None
        routers = [m.name for m in spec.models if args.model in {m.encoder_name(b) for b in m.bucket_lens}]
        if routers and routers[0] in profile.overhead:
            overhead = profile.overhead_for(routers[0]).p95_ms
    slo = args.slo_ms if args.slo_ms is not None else layout.slo_p95_ms
    return observed, curve, slo, args.overhead_ms if args.overhead_ms is not None else overhead


def run(args: argparse.Namespace) -> int:
    if args.rpm is None and args.replay is None:
        print("error: give --rpm (or --replay, whose recorded rate is the demand)", file=sys.stderr)
        return 2
    if args.replay is not None:
        return _run_replay(args)
    try:
        if args.profile is not None:
            curve, slo, overhead = _profile_inputs(args)
            demand = Demand(args.rpm, args.rows_per_request, args.utilization, slo, overhead)
            if args.batch is not None:
                if args.batch > curve.max_measured or args.batch < 1:
                    raise ValueError(f"batch {args.batch} was not measured: the profile has {args.model} at batch "
                                     f"sizes {curve.sizes}; re-run python -m tools profile for larger ones")
                table: list[Plan | str] = [plan(demand, args.batch, curve.at(args.batch), args.instances,
                                                args.gpu_hour_cost)]
            else:
                table = candidates(demand, curve, args.instances, args.gpu_hour_cost)
            chosen = best(table)
            source = f"measured c({chosen.batch}) of {args.model} in {args.profile}"
        else:
            if args.latency_ms is None or args.batch is None:
                print("error: give --latency-ms and --batch, or --profile with --model", file=sys.stderr)
                return 2
            demand = Demand(args.rpm, args.rows_per_request, args.utilization, args.slo_ms, args.overhead_ms or 0.0)
            table = [plan(demand, args.batch, args.latency_ms, args.instances, args.gpu_hour_cost)]
            chosen = table[0]
            source = "as given"
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"demand": asdict(demand), "plan": asdict(chosen), "formula": chosen.formula(demand),
                          "candidates": [asdict(p) if isinstance(p, Plan) else p for p in table]}, indent=2))
    else:
        _print_plan(chosen, demand, table, source)
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    try:
        observed, curve, slo, overhead = _replay_inputs(args)
        demand = Demand(args.rpm or observed.requests_per_min, args.rows_per_request, args.utilization, None, overhead)
        as_formed, preferred = observed_plans(observed, demand, args.instances, curve, args.gpu_hour_cost)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"observed": asdict(observed), "demand": asdict(demand), "as_formed": asdict(as_formed),
                          "at_preferred": asdict(preferred) if preferred else None,
                          "formula": as_formed.formula(demand)}, indent=2))
        return 0
    print(f"{observed.model} in {args.replay}: {observed.requests_per_min / 60:,.1f} rows/s in batches of "
          f"{observed.mean_batch_rows:.2f} rows taking {observed.batch_ms:.1f} ms"
          + (f" (SLO {slo:.0f} ms)" if slo else ""))
    _print_plan(as_formed, demand, [as_formed], "as the recording shows them")
    if preferred is not None:
        extra = as_formed.replicas - preferred.replicas
        print(f"\nat the preferred batch of {preferred.batch} (profile c({preferred.batch}) = "
              f"{preferred.latency_ms:.1f} ms): {preferred.formula(demand)}")
        if extra > 0:
            print(f"thin batches cost {extra} replica{'' if extra == 1 else 's'}; python -m tools explain on the "
                  "router says why they are thin")
    return 0
