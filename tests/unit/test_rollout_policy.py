"""Canary rollout arithmetic on recorded /metrics pages: parsing, histogram windows, gates and step verdicts.

The pages are rendered the way tritonserver exports the `embed` router's custom metrics next to its own:
`# HELP`/`# TYPE` per family, labels in alphabetical order, histograms as `_count`, `_sum` and cumulative
`_bucket{le=...}` lines ending in `+Inf`, with the router's real bucket edges. A step is a series of such
pages; it is judged as `tools.ops.rollout` judges it: each page parsed by `tools.observe.metrics` (the kit's
one Prometheus parser), minus the step's first page.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from python_backends.common.drift import COSINE_BUCKETS, DIFF_BUCKETS, SHADOW_HISTOGRAMS, DriftMeasure
from python_backends.embed.router import (
    LATENCY_BUCKETS_S,
    VERSION_COUNTER,
    VERSION_INFLIGHT,
    VERSION_LATENCY,
)
from tools.observe.metrics import parse_exposition
from tools.planning.rollout import (
    GateReading,
    Gates,
    Histogram,
    Snapshot,
    Verdict,
    VersionStats,
    baseline_of,
    evaluate_gates,
    parse_steps,
    snapshot_from_samples,
    step_verdict,
    step_weights,
)

MODEL = "embed"
BASELINE, CANDIDATE = 1, 2
GATES = Gates(slo_p95_ms=200)  # the defaults: 1% errors, cosine 0.98, 20 requests, 10 shadowed rows
POLL_S = 5.0  # seconds between two pages of a series


def snapshot_from_metrics(page: str, model: str) -> Snapshot:
    """A page read as the rollout tool reads it: parsed, then the router's samples of `model`."""
    return snapshot_from_samples(parse_exposition(page), model)


