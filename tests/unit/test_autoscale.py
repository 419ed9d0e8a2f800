"""The autoscaling decision on hand-made signals: ratios, hysteresis, cool-downs, the fragmentation guard."""

import dataclasses

import pytest

from tools.observe.explain import QueueKnobs
from tools.observe.scaling import default_pending_per_replica
from tools.planning.autoscale import (
    AutoscalePolicy,
    AutoscaleState,
    Signals,
    decide,
    ratios,
)

POLICY = AutoscalePolicy(slo_p95_ms=200.0, pending_per_replica=20.0, max_replicas=10, startup_s=60.0,
                         scale_down_window_s=300.0)


def signals(at_s=0.0, replicas=1, queue_ms=10.0, linger_ms=40.0, compute_ms=20.0, pending=10.0, p95_ms=120.0,
            busy=0.6, fragmented=False, served=100.0, busy_rejected=0.0) -> Signals:
    return Signals(at_s=at_s, replicas=replicas, queue_ms=queue_ms, linger_ms=linger_ms, compute_ms=compute_ms,
                   pending=pending, p95_ms=p95_ms, busy_share=busy, fragmented=fragmented, num_served=served,
                   num_busy=busy_rejected)


def test_ratios_are_one_at_each_target():
    measured = ratios(signals(queue_ms=60.0, pending=20.0, p95_ms=160.0, busy=0.8), POLICY)
    assert measured == pytest.approx({"queue": 1.0, "pending": 1.0, "utilization": 1.0, "latency": 1.0})


def test_demand_ratio_appears_only_while_admission_turns_requests_away():
    assert "demand" not in ratios(signals(), POLICY)
    assert ratios(signals(served=100.0, busy_rejected=150.0), POLICY)["demand"] == pytest.approx(2.5)


def test_within_the_band_nothing_changes():
    decision = decide(signals(), AutoscaleState(desired=3), POLICY)
    assert decision.desired == 3 and "within the band" in decision.reason


def test_queue_pressure_scales_up_by_the_ratio_at_most_doubling():
    # Requests wait 3x the linger budget plus a batch: three times the replicas, capped at double.
    decision = decide(signals(replicas=2, queue_ms=180.0), AutoscaleState(desired=2), POLICY)
    assert decision.desired == 4
    assert decision.reason.startswith("scale up 2 -> 4: queue pressure 3.00")


def test_a_small_overshoot_still_adds_one_replica():
    decision = decide(signals(replicas=4, pending=4 * 20.0 * 1.15), AutoscaleState(desired=4), POLICY)
    assert decision.desired == 5


def test_no_second_scale_up_while_new_pods_start_then_it_resumes():
    state = decide(signals(at_s=0.0, queue_ms=180.0), AutoscaleState(desired=1), POLICY).state
    assert state.desired == 2
    held = decide(signals(at_s=30.0, queue_ms=180.0), state, POLICY)
    assert held.desired == 2 and "need 60 s to start" in held.reason
    resumed = decide(signals(at_s=61.0, replicas=2, queue_ms=180.0), held.state, POLICY)
    assert resumed.desired == 4


def test_scale_down_waits_for_the_whole_window_of_low_pressure_and_removes_at_most_half():
    low = dict(queue_ms=1.0, pending=1.0, p95_ms=40.0, busy=0.1)
    state = AutoscaleState(desired=8)
    for at_s in (0.0, 100.0, 299.0):
        decision = decide(signals(at_s=at_s, replicas=8, **low), state, POLICY)
        assert decision.desired == 8, decision.reason
        state = decision.state
    decision = decide(signals(at_s=300.0, replicas=8, **low), state, POLICY)
    assert decision.desired == 4  # load 0.125 would say 1; half at most
    assert "below 0.5 for 300 s" in decision.reason


