"""The canary rollout of a new encoder version: plan, drive, record, and the lock that says one runs.

The server must run in explicit model-control mode (`python -m tools serve` does). `Rollout`
loads the new version of every bucket model through the repository API (`TritonControl`, over
`tools.server.control`: with the model's own config, its version list extended; `model_warmup`
runs before the version reports ready), then moves unpinned traffic step by step by rewriting
the router's routing file. At each step it reads the router's metrics and judges the candidate
against the baseline (`tools.planning.rollout`): error rate, p95 against the SLO, output
drift on a shadowed sample (by the model's measure: cosine, top-1 agreement, or a tolerance).
A failing gate moves all traffic back, waits for the candidate's in-flight requests and
unloads it; success moves all traffic to the candidate and unloads the old version once its
in-flight requests have drained. Every step and gate reading goes to a JSON record
(`Recorder`), and the model's state file says where the rollout stands.

A running rollout holds `RolloutLock` (an exclusive `flock` on `<model>.state.lock` beside the
state file) for its whole life, so a second rollout of the model is refused, and the lock of a
tool that crashed or was killed goes with its process. Everything here does I/O except
`make_plan`'s checks and `RolloutPlan.describe`; the command line is `tools.cli.rollout`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.drift import DriftMeasure
from python_backends.common.metric_buffer import DEFAULT_FLUSH_INTERVAL_S
from python_backends.embed.routing import RoutingSource, RoutingTable, read_routing_table, write_routing_table
from tools.observe.metrics import fetch_text, parse_exposition
from tools.paths import ROLLOUT_RECORDS
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
from tools.server.control import ControlError, ServerControl
from tools.spec.serving import BucketedModelSpec, load_spec

DEFAULT_RECORDS = ROLLOUT_RECORDS
FINAL_STATES = ("promoted", "rolled_back", "aborted", "failed")

# Before trusting the router's in-flight gauge at zero: every router instance has re-read the
# routing file (so no new request picks the drained version) and has flushed its buffered
# gauge at least once since (a flush may run late by up to one more interval on busy cores).
DRAIN_SETTLE_S = RoutingSource.check_interval_s + 2 * DEFAULT_FLUSH_INTERVAL_S


class RolloutError(RuntimeError):
    """The rollout cannot start or continue; the message says why."""


# What the server failing to answer looks like: a control call, or the metrics page (urllib's
# errors, an HTTP error status included, are OSErrors).
SERVER_ERRORS = (ControlError, OSError)


@dataclass
class TritonControl:
    """The server's repository, readiness and metrics endpoints."""

    http_url: str  # e.g. localhost:8000 (a http:// scheme is dropped)
    metrics_url: str  # e.g. http://localhost:8002/metrics
    timeout_s: float = 300.0  # loading with warm-up can take a while
    admin_key: str | None = field(default=None, repr=False)  # sent to the repository endpoints

    @property
    def server(self) -> ServerControl:
        return ServerControl(self.http_url, admin_key=self.admin_key, timeout_s=self.timeout_s)

    def loaded_versions(self, model: str) -> set[int]:
        return {int(entry["version"]) for entry in self.server.repository_index()
                if entry.get("name") == model and entry.get("state") == "READY" and entry.get("version")}

    def is_ready(self, model: str, version: int) -> bool:
        return self.server.is_model_ready(model, version)

    def load(self, config: mc.ModelConfig) -> None:
        """Load (or reload) a model with this config; Triton keeps serving the old set until the new is ready."""
        try:
            self.server.load(config.name, config=json_format.MessageToJson(config))
        except ControlError as err:
            raise RolloutError(f"loading {config.name} versions {list(config.version_policy.specific.versions)} "
                               f"failed: {err}") from None

    def metrics(self) -> str:
        return fetch_text(self.metrics_url, timeout_s=10.0)


def read_config(repository: Path, model: str) -> mc.ModelConfig:
    path = repository / model / "config.pbtxt"
    if not path.is_file():
        raise RolloutError(f"{path} not found")
    config = text_format.Parse(path.read_text(), mc.ModelConfig())
    config.name = config.name or model  # a user's own config may leave the name to its folder
    return config


