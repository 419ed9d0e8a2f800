"""SLO-to-knob derivation: the formula of DESIGN.md on hand-built latency curves."""

import math

import pytest

from tools.planning.derivation import (
    QUEUE_TIMEOUT_CEILING_US,
    BucketDemand,
    InfeasibleSLO,
    derive_knobs,
    find_knee,
    past_knee,
)
from tools.spec.profile import LatencyCurve

# A CPU-like curve: per-execution cost grows almost linearly past b = 8.
CURVE = LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0, 16: 20.0, 32: 39.0, 64: 77.0})


def demand(slo, expected=50.0, peak=150.0, overhead=3.0, **kw):
    return BucketDemand("encoder_16", slo_p95_ms=slo, overhead_ms=overhead, expected_rps=expected,
                        peak_rps=peak, **kw)


def test_curve_interpolates_between_measured_sizes_and_refuses_to_extrapolate():
    assert CURVE.at(8) == 11.0
    assert CURVE.at(12) == pytest.approx(15.5)
    with pytest.raises(ValueError, match="outside the measured range"):
        CURVE.at(65)


@pytest.mark.parametrize(
    ("points", "message"),
    [({}, "at least one"), ({2: 3.0}, "must include batch size 1"), ({1: 0.0}, "bad latency point")],
)
def test_curve_validation(points, message):
    with pytest.raises(ValueError, match=message):
        LatencyCurve(points)


def test_knee_is_where_doubling_stops_paying():
    # throughput: 250, 400, 571, 727, 800, 821, 831 rows/s; 16 -> 32 adds 2.6% < 10%
    assert find_knee(CURVE) == 16
    assert find_knee(CURVE, knee_gain=0.02) == 32
    # Linear cost from the start: no gain from batching at all.
    assert find_knee(LatencyCurve({1: 10.0, 2: 20.0, 4: 40.0})) == 1
    # Still gaining at the largest size measured: the knee is that size.
    assert find_knee(LatencyCurve({1: 10.0, 2: 10.0, 4: 10.0})) == 4


def test_max_batch_is_largest_b_with_room_for_two_executions():
    knobs = derive_knobs(demand(slo=50.0), CURVE)
    # o + 2·c(b) <= 50  ->  c(b) <= 23.5: c(18) = 22.375 fits, c(19) = 23.5625 does not
    assert knobs.max_batch_size == 18
    assert 3.0 + 2 * CURVE.at(18) <= 50.0 < 3.0 + 2 * CURVE.at(19)


def test_max_batch_stops_one_measured_size_past_the_knee():
    # throughput 16 -> 32 adds 2.6%: the knee is 16, and a batch of 32 is the largest worth forming.
    assert past_knee(CURVE) == 32
    knobs = derive_knobs(demand(slo=500.0), CURVE)  # the SLO alone would allow 64
    assert knobs.max_batch_size == 32
    assert knobs.reasons["max_batch_size"].startswith("the measured size after the throughput knee (16)")
    assert "the SLO would allow 64" in knobs.reasons["max_batch_size"]
    # A knee at the largest measured size caps nothing beyond it.
    assert past_knee(LatencyCurve({1: 10.0, 2: 10.0, 4: 10.0})) == 4


def test_tight_slo_gives_small_batches_and_near_zero_delay():
    knobs = derive_knobs(demand(slo=16.0, expected=20.0), CURVE)
    assert knobs.max_batch_size == 3  # 3 + 2·c(3) = 15 <= 16 < 3 + 2·c(4) = 17
    assert knobs.preferred_batch_size <= knobs.max_batch_size
    assert knobs.max_queue_delay_us <= 1000  # S - o - 2·c(b_pref) leaves at most 1 ms


