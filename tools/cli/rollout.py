"""Roll out a new encoder version by canary, with automatic rollback.

    python -m tools rollout embed --to 2            # 1% -> 5% -> 25% -> 50% -> 100%, gated
    python -m tools rollout embed --to 2 --dry-run  # print the plan, touch nothing
    python -m tools rollout status embed            # the running or last rollout, and the live split
    python -m tools rollout abort embed             # roll back the running rollout

The server must run in explicit model-control mode (`python -m tools serve` does). The tool
loads the new version of every bucket model through the repository API (with the model's
own config, its version list extended; `model_warmup` runs before the version reports
ready), then moves unpinned traffic step by step by rewriting the router's routing file.
At each step it reads the router's metrics and judges the candidate against the baseline
(`tools.planning.rollout`): error rate, p95 against the SLO, output drift on a shadowed
sample. A failing gate moves all traffic back, waits for the candidate's in-flight requests
and unloads it; success moves all traffic to the candidate and unloads the old version once
its in-flight requests have drained. Every step and gate reading goes to a JSON record.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tools.ops.rollout import (
    DEFAULT_RECORDS,
    FINAL_STATES,
    Recorder,
    RolloutError,
    RolloutLock,
    TritonControl,
    current_table,
    drive,
    embed_model,
    make_plan,
    read_state,
    request_abort,
    roll_back_orphan,
    rollout_running,
)
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.planning.rollout import DEFAULT_STEPS
from tools.repository.configs import ROUTING_FILE
from tools.server.admin_key import AdminKeyError, add_key_file_argument, key_for_tool
from tools.spec.serving import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL | status | abort",
                        help="the model to roll out (e.g. embed), or `status MODEL` / `abort MODEL`")
    parser.add_argument("target", nargs="?", default=None, metavar="MODEL",
                        help="with status or abort: the model")
    parser.add_argument("--to", type=int, help="the encoder version to roll out (its folders must exist)")
    parser.add_argument("--from", dest="from_version", type=int, default=None,
                        help="the baseline version (default: the one taking all traffic now)")
    parser.add_argument("--steps", default=",".join(f"{s:g}" for s in DEFAULT_STEPS),
                        help="candidate traffic percent per step, ending at 100 (default: %(default)s)")
    parser.add_argument("--step-seconds", type=float, default=30.0,
                        help="least time a step lasts, even when its gates pass early (default: %(default)s)")
    parser.add_argument("--max-step-seconds", type=float, default=300.0,
                        help="roll back when a step has not gathered enough data by then (default: %(default)s)")
    parser.add_argument("--max-error-rate", type=float, default=0.01,
                        help="errors gate: failed / answered on the candidate (default: %(default)s)")
    parser.add_argument("--slo-ms", type=float, default=None,
                        help="latency gate: p95 limit in ms (default: the model's SLO in the spec)")
    parser.add_argument("--min-cosine", type=float, default=0.98,
                        help="drift gate of embeddings: mean cosine to the baseline on shadowed rows "
                             "(default: %(default)s)")
    parser.add_argument("--min-top1-agreement", type=float, default=0.99,
                        help="drift gate of classifiers: share of shadowed rows whose top class agrees with the "
                             "baseline's (default: %(default)s)")
    parser.add_argument("--max-logit-diff", type=float, default=0.5,
                        help="drift gate of classifiers: largest absolute logit difference of any shadowed row "
                             "(default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="drift gate of tensor models: largest absolute output difference of any shadowed "
                             "row (required for them; no default)")
    parser.add_argument("--min-requests", type=int, default=20,
                        help="candidate requests a step needs before it can pass (default: %(default)s)")
    parser.add_argument("--min-shadow-samples", type=int, default=10,
                        help="shadowed rows a step needs before the drift gate can pass (default: %(default)s)")
    parser.add_argument("--shadow-rate", type=float, default=0.2,
                        help="share of the candidate's requests repeated on the baseline (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="longest wait for in-flight requests before unloading (default: %(default)s)")
    parser.add_argument("--url", default="localhost:8000", help="tritonserver HTTP address (default: %(default)s)")
    add_key_file_argument(parser)
    parser.add_argument("--metrics-url", default="localhost:8002/metrics",
                        help="tritonserver metrics address (default: %(default)s)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="the served repository; the routing file lives in it (default: %(default)s)")
    parser.add_argument("--records", type=Path, default=DEFAULT_RECORDS,
                        help="where rollout records and state go (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")


def _url(address: str) -> str:
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def show_status(args: argparse.Namespace, model_name: str) -> int:
    state = read_state(args.records, model_name)
    repository = args.model_repository.resolve()
    try:
        table = current_table(repository / model_name / ROUTING_FILE, embed_model(args.spec, model_name))
        print(f"live split of {model_name}: " + ", ".join(f"v{v} {table.share(v):.0%}" for v in table.versions)
              + (f" (candidate v{table.candidate}, shadow {table.shadow_rate:.0%})" if table.candidate else ""))
    except (RolloutError, SpecError, ValueError) as err:
        print(f"live split: unknown ({err})")
    if state is None:
        print(f"no rollout of {model_name} recorded in {args.records}")
        return 0
    running = state.get("status") not in FINAL_STATES
    alive = running and rollout_running(args.records, model_name)
    print(f"rollout v{state['baseline']} -> v{state['candidate']}: {state['status']}"
          + ("" if not running else " (tool running)" if alive else " (tool no longer running: `rollout abort`)"))
    if state.get("reason"):
        print(f"  reason: {state['reason']}")
    for step in state.get("steps", []):
        print(f"  step {step['percent']:g}%: {step.get('verdict', '?')} after {step.get('elapsed_s', 0)} s")
        for reading in step.get("readings", []):
            print(f"    {reading['gate']:<8} {reading['verdict']:<5} {reading['detail']}")
    print(f"  record: {state.get('record')}")
    return 0


def abort(args: argparse.Namespace, model_name: str) -> int:
    state = read_state(args.records, model_name)
    if state is None or state.get("status") in FINAL_STATES:
        print(f"no rollout of {model_name} is running")
        return 1
    if rollout_running(args.records, model_name):
        request_abort(args.records, model_name)
        print(f"abort requested; the rollout (pid {state.get('pid', '?')}) rolls back at its next check", flush=True)
        deadline = time.monotonic() + args.drain_timeout + 60
        while time.monotonic() < deadline:
            time.sleep(0.5)
            current = read_state(args.records, model_name) or {}
            if current.get("status") in FINAL_STATES:
                print(f"rollout {current['status']}: {current.get('reason', '')}")
                return 0
        print("the rollout did not finish rolling back in time; see `rollout status`", file=sys.stderr)
        return 1
    # The tool died mid-rollout (its lock went with it): put traffic back on the baseline ourselves.
    roll_back_orphan(args.records, args.spec, args.model_repository, model_name, state)
    print(f"the rollout tool is gone; all traffic moved back to v{state['baseline']}. Version {state['candidate']} "
          "stays loaded with no traffic; unload it with the repository API if it should go.")
    return 0


def already_running(args: argparse.Namespace) -> str:
    pid = (read_state(args.records, args.model) or {}).get("pid", "?")
    return f"error: a rollout of {args.model} is already running (pid {pid}); see `rollout status`"


def run(args: argparse.Namespace) -> int:
    try:
        if args.model in ("status", "abort"):
            if not args.target:
                print(f"error: `rollout {args.model}` needs the model name", file=sys.stderr)
                return 2
            return show_status(args, args.target) if args.model == "status" else abort(args, args.target)
        if args.to is None:
            print("error: say which version to roll out with --to VERSION", file=sys.stderr)
            return 2
        if rollout_running(args.records, args.model):
            print(already_running(args), file=sys.stderr)
            return 2
        plan = make_plan(args.spec, args.model, args.model_repository, args.to, from_version=args.from_version,
                         steps=args.steps, slo_ms=args.slo_ms, max_error_rate=args.max_error_rate,
                         min_cosine=args.min_cosine, min_top1_agreement=args.min_top1_agreement,
                         max_logit_diff=args.max_logit_diff, tolerance=args.tolerance, min_requests=args.min_requests,
                         min_shadow_samples=args.min_shadow_samples, shadow_rate=args.shadow_rate,
                         step_seconds=args.step_seconds, max_step_seconds=args.max_step_seconds)
    except (RolloutError, SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan.describe(), flush=True)
    if args.dry_run:
        print("dry run: nothing changed")
        return 0
    try:
        admin_key = key_for_tool(args)
    except AdminKeyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lock = RolloutLock(args.records, plan.model.name)
    if not lock.acquire():  # another rollout started since the check above
        print(already_running(args), file=sys.stderr)
        return 2
    try:
        control = TritonControl(_url(args.url), _url(args.metrics_url), admin_key=admin_key)
        recorder = Recorder(args.records, plan.model.name)
        code = drive(plan, control, args.model_repository, recorder, drain_timeout_s=args.drain_timeout)
    finally:
        lock.release()
    print(f"record: {recorder.path}")
    return code
