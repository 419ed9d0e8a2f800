"""The arithmetic of a canary rollout: metric windows, gates, steps. No I/O here.

A rollout moves unpinned traffic from a baseline version to a candidate in steps. During a
step the tool reads the router's metrics now and then (parsed by `tools.observe.metrics`,
they come here as samples); the difference from the step's start is the step's window. Three
gates judge the candidate on that window:

- errors: the candidate's error rate (failed / answered; queue rejections are retryable and
  reported apart) stays within `max_error_rate`. It fails as soon as the errors seen exceed
  what the rate allows over the step's minimum sample, so a broken version is pulled after
  a handful of failures rather than at the end of the step.
- latency: the candidate's p95, read from the router's latency histogram, is within the SLO.
- drift: the candidate's outputs on the shadowed sample are close to the baseline's on the
  same rows, by the measure of the model's kind (`python_backends.common.drift`): for
  embeddings the mean cosine is at least `min_cosine`; for classifiers the share of rows whose
  top class agrees is at least `min_top1_agreement` and no row's logits moved more than
  `max_logit_diff`; for tensor models no output moved more than the declared `tolerance`.
  A largest difference is read from the router's histogram as the upper edge of its highest
  non-empty bucket, so it is judged at the histogram's resolution (`DIFF_BUCKETS`).

A gate without enough data waits; a step passes when every gate passes and the step has
lasted its minimum time, and fails when a gate fails or the step runs out of time waiting.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from python_backends.common.drift import DIFF_BUCKETS, SHADOW_HISTOGRAMS, DriftMeasure
from tools.planning.samples import SeriesKey, histogram_quantile

DEFAULT_STEPS = (1.0, 5.0, 25.0, 50.0, 100.0)


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram: counts of observations <= each upper edge."""

    edges: tuple[float, ...] = ()  # finite upper edges, ascending
    cumulative: tuple[float, ...] = ()  # observations <= each edge
    count: float = 0.0  # all observations (the +Inf bucket)
    total: float = 0.0  # sum of the observed values

    def minus(self, earlier: Histogram) -> Histogram:
        """Observations made since `earlier` (same edges, or `earlier` empty)."""
        if not earlier.edges:
            return self
        if earlier.edges != self.edges:
            raise ValueError("histograms with different bucket edges cannot be subtracted")
        return Histogram(self.edges, tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
                         self.count - earlier.count, self.total - earlier.total)

    def quantile(self, q: float) -> float:
        """The q-quantile, interpolated linearly inside its bucket (PromQL's histogram_quantile,
        `tools.planning.samples.histogram_quantile`). NaN without observations; the last finite
        edge when it falls in the +Inf bucket."""
        buckets = [*zip(self.edges, self.cumulative, strict=True), (math.inf, self.count)]
        value = histogram_quantile(q, buckets)
        return math.nan if value is None else value

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else math.nan

    @property
    def upper_bound(self) -> float:
        """A bound on every observation: the upper edge of the highest non-empty bucket (the
        100th percentile, taken as the edge itself, not interpolated to a float near it); +inf
        when some observation lies past the last finite edge, which `quantile` reports as that
        edge; NaN without observations."""
        if self.count <= 0:
            return math.nan
        if not self.edges or self.count > self.cumulative[-1]:
            return math.inf
        return next(edge for edge, num in zip(self.edges, self.cumulative, strict=True) if num >= self.count)


@dataclass(frozen=True)
class VersionStats:
    """What the router counted for one encoder version."""

    ok: float = 0.0
    errors: float = 0.0
    rejected: float = 0.0  # queue-policy rejections (UNAVAILABLE): retryable, not the version's fault
    latency_s: Histogram = field(default_factory=Histogram)  # of successful requests
    inflight: float = 0.0  # being served now (a gauge, not subtracted)

    @property
    def answered(self) -> float:
        return self.ok + self.errors

    @property
    def error_rate(self) -> float:
        return self.errors / self.answered if self.answered else 0.0

    def minus(self, earlier: VersionStats) -> VersionStats:
        return VersionStats(self.ok - earlier.ok, self.errors - earlier.errors, self.rejected - earlier.rejected,
                            self.latency_s.minus(earlier.latency_s), self.inflight)


