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
(`tools.planning.rollout`): error rate, p95 against the SLO, embedding drift on a shadowed
sample. A failing gate moves all traffic back, waits for the candidate's in-flight requests
and unloads it; success moves all traffic to the candidate and unloads the old version once
its in-flight requests have drained. Every step and gate reading goes to a JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.metric_buffer import DEFAULT_FLUSH_INTERVAL_S
from python_backends.common.shared_files import boot_id, process_start_ticks
from python_backends.embed.routing import RoutingSource, RoutingTable, read_routing_table, write_routing_table
from tools.observe.metrics import parse_exposition
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC, REPO_ROOT
from tools.planning.rollout import (
    DEFAULT_STEPS,
    Gates,
    Snapshot,
    Verdict,
    baseline_of,
    evaluate_gates,
    parse_steps,
    snapshot_from_samples,
    step_verdict,
    step_weights,
)
from tools.repository.configs import ROUTING_FILE
from tools.server.admin_key import AdminKeyError, add_key_file_argument, admin_headers, key_for_tool
from tools.spec.serving import EmbedModelSpec, SpecError, load_spec

DEFAULT_RECORDS = REPO_ROOT / "rollouts"
FINAL_STATES = ("promoted", "rolled_back", "aborted", "failed")

# Before trusting the router's in-flight gauge at zero: every router instance has re-read the
# routing file (so no new request picks the drained version) and has flushed its buffered
# gauge at least once since (a flush may run late by up to one more interval on busy cores).
DRAIN_SETTLE_S = RoutingSource.check_interval_s + 2 * DEFAULT_FLUSH_INTERVAL_S


class RolloutError(RuntimeError):
    """The rollout cannot start or continue; the message says why."""


@dataclass
class TritonControl:
    """The server's repository, readiness and metrics endpoints."""

    http_url: str  # e.g. http://localhost:8000
    metrics_url: str  # e.g. http://localhost:8002/metrics
    timeout_s: float = 300.0  # loading with warm-up can take a while
    admin_key: str | None = field(default=None, repr=False)  # sent to the repository endpoints

    @property
    def admin_headers(self) -> dict[str, str]:
        return admin_headers(self.admin_key)

    def loaded_versions(self, model: str) -> set[int]:
        response = requests.post(f"{self.http_url}/v2/repository/index", json={}, headers=self.admin_headers,
                                 timeout=30)
        response.raise_for_status()
        return {int(entry["version"]) for entry in response.json()
                if entry.get("name") == model and entry.get("state") == "READY" and entry.get("version")}

    def is_ready(self, model: str, version: int) -> bool:
        try:
            return requests.get(f"{self.http_url}/v2/models/{model}/versions/{version}/ready", timeout=10).ok
        except requests.RequestException:
            return False

    def load(self, config: mc.ModelConfig) -> None:
        """Load (or reload) a model with this config; Triton keeps serving the old set until the new is ready."""
        body = {"parameters": {"config": json_format.MessageToJson(config)}}
        response = requests.post(f"{self.http_url}/v2/repository/models/{config.name}/load", json=body,
                                 headers=self.admin_headers, timeout=self.timeout_s)
        if not response.ok:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            raise RolloutError(f"loading {config.name} versions {list(config.version_policy.specific.versions)} "
                               f"failed: {message}")

    def metrics(self) -> str:
        response = requests.get(self.metrics_url, timeout=10)
        response.raise_for_status()
        return response.text


def read_config(repository: Path, model: str) -> mc.ModelConfig:
    path = repository / model / "config.pbtxt"
    if not path.is_file():
        raise RolloutError(f"{path} not found")
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def with_versions(config: mc.ModelConfig, versions: Sequence[int]) -> mc.ModelConfig:
    changed = mc.ModelConfig()
    changed.CopyFrom(config)
    changed.version_policy.specific.ClearField("versions")
    changed.version_policy.specific.versions.extend(sorted(versions))
    return changed


