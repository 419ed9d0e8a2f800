"""A p95 SLO over a length mix: which buckets batch, which run best effort, and when to refuse."""

import pytest

from tools.planning.derivation import (
    QUEUE_TIMEOUT_CEILING_US,
    BucketDemand,
    BucketFit,
    InfeasibleSLO,
    SloFit,
    admission_target_ms,
    derive_admission,
    derive_knobs,
    plan_slo_fit,
    slo_miss_allowance,
    slo_out_of_reach,
)
from tools.spec.profile import LatencyCurve

SLO = 100.0
OVERHEAD = 5.0
# c(1) per bucket: 16 and 64 meet o + 2·c(1) <= 100, 128 is at risk (5 + 60 <= 100 < 5 + 120),
# 256 misses even alone (5 + 110 > 100).
CURVES = {
    16: LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0}),
    64: LatencyCurve({1: 20.0, 2: 30.0, 4: 50.0}),
    128: LatencyCurve({1: 60.0, 2: 110.0}),
    256: LatencyCurve({1: 110.0, 2: 200.0}),
}


def fits(shares: dict[int, float], slo: float = SLO, curves: dict[int, LatencyCurve] = CURVES) -> dict[int, BucketFit]:
    return {b: BucketFit(f"encoder_{b}", share, slo, OVERHEAD, curves[b].at(1)) for b, share in shares.items()}


def test_a_p95_lets_five_percent_miss_and_exactly_five_is_within_it():
    assert slo_miss_allowance() == pytest.approx(0.05)
    assert slo_miss_allowance(0.99) == pytest.approx(0.01)
    assert not slo_out_of_reach(0.05)
    assert not slo_out_of_reach(0.04 + 0.01)  # summed shares carry float noise
    assert slo_out_of_reach(0.0501)
    assert slo_out_of_reach(0.02, percentile=0.99)
    with pytest.raises(ValueError, match="between 0 and 1"):
        slo_miss_allowance(1.0)


def test_buckets_are_classified_by_a_request_alone_and_one_behind_the_execution_in_flight():
    classified = {b: fit.fit for b, fit in fits({16: 0.5, 64: 0.3, 128: 0.15, 256: 0.05}).items()}
    assert classified == {16: SloFit.MEETS, 64: SloFit.MEETS, 128: SloFit.AT_RISK, 256: SloFit.INFEASIBLE}
    edge = BucketFit("encoder_32", 1.0, 100.0, 4.0, 48.0)  # 4 + 2·48 = 100: exactly the SLO
    assert edge.fit is SloFit.MEETS and edge.behind_one_ms == pytest.approx(100.0)


def test_infeasible_buckets_over_five_percent_are_refused_naming_each_with_its_share():
    mix = fits({16: 0.55, 64: 0.3, 128: 0.12, 256: 0.03})
    mix[128] = BucketFit("encoder_128", 0.12, SLO, OVERHEAD, 96.0)  # 101 ms alone: infeasible too
    with pytest.raises(InfeasibleSLO) as refused:
        plan_slo_fit("embed", mix)
    message = str(refused.value)
    assert message.startswith("embed: no configuration puts 95% of requests within the 100 ms p95 SLO")
    assert "carry 15.0% of the traffic, over the 5% the SLO lets miss" in message
    assert "encoder_128 (12.0% of traffic: o + c(1) = 5.0 + 96.0 = 101.0 ms" in message
    assert "encoder_256 (3.0% of traffic: o + c(1) = 5.0 + 110.0 = 115.0 ms" in message
    assert "encoder_16" not in message
    assert "raise the SLO, use faster hardware, or split those buckets" in message


def test_infeasible_buckets_at_exactly_five_percent_run_best_effort_with_a_warning():
    plan = plan_slo_fit("embed", fits({16: 0.6, 64: 0.3, 128: 0.05, 256: 0.05}))
    assert plan.best_effort == {128, 256}
    assert plan.budget_buckets == (16, 64)  # W leaves out the buckets that miss anyway
    assert set(plan.warnings) == {128, 256}
    assert plan.warnings[256].startswith("encoder_256: cannot meet the 100 ms p95 SLO: a request misses it even alone")
    assert "it carries 5.0% of the traffic and runs without batching" in plan.warnings[256]
    assert plan.warnings[128].startswith("encoder_128: at risk of missing the 100 ms p95 SLO")
    assert "o + c(1) = 5.0 + 60.0 = 65.0 ms, o + 2·c(1) = 125.0 ms" in plan.warnings[128]
    # Together they carry 10%: the warning says the SLO then holds only while they seldom queue.
    assert ("the SLO holds for the mix only while encoder_128, encoder_256 carry under 5% of its traffic: "
            "10.0% in the workload (more") in plan.warnings[128]
    with pytest.raises(InfeasibleSLO, match=r"encoder_256 \(5\.1% of traffic"):
        plan_slo_fit("embed", fits({16: 0.6, 64: 0.29, 128: 0.059, 256: 0.051}))