def test_loose_slo_gives_larger_batches_and_longer_delay():
    # A peak of 800 rows/s needs the largest useful batch; the budget decides how long to wait for it.
    tight = derive_knobs(demand(slo=30.0, expected=600.0, peak=800.0), CURVE)
    loose = derive_knobs(demand(slo=200.0, expected=600.0, peak=800.0), CURVE)
    # Loose: the SLO would allow 64, but past the knee (16) one measured size is worth forming.
    assert (tight.max_batch_size, loose.max_batch_size) == (10, 32)
    assert loose.preferred_batch_size > tight.preferred_batch_size
    assert tight.max_queue_delay_us == 500  # 30 - 3 - 2·c(10) = 0.5 ms
    assert loose.max_queue_delay_us == 18750  # 15 more rows at 800 rows/s
    # The queues take each request's deadline: their own timeout is only its ceiling.
    assert loose.default_timeout_us == tight.default_timeout_us == QUEUE_TIMEOUT_CEILING_US


def test_linger_is_capped_by_how_fast_traffic_fills_the_batch():
    # Loose SLO, plenty of budget: the batch of 16 fills in 15 rows / 1000 rows/s = 15 ms.
    knobs = derive_knobs(demand(slo=500.0, expected=1000.0, peak=1000.0), CURVE)
    assert knobs.preferred_batch_size == 16
    assert knobs.max_queue_delay_us == 15000


def test_linger_fits_inside_the_latency_admission_steers_to():
    # Slow traffic would want a long wait for the knee batch of 16 (15 rows at 100 rows/s =
    # 150 ms, inside S - o - 2·c(16) = 457 ms); with admission aiming answers at 120 ms the
    # linger leaves room for a batch ahead and the request's own: 120 - 2·20 = 80 ms.
    free = derive_knobs(demand(slo=500.0, expected=100.0, peak=100.0, shared_batch=16), CURVE)
    held = derive_knobs(demand(slo=500.0, expected=100.0, peak=100.0, shared_batch=16, latency_target_ms=120.0), CURVE)
    assert free.max_queue_delay_us == 150000
    assert held.max_queue_delay_us == 80000
    assert "T - 2·c(b_pref) = 120.0 - 2·20.0 = 80.0 ms" in held.reasons["max_queue_delay_microseconds"]
    # A target that a batch ahead and the request's own already fill leaves no linger at all.
    none = derive_knobs(demand(slo=500.0, expected=100.0, peak=100.0, shared_batch=16, latency_target_ms=30.0), CURVE)
    assert none.max_queue_delay_us == 0


def test_no_linger_when_single_rows_carry_the_traffic():
    # 100 rows/s against 250 rows/s unbatched at 80%: waiting would only add latency.
    knobs = derive_knobs(demand(slo=500.0, expected=100.0, peak=150.0), CURVE)
    assert knobs.max_queue_delay_us == 0
    assert "waiting buys nothing" in knobs.reasons["max_queue_delay_microseconds"]
    # 300 rows/s needs pairs (0.8 x 400 rows/s): wait for one more row, 1/300 s.
    pairs = derive_knobs(demand(slo=500.0, expected=300.0, peak=300.0), CURVE)
    assert pairs.max_queue_delay_us == 3333


def test_queue_policy_rejects_what_can_no_longer_make_it_and_sizes_queue_by_littles_law():
    knobs = derive_knobs(demand(slo=100.0, expected=100.0, peak=400.0), CURVE)
    c_max = CURVE.at(knobs.max_batch_size)
    # Each request's deadline is at most S - o - c(max_batch); the queue's own timeout is only
    # the ceiling it shortens, so a request without one is never turned away for its wait.
    assert knobs.default_timeout_us == QUEUE_TIMEOUT_CEILING_US
    assert f"S - o - c(max_batch) = 100 - 3.0 - {c_max:.1f}" in knobs.reasons["default_timeout_microseconds"]
    # The queue holds what drains at full batches within the budget after overhead, S - o.
    drain_rps = CURVE.throughput_rps(knobs.max_batch_size)
    assert knobs.max_queue_size == math.ceil(drain_rps * (100.0 - 3.0) / 1000)
    two = derive_knobs(demand(slo=100.0, expected=100.0, peak=2000.0, max_instances=2), CURVE)
    assert two.max_queue_size == math.ceil(2 * drain_rps * (100.0 - 3.0) / 1000)


