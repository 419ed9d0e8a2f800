"""Say, with numbers, why a model is slow and which knob to change.

Reads two snapshots of /metrics a window apart (or a recording), the served configs and, on a
live server, the statistics API; then tells whether requests are slow because they wait to
be batched, because every instance is busy, or because compute itself is slow, and whether
traffic is fragmented over buckets and versions: the case where the device is mostly idle
yet p99 rises, and where adding replicas would make it worse.

How each cause is told apart, per bucket queue (model version), over the window:
  waiting for an instance: mean queue time > the linger budget (max_queue_delay) + one batch
    of compute: a request waited for a batch to finish, not for one to fill;
  waiting to batch: mean queue time >= half the linger budget while batches close below the
    preferred size: the timer, not a full batch, releases them;
  slow compute: a batch takes > 1.5x what the latency profile measured for its size;
  fragmented: the traffic is split beyond what the configs were derived for (two versions of
    a bucket each waiting to batch, or >= 3 buckets waiting to batch), at least half of the
    requests wait to batch as above, and the device is < 50% busy: batches that one queue
    would fill are spread thin, so requests wait out the timer and p99 rises while the
    device idles.

The diagnosis is pure (views in, findings out); the gathering functions at the end read the
serving spec (`service_layout`), the configs (`knobs_from_repository`, `knobs_from_server`)
and the latency profile (`profile_curves`). The `explain` command is `tools/cli/explain.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.observe.metrics import (
    LLM_BLOCKS_TOTAL,
    LLM_BLOCKS_USED,
    LLM_RUNNING,
    LLM_TTFT,
    LLM_WAITING,
    ROUTER_LATENCY,
    TENANT_REQUESTS,
    QueueStats,
    Snapshot,
    Window,
    queue_stats,
)
from tools.spec.profile import LatencyCurve


class Cause(enum.StrEnum):
    HEALTHY = "healthy"
    BATCH_WAIT = "waiting to batch"
    CAPACITY_WAIT = "waiting for an instance"
    SLOW_COMPUTE = "slow compute"
    FRAGMENTED = "fragmented traffic"
    FAILING = "failing requests"
    KV_BOUND = "waiting for KV-cache blocks"
    SLOT_BOUND = "waiting for a batch slot"


@dataclass(frozen=True)
class QueueKnobs:
    """The batching knobs a bucket model is served with (from its config)."""

    model: str
    max_batch_size: int  # rows per batch at most
    preferred_batch: int  # largest preferred_batch_size; max_batch_size when none is set
    max_queue_delay_ms: float  # the linger budget: how long a batch may wait to fill
    instances: int  # instances per version

    @classmethod
    def from_config(cls, config: Mapping) -> QueueKnobs:
        """From a model config in Triton's JSON form (the config API, or protobuf's
        MessageToDict with field names preserved); int64 fields may be strings."""
        name = str(config.get("name", "?"))
        batching = config.get("dynamic_batching") or {}
        max_batch = int(config.get("max_batch_size", 0) or 0)
        preferred = [int(b) for b in batching.get("preferred_batch_size", [])]
        instances = sum(int(group.get("count", 1) or 1) for group in config.get("instance_group", [])) or 1
        return cls(model=name, max_batch_size=max_batch, preferred_batch=max(preferred) if preferred else max_batch,
                   max_queue_delay_ms=int(batching.get("max_queue_delay_microseconds", 0) or 0) / 1000.0,
                   instances=instances)


@dataclass(frozen=True)
class Thresholds:
    """Where a measurement turns into a finding (see the module docstring)."""

    batch_wait_share: float = 0.5  # queue time >= this share of the linger budget
    slow_compute_ratio: float = 1.5  # batch time >= this times the profiled c(b)
    low_utilization: float = 0.5  # device busy below this share: capacity is not the problem
    min_fragment_queues: int = 3  # bucket models lingering at once that count as a split (two versions of one do)
    lingering_share: float = 0.5  # share of requests in lingering queues that makes a split fragmentation
    headroom_share: float = 0.8  # p95 under this share of the SLO: waiting to batch needs no change
    min_requests: float = 5.0  # fewer requests in a queue than this say nothing


@dataclass(frozen=True)
class ServiceWindow:
    """A served model and the bucket queues behind it, over one window."""

    name: str  # the model clients call (the router), or one bucket model
    duration_s: float
    queues: Sequence[QueueStats]  # the bucket model versions behind it
    knobs: Mapping[str, QueueKnobs]  # bucket model -> its knobs
    lanes: int = 1  # batches the device runs side by side at full speed
    slo_p95_ms: float | None = None  # end-to-end target, when the spec gives one
    rate_rps: float = 0.0  # client requests per second
    p95_ms: float | None = None  # end-to-end, from the router's histogram
    p99_ms: float | None = None
    earlier_p99_ms: float | None = None  # the same over the window before, to see a rise
    num_failed: float = 0.0  # client requests that failed
    num_served: float = 0.0  # client requests answered (tenant counter, outcome ok)
    num_busy: float = 0.0  # client requests turned away as "server busy" by admission (not quota refusals)
    curves: Mapping[str, LatencyCurve] = field(default_factory=dict)  # profiled c(b) by bucket model

    @property
    def busy_share(self) -> float:
        """Share of the device's lanes the batches kept busy."""
        return sum(q.busy_s for q in self.queues) / (self.duration_s * max(1, self.lanes))

    def _weighted(self, value: Callable[[QueueStats], float]) -> float:
        total = sum(q.num_requests for q in self.queues)
        return sum(value(q) * q.num_requests for q in self.queues) / total if total else 0.0

    @property
    def queue_ms(self) -> float:
        return self._weighted(lambda q: q.queue_ms)

    @property
    def compute_ms(self) -> float:
        return self._weighted(lambda q: q.compute_ms)


