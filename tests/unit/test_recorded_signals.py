"""explain and autoscale on /metrics series recorded from the real server under known traffic.

The recordings in tests/data/metrics come from `python -m tools bench signals` (2 vCPU, the
committed configs): steady traffic at the spec's expected rate; an overload at twice the
measured goodput between two calm phases; and the fragmentation trap: the same 90 req/s of
short texts first on one queue, then spread over two buckets and both versions.
"""

from itertools import pairwise
from pathlib import Path

import pytest

from tools.observe.explain import Cause, diagnose, knobs_from_repository, service_layout, service_window
from tools.observe.metrics import Window, read_recording, windows
from tools.observe.scaling import default_pending_per_replica, replay, signals_from
from tools.planning.autoscale import AutoscalePolicy, AutoscaleState, decide
from tools.spec.serving import load_spec

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "metrics"
LAYOUT = service_layout("embed")
KNOBS = knobs_from_repository(LAYOUT.bucket_models, REPO / "model_repository")


def recording(name: str):
    return read_recording(DATA / f"{name}.jsonl.gz")


def window_at(snapshots, start_s: float, end_s: float) -> Window:
    """The window between the snapshots nearest to these offsets from the recording's start."""
    t0 = snapshots[0].at_s

    def nearest(offset: float):
        return min(snapshots, key=lambda s: abs(s.at_s - t0 - offset))

    return Window(nearest(start_s), nearest(end_s))


def view(window: Window, earlier: Window | None = None):
    return service_window(window, LAYOUT, KNOBS, earlier=earlier)


def policy(**overrides) -> AutoscalePolicy:
    values = dict(slo_p95_ms=LAYOUT.slo_p95_ms, pending_per_replica=default_pending_per_replica(KNOBS),
                  startup_s=60.0, scale_down_window_s=300.0)
    return AutoscalePolicy(**(values | overrides))


def decisions(name: str, **overrides):
    snapshots = recording(name)
    t0 = snapshots[0].at_s
    return [(d.at_s - t0, d) for d in replay(snapshots, lambda w, e: view(w, e), policy(**overrides), span_s=10.0)]


def test_recordings_hold_the_traffic_they_describe():
    steady = view(window_at(recording("steady"), 5, 40))
    assert steady.rate_rps == pytest.approx(load_spec().models[0].expected_rps, rel=0.25)
    # Recorded before the express model (which the layout lists now): every bucket model carried traffic.
    assert {q.model for q in steady.queues if q.num_requests} == set(load_spec().models[0].bucket_names)


def test_steady_traffic_keeps_one_replica_and_nothing_waits_for_capacity():
    for _, decision in decisions("steady"):
        assert decision.desired == 1, decision.reason
    diagnosis = diagnose(view(window_at(recording("steady"), 20, 40)))
    assert not diagnosis.causes & {Cause.CAPACITY_WAIT, Cause.FRAGMENTED, Cause.FAILING}, diagnosis.findings


def test_overload_scales_up_during_the_overload_and_not_before():
    made = decisions("overload")
    calm = [d for t, d in made if t <= 18.0]
    assert calm and all(d.desired == 1 for d in calm)
    first_up = next((t, d) for t, d in made if d.desired > 1)
    assert 20.0 <= first_up[0] <= 45.0, first_up
    # Admission keeps the admitted requests near the SLO, so what was asked over what was
    # served is the signal that says how much capacity is missing.
    assert first_up[1].ratios.get("demand", 0.0) > 1.1 or first_up[1].ratios["latency"] > 1.1
    assert max(d.desired for _, d in made) >= 2


def test_overload_waits_for_new_pods_before_adding_again():
    made = decisions("overload")
    ups = [t for (_, before), (t, d) in pairwise(made) if d.desired > before.desired]
    assert ups
    assert all(later - earlier >= 60.0 for earlier, later in pairwise(ups))


def test_overload_scales_back_down_once_the_calm_lasts_the_window():
    made = decisions("overload", scale_down_window_s=30.0, startup_s=20.0)
    peak = max(d.desired for _, d in made)
    assert peak >= 2
    assert made[-1][1].desired < peak, [d.reason for _, d in made[-5:]]
    downs = [t for (_, before), (t, d) in pairwise(made) if d.desired < before.desired]
    assert downs and min(downs) >= 60.0 + 30.0  # after the overload ended and the calm lasted the window