# --- pages as tritonserver exports them -------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: object) -> str:
    return "{" + ",".join(f'{name}="{_escape(str(value))}"' for name, value in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    return f"{value:.16g}"  # prometheus-cpp writes doubles with 16 significant digits: 17, 0.005, 3.215


@dataclass
class Observed:
    """A histogram as the server keeps it: a count per bucket, the last one +Inf."""

    edges: tuple[float, ...]
    per_bucket: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.per_bucket = self.per_bucket or [0] * (len(self.edges) + 1)

    def observe(self, value: float) -> None:
        self.per_bucket[bisect_left(self.edges, value)] += 1  # bucket `le` holds values <= le
        self.total += value

    def lines(self, name: str, labels: dict) -> list[str]:
        count = sum(self.per_bucket)
        lines = [f"{name}_count{_labels(**labels)} {count}", f"{name}_sum{_labels(**labels)} {_number(self.total)}"]
        cumulative = 0
        for edge, num in zip(self.edges, self.per_bucket[:-1], strict=True):
            cumulative += num
            lines.append(f"{name}_bucket{_labels(**labels, le=_number(edge))} {cumulative}")
        lines.append(f"{name}_bucket{_labels(**labels, le='+Inf')} {count}")
        return lines


@dataclass
class RouterMetrics:
    """The cumulative metrics of one router model, kept as the `embed` adapter keeps them."""

    model: str = MODEL
    outcomes: dict[tuple[int, str], int] = field(default_factory=dict)  # (version, outcome) -> requests
    latency_s: dict[int, Observed] = field(default_factory=dict)  # version -> durations of ok requests
    inflight: dict[int, int] = field(default_factory=dict)  # version -> requests being served
    shadowed: dict[tuple[str, int, int], Observed] = field(default_factory=dict)  # (series, baseline, candidate)
    num_rows: int = 0  # rows sent to the 16-token bucket: a router metric without a version

    def _series_of(self, version: int) -> None:
        # The adapter creates a version's counters, histogram and gauge together, on its first request.
        if version not in self.latency_s:
            self.outcomes.update({(version, outcome): 0 for outcome in ("ok", "error", "rejected")})
            self.latency_s[version] = Observed(LATENCY_BUCKETS_S)
            self.inflight[version] = 0

    def serve(self, version: int, latencies_s: Sequence[float] = (), errors: int = 0, rejected: int = 0,
              inflight: int | None = None) -> None:
        self._series_of(version)
        for seconds in latencies_s:
            self.latency_s[version].observe(seconds)
        self.outcomes[version, "ok"] += len(latencies_s)
        self.outcomes[version, "error"] += errors
        self.outcomes[version, "rejected"] += rejected
        self.num_rows += len(latencies_s)
        if inflight is not None:
            self.inflight[version] = inflight

    def shadow(self, baseline: int, candidate: int, cosines: Sequence[float], series: str = "cosine") -> None:
        histogram = self.shadowed.setdefault((series, baseline, candidate), Observed(SHADOW_HISTOGRAMS[series][2]))
        for value in cosines:
            histogram.observe(value)


def _family(name: str, kind: str, help_text: str, lines: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]


def metrics_page(*routers: RouterMetrics, num_inferences: int = 5230) -> str:
    """One /metrics page: Triton's own metrics around the routers' custom families."""
    triton_head = [
        *_family("nv_inference_request_success", "counter",
                 "Number of successful inference requests, all batch sizes", [
                     f'nv_inference_request_success{{model="embed",version="1"}} {num_inferences}',
                     f'nv_inference_request_success{{model="encoder_16",version="1"}} {num_inferences - 219}',
                     'nv_inference_request_success{model="encoder_16",version="2"} 219',
                 ]),
        *_family("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)",
                 [f'nv_inference_count{{model="embed",version="1"}} {num_inferences}']),
        *_family("nv_inference_pending_request_count", "gauge",
                 "Instantaneous number of pending requests awaiting execution per-model.",
                 ['nv_inference_pending_request_count{model="embed",version="1"} 3']),
    ]
    triton_tail = [
        *_family("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)",
                 ['nv_gpu_utilization{gpu_uuid="GPU-5f1c1f38-9a8e-3b6c-1d2e-4c8f0e7a9b21"} 0.41']),
        *_family("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM) in bytes",
                 ["nv_cpu_memory_used_bytes 12884901888"]),
    ]
    counters, latency, inflight, rows = [], [], [], []
    shadowed: dict[str, list[str]] = {series: [] for series in SHADOW_HISTOGRAMS}
    for router in routers:
        for (version, outcome), value in sorted(router.outcomes.items()):
            counters.append(f"{VERSION_COUNTER[0]}{_labels(model=router.model, outcome=outcome, version=version)} "
                            f"{value}")
        for version, histogram in sorted(router.latency_s.items()):
            latency += histogram.lines(VERSION_LATENCY[0], {"model": router.model, "version": version})
            inflight.append(f"{VERSION_INFLIGHT[0]}{_labels(model=router.model, version=version)} "
                            f"{router.inflight[version]}")
        for (series, baseline, candidate), histogram in sorted(router.shadowed.items()):
            shadowed[series] += histogram.lines(SHADOW_HISTOGRAMS[series][0],
                                                {"baseline": baseline, "candidate": candidate, "model": router.model})
        rows.append(f"embed_bucket_rows_total{_labels(bucket=16, model=router.model)} {router.num_rows}")
    custom = [
        *_family("embed_bucket_rows_total", "counter", "Rows the embed router sent to each length bucket", rows),
        *_family(VERSION_COUNTER[0], "counter", VERSION_COUNTER[1], counters),
        *_family(VERSION_LATENCY[0], "histogram", VERSION_LATENCY[1], latency),
        *_family(VERSION_INFLIGHT[0], "gauge", VERSION_INFLIGHT[1], inflight),
        *(line for series, (name, help_text, _) in SHADOW_HISTOGRAMS.items()
          for line in _family(name, "histogram", help_text, shadowed[series])),
    ]
    return "\n".join([*triton_head, *custom, *triton_tail]) + "\n"


# --- a step walked as the rollout tool walks it -----------------------------------------------

Traffic = Callable[[RouterMetrics, int], None]  # what the router served between poll - 1 and poll


def record_series(router: RouterMetrics, num_polls: int, traffic: Traffic, *others: RouterMetrics) -> list[str]:
    """The pages a step reads: its first page, then one per poll after `traffic` has been served."""
    pages = [metrics_page(router, *others)]
    for poll in range(1, num_polls + 1):
        traffic(router, poll)
        for other in others:
            other.serve(1, [0.9] * 50, errors=10)  # a sick neighbour on the same server
        pages.append(metrics_page(router, *others, num_inferences=5230 + 80 * poll))
    return pages


@dataclass(frozen=True)
class Poll:
    elapsed_s: float
    verdict: Verdict
    why: str
    readings: dict[str, GateReading]  # gate -> its reading
    window: Snapshot


def walk_step(pages: Sequence[str], gates: Gates = GATES, min_step_s: float = 30.0,
              max_step_s: float = 300.0) -> list[Poll]:
    """Judge every page after the first on its window (page minus the step's first page), as `Rollout` does."""
    start = snapshot_from_metrics(pages[0], MODEL)
    polls = []
    for number, page in enumerate(pages[1:], start=1):
        window = snapshot_from_metrics(page, MODEL).minus(start)
        readings = evaluate_gates(window, BASELINE, CANDIDATE, gates)
        verdict, why = step_verdict(readings, number * POLL_S, min_step_s, max_step_s)
        polls.append(Poll(number * POLL_S, verdict, why, {r.gate: r for r in readings}, window))
    return polls


def first_decision(polls: Sequence[Poll]) -> int:
    """The poll (1-based) at which the tool stops waiting: the first verdict that is not WAIT."""
    return next(number for number, poll in enumerate(polls, start=1) if poll.verdict is not Verdict.WAIT)


def before_the_step(num_candidate_requests: int = 25) -> RouterMetrics:
    """The router as a step finds it: hours of baseline traffic and, after a first step, some canary traffic."""
    router = RouterMetrics()
    router.serve(BASELINE, [0.04, 0.06, 0.08, 0.12] * 1250, errors=3, rejected=40, inflight=6)
    if num_candidate_requests:
        router.serve(CANDIDATE, [0.05] * num_candidate_requests, inflight=1)
        router.shadow(BASELINE, CANDIDATE, [0.996] * 8)
    return router


def baseline_traffic(router: RouterMetrics, poll: int) -> None:
    router.serve(BASELINE, [0.04, 0.06, 0.08, 0.12] * 19, inflight=5 + poll % 3)


def good_candidate(router: RouterMetrics, poll: int) -> None:
    baseline_traffic(router, poll)
    router.serve(CANDIDATE, [0.03, 0.045, 0.06, 0.09], rejected=2 if poll == 2 else 0, inflight=poll % 2)
    router.shadow(BASELINE, CANDIDATE, [0.996])


def erroring_candidate(router: RouterMetrics, poll: int) -> None:
    """Healthy for two polls, then one request in four fails."""
    baseline_traffic(router, poll)
    router.serve(CANDIDATE, [0.04] * (4 if poll < 3 else 3), errors=0 if poll < 3 else 1)
    router.shadow(BASELINE, CANDIDATE, [0.996])


def slow_candidate(router: RouterMetrics, poll: int) -> None:
    baseline_traffic(router, poll)
    router.serve(CANDIDATE, [0.42, 0.44, 0.46, 0.48])
    router.shadow(BASELINE, CANDIDATE, [0.996])


def drifting_candidate(router: RouterMetrics, poll: int) -> None:
    baseline_traffic(router, poll)
    router.serve(CANDIDATE, [0.03, 0.045, 0.06, 0.09])
    router.shadow(BASELINE, CANDIDATE, [0.90])


def unrouted_candidate(router: RouterMetrics, poll: int) -> None:
    """The routing change never reached the router: the candidate gets nothing."""
    baseline_traffic(router, poll)


# --- parsing ----------------------------------------------------------------------------------


def test_parsing_reads_names_labels_and_values_and_skips_comments():
    text = "\n".join([
        "# HELP embed_requests_total Routed requests",
        "# TYPE embed_requests_total counter",
        'embed_requests_total{model="embed",outcome="ok",version="2"} 17',
        "nv_cpu_memory_used_bytes 1.2884901888e+10",
        'embed_request_duration_seconds_bucket{le="+Inf",model="embed",version="2"} 17 1712000000000',
        "",
    ])
    assert parse_exposition(text) == {
        ("embed_requests_total", (("model", "embed"), ("outcome", "ok"), ("version", "2"))): 17.0,
        ("nv_cpu_memory_used_bytes", ()): 1.2884901888e10,
        ("embed_request_duration_seconds_bucket", (("le", "+Inf"), ("model", "embed"), ("version", "2"))): 17.0,
    }


@pytest.mark.parametrize("bad_line", ["not a sample", 'broken{model="embed"} not-a-number'])
def test_a_page_with_a_line_that_is_not_a_sample_is_refused_naming_the_line(bad_line):
    # Skipping it would read as no traffic: the step would wait it out and blame the canary.
    page = metrics_page(RouterMetrics()) + bad_line + "\n"
    with pytest.raises(ValueError, match=f"unreadable metrics text at line {page.count(chr(10))}"):
        snapshot_from_metrics(page, MODEL)


def test_parsing_keeps_labels_apart_around_escaped_quotes_and_braces():
    line = r'nv_model_info{detail="say \"hi\" {x}",model="embed",path="C:\\models",version="1"} 3'
    [((name, labels), value)] = parse_exposition(line).items()
    assert (name, value) == ("nv_model_info", 3.0)
    assert {key for key, _ in labels} == {"detail", "model", "path", "version"}
    assert (dict(labels)["model"], dict(labels)["version"]) == ("embed", "1")


def test_parsing_unescapes_label_values():
    line = r'nv_model_info{detail="say \"hi\"",path="C:\\models"} 3'
    [(_, labels)] = parse_exposition(line)
    assert dict(labels) == {"detail": 'say "hi"', "path": "C:\\models"}


def test_rendered_page_looks_like_tritons():
    router = RouterMetrics()
    router.serve(CANDIDATE, [0.15, 0.2, 0.21] + [0.04] * 14)
    page = metrics_page(router)
    assert 'embed_request_duration_seconds_bucket{le="0.2",model="embed",version="2"} 16\n' in page
    assert 'embed_request_duration_seconds_bucket{le="+Inf",model="embed",version="2"} 17\n' in page
    assert 'embed_requests_total{model="embed",outcome="ok",version="2"} 17\n' in page
    assert "# TYPE embed_request_duration_seconds histogram\n" in page
    assert 'nv_inference_count{model="embed",version="1"} 5230\n' in page


def test_snapshot_reads_each_versions_counters_histogram_and_gauge():
    router = RouterMetrics()
    router.serve(1, [0.004, 0.05, 0.05, 0.3], errors=2, rejected=5, inflight=7)
    router.serve(2, [0.012] * 3, inflight=1)
    router.shadow(1, 2, [0.999, 0.97])
    snapshot = snapshot_from_metrics(metrics_page(router), MODEL)
    assert set(snapshot.versions) == {1, 2}
    v1 = snapshot.version(1)
    assert (v1.ok, v1.errors, v1.rejected, v1.inflight, v1.answered) == (4, 2, 5, 7, 6)
    assert v1.error_rate == pytest.approx(2 / 6)
    assert v1.latency_s.edges == LATENCY_BUCKETS_S
    assert v1.latency_s.count == 4
    assert v1.latency_s.total == pytest.approx(0.404)
    assert v1.latency_s.cumulative[:5] == (1, 1, 1, 1, 3)  # le 0.005, 0.01, 0.02, 0.03, 0.05
    assert v1.latency_s.cumulative[-1] == 4
    assert snapshot.version(2).latency_s.cumulative[:3] == (0, 0, 3)
    cosines = snapshot.cosines(1, 2)
    assert (cosines.edges, cosines.count) == (COSINE_BUCKETS, 2)
    assert cosines.mean == pytest.approx(0.9845)
    assert snapshot.cosines(2, 1) == Histogram()
    assert snapshot.version(3) == VersionStats()


def test_snapshot_ignores_other_models_and_tritons_own_metrics():
    # Encoder versions 2 and 3 behind the router; Triton's own series for the router carry version="1".
    router = RouterMetrics()
    router.serve(2, [0.05] * 10)
    router.serve(3, [0.06] * 4, errors=1)
    other = RouterMetrics(model="embed_multilingual")
    other.serve(2, [0.9] * 50, errors=30, rejected=4, inflight=9)
    other.shadow(1, 2, [0.1] * 5)
    snapshot = snapshot_from_metrics(metrics_page(other, router), MODEL)
    assert set(snapshot.versions) == {2, 3}
    assert (snapshot.version(2).ok, snapshot.version(2).errors, snapshot.version(2).inflight) == (10, 0, 0)
    assert snapshot.version(3).errors == 1
    assert snapshot.drift == {}
    assert snapshot_from_metrics(metrics_page(other, router), "no_such_model") == Snapshot({}, {})


def test_snapshot_reads_buckets_in_any_label_order_and_line_order():
    # prometheus-cpp appends `le` after the metric's own labels; the bucket lines may come before _count.
    text = "\n".join([
        'embed_request_duration_seconds_bucket{model="embed",version="2",le="0.2"} 3',
        'embed_request_duration_seconds_bucket{model="embed",version="2",le="+Inf"} 5',
        'embed_request_duration_seconds_bucket{model="embed",version="2",le="0.1"} 1',
        'embed_request_duration_seconds_sum{model="embed",version="2"} 12.5',
        'embed_request_duration_seconds_count{model="embed",version="2"} 5',
    ])
    latency = snapshot_from_metrics(text, MODEL).version(2).latency_s
    assert latency == Histogram(edges=(0.1, 0.2), cumulative=(1, 3), count=5, total=12.5)


def test_observations_past_the_last_edge_count_only_in_inf():
    router = RouterMetrics()
    router.serve(CANDIDATE, [0.05] * 10 + [12.0, 30.0])
    latency = snapshot_from_metrics(metrics_page(router), MODEL).version(CANDIDATE).latency_s
    assert latency.edges[-1] == 10.0
    assert (latency.cumulative[-1], latency.count) == (10, 12)
    assert latency.quantile(0.95) == 10.0  # in the +Inf bucket: the last finite edge


# --- histograms -------------------------------------------------------------------------------

SPREAD = Histogram(edges=(0.1, 0.2, 0.5), cumulative=(10, 30, 40), count=40, total=8.0)


@pytest.mark.parametrize(
    ("histogram", "q", "expected"),
    [
        (SPREAD, 0.5, 0.15),  # rank 20 of the 20 in (0.1, 0.2]: 0.1 + 0.1 * (20 - 10) / (30 - 10)
        (SPREAD, 0.95, 0.44),  # rank 38: 0.2 + 0.3 * (38 - 30) / (40 - 30)
        (SPREAD, 0.25, 0.1),  # rank 10 is the top of the first bucket
        (SPREAD, 0.75, 0.2),  # rank 30 is the top of the second
        (SPREAD, 0.1, 0.04),  # inside the first bucket, interpolated up from 0
        (Histogram((0.005, 0.01), (10, 10), 10, 0.03), 0.95, 0.00475),  # everything in the first bucket
        (Histogram((0.005, 0.01), (10, 10), 10, 0.03), 1.0, 0.005),
        (Histogram((0.1, 0.2), (1, 2), 10, 50.0), 0.95, 0.2),  # in +Inf: the last finite edge
        (Histogram((0.1, 0.2), (0, 0), 3, 90.0), 0.5, 0.2),
        (Histogram((0.4, 0.5), (0, 100), 100, 45.0), 0.95, 0.495),  # all in (0.4, 0.5]
    ],
)
def test_quantile_interpolates_like_promql(histogram, q, expected):
    assert histogram.quantile(q) == pytest.approx(expected)


def test_quantile_and_mean_of_no_observations_are_nan():
    assert math.isnan(Histogram().quantile(0.95))
    assert math.isnan(Histogram((0.1, 0.2), (0, 0), 0, 0.0).quantile(0.5))
    assert math.isnan(Histogram().mean)
    assert SPREAD.mean == pytest.approx(0.2)


def test_quantile_of_recorded_latencies_matches_the_hand_computed_value():
    router = RouterMetrics()
    # 80 requests at 150 ms, then 10 in (0.3, 0.4] and 10 in (0.4, 0.5]: p95 is halfway through (0.4, 0.5].
    router.serve(CANDIDATE, [0.15] * 80 + [0.35] * 10 + [0.45] * 10)
    latency = snapshot_from_metrics(metrics_page(router), MODEL).version(CANDIDATE).latency_s
    assert latency.quantile(0.95) == pytest.approx(0.45)
    assert latency.quantile(0.5) == pytest.approx(0.125 + 0.025 * 50 / 80)  # rank 50 of 80 in (0.125, 0.15]
    assert latency.mean == pytest.approx((0.15 * 80 + 0.35 * 10 + 0.45 * 10) / 100)


def test_histogram_minus_keeps_what_was_observed_since():
    earlier = Histogram((0.1, 0.2, 0.5), (4, 10, 12), 13, 2.5)
    assert SPREAD.minus(earlier) == Histogram((0.1, 0.2, 0.5), (6, 20, 28), 27, 5.5)
    assert SPREAD.minus(Histogram()) == SPREAD  # a series that did not exist yet
    assert SPREAD.minus(SPREAD) == Histogram((0.1, 0.2, 0.5), (0, 0, 0), 0, 0.0)


def test_histogram_minus_refuses_different_edges():
    with pytest.raises(ValueError, match="different bucket edges"):
        SPREAD.minus(Histogram((0.1, 0.25, 0.5), (1, 2, 3), 3, 0.5))
    with pytest.raises(ValueError, match="different bucket edges"):
        Histogram().minus(SPREAD)


# --- windows ----------------------------------------------------------------------------------


def test_window_subtracts_counters_but_not_the_inflight_gauge():
    router = before_the_step()
    first = snapshot_from_metrics(metrics_page(router), MODEL)
    router.serve(BASELINE, [0.05] * 30, errors=1, rejected=2, inflight=2)
    router.serve(CANDIDATE, [0.02, 0.3], errors=1, inflight=4)
    router.shadow(BASELINE, CANDIDATE, [0.9, 0.99])
    window = snapshot_from_metrics(metrics_page(router), MODEL).minus(first)
    base, cand = window.version(BASELINE), window.version(CANDIDATE)
    assert (base.ok, base.errors, base.rejected, base.inflight) == (30, 1, 2, 2)  # gauge: 2 now, not 2 - 6
    assert (cand.ok, cand.errors, cand.rejected, cand.inflight) == (2, 1, 0, 4)  # gauge: 4 now, not 4 - 1
    assert (base.latency_s.count, cand.latency_s.count) == (30, 2)
    assert cand.latency_s.total == pytest.approx(0.32)
    assert cand.latency_s.cumulative[2] == 1  # le 0.02; the 25 earlier requests at 50 ms are gone
    cosines = window.cosines(BASELINE, CANDIDATE)
    assert (cosines.count, cosines.mean) == (2, pytest.approx(0.945))


def test_window_of_a_version_that_appears_during_the_step_is_all_it_did():
    router = before_the_step(num_candidate_requests=0)
    first = snapshot_from_metrics(metrics_page(router), MODEL)
    assert CANDIDATE not in first.versions
    router.serve(CANDIDATE, [0.05] * 3, errors=1, inflight=1)
    router.shadow(BASELINE, CANDIDATE, [0.99])
    window = snapshot_from_metrics(metrics_page(router), MODEL).minus(first)
    assert window.version(CANDIDATE) == snapshot_from_metrics(metrics_page(router), MODEL).version(CANDIDATE)
    assert window.cosines(BASELINE, CANDIDATE).count == 1


# --- gates ------------------------------------------------------------------------------------


def window_of(ok: int = 0, errors: int = 0, rejected: int = 0, latency_s: float = 0.05,
              cosines: Sequence[float] = ()) -> Snapshot:
    """A window from two recorded pages: a baseline at 1%-error health and a candidate as given."""
    router = before_the_step()
    first = snapshot_from_metrics(metrics_page(router), MODEL)
    router.serve(BASELINE, [0.06] * 99, errors=1)
    router.serve(CANDIDATE, [latency_s] * ok, errors=errors, rejected=rejected)
    router.shadow(BASELINE, CANDIDATE, cosines)
    return snapshot_from_metrics(metrics_page(router), MODEL).minus(first)


def gate(window: Snapshot, name: str, gates: Gates = GATES) -> GateReading:
    return {r.gate: r for r in evaluate_gates(window, BASELINE, CANDIDATE, gates)}[name]


@pytest.mark.parametrize(
    ("ok", "errors", "rejected", "verdict"),
    [
        (0, 0, 0, Verdict.WAIT),
        (19, 0, 0, Verdict.WAIT),
        (20, 0, 0, Verdict.PASS),  # a healthy candidate passes once it has min_requests
        (3, 1, 0, Verdict.FAIL),  # the first error, long before min_requests: fail fast
        (0, 1, 0, Verdict.FAIL),
        (995, 5, 0, Verdict.PASS),  # 0.5% over a large sample
        (990, 10, 0, Verdict.PASS),  # exactly at the limit
        (989, 11, 0, Verdict.FAIL),  # just over it
        (5, 0, 40, Verdict.WAIT),  # rejections are retryable, neither errors nor answers
        (20, 0, 500, Verdict.PASS),
    ],
)
def test_errors_gate(ok, errors, rejected, verdict):
    assert gate(window_of(ok, errors, rejected), "errors").verdict is verdict


def test_errors_gate_fails_fast_only_past_what_the_minimum_sample_allows():
    gates = Gates(slo_p95_ms=200, max_error_rate=0.1, min_requests=20)  # 2 errors allowed in 20
    assert gates.errors_allowed == 2
    assert gate(window_of(ok=3, errors=2), "errors", gates).verdict is Verdict.WAIT
    assert gate(window_of(ok=3, errors=3), "errors", gates).verdict is Verdict.FAIL
    assert gate(window_of(ok=18, errors=2), "errors", gates).verdict is Verdict.PASS
    assert gate(window_of(ok=250, errors=30), "errors", gates).verdict is Verdict.FAIL  # 10.7%


def test_errors_gate_reading_says_what_it_counted():
    reading = gate(window_of(ok=3, errors=1, rejected=7), "errors")
    assert (reading.value, reading.limit) == (0.25, 0.01)
    assert reading.detail == "candidate v2: 1 failed of 4 (25.0%), 7 rejected; baseline v1: 1.0% of 100"


@pytest.mark.parametrize(
    ("ok", "latency_s", "verdict", "p95_ms"),
    [
        (0, 0.05, Verdict.WAIT, None),
        (19, 0.05, Verdict.WAIT, 49.0),  # p95 known, but too few requests to judge
        (20, 0.05, Verdict.PASS, 49.0),  # all in (0.03, 0.05]: 30 + 20 * 0.95
        (200, 0.19, Verdict.PASS, 198.75),  # all in (0.175, 0.2]: 175 + 25 * 0.95
        (20, 0.45, Verdict.FAIL, 495.0),  # a slow version: all in (0.4, 0.5]
        (20, 0.21, Verdict.FAIL, 247.5),
    ],
)
def test_latency_gate(ok, latency_s, verdict, p95_ms):
    reading = gate(window_of(ok=ok, latency_s=latency_s), "latency")
    assert reading.verdict is verdict
    assert reading.value == (None if p95_ms is None else pytest.approx(p95_ms))
    assert reading.limit == 200


def test_latency_gate_counts_only_answered_requests():
    # 30 requests, 20 of them failed: the latency histogram holds the 10 that succeeded.
    gates = Gates(slo_p95_ms=200, max_error_rate=0.9)
    assert gate(window_of(ok=10, errors=20), "latency", gates).verdict is Verdict.WAIT
    assert gate(window_of(ok=10, errors=20), "errors", gates).verdict is Verdict.PASS


def test_latency_gate_reading_names_both_versions():
    reading = gate(window_of(ok=20, latency_s=0.45), "latency")
    assert reading.detail == ("candidate v2 p95 495 ms over 20 requests (SLO 200 ms); "
                              "baseline v1 p95 74 ms")  # 99 at 60 ms: (0.05, 0.075] -> 50 + 25 * 0.95
    assert gate(window_of(), "latency").detail.endswith("baseline v1 p95 74 ms")


@pytest.mark.parametrize(
    ("cosines", "min_shadow_samples", "verdict", "mean"),
    [
        ((), 10, Verdict.WAIT, None),
        ([0.99] * 9, 10, Verdict.WAIT, 0.99),
        ([0.99] * 10, 10, Verdict.PASS, 0.99),
        ([0.90] * 10, 10, Verdict.FAIL, 0.90),
        ((), 0, Verdict.PASS, None),  # no shadowing asked for
        ([0.90], 0, Verdict.FAIL, 0.90),  # ... but rows that came are still judged
    ],
)
def test_drift_gate(cosines, min_shadow_samples, verdict, mean):
    gates = Gates(slo_p95_ms=200, min_shadow_samples=min_shadow_samples)
    reading = gate(window_of(ok=20, cosines=cosines), "drift", gates)
    assert reading.verdict is verdict
    assert reading.value == (None if mean is None else pytest.approx(mean))


def test_drift_gate_passes_a_mean_exactly_at_the_limit():
    gates = Gates(slo_p95_ms=200, min_cosine=0.75)  # 0.75, 1.0, 0.5 and their sums are exact in binary
    for cosines, verdict in (([1.0, 0.5] * 5, Verdict.PASS), ([1.0, 0.5] * 4 + [1.0, 0.4375], Verdict.FAIL)):
        router = RouterMetrics()  # the step's first rows: no earlier sum to subtract
        first = snapshot_from_metrics(metrics_page(router), MODEL)
        router.shadow(BASELINE, CANDIDATE, cosines)
        window = snapshot_from_metrics(metrics_page(router), MODEL).minus(first)
        assert gate(window, "drift", gates).verdict is verdict


def test_drift_gate_reading_before_and_after_shadowed_rows():
    assert gate(window_of(), "drift").detail == "no shadowed rows yet (need 10)"
    assert gate(window_of(cosines=[0.99, 0.97]), "drift").detail == "mean cosine v2 vs v1 0.9800 over 2 shadowed rows"


# --- drift gates by measure -----------------------------------------------------------------

TOP1 = Gates(slo_p95_ms=200, drift=DriftMeasure.TOP1)  # agreement >= 0.99, logit difference <= 0.5
TOLERANCE = Gates(slo_p95_ms=200, drift=DriftMeasure.ABS_DIFF, tolerance=0.01)


def shadow_window(**series: Sequence[float]) -> Snapshot:
    """A window in which the router observed these per-row values of each named series."""
    router = before_the_step()
    first = snapshot_from_metrics(metrics_page(router), MODEL)
    router.serve(CANDIDATE, [0.05] * 20)
    for name, values in series.items():
        router.shadow(BASELINE, CANDIDATE, values, series=name)
    return snapshot_from_metrics(metrics_page(router), MODEL).minus(first)


def test_snapshot_reads_every_shadow_series_by_name():
    router = RouterMetrics()
    router.shadow(1, 2, [1.0, 0.0, 1.0, 1.0], series="top1_agreement")
    router.shadow(1, 2, [0.001, 0.3, 0.02, 0.0], series="max_logit_diff")
    router.shadow(1, 2, [0.004, 12.0], series="max_abs_diff")
    other = RouterMetrics(model="reranker")
    other.shadow(1, 2, [0.0] * 5, series="top1_agreement")
    snapshot = snapshot_from_metrics(metrics_page(other, router), MODEL)
    assert set(snapshot.drift) == {("top1_agreement", 1, 2), ("max_logit_diff", 1, 2), ("max_abs_diff", 1, 2)}
    agreement = snapshot.shadowed("top1_agreement", 1, 2)
    assert (agreement.edges, agreement.cumulative, agreement.count, agreement.mean) == ((0.5, 1.0), (1, 4), 4, 0.75)
    logit_diff = snapshot.shadowed("max_logit_diff", 1, 2)
    assert logit_diff.edges == DIFF_BUCKETS and logit_diff.upper_bound == 0.5  # 0.3 is in (0.25, 0.5]
    assert snapshot.shadowed("max_abs_diff", 1, 2).upper_bound == math.inf  # 12 is past the last edge, 10
    assert snapshot.cosines(1, 2) == Histogram() == snapshot.shadowed("cosine", 1, 2)


@pytest.mark.parametrize(
    ("histogram", "bound"),
    [
        (SPREAD, 0.5),  # observations up to the last bucket
        (Histogram((0.1, 0.2, 0.5), (3, 3, 3), 3, 0.1), 0.1),  # all in the first bucket
        (Histogram((0.1, 0.2, 0.5), (0, 2, 2), 2, 0.3), 0.2),
        (Histogram((0.1, 0.2, 0.5), (1, 2, 2), 3, 9.0), math.inf),  # one past the last edge
        (Histogram((), (), 2, 1.0), math.inf),  # no finite edges at all
    ],
)
def test_upper_bound_is_the_edge_of_the_highest_non_empty_bucket(histogram, bound):
    assert histogram.upper_bound == bound
    if math.isfinite(bound):
        assert histogram.quantile(1.0) == pytest.approx(bound)  # the 100th percentile, to rounding


def test_upper_bound_of_no_observations_is_nan():
    assert math.isnan(Histogram().upper_bound)
    assert math.isnan(SPREAD.minus(SPREAD).upper_bound)


def test_window_subtracts_every_shadow_series():
    router = before_the_step()
    router.shadow(BASELINE, CANDIDATE, [8.0], series="max_abs_diff")  # before the step: not the window's
    first = snapshot_from_metrics(metrics_page(router), MODEL)
    router.shadow(BASELINE, CANDIDATE, [0.002, 0.001], series="max_abs_diff")
    window = snapshot_from_metrics(metrics_page(router), MODEL).minus(first)
    diff = window.shadowed("max_abs_diff", BASELINE, CANDIDATE)
    assert (diff.count, diff.upper_bound) == (2, 0.0025)


@pytest.mark.parametrize(
    ("agreement", "logit_diffs", "verdict", "value"),
    [
        ((), (), Verdict.WAIT, None),
        ([1.0] * 9, [0.1] * 9, Verdict.WAIT, 1.0),
        ([1.0] * 10, [0.1] * 10, Verdict.PASS, 1.0),
        ([1.0] * 99 + [0.0], [0.1] * 100, Verdict.PASS, 0.99),  # agreement exactly at the limit
        ([1.0] * 98 + [0.0] * 2, [0.1] * 100, Verdict.FAIL, 0.98),
        ([1.0] * 10, [0.1] * 9 + [0.5], Verdict.PASS, 1.0),  # 0.5 is the edge: <= 0.5
        ([1.0] * 10, [0.1] * 9 + [0.51], Verdict.FAIL, 1.0),  # one row's logits moved too far
        ([1.0] * 10, [0.1] * 9 + [math.inf], Verdict.FAIL, 1.0),  # a NaN row (scored +inf)
    ],
)
def test_top1_gate_judges_agreement_and_the_largest_logit_difference(agreement, logit_diffs, verdict, value):
    reading = gate(shadow_window(top1_agreement=agreement, max_logit_diff=logit_diffs), "drift", TOP1)
    assert reading.verdict is verdict
    assert reading.value == (None if value is None else pytest.approx(value))
    assert reading.limit == 0.99


def test_top1_gate_reading_says_what_it_measured():
    window = shadow_window(top1_agreement=[1.0] * 199 + [0.0], max_logit_diff=[0.02] * 199 + [0.3])
    assert gate(window, "drift", TOP1).detail == (
        "top-1 agreement v2 vs v1 0.9950 (min 0.99), largest logit difference <= 0.5 (max 0.5) "
        "over 200 shadowed rows")
    window = shadow_window(top1_agreement=[1.0] * 10, max_logit_diff=[0.02] * 9 + [40.0])
    assert gate(window, "drift", TOP1).detail == (
        "top-1 agreement v2 vs v1 1.0000 (min 0.99), largest logit difference > 10 (max 0.5) "
        "over 10 shadowed rows")
    assert gate(shadow_window(), "drift", TOP1).detail == "no shadowed rows yet (need 10)"


@pytest.mark.parametrize(
    ("diffs", "verdict", "value"),
    [
        ((), Verdict.WAIT, None),
        ([0.0] * 10, Verdict.PASS, 0.0001),  # exact matches land in the first bucket
        ([0.001] * 9 + [0.01], Verdict.PASS, 0.01),  # the tolerance is an edge: <= 0.01
        ([0.001] * 9 + [0.011], Verdict.FAIL, 0.025),
        ([0.001] * 9 + [math.inf], Verdict.FAIL, None),  # past every edge: no finite value, the detail says > 10
    ],
)
def test_tolerance_gate_judges_the_largest_absolute_difference(diffs, verdict, value):
    reading = gate(shadow_window(max_abs_diff=diffs), "drift", TOLERANCE)
    assert (reading.verdict, reading.value, reading.limit) == (verdict, value, 0.01)


def test_tolerance_gate_reading_says_what_it_measured():
    window = shadow_window(max_abs_diff=[0.0002] * 119 + [0.004])
    assert gate(window, "drift", TOLERANCE).detail == (
        "largest absolute difference v2 vs v1 <= 0.005 (tolerance 0.01) over 120 shadowed rows")
    window = shadow_window(max_abs_diff=[0.0002] * 9 + [math.inf])
    assert gate(window, "drift", TOLERANCE).detail == (
        "largest absolute difference v2 vs v1 > 10 (tolerance 0.01) over 10 shadowed rows")


def test_a_tolerance_between_two_edges_is_judged_at_the_edge_below_it():
    gates = replace(TOLERANCE, tolerance=0.003)  # between the edges 0.0025 and 0.005
    assert gate(shadow_window(max_abs_diff=[0.0025] * 10), "drift", gates).verdict is Verdict.PASS
    assert gate(shadow_window(max_abs_diff=[0.0028] * 10), "drift", gates).verdict is Verdict.FAIL


def test_each_measure_reads_only_its_own_series():
    cosines_only = shadow_window(cosine=[0.2] * 10)
    assert gate(cosines_only, "drift", TOP1).verdict is Verdict.WAIT
    assert gate(cosines_only, "drift", TOLERANCE).verdict is Verdict.WAIT
    classifier = shadow_window(top1_agreement=[1.0] * 10, max_logit_diff=[0.1] * 10)
    assert gate(classifier, "drift").verdict is Verdict.WAIT  # the default measure: cosine
    assert gate(shadow_window(max_abs_diff=[0.1] * 10), "drift", TOP1).verdict is Verdict.WAIT


def test_top1_gate_waits_for_both_of_its_series():
    window = shadow_window(top1_agreement=[1.0] * 10, max_logit_diff=[0.1] * 4)
    assert gate(window, "drift", TOP1).verdict is Verdict.WAIT


def test_a_measure_without_shadowing_asked_for_passes_until_rows_come():
    gates = replace(TOP1, min_shadow_samples=0)
    assert gate(shadow_window(), "drift", gates).verdict is Verdict.PASS
    bad = shadow_window(top1_agreement=[0.0], max_logit_diff=[3.0])
    assert gate(bad, "drift", gates).verdict is Verdict.FAIL


def test_drift_text_says_each_measures_condition():
    assert GATES.drift_text(1) == "mean cosine vs v1 >= 0.98"
    assert TOP1.drift_text(3) == "top-1 agreement vs v3 >= 0.99 and largest logit difference <= 0.5"
    assert TOLERANCE.drift_text(1) == "largest absolute difference vs v1 <= 0.01"
    assert replace(TOLERANCE, tolerance=0.003).drift_text(1) == (
        "largest absolute difference vs v1 <= 0.003 (judged at the histogram edge 0.0025)")
    assert replace(TOP1, max_logit_diff=0.3).drift_text(1).endswith(
        "largest logit difference <= 0.3 (judged at the histogram edge 0.25)")


def test_gates_take_the_measure_by_name():
    assert Gates(slo_p95_ms=200, drift="top1").drift is DriftMeasure.TOP1
    assert GATES.drift is DriftMeasure.COSINE


def test_recorded_step_of_a_classifier_that_flips_classes_fails_at_its_tenth_row():
    def flipping_classifier(router: RouterMetrics, poll: int) -> None:
        baseline_traffic(router, poll)
        router.serve(CANDIDATE, [0.03, 0.045, 0.06, 0.09])
        router.shadow(BASELINE, CANDIDATE, [1.0 if poll % 4 else 0.0], series="top1_agreement")
        router.shadow(BASELINE, CANDIDATE, [0.05], series="max_logit_diff")

    polls = walk_step(record_series(before_the_step(), 14, flipping_classifier), gates=TOP1)
    assert first_decision(polls) == 10
    assert polls[9].why == ("drift gate failed: top-1 agreement v2 vs v1 0.8000 (min 0.99), largest logit "
                            "difference <= 0.05 (max 0.5) over 10 shadowed rows")


def test_readings_of_an_empty_window_are_json_without_nan():
    readings = evaluate_gates(Snapshot({}, {}), BASELINE, CANDIDATE, GATES)
    assert [(r.gate, r.verdict, r.value) for r in readings] == [
        ("errors", Verdict.WAIT, None), ("latency", Verdict.WAIT, None), ("drift", Verdict.WAIT, None)]
    record = json.loads(json.dumps([r.to_json() for r in readings], allow_nan=False))
    assert record[1] == {"gate": "latency", "verdict": "wait", "value": None, "limit": 200,
                         "detail": "candidate v2 p95 nan ms over 0 requests (SLO 200 ms); baseline v1 p95 no requests"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slo_p95_ms": 0}, "slo_p95_ms must be > 0, got 0"),
        ({"slo_p95_ms": 200, "max_error_rate": 1.0}, r"max_error_rate must be within \[0, 1\), got 1.0"),
        ({"slo_p95_ms": 200, "max_error_rate": -0.1}, "max_error_rate must be within"),
        ({"slo_p95_ms": 200, "min_cosine": 1.5}, r"min_cosine must be within \[-1, 1\], got 1.5"),
        ({"slo_p95_ms": 200, "min_top1_agreement": 1.5}, r"min_top1_agreement must be within \[0, 1\], got 1.5"),
        ({"slo_p95_ms": 200, "max_logit_diff": 0.0},
         r"max_logit_diff must be >= 0.0001 \(the first edge of the drift histogram\), got 0.0"),
        ({"slo_p95_ms": 200, "max_logit_diff": math.nan}, "max_logit_diff must be >= 0.0001"),
        ({"slo_p95_ms": 200, "drift": "abs_diff"},
         r"the abs_diff drift gate needs a declared tolerance \(the largest absolute output difference "
         r"allowed\); it has no default"),
        ({"slo_p95_ms": 200, "drift": "abs_diff", "tolerance": 1e-5}, "tolerance must be >= 0.0001"),
        ({"slo_p95_ms": 200, "tolerance": -1.0}, "tolerance must be >= 0.0001"),
        ({"slo_p95_ms": 200, "drift": "l2"}, "'l2' is not a valid DriftMeasure"),
        ({"slo_p95_ms": 200, "min_requests": 0}, "min_requests must be >= 1"),
        ({"slo_p95_ms": 200, "min_shadow_samples": -1}, "min_shadow_samples >= 0"),
    ],
)
def test_gates_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Gates(**kwargs)