def test_instances_cover_the_peak_and_warn_when_hardware_caps_them():
    knobs = derive_knobs(demand(slo=100.0, expected=100.0, peak=2000.0, max_instances=2), CURVE)
    assert knobs.instance_count == 2
    assert knobs.warnings and "add replicas" in knobs.warnings[0]
    roomy = derive_knobs(demand(slo=100.0, expected=10.0, peak=50.0, max_instances=4), CURVE)
    assert roomy.instance_count == 1 and not roomy.warnings


def test_every_knob_is_explained_with_numbers():
    knobs = derive_knobs(demand(slo=100.0), CURVE)
    assert set(knobs.reasons) == {"max_batch_size", "preferred_batch_size", "max_queue_delay_microseconds",
                                  "default_timeout_microseconds", "max_queue_size", "instance_count"}
    assert "o + 2·c(b) = 3.0 + 2·48.5 = 100.0 <= 100 ms" in knobs.reasons["max_batch_size"]
    assert "Little's law" in knobs.reasons["max_queue_size"]


def test_bucket_whose_single_request_exceeds_the_slo_is_an_error_naming_it():
    slow = LatencyCurve({1: 120.0, 2: 200.0})
    with pytest.raises(InfeasibleSLO, match=r"encoder_256: a single request alone takes .* over the 100 ms"):
        derive_knobs(BucketDemand("encoder_256", 100.0, 5.0, 10.0, 20.0), slow)


def test_bucket_that_cannot_absorb_one_wait_is_an_error_naming_it():
    with pytest.raises(InfeasibleSLO, match=r"encoder_128: even unbatched.*2·40.0"):
        derive_knobs(BucketDemand("encoder_128", 80.0, 5.0, 10.0, 20.0), LatencyCurve({1: 40.0, 2: 60.0}))


def test_inconsistent_demand_is_rejected():
    with pytest.raises(ValueError, match="expected_rps <= peak_rps"):
        derive_knobs(demand(slo=100.0, expected=10.0, peak=5.0), CURVE)


def test_queue_timeout_can_be_left_to_the_queue_bound():
    with_timeout = derive_knobs(demand(slo=100.0), CURVE)
    without = derive_knobs(demand(slo=100.0, queue_timeout=False), CURVE)
    assert without.default_timeout_us == 0
    assert "not set" in without.reasons["default_timeout_microseconds"]
    # The queue is still sized to what drains within the SLO's wait budget.
    assert without.max_queue_size == with_timeout.max_queue_size > 0


def test_router_has_an_instance_per_core_and_workers_for_all_that_admission_lets_in():
    from python_backends.embed.admission import ADMIT_ALL, AdmissionPolicy
    from tools.planning.derivation import derive_router

    admission = AdmissionPolicy(row_cost_ms={16: 5.0, 256: 80.0}, lanes=2, max_work_ms=60.0, target_ms=195.0,
                                min_work_ms=40.0, max_limit_ms=195.0)
    plan = derive_router(peak_rps=100.0, slo_p95_ms=200.0, host_cores=2, max_instances=8, admission=admission)
    # 195 ms x 2 lanes of 5 ms rows = 78 requests in flight at most (Little's law at peak: 20).
    assert (plan.instance_count, plan.max_concurrent_requests) == (2, 39)
    assert "78 requests" in plan.reasons["max_concurrent_requests"]
    assert "an instance holds no request" in plan.reasons["instance_count"]
    # Without admission Little's law at peak sizes the workers; the spec caps the instances.
    busy = derive_router(peak_rps=500.0, slo_p95_ms=200.0, host_cores=16, max_instances=4, admission=ADMIT_ALL)
    assert (busy.instance_count, busy.max_concurrent_requests) == (4, 25)
    assert "capped at 4" in busy.reasons["instance_count"]
    assert derive_router(1.0, 50.0, 1, 8, ADMIT_ALL).max_concurrent_requests == 1


def test_inline_limits_allow_twice_a_lone_call_within_a_tenth_of_the_slo():
    from tools.planning.derivation import derive_inline

    policy, reason = derive_inline({"encoder_16": 6.7, "encoder_32": 11.0, "encoder_64": 18.7}, overhead_ms=5.2,
                                   slo_p95_ms=200.0)
    # 2·6.7 + 5.2 = 18.6; 2·11 + 5.2 = 27.2 is capped at 10% of 200 ms; 18.7 + 5.2 alone is over 20 ms.
    assert dict(policy.max_ms_by_target) == {"encoder_16": 18.6, "encoder_32": 20.0, "encoder_64": 0.0}
    assert "encoder_16 18.6, encoder_32 20.0 ms" in reason
    assert "never for encoder_64" in reason
    # A looser SLO lets the longer bucket in as well.
    assert derive_inline({"encoder_64": 18.7}, 5.2, 500.0)[0].limit_ms("encoder_64") == 42.6