@dataclass(frozen=True)
class Snapshot:
    """The router metrics of one model at one moment."""

    versions: Mapping[int, VersionStats]
    # (series, baseline, candidate) -> histogram of shadowed rows; series as in
    # `python_backends.common.drift.SHADOW_HISTOGRAMS` ("cosine", "top1_agreement", ...)
    drift: Mapping[tuple[str, int, int], Histogram]

    def version(self, version: int) -> VersionStats:
        return self.versions.get(version, VersionStats())

    def shadowed(self, series: str, baseline: int, candidate: int) -> Histogram:
        return self.drift.get((series, baseline, candidate), Histogram())

    def cosines(self, baseline: int, candidate: int) -> Histogram:
        return self.shadowed("cosine", baseline, candidate)

    def minus(self, earlier: Snapshot) -> Snapshot:
        return Snapshot(
            versions={v: s.minus(earlier.version(v)) for v, s in self.versions.items()},
            drift={key: h.minus(earlier.drift.get(key, Histogram())) for key, h in self.drift.items()},
        )


def _histograms(samples: Sequence[tuple[str, dict[str, str], float]], name: str, key_of) -> dict:
    buckets: dict = {}
    counts: dict = {}
    sums: dict = {}
    for metric, labels, value in samples:
        if metric == f"{name}_bucket" and labels.get("le") not in (None, "+Inf"):
            buckets.setdefault(key_of(labels), []).append((float(labels["le"]), value))
        elif metric == f"{name}_count":
            counts[key_of(labels)] = value
        elif metric == f"{name}_sum":
            sums[key_of(labels)] = value
    result = {}
    for key, count in counts.items():
        pairs = sorted(buckets.get(key, []))
        result[key] = Histogram(tuple(e for e, _ in pairs), tuple(c for _, c in pairs), count, sums.get(key, 0.0))
    return result


def snapshot_from_samples(series: Mapping[SeriesKey, float], model: str) -> Snapshot:
    """The router's per-version metrics of `model` from a parsed /metrics page
    (`tools.observe.metrics.parse_exposition`: (sample name, labels) -> value)."""
    samples = [(metric, dict(labels), value) for (metric, labels), value in series.items()
               if dict(labels).get("model") == model]
    counts: dict[int, dict[str, float]] = {}
    inflight: dict[int, float] = {}
    for metric, labels, value in samples:
        if not labels.get("version", "").isdigit():
            continue
        version = int(labels["version"])
        if metric == "embed_requests_total":
            counts.setdefault(version, {})[labels.get("outcome", "")] = value
        elif metric == "embed_inflight_requests":
            inflight[version] = value
    latency = _histograms(samples, "embed_request_duration_seconds", lambda labels: int(labels["version"]))
    drift = {}
    for series, (metric, _, _) in SHADOW_HISTOGRAMS.items():
        drift.update(_histograms(samples, metric,
                                 lambda labels, s=series: (s, int(labels["baseline"]), int(labels["candidate"]))))
    versions = {}
    for version in set(counts) | set(inflight) | set(latency):
        c = counts.get(version, {})
        versions[version] = VersionStats(c.get("ok", 0.0), c.get("error", 0.0), c.get("rejected", 0.0),
                                         latency.get(version, Histogram()), inflight.get(version, 0.0))
    return Snapshot(versions, drift)


@dataclass(frozen=True)
class Gates:
    """Thresholds a candidate must meet at every step."""

    slo_p95_ms: float  # the candidate's p95 must be within this (the model's SLO)
    max_error_rate: float = 0.01  # failed / answered requests on the candidate
    drift: DriftMeasure = DriftMeasure.COSINE  # how outputs are compared: by the model's kind
    min_cosine: float = 0.98  # cosine: mean cosine of the candidate's embeddings against the baseline's
    min_top1_agreement: float = 0.99  # top1: share of rows whose top class agrees with the baseline's
    max_logit_diff: float = 0.5  # top1: largest absolute logit difference of any row
    tolerance: float | None = None  # abs_diff: largest absolute output difference (declared; no default)
    min_requests: int = 20  # candidate requests a step needs before its latency and error gates can pass
    min_shadow_samples: int = 10  # shadowed rows a step needs before the drift gate can pass

    def __post_init__(self) -> None:
        object.__setattr__(self, "drift", DriftMeasure(self.drift))
        if self.slo_p95_ms <= 0:
            raise ValueError(f"slo_p95_ms must be > 0, got {self.slo_p95_ms}")
        if not 0 <= self.max_error_rate < 1:
            raise ValueError(f"max_error_rate must be within [0, 1), got {self.max_error_rate}")
        if not -1 <= self.min_cosine <= 1:
            raise ValueError(f"min_cosine must be within [-1, 1], got {self.min_cosine}")
        if not 0 <= self.min_top1_agreement <= 1:
            raise ValueError(f"min_top1_agreement must be within [0, 1], got {self.min_top1_agreement}")
        _check_difference("max_logit_diff", self.max_logit_diff)
        if self.tolerance is not None:
            _check_difference("tolerance", self.tolerance)
        elif self.drift is DriftMeasure.ABS_DIFF:
            raise ValueError("the abs_diff drift gate needs a declared tolerance (the largest absolute "
                             "output difference allowed); it has no default")
        if self.min_requests < 1 or self.min_shadow_samples < 0:
            raise ValueError("min_requests must be >= 1 and min_shadow_samples >= 0")

    def drift_text(self, baseline: int) -> str:
        """The drift gate's condition, as the rollout plan prints it."""
        if self.drift is DriftMeasure.COSINE:
            return f"mean cosine vs v{baseline} >= {self.min_cosine}"
        if self.drift is DriftMeasure.TOP1:
            return (f"top-1 agreement vs v{baseline} >= {self.min_top1_agreement} and largest logit difference "
                    f"<= {self.max_logit_diff:g}{_resolution(self.max_logit_diff)}")
        return f"largest absolute difference vs v{baseline} <= {self.tolerance:g}{_resolution(self.tolerance)}"

    @property
    def errors_allowed(self) -> int:
        """Errors the candidate may make over a minimum sample and still pass."""
        return math.floor(self.max_error_rate * self.min_requests)