@dataclass(frozen=True)
class Finding:
    cause: Cause
    subject: str  # the queue or service it is about
    evidence: str  # the numbers that show it
    knob: str  # what to change


@dataclass(frozen=True)
class Diagnosis:
    name: str
    summary: str  # one line: where the time goes
    findings: tuple[Finding, ...]
    formed_batches: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # model -> batch size -> count

    @property
    def causes(self) -> set[Cause]:
        return {f.cause for f in self.findings}


def _subject(q: QueueStats) -> str:
    return f"{q.model} v{q.version}" if q.version else q.model


def _fill_rows_per_s(q: QueueStats) -> float:
    return q.num_rows / q.duration_s


def _lingers(q: QueueStats, knobs: QueueKnobs | None, limits: Thresholds) -> bool:
    """Released by the timer below the preferred size, not by a full batch or a free instance."""
    if knobs is None or knobs.max_queue_delay_ms <= 0:
        return False
    return (limits.batch_wait_share * knobs.max_queue_delay_ms <= q.queue_ms <= knobs.max_queue_delay_ms + q.compute_ms
            and q.mean_batch_rows < knobs.preferred_batch)


def diagnose_queue(q: QueueStats, knobs: QueueKnobs | None, curve: LatencyCurve | None,
                   limits: Thresholds = Thresholds(), latency_headroom: bool = False) -> list[Finding]:
    """Findings for one bucket queue (pure). `latency_headroom`: p95 is well inside the SLO,
    so waiting to batch is the planned linger doing its job, not something to fix."""
    if q.num_requests < limits.min_requests or knobs is None:
        return []
    findings = []
    delay, batch = knobs.max_queue_delay_ms, q.mean_batch_rows
    where = (f"queue {q.queue_ms:.1f} ms, compute {q.compute_ms:.1f} ms per batch of {batch:.1f} rows "
             f"(preferred {knobs.preferred_batch}, max {knobs.max_batch_size}), linger budget {delay:.0f} ms, "
             f"{q.rate_rps:.1f} req/s")
    if q.queue_ms > delay + q.compute_ms:
        findings.append(Finding(
            Cause.CAPACITY_WAIT, _subject(q),
            f"{where}: requests wait longer than the linger budget plus one batch, so every one of the "
            f"{knobs.instances} instances is busy",
            f"add capacity: more replicas (python -m tools autoscale), or instance_group count above "
            f"{knobs.instances} if the device has idle lanes"))
    elif _lingers(q, knobs, limits):
        fill_s = knobs.preferred_batch / max(_fill_rows_per_s(q), 1e-9)
        if latency_headroom:
            knob = (f"none while p95 has headroom: the {delay:.0f} ms linger is what gen-config planned for peak "
                    "traffic; if this traffic is the normal one, set the router's expected_rps in serving.toml to "
                    "it and regenerate (python -m tools gen-config)")
        else:
            knob = (f"lower max_queue_delay_microseconds on {q.model} (now {delay * 1000:.0f}), or regenerate with "
                    "the measured rate: set expected_rps in serving.toml and run python -m tools gen-config")
        findings.append(Finding(
            Cause.BATCH_WAIT, _subject(q),
            f"{where}: batches close on the timer at {batch:.1f} rows; at {_fill_rows_per_s(q):.1f} rows/s a "
            f"batch of {knobs.preferred_batch} takes {fill_s * 1000:.0f} ms to fill", knob))
    if curve is not None and batch >= 1:
        size = min(batch, float(curve.max_measured))  # c(b) between measured sizes is interpolated
        expected = curve.at(size)
        if q.compute_ms > limits.slow_compute_ratio * expected:
            findings.append(Finding(
                Cause.SLOW_COMPUTE, _subject(q),
                f"a batch of {batch:.1f} rows takes {q.compute_ms:.1f} ms; the profile gives "
                f"{expected:.1f} ms for {size:g} rows ({q.compute_ms / expected:.1f}x)",
                "the device is shared or slower than profiled: re-run python -m tools profile on this "
                "hardware and regenerate, or run fewer instances per device lane"))
    return findings