def test_a_mix_that_meets_the_slo_everywhere_plans_as_before():
    plan = plan_slo_fit("embed", fits({16: 0.7, 64: 0.3}))
    assert plan.best_effort == frozenset() and plan.warnings == {} and plan.budget_buckets == (16, 64)


def test_a_model_whose_every_bucket_is_at_risk_still_gets_a_configuration():
    curves = {16: LatencyCurve({1: 50.0, 2: 90.0}), 32: LatencyCurve({1: 60.0, 2: 110.0})}
    plan = plan_slo_fit("rerank", fits({16: 0.7, 32: 0.3}, curves=curves))
    assert plan.best_effort == {16, 32} and plan.budget_buckets == (16, 32)
    assert "carry under 5% of its traffic: 100.0% in the workload (more" in plan.warnings[16]
    for bucket, curve in curves.items():
        knobs = derive_knobs(BucketDemand(f"encoder_{bucket}", SLO, OVERHEAD, 10.0, 20.0, best_effort=True), curve)
        assert (knobs.max_batch_size, knobs.preferred_batch_size, knobs.max_queue_delay_us) == (1, 1, 0)
        assert knobs.reasons["max_batch_size"].startswith("1, best effort: even unbatched o + 2·c(1)")
    admission = derive_admission(curves, {16: 1, 32: 1}, 2, SLO, OVERHEAD, 20.0, plan.budget_buckets)
    assert admission.policy.max_work_ms == pytest.approx((SLO - OVERHEAD - 60.0) / 2)


def test_a_best_effort_bucket_runs_unbatched_and_keeps_the_other_knobs():
    at_risk = BucketDemand("encoder_128", SLO, OVERHEAD, 10.0, 40.0, max_instances=2, lanes=2, best_effort=True,
                           shared_batch=2)
    knobs = derive_knobs(at_risk, CURVES[128])
    assert (knobs.max_batch_size, knobs.preferred_batch_size, knobs.max_queue_delay_us) == (1, 1, 0)
    assert knobs.reasons["max_queue_delay_microseconds"] == "0, best effort: no batching, so nothing to wait for"
    # The rest as for any bucket: the timeout after one row, Little's law, one instance per lane.
    assert knobs.default_timeout_us == QUEUE_TIMEOUT_CEILING_US  # deadlines come with the requests
    assert f"= {SLO - OVERHEAD - 60.0:.1f} ms" in knobs.reasons["default_timeout_microseconds"]
    assert knobs.instance_count == 2 and knobs.max_queue_size >= 1
    # A bucket that misses even alone gets no queue timeout: late beats rejected.
    infeasible = derive_knobs(BucketDemand("encoder_256", SLO, OVERHEAD, 1.0, 2.0, best_effort=True), CURVES[256])
    assert (infeasible.max_batch_size, infeasible.default_timeout_us) == (1, 0)
    assert "served late, not rejected" in infeasible.reasons["default_timeout_microseconds"]
    # best_effort changes nothing for a bucket that meets the SLO.
    meets = BucketDemand("encoder_16", SLO, OVERHEAD, 10.0, 40.0)
    assert derive_knobs(meets, CURVES[16]) == derive_knobs(BucketDemand(
        "encoder_16", SLO, OVERHEAD, 10.0, 40.0, best_effort=True), CURVES[16])


def test_the_admission_budget_is_taken_over_the_buckets_that_meet_the_slo():
    preferred = {16: 4, 64: 2, 128: 1, 256: 1}
    every = {16: CURVES[16], 64: CURVES[64], 128: CURVES[128]}
    # Over every bucket, 128's c(1) leaves W = 100 - 5 - 60 = 35 ms.
    assert admission_target_ms(every, SLO, OVERHEAD) == pytest.approx(SLO - OVERHEAD - 0.75 * 35.0 * 0.5)
    admission = derive_admission(CURVES, preferred, 2, SLO, OVERHEAD, 50.0, budget_buckets=(16, 64))
    # Over the buckets that meet it: W = 100 - 5 - 20 = 75 ms; the others' rows are still costed.
    assert admission.policy.max_work_ms == pytest.approx(75.0 * 0.5)
    assert admission.policy.row_cost_ms[256] == pytest.approx(110.0)
    assert admission.policy.target_ms == pytest.approx(admission_target_ms(CURVES, SLO, OVERHEAD, (16, 64)))
    assert ("W = S - o - c_64(1) = 100 - 5.0 - 20.0 = 75.0 ms, taken over the buckets that can meet the SLO "
            "(16, 64): bucket(s) 128, 256 cannot, and their rows are still admitted and costed") \
        in admission.reasons["admission"]
    # Over every bucket the reason says nothing of the kind (committed configs keep their text).
    assert "taken over" not in derive_admission(every, preferred, 2, 200.0, OVERHEAD, 50.0).reasons["admission"]
    with pytest.raises(ValueError, match="needs buckets with curves"):
        derive_admission(CURVES, preferred, 2, SLO, OVERHEAD, 50.0, budget_buckets=(512,))
    with pytest.raises(ValueError, match="needs buckets with curves"):
        admission_target_ms(CURVES, SLO, OVERHEAD, ())