@pytest.mark.parametrize(
    ("max_error_rate", "min_requests", "allowed"),
    [(0.01, 20, 0), (0.05, 20, 1), (0.1, 20, 2), (0.01, 1000, 10), (0.0, 100, 0)],
)
def test_errors_allowed_over_the_minimum_sample(max_error_rate, min_requests, allowed):
    assert Gates(slo_p95_ms=200, max_error_rate=max_error_rate, min_requests=min_requests).errors_allowed == allowed


# --- step verdicts ----------------------------------------------------------------------------


def readings_of(*verdicts: Verdict) -> list[GateReading]:
    """Measured readings of errors, latency and drift, with the verdicts given."""
    window = window_of(ok=20, cosines=[0.99] * 10)
    return [replace(r, verdict=verdict)
            for r, verdict in zip(evaluate_gates(window, BASELINE, CANDIDATE, GATES), verdicts, strict=True)]


def test_step_fails_when_any_gate_fails_even_while_others_wait():
    verdict, why = step_verdict(readings_of(Verdict.WAIT, Verdict.FAIL, Verdict.WAIT), 1.0, 30, 300)
    assert verdict is Verdict.FAIL
    assert why.startswith("latency gate failed: candidate v2 p95 ")
    verdict, why = step_verdict(readings_of(Verdict.FAIL, Verdict.PASS, Verdict.FAIL), 1.0, 30, 300)
    assert why.startswith("errors gate failed: ") and "; drift gate failed: mean cosine" in why