def split_lingering_share(view: ServiceWindow, limits: Thresholds = Thresholds()) -> float:
    """Share of the requests that wait out a linger timer in queues split beyond the plan; 0
    when the traffic is not split that way (pure).

    gen-config derives each bucket's linger for the bucket's whole share of the traffic, so
    versions that divide a bucket's queue, or lingering spread over many buckets, thin the
    batches below what the configs were made for."""
    active = [q for q in view.queues if q.num_requests >= limits.min_requests]
    lingering = [q for q in active if _lingers(q, view.knobs.get(q.model), limits)]
    lingering_models = [q.model for q in lingering]
    split = (any(lingering_models.count(m) > 1 for m in set(lingering_models))
             or len(set(lingering_models)) >= limits.min_fragment_queues)
    if not split:
        return 0.0
    return sum(q.num_requests for q in lingering) / sum(q.num_requests for q in active)


def diagnose(view: ServiceWindow, limits: Thresholds = Thresholds()) -> Diagnosis:
    """Where a service's time goes and what to change (pure)."""
    findings: list[Finding] = []
    active = [q for q in view.queues if q.num_requests >= limits.min_requests]
    busy = view.busy_share
    latency = ""
    if view.p95_ms is not None:
        latency = f"p95 {view.p95_ms:.0f} ms"
        if view.slo_p95_ms:
            latency += f" against an SLO of {view.slo_p95_ms:.0f} ms"
        latency += ", "
    waiting, computing = view.queue_ms, view.compute_ms
    if waiting + computing > 0:
        larger = "waiting in the bucket queues" if waiting > computing else "compute"
        verdict = (f"; most of the bucket time is {larger} "
                   f"({max(waiting, computing) / (waiting + computing):.0%})")
    else:
        verdict = "; no traffic reached the bucket models"
    summary = (f"{view.name}: {view.rate_rps:.1f} req/s, {latency}bucket queue {waiting:.1f} ms + "
               f"compute {computing:.1f} ms per request, device {busy:.0%} busy over {view.duration_s:.0f} s{verdict}")
    if view.num_failed > 0:
        findings.append(Finding(Cause.FAILING, view.name, f"{view.num_failed:.0f} requests failed in the window",
                                "look at the server log; rejections are counted per tenant in top"))

    versions = {q.version for q in active}
    models = {q.model for q in active}
    lingering_share = split_lingering_share(view, limits)
    if lingering_share >= limits.lingering_share and busy < limits.low_utilization:
        trend = ""
        if view.p99_ms is not None:
            trend = f"; p99 {view.p99_ms:.0f} ms"
            if view.earlier_p99_ms is not None:
                trend += f" (was {view.earlier_p99_ms:.0f} ms)"
        findings.append(Finding(
            Cause.FRAGMENTED, view.name,
            f"{view.rate_rps:.1f} req/s split over {len(active)} queues ({len(models)} buckets x {len(versions)} "
            f"versions); {lingering_share:.0%} of requests wait out the linger timer in batches under the preferred "
            f"size while the device is only {busy:.0%} busy{trend}",
            "do not add replicas (they split the traffic further): finish or roll back the rollout so one "
            "version takes the traffic (python -m tools rollout), merge thin buckets in serving.toml, or lower "
            "max_queue_delay_microseconds on the lingering queues"))
    headroom = (view.p95_ms is not None and view.slo_p95_ms is not None
                and view.p95_ms <= limits.headroom_share * view.slo_p95_ms)
    for q in view.queues:
        findings.extend(diagnose_queue(q, view.knobs.get(q.model), view.curves.get(q.model), limits, headroom))
    if not findings:
        findings.append(Finding(Cause.HEALTHY, view.name, "no queue waits past its budget and compute matches "
                                "the profile", "nothing to change"))
    return Diagnosis(view.name, summary, tuple(findings))