def test_latency_alone_never_drives_a_scale_down_and_vetoes_one_near_the_slo():
    # At low traffic p95 stays up (requests wait for their batch timer): the load ratios decide.
    quiet = dict(queue_ms=1.0, pending=1.0, busy=0.1)
    state = AutoscaleState(desired=4)
    for at_s in (0.0, 300.0):
        decision = decide(signals(at_s=at_s, replicas=4, p95_ms=120.0, **quiet), state, POLICY)
        state = decision.state
    assert decision.desired == 2, decision.reason  # latency 0.75, but the load is 0.125
    vetoed = AutoscaleState(desired=4)
    for at_s in (0.0, 300.0):
        decision = decide(signals(at_s=at_s, replicas=4, p95_ms=170.0, **quiet), vetoed, POLICY)
        vetoed = decision.state
    assert decision.desired == 4, decision.reason  # latency 1.06: too close to the SLO to remove any


def test_a_blip_of_normal_pressure_restarts_the_scale_down_window():
    low = dict(queue_ms=1.0, pending=1.0, p95_ms=40.0, busy=0.1)
    state = decide(signals(at_s=0.0, replicas=4, **low), AutoscaleState(desired=4), POLICY).state
    state = decide(signals(at_s=200.0, replicas=4), state, POLICY).state  # back in the band
    decision = decide(signals(at_s=310.0, replicas=4, **low), state, POLICY)
    assert decision.desired == 4 and "(0 s so far)" in decision.reason


def test_no_scale_down_soon_after_a_scale_up():
    up = decide(signals(at_s=0.0, queue_ms=180.0), AutoscaleState(desired=2), POLICY)
    low = dict(queue_ms=1.0, pending=1.0, p95_ms=40.0, busy=0.1)
    state = up.state
    for at_s in (10.0, 200.0):
        state = decide(signals(at_s=at_s, replicas=up.desired, **low), state, POLICY).state
    assert decide(signals(at_s=250.0, replicas=up.desired, **low), state, POLICY).desired == up.desired


def test_fragmented_traffic_holds_even_when_p95_is_high():
    trap = signals(queue_ms=45.0, linger_ms=60.0, compute_ms=9.0, p95_ms=190.0, busy=0.08, fragmented=True)
    decision = decide(trap, AutoscaleState(desired=2), POLICY)
    assert decision.desired == 2
    assert "fragmented" in decision.reason and "8% busy" in decision.reason


def test_fragmentation_does_not_mask_real_saturation():
    saturated = signals(queue_ms=300.0, linger_ms=60.0, compute_ms=9.0, p95_ms=400.0, busy=0.45, fragmented=True)
    assert decide(saturated, AutoscaleState(desired=1), POLICY).desired == 2
    busy_device = signals(queue_ms=45.0, linger_ms=60.0, compute_ms=9.0, p95_ms=190.0, busy=0.95, fragmented=True)
    assert decide(busy_device, AutoscaleState(desired=1), POLICY).desired == 2  # utilization 1.19 says add


def test_limits_are_respected():
    at_max = decide(signals(queue_ms=500.0, replicas=9), AutoscaleState(desired=10), POLICY)
    assert at_max.desired == 10 and "max_replicas" in at_max.reason
    floor = dataclasses.replace(POLICY, min_replicas=2)
    assert decide(signals(), AutoscaleState(desired=1), floor).desired == 2


@pytest.mark.parametrize("bad", [dict(slo_p95_ms=0.0), dict(min_replicas=0), dict(min_replicas=5, max_replicas=4),
                                 dict(scale_up_above=0.9), dict(scale_down_below=1.0), dict(max_step_up=1.0),
                                 dict(startup_s=-1.0)])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        dataclasses.replace(POLICY, **bad)


def test_default_pending_target_is_one_preferred_batch_per_instance():
    knobs = {"a": QueueKnobs("a", 22, 4, 60.0, 2), "b": QueueKnobs("b", 8, 1, 0.0, 2)}
    assert default_pending_per_replica(knobs) == 2 * 4 + 2 * 1


def test_scale_up_counts_from_the_replicas_serving_not_from_those_asked_for():
    # 4 asked for, 2 serving and measured: pressure 1.5 on 2 needs 3, which is already asked for.
    decision = decide(signals(at_s=100.0, replicas=2, pending=2 * 20.0 * 1.5), AutoscaleState(desired=4), POLICY)
    assert decision.desired == 4 and "4 are already asked for (2 serving)" in decision.reason