def test_step_waiting_for_data_fails_once_out_of_time():
    readings = readings_of(Verdict.PASS, Verdict.WAIT, Verdict.WAIT)
    assert step_verdict(readings, 299.9, 30, 300) == (Verdict.WAIT, "waiting for latency, drift")
    verdict, why = step_verdict(readings, 300.0, 30, 300)
    assert verdict is Verdict.FAIL
    assert why.startswith("not enough canary traffic in 300 s to judge: candidate v2 p95 ")
    assert why.endswith("; mean cosine v2 vs v1 0.9900 over 10 shadowed rows")


def test_step_with_passing_gates_holds_until_its_minimum_time():
    readings = readings_of(Verdict.PASS, Verdict.PASS, Verdict.PASS)
    assert step_verdict(readings, 12.0, 30, 300) == (Verdict.WAIT, "gates pass; holding the step for 18 s more")
    assert step_verdict(readings, 30.0, 30, 300) == (Verdict.PASS, "all gates pass")
    assert step_verdict(readings, 400.0, 30, 300) == (Verdict.PASS, "all gates pass")


# --- recorded steps ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_prior_requests", [0, 25], ids=["first-step", "after-a-step"])
def test_good_candidate_passes_once_every_gate_has_data_and_the_step_its_time(num_prior_requests):
    pages = record_series(before_the_step(num_prior_requests), 14, good_candidate,
                          RouterMetrics(model="embed_multilingual"))
    polls = walk_step(pages, min_step_s=60)
    # 4 candidate requests and 1 shadowed row a poll: errors and latency judge at poll 5, drift at 10.
    whys = [poll.why for poll in polls]
    assert whys[:4] == ["waiting for errors, latency, drift"] * 4
    assert whys[4:9] == ["waiting for drift"] * 5
    assert whys[9:11] == ["gates pass; holding the step for 10 s more", "gates pass; holding the step for 5 s more"]
    assert first_decision(polls) == 12
    assert (polls[11].verdict, polls[11].why) == (Verdict.PASS, "all gates pass")
    window = polls[11].window
    assert (window.version(CANDIDATE).answered, window.version(CANDIDATE).rejected) == (48, 2)
    assert window.version(BASELINE).answered == 12 * 76
    assert window.version(CANDIDATE).inflight == 0  # poll 12 left none in flight
    assert polls[11].readings["latency"].value == pytest.approx(95.0)  # rank 45.6: 75 + 25 * (45.6 - 36) / 12
    assert polls[11].readings["drift"].value == pytest.approx(0.996)