def _check_difference(name: str, limit: float) -> None:
    # A row that matches exactly still lands in the first bucket: a limit below its edge fails every step.
    if not limit >= DIFF_BUCKETS[0]:
        raise ValueError(f"{name} must be >= {DIFF_BUCKETS[0]:g} (the first edge of the drift histogram), "
                         f"got {limit}")


def _resolution(limit: float) -> str:
    """Where a limit between two histogram edges is judged: at the edge below it."""
    edge = max(e for e in DIFF_BUCKETS if e <= limit)
    return "" if edge == limit else f" (judged at the histogram edge {edge:g})"


class Verdict(StrEnum):
    PASS = "pass"
    WAIT = "wait"  # not enough data yet
    FAIL = "fail"


@dataclass(frozen=True)
class GateReading:
    """One gate on one window: the value measured, its limit, and the verdict."""

    gate: str  # errors, latency or drift
    verdict: Verdict
    value: float | None  # NaN-free: None when nothing was measured
    limit: float
    detail: str  # one line a person can read

    def to_json(self) -> dict:
        return {"gate": self.gate, "verdict": self.verdict.value, "value": self.value, "limit": self.limit,
                "detail": self.detail}


def _number(value: float) -> float | None:
    """A reading's value for JSON: None when nothing was measured, or past the histogram's last edge
    (the detail says which)."""
    return None if not math.isfinite(value) else round(value, 6)


def evaluate_gates(window: Snapshot, baseline: int, candidate: int, gates: Gates) -> list[GateReading]:
    """Judge the candidate on one step's window, with the baseline's figures alongside."""
    cand, base = window.version(candidate), window.version(baseline)
    readings = []

    # The small tolerance keeps this check and the rate comparison below agreeing at the limit.
    errors_over = cand.errors > gates.max_error_rate * max(cand.answered, gates.min_requests) + 1e-9
    if errors_over and cand.errors > gates.errors_allowed:
        verdict = Verdict.FAIL
    elif cand.answered < gates.min_requests:
        verdict = Verdict.WAIT
    else:
        verdict = Verdict.PASS if cand.error_rate <= gates.max_error_rate else Verdict.FAIL
    readings.append(GateReading(
        "errors", verdict, _number(cand.error_rate) if cand.answered else None, gates.max_error_rate,
        f"candidate v{candidate}: {cand.errors:.0f} failed of {cand.answered:.0f} ({cand.error_rate:.1%}), "
        f"{cand.rejected:.0f} rejected; baseline v{baseline}: {base.error_rate:.1%} of {base.answered:.0f}"))

    p95_ms = cand.latency_s.quantile(0.95) * 1000
    base_p95_ms = base.latency_s.quantile(0.95) * 1000
    if cand.latency_s.count < gates.min_requests:
        verdict = Verdict.WAIT
    else:
        verdict = Verdict.PASS if p95_ms <= gates.slo_p95_ms else Verdict.FAIL
    base_text = f"{base_p95_ms:.0f} ms" if not math.isnan(base_p95_ms) else "no requests"
    readings.append(GateReading(
        "latency", verdict, _number(p95_ms), gates.slo_p95_ms,
        f"candidate v{candidate} p95 {p95_ms:.0f} ms over {cand.latency_s.count:.0f} requests "
        f"(SLO {gates.slo_p95_ms:.0f} ms); baseline v{baseline} p95 {base_text}"))

    readings.append(_drift_reading(window, baseline, candidate, gates))
    return readings


def _bound_text(bound: float) -> str:
    return f"> {DIFF_BUCKETS[-1]:g}" if math.isinf(bound) else f"<= {bound:g}"