@dataclass(frozen=True)
class LLMWindow:
    """The LLM engine over one window."""

    name: str
    ttft_p95_s: float | None
    running: float
    waiting: float
    blocks_used: float
    blocks_total: float
    max_num_seqs: int | None = None


def diagnose_llm(view: LLMWindow, kv_full_share: float = 0.9) -> Diagnosis:
    """Why LLM requests wait for their first token (pure)."""
    ttft = f"TTFT p95 {view.ttft_p95_s:.2f} s" if view.ttft_p95_s is not None else "no first tokens"
    used = view.blocks_used / view.blocks_total if view.blocks_total else 0.0
    summary = (f"{view.name}: {ttft}, {view.running:.0f} running, {view.waiting:.0f} waiting, "
               f"KV blocks {view.blocks_used:.0f}/{view.blocks_total:.0f} ({used:.0%})")
    findings = []
    if view.waiting > 0 and used >= kv_full_share:
        findings.append(Finding(Cause.KV_BOUND, view.name, f"{view.waiting:.0f} sequences wait while {used:.0%} "
                                "of the KV cache is held", "raise kv_cache_mb in serving.toml (memory allowing) "
                                "or add replicas"))
    elif view.waiting > 0 and view.max_num_seqs is not None and view.running >= view.max_num_seqs:
        findings.append(Finding(Cause.SLOT_BOUND, view.name, f"{view.waiting:.0f} wait with all "
                                f"{view.max_num_seqs} batch slots running", "raise max_num_seqs or add replicas"))
    elif view.waiting > 0:
        findings.append(Finding(Cause.SLOW_COMPUTE, view.name, f"{view.waiting:.0f} wait with KV room and free "
                                "slots: prefill under max_num_batched_tokens is the limit",
                                "raise max_num_batched_tokens (longer steps, faster admission) or add replicas"))
    else:
        findings.append(Finding(Cause.HEALTHY, view.name, "nothing waits", "nothing to change"))
    return Diagnosis(view.name, summary, tuple(findings))


# --- gathering: snapshots, configs and the spec into the views above -------------------------------


@dataclass(frozen=True)
class ServiceLayout:
    """What stands behind a served name (from the serving spec)."""

    name: str
    bucket_models: tuple[str, ...]  # the bucket models its requests go to; the model itself when it is one
    slo_p95_ms: float | None
    lanes: int


def service_layout(name: str, spec_path: Path | None = None) -> ServiceLayout:
    from tools.spec.profile import load_profile
    from tools.spec.serving import load_spec

    spec = load_spec(spec_path) if spec_path else load_spec()
    lanes = 1
    try:
        profile = load_profile(spec.profile)
        hardware = spec.hardware.get(profile.hardware.kind)
        if hardware is not None:
            lanes = hardware.lanes(profile.hardware.cpu_count)
    except (OSError, ValueError):
        pass
    for model in spec.models:
        # The express model, where there is one, takes the lingering buckets' rows at light load.
        buckets = tuple(model.encoder_name(length) for length in model.bucket_lens) + (
            (model.express_name,) if model.express_name else ())
        if name == model.name:
            return ServiceLayout(name, buckets, model.slo_p95_ms, lanes)
        if name in buckets:
            return ServiceLayout(name, (name,), model.slo_p95_ms, lanes)
    return ServiceLayout(name, (name,), None, lanes)


def service_window(window: Window, layout: ServiceLayout, knobs: Mapping[str, QueueKnobs],
                   curves: Mapping[str, LatencyCurve] | None = None, earlier: Window | None = None) -> ServiceWindow:
    queues = queue_stats(window, set(layout.bucket_models))
    is_router = layout.bucket_models != (layout.name,)
    clients = queue_stats(window, {layout.name}) if is_router else queues
    p95 = p99 = earlier_p99 = None
    if is_router:
        p95 = window.quantile(0.95, ROUTER_LATENCY, model=layout.name)
        p99 = window.quantile(0.99, ROUTER_LATENCY, model=layout.name)
        if earlier is not None:
            earlier_p99 = earlier.quantile(0.99, ROUTER_LATENCY, model=layout.name)

    def to_ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000.0

    return ServiceWindow(
        name=layout.name, duration_s=window.duration_s, queues=queues, knobs=knobs, lanes=layout.lanes,
        slo_p95_ms=layout.slo_p95_ms, rate_rps=sum(q.num_requests for q in clients) / window.duration_s,
        p95_ms=to_ms(p95), p99_ms=to_ms(p99), earlier_p99_ms=to_ms(earlier_p99),
        num_failed=sum(q.num_failed for q in clients), curves=curves or {},
        num_served=window.increase(TENANT_REQUESTS, model=layout.name, outcome="ok"),
        num_busy=window.increase(TENANT_REQUESTS, model=layout.name, outcome="rejected"))