def test_shared_device_batches_grow_where_they_free_the_most_time():
    from tools.planning.derivation import SharedLoad, plan_shared_batches

    short = LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0})  # batches well
    long = LatencyCurve({1: 40.0, 2: 78.0, 4: 150.0})  # barely batches
    loads = [SharedLoad("encoder_16", 150.0, short, 8), SharedLoad("encoder_256", 10.0, long, 4)]
    sizes, total = plan_shared_batches(loads, max_utilization=0.8)
    # Alone at b = 1 they need 0.6 + 0.4 = 1.0 of the device; batching the short bucket is what pays.
    assert sizes["encoder_256"] == 1 and sizes["encoder_16"] > 1
    assert total <= 0.8
    # Light traffic needs no batching at all.
    light, light_total = plan_shared_batches([SharedLoad("encoder_16", 10.0, short, 8)], 0.8)
    assert light == {"encoder_16": 1} and light_total == pytest.approx(0.04)
    # Over capacity even fully batched: every bucket ends at its largest useful batch.
    heavy, heavy_total = plan_shared_batches([SharedLoad("encoder_16", 2000.0, short, 8)], 0.8)
    assert heavy == {"encoder_16": 8} and heavy_total > 0.8


def test_shared_batch_sets_the_linger():
    knobs = derive_knobs(demand(slo=200.0, expected=100.0, peak=200.0, shared_batch=4), CURVE)
    assert knobs.max_queue_delay_us == 15000  # 3 more rows at 200 rows/s
    assert "with the other buckets" in knobs.reasons["max_queue_delay_microseconds"]


def test_a_device_with_more_lanes_carries_more_before_batching():
    from tools.planning.derivation import SharedLoad, plan_shared_batches

    short = LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0})
    loads = [SharedLoad("encoder_16", 300.0, short, 8)]  # 1.2 lanes busy at b = 1
    one_lane, one_total = plan_shared_batches(loads, max_utilization=0.8)
    two_lanes, two_total = plan_shared_batches(loads, max_utilization=0.8, lanes=2)
    assert one_lane["encoder_16"] > 1 and one_total <= 0.8
    assert two_lanes == {"encoder_16": 1} and two_total == pytest.approx(0.6)
    with pytest.raises(ValueError, match="at least one lane"):
        plan_shared_batches(loads, 0.8, lanes=0)


def test_work_outside_the_buckets_counts_against_the_device():
    from tools.planning.derivation import SharedLoad, plan_shared_batches

    short = LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0})
    loads = [SharedLoad("encoder_16", 150.0, short, 8)]  # 0.6 of the device at b = 1
    alone, _ = plan_shared_batches(loads, max_utilization=0.8)
    with_router, total = plan_shared_batches(loads, max_utilization=0.8, base_utilization=0.3)
    assert alone == {"encoder_16": 1}
    assert with_router["encoder_16"] > 1 and 0.3 < total <= 0.8
    with pytest.raises(ValueError, match="base utilisation"):
        plan_shared_batches(loads, 0.8, base_utilization=-0.1)


def test_every_lane_gets_an_instance_within_the_spec_cap():
    lanes = derive_knobs(demand(slo=100.0, expected=10.0, peak=50.0, max_instances=8, lanes=2), CURVE)
    assert lanes.instance_count == 2 and "one per lane of the device = 2" in lanes.reasons["instance_count"]
    capped = derive_knobs(demand(slo=100.0, expected=10.0, peak=50.0, max_instances=1, lanes=2), CURVE)
    assert capped.instance_count == 1 and "capped at 1 by the spec" in capped.reasons["instance_count"]
    assert not capped.warnings  # the peak itself fits one instance: nothing to act on