def _drift_reading(window: Snapshot, baseline: int, candidate: int, gates: Gates) -> GateReading:
    """The drift gate by the model's measure; waits for `min_shadow_samples` rows."""
    versus = f"v{candidate} vs v{baseline}"
    if gates.drift is DriftMeasure.COSINE:
        cosines = window.shadowed("cosine", baseline, candidate)
        num_rows, value, limit = cosines.count, cosines.mean, gates.min_cosine
        passes = cosines.mean >= gates.min_cosine
        detail = f"mean cosine {versus} {cosines.mean:.4f} over {num_rows:.0f} shadowed rows"
    elif gates.drift is DriftMeasure.TOP1:
        agreement = window.shadowed("top1_agreement", baseline, candidate)
        logit_diff = window.shadowed("max_logit_diff", baseline, candidate)
        num_rows = min(agreement.count, logit_diff.count)
        value, limit, bound = agreement.mean, gates.min_top1_agreement, logit_diff.upper_bound
        passes = agreement.mean >= gates.min_top1_agreement and bound <= gates.max_logit_diff
        detail = (f"top-1 agreement {versus} {agreement.mean:.4f} (min {gates.min_top1_agreement:g}), "
                  f"largest logit difference {_bound_text(bound)} (max {gates.max_logit_diff:g}) "
                  f"over {num_rows:.0f} shadowed rows")
    else:
        diff = window.shadowed("max_abs_diff", baseline, candidate)
        num_rows, value, limit = diff.count, diff.upper_bound, gates.tolerance
        passes = diff.upper_bound <= gates.tolerance
        detail = (f"largest absolute difference {versus} {_bound_text(value)} (tolerance {gates.tolerance:g}) "
                  f"over {num_rows:.0f} shadowed rows")
    if num_rows < max(1, gates.min_shadow_samples):
        verdict = Verdict.WAIT if gates.min_shadow_samples > 0 else Verdict.PASS
    else:
        verdict = Verdict.PASS if passes else Verdict.FAIL
    return GateReading("drift", verdict, _number(value), limit,
                       detail if num_rows else f"no shadowed rows yet (need {gates.min_shadow_samples})")


def step_verdict(readings: Sequence[GateReading], elapsed_s: float, min_step_s: float,
                 max_step_s: float) -> tuple[Verdict, str]:
    """Whether a step is done: (PASS | WAIT | FAIL, why)."""
    failed = [r for r in readings if r.verdict is Verdict.FAIL]
    if failed:
        return Verdict.FAIL, "; ".join(f"{r.gate} gate failed: {r.detail}" for r in failed)
    waiting = [r for r in readings if r.verdict is Verdict.WAIT]
    if waiting:
        if elapsed_s >= max_step_s:
            return Verdict.FAIL, (f"not enough canary traffic in {max_step_s:.0f} s to judge: "
                                  + "; ".join(r.detail for r in waiting))
        return Verdict.WAIT, "waiting for " + ", ".join(r.gate for r in waiting)
    if elapsed_s < min_step_s:
        return Verdict.WAIT, f"gates pass; holding the step for {min_step_s - elapsed_s:.0f} s more"
    return Verdict.PASS, "all gates pass"


def parse_steps(raw: str) -> tuple[float, ...]:
    """`1,5,25,50,100`: the candidate's traffic percent at each step, rising, ending at 100."""
    try:
        steps = tuple(float(part) for part in raw.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"steps {raw!r} must be comma-separated percentages, e.g. 1,5,25,50,100") from None
    if not steps:
        raise ValueError("give at least one step")
    if any(not 0 < s <= 100 for s in steps):
        raise ValueError(f"every step must be within (0, 100], got {list(steps)}")
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(f"steps must rise, got {list(steps)}")
    if steps[-1] != 100:
        raise ValueError(f"the last step must be 100 (the candidate takes all traffic), got {steps[-1]:g}")
    return steps


def step_weights(baseline: int, candidate: int, percent: float) -> dict[int, float]:
    """Routing weights that give the candidate `percent` of unpinned traffic."""
    weights = {candidate: percent}
    if percent < 100:
        weights[baseline] = 100.0 - percent
    return weights


def baseline_of(weights: Mapping[int, float], candidate: int) -> int:
    """The version a rollout starts from: the only one with traffic, which must not be the candidate."""
    live = sorted(v for v, w in weights.items() if w > 0)
    if len(live) != 1:
        raise ValueError(f"traffic is split over versions {live}; finish or abort that first, "
                         "or name the baseline with --from")
    if live[0] == candidate:
        raise ValueError(f"version {candidate} already takes all traffic")
    return live[0]