def llm_window(window: Window, name: str, max_num_seqs: int | None = None) -> LLMWindow:
    return LLMWindow(name=name, ttft_p95_s=window.quantile(0.95, LLM_TTFT, model=name),
                     running=window.gauge(LLM_RUNNING, model=name), waiting=window.gauge(LLM_WAITING, model=name),
                     blocks_used=window.gauge(LLM_BLOCKS_USED, model=name),
                     blocks_total=window.gauge(LLM_BLOCKS_TOTAL, model=name), max_num_seqs=max_num_seqs)


def knobs_from_repository(models: Sequence[str], repository: Path) -> dict[str, QueueKnobs]:
    """Knobs from the config.pbtxt files (for recordings, where no server answers)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    knobs = {}
    for model in models:
        path = repository / model / "config.pbtxt"
        if path.is_file():
            config = text_format.Parse(path.read_text(), mc.ModelConfig())
            knobs[model] = QueueKnobs.from_config(json_format.MessageToDict(config, preserving_proto_field_name=True))
    return knobs


def knobs_from_server(models: Sequence[str], http_url: str) -> dict[str, QueueKnobs]:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(http_url)
    knobs = {}
    try:
        for model in models:
            try:
                knobs[model] = QueueKnobs.from_config(client.get_model_config(model))
            except InferenceServerException:
                continue  # not loaded: it carries no traffic either
    finally:
        client.close()
    return knobs


def profile_curves(models: Sequence[str], profile_path: Path | None) -> dict[str, LatencyCurve]:
    from tools.spec.profile import load_profile

    if profile_path is None or not profile_path.is_file():
        return {}
    profile = load_profile(profile_path)
    return {m: profile.models[m].curve for m in models if m in profile.models}


def formed_batches(before: Mapping, after: Mapping, models: Sequence[str]) -> dict[str, dict[int, int]]:
    """Batches Triton formed per model and size between two statistics-API answers
    (`get_inference_statistics(as_json=True)`); versions summed; a reset counts from zero."""

    def counts(stats: Mapping) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for model_stats in stats.get("model_stats") or ():
            if model_stats.get("name") not in models:
                continue
            sizes = out.setdefault(model_stats["name"], {})
            for batch in model_stats.get("batch_stats") or ():
                size = int(batch["batch_size"])
                sizes[size] = sizes.get(size, 0) + int((batch.get("compute_infer") or {}).get("count", 0))
        return out

    old, new = counts(before), counts(after)
    delta = {}
    for model, sizes in new.items():
        base = old.get(model, {})
        changed = {size: count - base.get(size, 0) if count >= base.get(size, 0) else count
                   for size, count in sizes.items()}
        delta[model] = {size: count for size, count in sorted(changed.items()) if count > 0}
    return delta


def render(diagnosis: Diagnosis) -> str:
    lines = [diagnosis.summary]
    for finding in diagnosis.findings:
        lines += [f"- {finding.cause} ({finding.subject}): {finding.evidence}", f"  knob: {finding.knob}"]
    if any(diagnosis.formed_batches.values()):
        lines.append("formed batches in the window (statistics API), size x count:")
        for model, sizes in diagnosis.formed_batches.items():
            if sizes:
                lines.append(f"  {model}: " + ", ".join(f"{size} x {count}" for size, count in sizes.items()))
    return "\n".join(lines)


def to_json(diagnosis: Diagnosis) -> dict:
    return {"model": diagnosis.name, "summary": diagnosis.summary,
            "findings": [{"cause": f.cause.value, "subject": f.subject, "evidence": f.evidence, "knob": f.knob}
                         for f in diagnosis.findings],
            "formed_batches": {model: {str(size): count for size, count in sizes.items()}
                               for model, sizes in diagnosis.formed_batches.items()}}


def last_windows(snapshots: list[Snapshot], window_s: float) -> tuple[Window, Window | None]:
    """The last `window_s` of a recording and the window before it (None when the recording is
    too short), as a live read would judge them."""
    end = snapshots[-1]
    start = next((s for s in reversed(snapshots) if end.at_s - s.at_s >= window_s), snapshots[0])
    before = next((s for s in reversed(snapshots) if start.at_s - s.at_s >= window_s), None)
    return Window(start, end), (Window(before, start) if before is not None else None)