@pytest.mark.parametrize(
    ("traffic", "decided_at", "gate", "why"),
    [
        (erroring_candidate, 3, "errors", "errors gate failed: candidate v2: 1 failed of 12 (8.3%), 0 rejected; "
                                          "baseline v1: 0.0% of 228"),
        (slow_candidate, 5, "latency", "latency gate failed: candidate v2 p95 495 ms over 20 requests "
                                       "(SLO 200 ms); baseline v1 p95 120 ms"),
        (drifting_candidate, 10, "drift", "drift gate failed: mean cosine v2 vs v1 0.9000 over 10 shadowed rows"),
    ],
    ids=["errors", "slow", "drift"],
)
def test_bad_candidate_fails_at_the_first_poll_its_gate_can_judge(traffic, decided_at, gate, why):
    polls = walk_step(record_series(before_the_step(), 14, traffic, RouterMetrics(model="embed_multilingual")))
    assert [poll.verdict for poll in polls[:decided_at - 1]] == [Verdict.WAIT] * (decided_at - 1)
    assert first_decision(polls) == decided_at
    assert polls[decided_at - 1].verdict is Verdict.FAIL
    assert polls[decided_at - 1].why == why
    assert polls[decided_at - 1].readings[gate].verdict is Verdict.FAIL


def test_candidate_without_traffic_fails_when_the_step_runs_out_of_time():
    polls = walk_step(record_series(before_the_step(), 14, unrouted_candidate), max_step_s=60)
    assert first_decision(polls) == 12  # 12 polls x 5 s
    assert polls[10].why == "waiting for errors, latency, drift"
    assert polls[11].verdict is Verdict.FAIL
    assert polls[11].why.startswith("not enough canary traffic in 60 s to judge: candidate v2: 0 failed of 0")