@dataclass
class RolloutPlan:
    """What a rollout will do, checked before anything changes."""

    model: EmbedModelSpec
    baseline: int
    candidate: int
    steps: tuple[float, ...]
    gates: Gates
    shadow_rate: float
    min_step_s: float
    max_step_s: float
    routing_path: Path
    encoders: tuple[str, ...]

    def describe(self) -> str:
        g = self.gates
        lines = [
            f"roll out {self.model.name}: encoder version {self.baseline} -> {self.candidate} "
            f"on {', '.join(self.encoders)}",
            f"  load v{self.candidate} of every bucket model (warm-up runs before it reports ready)",
            "  steps (candidate share of unpinned traffic): " + " -> ".join(f"{s:g}%" for s in self.steps),
            f"  each step lasts at least {self.min_step_s:g} s, at most {self.max_step_s:g} s waiting for data",
            f"  gates: error rate <= {g.max_error_rate:.1%}; p95 <= {g.slo_p95_ms:g} ms (SLO); mean cosine vs "
            f"v{self.baseline} >= {g.min_cosine} on a {self.shadow_rate:.0%} shadowed sample; "
            f"at least {g.min_requests} requests and {g.min_shadow_samples} shadowed rows per step",
            f"  pass: all traffic to v{self.candidate}, unload v{self.baseline} after its in-flight requests drain",
            f"  fail: all traffic back to v{self.baseline}, unload v{self.candidate}; the record says which gate",
            f"  routing file: {self.routing_path}",
        ]
        return "\n".join(lines)


@dataclass
class Recorder:
    """The JSON record of one rollout, rewritten after every change, plus the model's state file."""

    records_dir: Path
    model: str
    record: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def state_path(self) -> Path:
        return state_path(self.records_dir, self.model)

    def start(self, plan: RolloutPlan) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.path = self.records_dir / f"{self.model}-{stamp}-v{plan.baseline}-to-v{plan.candidate}.json"
        self.record = {
            "model": self.model, "baseline": plan.baseline, "candidate": plan.candidate,
            "steps_planned": list(plan.steps), "gates": vars(plan.gates), "shadow_rate": plan.shadow_rate,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **process_stamp(os.getpid()),
            "status": "loading", "steps": [], "events": [],
        }
        self.save()

    def event(self, text: str, **extra) -> None:
        self.record["events"].append({"t": round(time.time(), 3), "event": text, **extra})
        print(text, flush=True)
        self.save()

    def save(self) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        for target, data in ((self.path, self.record),
                             (self.state_path, {**self.record, "record": str(self.path)})):
            staging = target.with_name(f".{target.name}.tmp")
            staging.write_text(json.dumps(data, indent=2) + "\n")
            os.replace(staging, target)

    def abort_requested(self) -> bool:
        try:
            return bool(json.loads(self.state_path.read_text()).get("abort_requested"))
        except (OSError, ValueError):
            return False


def state_path(records_dir: Path, model: str) -> Path:
    return records_dir / f"{model}.state.json"


def read_state(records_dir: Path, model: str) -> dict | None:
    try:
        return json.loads(state_path(records_dir, model).read_text())
    except FileNotFoundError:
        return None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_stamp(pid: int) -> dict[str, Any]:
    """What names process `pid` beyond its id, which the system reuses: its start time and the boot."""
    return {"pid": pid, "pid_start_ticks": process_start_ticks(pid), "boot_id": boot_id()}


def same_process(stamp: Mapping[str, Any], running: bool, start_ticks: int | None, boot: str | None) -> bool:
    """Whether the process a state file stamped still runs, given what runs under its pid now.

    A pid alone says little once the tool is gone: the system hands it to a later process
    (after a reboot, almost surely). So the start time and the boot must match where both
    were recorded and can be read now; a stamp of an older tool, with the pid only, is
    judged by the pid.
    """
    if not running:
        return False
    recorded_boot, recorded_start = stamp.get("boot_id"), stamp.get("pid_start_ticks")
    if recorded_boot is not None and boot is not None and recorded_boot != boot:
        return False
    return recorded_start is None or start_ticks is None or int(recorded_start) == start_ticks


def tool_alive(state: Mapping[str, Any]) -> bool:
    """Whether the rollout tool that wrote `state` still runs."""
    pid = int(state.get("pid", 0) or 0)
    running = pid_alive(pid)
    return same_process(state, running, process_start_ticks(pid) if running else None, boot_id())


