"""A live terminal view of every model: rate, p95 against its SLO, queue vs compute, batches, rejections.

Reads /metrics every --interval seconds and shows what happened over the last window:
  models   requests/s, failures, end-to-end p95 against the SLO (the router) or time to
           first token (the LLM), mean queue and compute time per request, the batches Triton
           formed (mean rows, and p95 from the kit's histogram), requests pending now;
  versions the router's split over encoder versions, with each version's p95 and outcomes;
  tenants  requests per tenant and tier: served, rejected (server busy), over quota, refused for a bad
           tenant credential (tenant "unknown");
  buckets  padding waste per length bucket (padded token slots / real tokens), and the share of
           its rows the express model served (light traffic; the bucket model lingers at peak);
  llm      running and waiting sequences, KV-cache blocks in use.

  python -m tools top                                   # refresh every 2 s until Ctrl-C
  python -m tools top --once --interval 5               # one table after 5 s, then exit
  python -m tools top --record run.jsonl.gz --duration 120   # also keep every snapshot
  python -m tools top --replay run.jsonl.gz --interval 10     # the last 10 s of a recording
"""

# The `top` command: reads /metrics (or a recording), keeps a recording, draws the tables of
# tools.observe.top. The docstring above is its --help text.

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tools.observe.metrics import Snapshot, Window, open_recording, read_recording, snapshot_line, take_snapshot
from tools.observe.top import render
from tools.spec.serving import load_spec


def slos_from_spec(spec_path: Path | None) -> dict[str, float]:
    spec = load_spec(spec_path) if spec_path else load_spec()
    return {model.name: model.slo_p95_ms for model in spec.models}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="the server's metrics endpoint")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    parser.add_argument("--once", action="store_true", help="print one table after one interval, then exit")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (default: never)")
    parser.add_argument("--record", type=Path, default=None,
                        help="append every snapshot to this JSON-lines file, gzip-compressed if it ends in .gz "
                             "(replay it with explain/autoscale --replay)")
    parser.add_argument("--replay", type=Path, default=None,
                        help="print the last --interval seconds of a recording instead of reading a server")
    parser.add_argument("--spec", type=Path, default=None, help="serving spec, for the SLOs (default serving.toml)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    if args.interval <= 0 or args.duration < 0:
        print("error: --interval must be > 0 and --duration >= 0", file=sys.stderr)
        return 2
    slos = slos_from_spec(args.spec)
    console = Console()
    if args.replay is not None:
        try:
            snapshots = read_recording(args.replay)
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        end = snapshots[-1]
        start = next((s for s in reversed(snapshots) if end.at_s - s.at_s >= args.interval), snapshots[0])
        console.print(render(Window(start, end), slos))
        return 0
    record = open_recording(args.record, "at") if args.record else None

    def read() -> Snapshot:
        snapshot = take_snapshot(args.metrics_url)
        if record is not None:
            record.write(snapshot_line(snapshot))
            record.flush()
        return snapshot

    try:
        previous = read()
        started = previous.at_s
        if args.once:
            time.sleep(args.interval)
            console.print(render(Window(previous, read()), slos))
            return 0
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while not args.duration or previous.at_s - started < args.duration:
                time.sleep(args.interval)
                current = read()
                live.update(render(Window(previous, current), slos), refresh=True)
                previous = current
    except KeyboardInterrupt:
        return 0
    except OSError as err:
        print(f"error: cannot read {args.metrics_url}: {err}; is the server running (python -m tools serve)?",
              file=sys.stderr)
        return 1
    finally:
        if record is not None:
            record.close()
    return 0