def with_versions(config: mc.ModelConfig, versions: Sequence[int]) -> mc.ModelConfig:
    changed = mc.ModelConfig()
    changed.CopyFrom(config)
    changed.version_policy.specific.ClearField("versions")
    changed.version_policy.specific.versions.extend(sorted(versions))
    return changed


@dataclass
class RolloutPlan:
    """What a rollout will do, checked before anything changes."""

    model: BucketedModelSpec
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
            f"  load v{self.candidate} of every bucket model (and the express model, where there is one; "
            "warm-up runs before it reports ready)",
            "  steps (candidate share of unpinned traffic): " + " -> ".join(f"{s:g}%" for s in self.steps),
            f"  each step lasts at least {self.min_step_s:g} s, at most {self.max_step_s:g} s waiting for data",
            f"  gates: error rate <= {g.max_error_rate:.1%}; p95 <= {g.slo_p95_ms:g} ms (SLO); "
            f"{g.drift_text(self.baseline)} on a {self.shadow_rate:.0%} shadowed sample; "
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
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
            "status": "loading", "steps": [], "events": [],
        }
        abort_path(self.records_dir, self.model).unlink(missing_ok=True)  # one left by an earlier rollout
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
        """Whether `rollout abort` asked this rollout to roll back (`request_abort`)."""
        return abort_path(self.records_dir, self.model).exists()


def state_path(records_dir: Path, model: str) -> Path:
    return records_dir / f"{model}.state.json"


def read_state(records_dir: Path, model: str) -> dict | None:
    try:
        return json.loads(state_path(records_dir, model).read_text())
    except FileNotFoundError:
        return None


def abort_path(records_dir: Path, model: str) -> Path:
    """The file whose presence asks the running rollout of `model` to roll back. It is a file of
    its own: written into the state file, the request was lost whenever the tool saved its own
    state between reading the file and the request landing (seen in CI: an abort never taken)."""
    return records_dir / f"{model}.abort"


def lock_path(records_dir: Path, model: str) -> Path:
    return records_dir / f"{model}.state.lock"