class Rollout:
    """Runs one planned rollout against a server."""

    def __init__(self, plan: RolloutPlan, control: TritonControl, repository: Path, recorder: Recorder,
                 poll_s: float = 1.0, drain_timeout_s: float = 120.0, sleep: Callable[[float], None] = time.sleep):
        self.plan = plan
        self.control = control
        self.repository = repository
        self.recorder = recorder
        self.poll_s = poll_s
        self.drain_timeout_s = drain_timeout_s
        self.sleep = sleep
        self.loaded_before: dict[str, set[int]] = {}
        self.generation = 0

    def _route(self, table_weights: dict[int, float], candidate: int | None = None) -> None:
        self.generation += 1
        shadow = self.plan.shadow_rate if candidate is not None else 0.0
        table = RoutingTable(table_weights, candidate=candidate,
                             baseline=self.plan.baseline if candidate is not None else None,
                             shadow_rate=shadow, generation=self.generation)
        write_routing_table(self.plan.routing_path, table)

    def _snapshot(self) -> Snapshot:
        try:
            series = parse_exposition(self.control.metrics())
        except ValueError as err:
            raise RolloutError(f"{self.control.metrics_url} is not a metrics page: {err}") from None
        return snapshot_from_samples(series, self.plan.model.name)

    def _load_versions(self, encoder: str, versions: set[int]) -> None:
        """Have `encoder` serve exactly `versions`, with its own config from the repository."""
        self.control.load(with_versions(read_config(self.repository, encoder), versions))

    def load_candidate(self) -> None:
        plan = self.plan
        started = time.monotonic()
        for encoder in plan.encoders:
            self.loaded_before[encoder] = self.control.loaded_versions(encoder)
            if plan.baseline not in self.loaded_before[encoder]:
                raise RolloutError(f"{encoder} does not serve the baseline version {plan.baseline} "
                                   f"(loaded: {sorted(self.loaded_before[encoder])})")
        missing = [e for e in plan.encoders if plan.candidate not in self.loaded_before[e]]
        if missing:
            self.recorder.event(f"loading v{plan.candidate} of {', '.join(missing)} ...")
            for encoder in missing:
                versions = self.loaded_before[encoder] | {plan.candidate}
                self._load_versions(encoder, versions)
        not_ready = [e for e in plan.encoders if not self.control.is_ready(e, plan.candidate)]
        if not_ready:
            raise RolloutError(f"v{plan.candidate} of {', '.join(not_ready)} did not become ready")
        self.recorder.event(f"v{plan.candidate} ready on every bucket model "
                            f"({time.monotonic() - started:.1f} s, warm-up included)")

    def run(self) -> int:
        plan, rec = self.plan, self.recorder
        rec.start(plan)
        try:
            self.load_candidate()
        except (RolloutError, requests.RequestException) as err:
            rec.record.update(status="failed", reason=str(err))
            rec.event(f"rollout failed before any traffic moved: {err}")
            self._restore_versions(keep=plan.baseline)
            return 1
        for percent in plan.steps:
            outcome, reason = self._run_step(percent)
            if outcome is not Verdict.PASS:
                return self._roll_back(reason, aborted=outcome is None)
        return self._promote()

    def _run_step(self, percent: float) -> tuple[Verdict | None, str]:
        plan, rec = self.plan, self.recorder
        self._route(step_weights(plan.baseline, plan.candidate, percent), candidate=plan.candidate)
        rec.record["status"] = f"step {percent:g}%"
        rec.event(f"step {percent:g}%: v{plan.candidate} takes {percent:g}% of unpinned traffic")
        # Routers re-read the file within a quarter second; let that pass before the window opens.
        self.sleep(0.5)
        start, started = self._snapshot(), time.monotonic()
        step = {"percent": percent, "started_at": round(time.time(), 3), "readings": []}
        rec.record["steps"].append(step)
        while True:
            self.sleep(self.poll_s)
            if rec.abort_requested():
                step["verdict"] = "aborted"
                return None, "aborted by the operator (`rollout abort`)"
            window = self._snapshot().minus(start)
            readings = evaluate_gates(window, plan.baseline, plan.candidate, plan.gates)
            elapsed = time.monotonic() - started
            verdict, why = step_verdict(readings, elapsed, plan.min_step_s, plan.max_step_s)
            step.update(elapsed_s=round(elapsed, 2), readings=[r.to_json() for r in readings], verdict=verdict.value,
                        why=why, requests={"candidate": window.version(plan.candidate).answered,
                                           "baseline": window.version(plan.baseline).answered})
            rec.save()
            print(f"  {percent:>5g}%  {elapsed:5.1f} s  " + "  ".join(
                f"{r.gate}={'-' if r.value is None else f'{r.value:.4g}'}({r.verdict.value})" for r in readings),
                flush=True)
            if verdict is not Verdict.WAIT:
                return verdict, why

    def _wait_drain(self, version: int) -> dict:
        """Wait until the router has no request in flight on `version`; return what was seen."""
        started = time.monotonic()
        peak = self._snapshot().version(version).inflight  # what was in flight when draining began
        self.sleep(DRAIN_SETTLE_S)
        while True:
            inflight = self._snapshot().version(version).inflight
            peak = max(peak, inflight)
            waited = time.monotonic() - started
            if inflight <= 0 or waited > self.drain_timeout_s:
                return {"version": version, "waited_s": round(waited, 2), "max_inflight_seen": peak,
                        "timed_out": inflight > 0}
            self.sleep(0.2)

    def _restore_versions(self, keep: int) -> None:
        """Put every bucket model back to the versions it served before, keeping `keep`."""
        for encoder in self.plan.encoders:
            before = self.loaded_before.get(encoder)
            if before is None:
                continue
            try:
                loaded = self.control.loaded_versions(encoder)
                if loaded != before | {keep}:
                    self._load_versions(encoder, before | {keep})
            except (RolloutError, requests.RequestException) as err:
                self.recorder.event(f"could not restore the versions of {encoder}: {err}")

    def _roll_back(self, reason: str, aborted: bool) -> int:
        plan, rec = self.plan, self.recorder
        self._route({plan.baseline: 100.0})
        rec.record.update(status="rolling_back", reason=reason)
        rec.event(f"ROLLING BACK to v{plan.baseline}: {reason}")
        drain = self._wait_drain(plan.candidate)
        rec.record["drain"] = drain
        self._restore_versions(keep=plan.baseline)
        rec.record.update(status="aborted" if aborted else "rolled_back",
                          finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        rec.event(f"rolled back: all traffic on v{plan.baseline}; v{plan.candidate} drained in "
                  f"{drain['waited_s']} s and is back to its state before the rollout")
        return 1

    def roll_back_safely(self, reason: str, aborted: bool) -> int:
        """Roll back after an interruption; if even that fails, say what state things are in."""
        try:
            return self._roll_back(reason, aborted)
        except (requests.RequestException, RolloutError, OSError) as err:
            self.recorder.record.update(status="failed", reason=f"{reason}; rolling back failed too: {err}")
            self.recorder.event(f"ROLLBACK INCOMPLETE: {err}. The routing file sends all traffic to "
                                f"v{self.plan.baseline}; check the loaded versions with `rollout status`.")
            return 1

    def _promote(self) -> int:
        plan, rec = self.plan, self.recorder
        self._route({plan.candidate: 100.0})
        rec.record["status"] = "draining"
        rec.event(f"all gates passed: v{plan.candidate} takes all traffic; draining v{plan.baseline} ...")
        drain = self._wait_drain(plan.baseline)
        rec.record["drain"] = drain
        if drain["timed_out"]:
            rec.event(f"v{plan.baseline} still had requests in flight after {self.drain_timeout_s:g} s; "
                      "unloading anyway (Triton finishes the ones it holds)")
        for encoder in plan.encoders:
            keep = (self.control.loaded_versions(encoder) | {plan.candidate}) - {plan.baseline}
            self._load_versions(encoder, keep)
        rec.record.update(status="promoted", finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        rec.event(f"promoted v{plan.candidate}; v{plan.baseline} unloaded after draining "
                  f"({drain['waited_s']} s, at most {drain['max_inflight_seen']:.0f} in flight)")
        return 0


def embed_model(spec_path: Path, name: str) -> EmbedModelSpec:
    spec = load_spec(spec_path)
    for model in spec.models:
        if model.name == name:
            return model
    raise RolloutError(f"{spec_path}: no embedding model {name!r} (models: {[m.name for m in spec.models]})")


def current_table(routing_path: Path, model: EmbedModelSpec) -> RoutingTable:
    if routing_path.is_file():
        return read_routing_table(routing_path)
    return RoutingTable(dict(model.traffic))


def make_plan(args: argparse.Namespace) -> RolloutPlan:
    model = embed_model(args.spec, args.model)
    repository = args.model_repository.resolve()
    routing_path = repository / model.name / ROUTING_FILE
    try:
        steps = parse_steps(args.steps)
        gates = Gates(slo_p95_ms=args.slo_ms or model.slo_p95_ms, max_error_rate=args.max_error_rate,
                      min_cosine=args.min_cosine, min_requests=args.min_requests,
                      min_shadow_samples=args.min_shadow_samples)
        baseline = args.from_version or baseline_of(current_table(routing_path, model).weights, args.to)
    except ValueError as err:
        raise RolloutError(str(err)) from None
    if baseline == args.to:
        raise RolloutError(f"--from and --to are both version {args.to}")
    encoders = tuple(model.encoder_name(length) for length in model.bucket_lens)
    missing = [f"{e}/{args.to}" for e in encoders if not (repository / e / str(args.to) / "model.py").is_file()]
    if missing:
        raise RolloutError(f"version {args.to} has no model folder in {repository}: {', '.join(missing)}")
    if not 0 < args.shadow_rate <= 1:
        raise RolloutError(f"--shadow-rate must be within (0, 1], got {args.shadow_rate}")
    return RolloutPlan(model=model, baseline=baseline, candidate=args.to, steps=steps, gates=gates,
                       shadow_rate=args.shadow_rate, min_step_s=args.step_seconds, max_step_s=args.max_step_seconds,
                       routing_path=routing_path, encoders=encoders)


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
                        help="drift gate: mean cosine to the baseline on shadowed rows (default: %(default)s)")
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
    alive = running and tool_alive(state)
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
    path = state_path(args.records, model_name)
    if tool_alive(state):
        state["abort_requested"] = True
        path.write_text(json.dumps(state, indent=2) + "\n")
        print(f"abort requested; the rollout (pid {state['pid']}) rolls back at its next check", flush=True)
        deadline = time.monotonic() + args.drain_timeout + 60
        while time.monotonic() < deadline:
            time.sleep(0.5)
            current = read_state(args.records, model_name) or {}
            if current.get("status") in FINAL_STATES:
                print(f"rollout {current['status']}: {current.get('reason', '')}")
                return 0
        print("the rollout did not finish rolling back in time; see `rollout status`", file=sys.stderr)
        return 1
    # The tool died mid-rollout: put traffic back on the baseline ourselves.
    repository = args.model_repository.resolve()
    model = embed_model(args.spec, model_name)
    write_routing_table(repository / model.name / ROUTING_FILE, RoutingTable({int(state["baseline"]): 100.0}))
    print(f"the rollout tool is gone; all traffic moved back to v{state['baseline']}. Version {state['candidate']} "
          "stays loaded with no traffic; unload it with the repository API if it should go.")
    state.update(status="aborted", reason="aborted after the rollout tool stopped")
    path.write_text(json.dumps(state, indent=2) + "\n")
    return 0


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
        state = read_state(args.records, args.model)
        if state and state.get("status") not in FINAL_STATES and tool_alive(state):
            print(f"error: a rollout of {args.model} is already running (pid {state['pid']}); "
                  "see `rollout status`", file=sys.stderr)
            return 2
        plan = make_plan(args)
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
    control = TritonControl(_url(args.url), _url(args.metrics_url), admin_key=admin_key)
    recorder = Recorder(args.records, plan.model.name)
    rollout = Rollout(plan, control, args.model_repository.resolve(), recorder, drain_timeout_s=args.drain_timeout)
    try:
        code = rollout.run()
    except KeyboardInterrupt:
        code = rollout.roll_back_safely("interrupted (Ctrl-C)", aborted=True)
    except (requests.RequestException, RolloutError) as err:
        code = rollout.roll_back_safely(f"the server stopped answering the tool: {err}", aborted=False)
    print(f"record: {recorder.path}")
    return code