def test_window_of_the_first_page_alone_is_empty():
    pages = record_series(before_the_step(), 1, good_candidate)
    start = snapshot_from_metrics(pages[0], MODEL)
    window = start.minus(start)
    assert window.version(CANDIDATE).answered == 0
    assert window.version(CANDIDATE).inflight == 1  # the gauge as it stands
    assert [r.verdict for r in evaluate_gates(window, BASELINE, CANDIDATE, GATES)] == [Verdict.WAIT] * 3


# --- steps and weights ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "steps"),
    [
        ("1,5,25,50,100", (1.0, 5.0, 25.0, 50.0, 100.0)),
        ("100", (100.0,)),
        (" 0.5 , 10,100 ", (0.5, 10.0, 100.0)),
        ("1,,100,", (1.0, 100.0)),
        ("1e1,1e2", (10.0, 100.0)),
    ],
)
def test_parse_steps(raw, steps):
    assert parse_steps(raw) == steps


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("1,five,100", r"steps '1,five,100' must be comma-separated percentages, e\.g\. 1,5,25,50,100"),
        ("1;5;100", "must be comma-separated percentages"),
        ("", "give at least one step"),
        (" , ", "give at least one step"),
        ("0,50,100", r"every step must be within \(0, 100\], got \[0.0, 50.0, 100.0\]"),
        ("50,150", r"within \(0, 100\]"),
        ("-5,100", r"within \(0, 100\]"),
        ("nan,100", r"within \(0, 100\]"),
        ("5,5,100", r"steps must rise, got \[5.0, 5.0, 100.0\]"),
        ("50,25,100", "steps must rise"),
        ("1,5,50", r"the last step must be 100 \(the candidate takes all traffic\), got 50"),
    ],
)
def test_parse_steps_errors(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_steps(raw)


@pytest.mark.parametrize(
    ("percent", "weights"),
    [(1.0, {2: 1.0, 1: 99.0}), (25.0, {2: 25.0, 1: 75.0}), (99.5, {2: 99.5, 1: 0.5}), (100.0, {2: 100.0})],
)
def test_step_weights_give_the_candidate_its_percent(percent, weights):
    assert step_weights(BASELINE, CANDIDATE, percent) == weights


@pytest.mark.parametrize(
    ("weights", "candidate", "baseline"),
    [({1: 100.0}, 2, 1), ({1: 100.0, 2: 0.0}, 2, 1), ({3: 1.0, 1: 0.0}, 2, 3), ({1: 0.0, 4: 7.0}, 1, 4)],
)
def test_baseline_of_is_the_only_version_with_traffic(weights, candidate, baseline):
    assert baseline_of(weights, candidate) == baseline


@pytest.mark.parametrize(
    ("weights", "candidate", "message"),
    [
        ({1: 90.0, 2: 10.0}, 2, r"traffic is split over versions \[1, 2\]; finish or abort that first, "
                                r"or name the baseline with --from"),
        ({3: 1.0, 1: 1.0, 2: 0.0}, 2, r"split over versions \[1, 3\]"),
        ({1: 0.0}, 2, r"split over versions \[\]"),
        ({2: 100.0}, 2, "version 2 already takes all traffic"),
        ({1: 0.0, 2: 100.0}, 2, "version 2 already takes all traffic"),
    ],
)
def test_baseline_of_errors(weights, candidate, message):
    with pytest.raises(ValueError, match=message):
        baseline_of(weights, candidate)


def test_a_sample_with_a_non_numeric_version_label_is_skipped_not_fatal():
    page = 'foo{model="embed",version="v1"} 1\nembed_requests_total{model="embed",outcome="ok",version="2"} 4\n'
    assert snapshot_from_metrics(page, "embed").version(2).ok == 4


@pytest.mark.parametrize("rate", [0.01, 0.29, 0.57, 0.58])
def test_errors_exactly_at_the_limit_pass_with_a_full_sample(rate):
    errors = round(rate * 100)
    window = Snapshot({2: VersionStats(ok=100 - errors, errors=errors)}, {})
    gates = Gates(slo_p95_ms=200, max_error_rate=rate, min_requests=20, min_shadow_samples=0)
    errors_gate = next(r for r in evaluate_gates(window, 1, 2, gates) if r.gate == "errors")
    assert errors_gate.verdict is Verdict.PASS


def test_the_rollout_tool_stops_on_a_page_that_is_not_metrics():
    # A proxy's error page in place of /metrics: a RolloutError, which the tool answers by rolling back.
    from types import SimpleNamespace

    from tools.ops.rollout import Rollout, RolloutError

    control = SimpleNamespace(metrics_url="http://localhost:8002/metrics",
                              metrics=lambda: "<html><body>502 Bad Gateway</body></html>\n")
    rollout = Rollout(SimpleNamespace(model=SimpleNamespace(name=MODEL)), control, Path("."), recorder=None)
    with pytest.raises(RolloutError, match="is not a metrics page: unreadable metrics text at line 1"):
        rollout._snapshot()