class RolloutLock:
    """The lock a rollout of one model holds for its whole life: an exclusive `flock` on a file
    beside the model's state file. The kernel releases it when the holder exits, however it
    exits, so a crashed tool never blocks the next rollout, and a reused pid never passes for
    the tool that held it."""

    def __init__(self, records_dir: Path, model: str):
        self.path = lock_path(records_dir, model)
        self._lock = FileLock(str(self.path))

    def acquire(self) -> bool:
        """Take the lock; False when another rollout of the model holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(blocking=False)
        except Timeout:
            return False
        return True

    def release(self) -> None:
        self._lock.release()


def rollout_running(records_dir: Path, model: str) -> bool:
    """Whether a rollout tool of `model` runs now: whether some process holds its lock."""
    if not lock_path(records_dir, model).exists():
        return False  # no rollout ever ran here (and a dry run creates nothing)
    probe = RolloutLock(records_dir, model)
    if not probe.acquire():
        return True
    probe.release()
    return False


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
        """Have `encoder` serve exactly `versions`, with its own config from the repository (the
        user's own, for an external model)."""
        repository = self.plan.model.bucket_repository(self.repository)
        self.control.load(with_versions(read_config(repository, encoder), versions))

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
        except (RolloutError, *SERVER_ERRORS) as err:
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
            except (RolloutError, *SERVER_ERRORS) as err:
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
        except (*SERVER_ERRORS, RolloutError, OSError) as err:
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


def embed_model(spec_path: Path, name: str) -> BucketedModelSpec:
    spec = load_spec(spec_path)
    for model in spec.models:
        if model.name == name:
            return model
    raise RolloutError(f"{spec_path}: no embedding model {name!r} (models: {[m.name for m in spec.models]})")


def current_table(routing_path: Path, model: BucketedModelSpec) -> RoutingTable:
    if routing_path.is_file():
        return read_routing_table(routing_path)
    return RoutingTable(dict(model.traffic))


def make_plan(spec: Path, model_name: str, model_repository: Path, to: int, *, from_version: int | None = None,
              steps: str = ",".join(f"{s:g}" for s in DEFAULT_STEPS), slo_ms: float | None = None,
              max_error_rate: float = 0.01, drift: DriftMeasure | None = None, min_cosine: float = 0.98,
              min_top1_agreement: float = 0.99, max_logit_diff: float = 0.5, tolerance: float | None = None,
              min_requests: int = 20, min_shadow_samples: int = 10, shadow_rate: float = 0.2,
              step_seconds: float = 30.0, max_step_seconds: float = 300.0) -> RolloutPlan:
    """The plan for rolling `model_name` out to encoder version `to`, checked against the spec
    and the repository; a RolloutError says what is wrong. `drift` is the output-drift measure,
    by default the model kind's (cosine for an encoder, top-1 agreement and largest logit difference
    for a classifier); only that measure's thresholds apply, and `tolerance` is required for abs_diff."""
    model = embed_model(spec, model_name)
    repository = model_repository.resolve()
    routing_path = repository / model.name / ROUTING_FILE
    try:
        parsed_steps = parse_steps(steps)
        gates = Gates(slo_p95_ms=slo_ms or model.slo_p95_ms, max_error_rate=max_error_rate,
                      drift=drift or model.kind.drift,
                      min_cosine=min_cosine, min_top1_agreement=min_top1_agreement, max_logit_diff=max_logit_diff,
                      tolerance=tolerance if tolerance is not None else model.tolerance, min_requests=min_requests,
                      min_shadow_samples=min_shadow_samples)
        baseline = from_version or baseline_of(current_table(routing_path, model).weights, to)
    except ValueError as err:
        raise RolloutError(str(err)) from None
    if baseline == to:
        raise RolloutError(f"--from and --to are both version {to}")
    buckets = model.bucket_repository(repository)
    # The express model serves the same versions as the bucket models: it loads and unloads with them.
    encoders = model.bucket_models(buckets)

    def has_version(encoder: str) -> bool:
        """The kit's bucket folders hold a model.py shim; an external model's whatever its backend reads."""
        folder = buckets / encoder / str(to)
        return folder.is_dir() if model.repository is not None else (folder / "model.py").is_file()

    missing = [f"{e}/{to}" for e in encoders if not has_version(e)]
    if missing:
        raise RolloutError(f"version {to} has no model folder in {buckets}: {', '.join(missing)}")
    if not 0 < shadow_rate <= 1:
        raise RolloutError(f"--shadow-rate must be within (0, 1], got {shadow_rate}")
    return RolloutPlan(model=model, baseline=baseline, candidate=to, steps=parsed_steps, gates=gates,
                       shadow_rate=shadow_rate, min_step_s=step_seconds, max_step_s=max_step_seconds,
                       routing_path=routing_path, encoders=encoders)


def request_abort(records_dir: Path, model: str) -> None:
    """Ask the running rollout of `model` to roll back at its next check (`abort_path`)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    abort_path(records_dir, model).write_text(f"abort requested at {stamp}\n")


def roll_back_orphan(records_dir: Path, spec: Path, model_repository: Path, model_name: str, state: dict) -> None:
    """Put all traffic back on the baseline of a rollout whose tool is gone, and mark it aborted.
    The candidate stays loaded, with no traffic."""
    model = embed_model(spec, model_name)
    write_routing_table(model_repository.resolve() / model.name / ROUTING_FILE,
                        RoutingTable({int(state["baseline"]): 100.0}))
    state.update(status="aborted", reason="aborted after the rollout tool stopped")
    state_path(records_dir, model.name).write_text(json.dumps(state, indent=2) + "\n")


def drive(plan: RolloutPlan, control: TritonControl, model_repository: Path, recorder: Recorder,
          drain_timeout_s: float) -> int:
    """Run `plan` to its end: 0 when promoted, 1 when rolled back or failed. Ctrl-C, or a server
    that stops answering, rolls back."""
    rollout = Rollout(plan, control, model_repository.resolve(), recorder, drain_timeout_s=drain_timeout_s)
    try:
        return rollout.run()
    except KeyboardInterrupt:
        return rollout.roll_back_safely("interrupted (Ctrl-C)", aborted=True)
    except (*SERVER_ERRORS, RolloutError) as err:
        return rollout.roll_back_safely(f"the server stopped answering the tool: {err}", aborted=False)