def test_fragmented_phase_is_diagnosed_and_the_single_queue_phase_is_not():
    snapshots = recording("fragmented")
    one_queue = diagnose(view(window_at(snapshots, 10, 28)))
    spread = diagnose(view(window_at(snapshots, 45, 68), earlier=window_at(snapshots, 10, 28)))
    assert Cause.FRAGMENTED not in one_queue.causes, one_queue.findings
    assert Cause.FRAGMENTED in spread.causes, spread.findings
    finding = next(f for f in spread.findings if f.cause is Cause.FRAGMENTED)
    assert "2 buckets x 2 versions" in finding.evidence
    assert "do not add replicas" in finding.knob


def test_fragmentation_raises_the_tail_while_the_device_idles():
    snapshots = recording("fragmented")
    one_queue, spread = view(window_at(snapshots, 10, 28)), view(window_at(snapshots, 45, 68))
    assert spread.busy_share < 0.5
    assert spread.p99_ms > one_queue.p99_ms
    assert spread.queue_ms > one_queue.queue_ms


def test_autoscale_never_adds_replicas_for_fragmented_traffic():
    for _, decision in decisions("fragmented"):
        assert decision.desired == 1, decision.reason


def test_autoscale_holds_on_fragmentation_even_when_latency_alone_would_scale():
    # Judged against an SLO the spread phase's p95 overshoots by half, a latency-only rule
    # would add replicas in every window of it; the fragmentation guard holds and says why.
    snapshots = recording("fragmented")
    spread = view(window_at(snapshots, 45, 68))
    tight = policy(slo_p95_ms=spread.p95_ms / 0.8 / 1.5)
    t0 = snapshots[0].at_s
    judged = [w for w in windows(snapshots, 10.0) if w.start.at_s - t0 >= 35.0]
    assert len(judged) >= 5
    for window in judged:
        decision = decide(signals_from(view(window), replicas=1, at_s=window.end.at_s), AutoscaleState(1), tight)
        assert decision.ratios["latency"] > 1.1
        assert decision.desired == 1 and "fragmented" in decision.reason, decision.reason


def test_signals_from_a_recorded_window_carry_the_linger_budget_of_the_queues_used():
    snapshots = recording("fragmented")
    signals = signals_from(view(window_at(snapshots, 10, 28)), replicas=1, at_s=0.0)
    assert signals.linger_ms == pytest.approx(KNOBS["encoder_16"].max_queue_delay_ms)


def test_capacity_from_the_batches_traffic_formed():
    from tools.observe.scaling import observed_batches
    from tools.planning.capacity import Demand, observed_plans

    snapshots = recording("fragmented")
    one_queue = observed_batches(window_at(snapshots, 10, 28), "encoder_16", KNOBS["encoder_16"].preferred_batch)
    spread = observed_batches(window_at(snapshots, 45, 68), "encoder_16", KNOBS["encoder_16"].preferred_batch)
    # One queue filled its preferred batches; split over versions, the same bucket's batches thinned.
    assert spread.mean_batch_rows < one_queue.mean_batch_rows
    assert one_queue.requests_per_min == pytest.approx(90 * 60, rel=0.2)
    demand = Demand(30_000)
    as_one, _ = observed_plans(one_queue, demand, 1, None)
    as_spread, _ = observed_plans(spread, demand, 1, None)
    assert as_spread.rows_per_s_per_replica < as_one.rows_per_s_per_replica
    assert as_spread.replicas >= as_one.replicas
    # The recorded rate itself fits on the one replica that served it.
    carried = Demand(spread.requests_per_min)
    assert observed_plans(spread, carried, 1, None)[0].replicas == 1


def test_capacity_names_the_gap_to_the_preferred_batch():
    from tools.observe.scaling import observed_batches
    from tools.planning.capacity import Demand, observed_plans
    from tools.spec.profile import LatencyCurve

    spread = observed_batches(window_at(recording("fragmented"), 45, 68), "encoder_16", 4)
    curve = LatencyCurve({1: 6.7, 2: 11.2, 4: 18.9, 8: 34.8})
    as_formed, at_preferred = observed_plans(spread, Demand(30_000), 1, curve)
    assert at_preferred is not None and at_preferred.batch == 4
    assert at_preferred.replicas <= as_formed.replicas
