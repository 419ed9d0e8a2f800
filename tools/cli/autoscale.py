"""Desired replicas from leading signals, with hysteresis and a cool-down fit for GPU pods.

  python -m tools autoscale embed                      # live: a decision every 10 s
  python -m tools autoscale embed --replay tests/data/metrics/overload.jsonl.gz
"""

# The `autoscale` command: reads the server (or a recording) and the served configs, and prints
# the decisions of tools.planning.autoscale, whose docstring --help shows before the examples.

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable

from tools.cli._options import add_server_or_recording
from tools.observe.explain import (
    ServiceWindow,
    knobs_from_repository,
    knobs_from_server,
    service_layout,
    service_window,
)
from tools.observe.metrics import Window, read_recording, take_snapshot
from tools.observe.scaling import default_pending_per_replica, replay, signals_from
from tools.planning import autoscale as policy
from tools.planning.autoscale import AutoscalePolicy, AutoscaleState, Decision, decide

EXPLAINED_BY = policy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the served model to scale (the router: embed)")
    add_server_or_recording(parser, "decide over a recording (from `python -m tools top --record`) instead of a server")
    parser.add_argument("--replicas", type=int, default=1,
                        help="replicas whose traffic the metrics show (default 1: this server)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds per window and decision (default 10)")
    parser.add_argument("--count", type=int, default=0, help="decisions to make, then exit (default 0: until Ctrl-C)")
    parser.add_argument("--min-replicas", type=int, default=1, help="never fewer (default 1)")
    parser.add_argument("--max-replicas", type=int, default=32, help="never more (default 32)")
    parser.add_argument("--startup-s", type=float, default=60.0,
                        help="seconds a new pod takes to serve: no second scale-up before (default 60)")
    parser.add_argument("--scale-down-window-s", type=float, default=300.0,
                        help="seconds of low pressure before scaling down (default 300)")
    parser.add_argument("--pending-per-replica", type=float, default=None,
                        help="requests pending at the bucket models per replica at target (default: one "
                             "preferred batch per bucket-model instance, from the served configs)")
    parser.add_argument("--json", action="store_true", help="one JSON object per decision")


def _print(decision: Decision, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"at_s": decision.at_s, "desired_replicas": decision.desired,
                          "pressure": round(decision.pressure, 3),
                          "ratios": {k: round(v, 3) for k, v in decision.ratios.items()}, "reason": decision.reason}),
              flush=True)
    else:
        print(f"{time.strftime('%H:%M:%S', time.localtime(decision.at_s))}  desired {decision.desired}  "
              f"{decision.reason}", flush=True)


def _live(args: argparse.Namespace, view_of, policy: AutoscalePolicy) -> Iterable[Decision]:
    state = AutoscaleState(desired=args.replicas)
    earlier: Window | None = None
    start = take_snapshot(args.metrics_url)
    made = 0
    while args.count == 0 or made < args.count:
        time.sleep(args.interval)
        end = take_snapshot(args.metrics_url)
        window = Window(start, end)
        decision = decide(signals_from(view_of(window, earlier), args.replicas, end.at_s), state, policy)
        state, earlier, start = decision.state, window, end
        made += 1
        yield decision


def run(args: argparse.Namespace) -> int:
    if args.replicas < 1 or args.interval <= 0 or args.count < 0:
        print("error: --replicas must be >= 1, --interval > 0 and --count >= 0", file=sys.stderr)
        return 2
    try:
        layout = service_layout(args.model, args.spec)
        if layout.slo_p95_ms is None:
            print(f"error: the serving spec gives no SLO for {args.model!r}; autoscale a served router "
                  "(e.g. embed)", file=sys.stderr)
            return 2
        if args.replay is not None:
            knobs = knobs_from_repository(layout.bucket_models, args.repository)
        else:
            knobs = knobs_from_server(layout.bucket_models, args.http_url)
        policy = AutoscalePolicy(
            slo_p95_ms=layout.slo_p95_ms,
            pending_per_replica=args.pending_per_replica or default_pending_per_replica(knobs),
            min_replicas=args.min_replicas, max_replicas=args.max_replicas, startup_s=args.startup_s,
            scale_down_window_s=args.scale_down_window_s)

        def view_of(window: Window, earlier: Window | None) -> ServiceWindow:
            return service_window(window, layout, knobs, earlier=earlier)

        if args.replay is not None:
            decisions = replay(read_recording(args.replay), view_of, policy, args.interval, args.replicas)
        else:
            decisions = _live(args, view_of, policy)
        for decision in decisions:
            _print(decision, args.json)
    except KeyboardInterrupt:
        return 0
    except OSError as err:
        print(f"error: cannot read the server: {err}; is it running (python -m tools serve)?", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
