"""The router's admission policy and its derivation: pure, with hand-made numbers."""

from __future__ import annotations

import json
import multiprocessing
import sys
import threading
from dataclasses import replace

import pytest

from python_backends.embed.admission import (
    ADMIT_ALL,
    MAX_SLOTS,
    AdmissionDecision,
    AdmissionPolicy,
    SharedWork,
    adjust_bound,
    answer_deadline_s,
    deadline_passed,
    decide,
    instance_slot,
    queue_wait_ms,
    seen_latency_ms,
    shared_work_ahead_ms,
    tier_share,
)
from tools.planning.derivation import ADMISSION_WORK_SHARE, admission_target_ms, derive_admission
from tools.spec.profile import LatencyCurve

POLICY = AdmissionPolicy(row_cost_ms={16: 4.0, 256: 80.0}, lanes=2, max_work_ms=60.0)
SHARED = AdmissionPolicy(row_cost_ms={16: 4.0, 64: 20.0, 256: 80.0}, lanes=2, max_work_ms=60.0, shared_lanes=True)


def test_work_is_rows_times_row_cost_over_lanes():
    assert POLICY.work_ms({16: 3}) == pytest.approx(6.0)
    assert POLICY.work_ms({16: 1, 256: 2}) == pytest.approx((4.0 + 160.0) / 2)


def test_work_of_a_bucket_without_a_cost_is_an_error():
    with pytest.raises(ValueError, match=r"no row cost for buckets \[64\]"):
        POLICY.work_ms({64: 1})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lanes": 0}, "lanes must be >= 1"),
    ({"max_work_ms": -1.0}, "max_work_ms must be >= 0"),
    ({"row_cost_ms": {16: -2.0}}, "row_cost_ms of bucket 16"),
    ({"batch_ms": {16: -2.0}}, "batch_ms of bucket 16"),
])
def test_policy_rejects_impossible_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdmissionPolicy(**{"row_cost_ms": {16: 1.0}, "lanes": 1, "max_work_ms": 10.0, **kwargs})


def test_policy_round_trips_through_json_and_bad_json_names_the_problem():
    assert AdmissionPolicy.from_json(POLICY.to_json()) == POLICY
    assert AdmissionPolicy.from_json(SHARED.to_json()) == SHARED
    with_deadlines = AdmissionPolicy(row_cost_ms={16: 4.0}, lanes=2, max_work_ms=60.0, batch_ms={16: 30.0})
    assert AdmissionPolicy.from_json(with_deadlines.to_json()) == with_deadlines
    assert AdmissionPolicy.from_json(ADAPTIVE.to_json()) == ADAPTIVE
    # A config written before probe_ms probes with the floor on every lane, as it did then.
    older = {key: value for key, value in json.loads(ADAPTIVE.to_json()).items() if key != "probe_ms"}
    assert AdmissionPolicy.from_json(json.dumps(older)).probe_ms == ADAPTIVE.min_work_ms * ADAPTIVE.lanes
    with pytest.raises(ValueError, match="admission policy is not valid"):
        AdmissionPolicy.from_json('{"lanes": 2}')
    with pytest.raises(ValueError, match="admission policy is not valid"):
        AdmissionPolicy.from_json("not json")


def test_work_by_bucket_is_per_lane_and_sums_to_the_work():
    assert SHARED.work_by_bucket({16: 3, 256: 1}) == {16: pytest.approx(6.0), 256: pytest.approx(40.0)}
    assert SHARED.work_ms({16: 3, 256: 1}) == pytest.approx(46.0)


def test_on_shared_lanes_a_row_ahead_costs_a_request_at_most_its_own_size():
    ahead = {16: 10.0, 64: 30.0, 256: 120.0}  # ms per lane: rows of 2, 10 and 40 ms per lane
    # A one-row request of bucket 16 (2 ms per lane) finishes before every longer row ahead
    # of it: each of them has had only 2 ms by then (3 rows of 64, 3 of 256).
    assert shared_work_ahead_ms(SHARED, ahead, own_work_ms=2.0) == pytest.approx(10.0 + 3 * 2.0 + 3 * 2.0)
    # A 256 row (40 ms per lane) waits for everything shorter and shares with its equals.
    assert shared_work_ahead_ms(SHARED, ahead, own_work_ms=40.0) == pytest.approx(160.0)
    # A 64 row: the 16 and 64 rows in full, each 256 row up to 10 ms.
    assert shared_work_ahead_ms(SHARED, ahead, own_work_ms=10.0) == pytest.approx(10.0 + 30.0 + 3 * 10.0)


def test_without_shared_lanes_every_row_ahead_counts_in_full():
    one_queue = AdmissionPolicy(row_cost_ms=SHARED.row_cost_ms, lanes=2, max_work_ms=60.0)
    assert shared_work_ahead_ms(one_queue, {16: 10.0, 256: 120.0}, own_work_ms=2.0) == pytest.approx(130.0)


def test_shared_admission_lets_short_requests_past_long_work_and_refuses_long_ones(tmp_path):
    shared = AdmissionPolicy(row_cost_ms=SHARED.row_cost_ms, lanes=2, max_work_ms=81.0, shared_lanes=True)
    one_queue = AdmissionPolicy(row_cost_ms=SHARED.row_cost_ms, lanes=2, max_work_ms=81.0)
    work = SharedWork(tmp_path / "work.bin", 0, buckets=(16, 64, 256))
    assert work.admit(shared, {256: 40.0}).admitted
    assert work.admit(shared, {256: 40.0}).admitted  # 40 ahead + 40 <= 81
    assert work.ahead_by_bucket() == {None: 0.0, 16: 0.0, 64: 0.0, 256: pytest.approx(80.0)}
    # A third long row would finish after the 80 ms ahead of it: refused.
    refused = work.admit(shared, {256: 40.0})
    assert not refused.admitted and refused.work_ahead_ms == pytest.approx(80.0)
    # A short row is done after 2 ms of each long one: admitted where one queue would refuse it.
    assert not work.admit(one_queue, {16: 2.0}).admitted
    short = work.admit(shared, {16: 2.0})
    assert short.admitted and short.work_ahead_ms == pytest.approx(4.0)
    work.add({256: -40.0, 16: -2.0})
    assert work.ahead_by_bucket()[256] == pytest.approx(40.0) and work.total_ms() == pytest.approx(40.0)
    work.close()


def test_a_request_refused_even_at_the_least_work_is_refused_before_its_rows_are_known(tmp_path):
    shared = AdmissionPolicy(row_cost_ms=SHARED.row_cost_ms, lanes=2, max_work_ms=85.0, shared_lanes=True,
                             target_ms=150.0, min_work_ms=10.0, max_limit_ms=190.0, probe_ms=80.0)
    assert shared.smallest_work_ms == pytest.approx(SHARED.row_cost_ms[16] / 2)
    work = SharedWork(tmp_path / "work.bin", 0, buckets=(16, 64, 256))
    assert work.refuses_any(shared) is None  # idle
    work.add({16: 84.0})  # more than one slowest row (80 ms) per lane: busy even at light load
    refused = work.refuses_any(shared)
    assert refused is not None and refused.at_least and "this request's at least 2 ms" in refused.message()
    # Whatever its rows, `admit` refuses it too: the check only spares the tokenizing.
    assert not work.admit(shared, {16: 2.0}).admitted and not work.admit(shared, {256: 40.0}).admitted
    # Long work ahead counts as the lanes share it: a short request still fits beside it.
    work.add({16: -84.0, 256: 84.0})
    assert work.refuses_any(shared) is None and work.admit(shared, {16: 2.0}).admitted
    assert "waited 200 ms" in work.refuses_any(shared, waited_ms=200.0).message()
    assert work.refuses_any(ADMIT_ALL) is None
    work.close()


def test_a_request_is_admitted_while_the_work_with_its_own_fits():
    assert decide(POLICY, work_ahead_ms=50.0, own_work_ms=10.0).admitted
    refused = decide(POLICY, work_ahead_ms=50.0, own_work_ms=10.5)
    assert not refused.admitted
    assert "50 ms of work in flight plus this request's 10 ms exceeds the 60 ms" in refused.message()


def test_an_idle_server_admits_even_a_request_larger_than_the_budget():
    assert decide(POLICY, work_ahead_ms=0.0, own_work_ms=500.0).admitted


def test_without_a_budget_everything_is_admitted():
    assert decide(ADMIT_ALL, work_ahead_ms=1e6, own_work_ms=1e6).admitted


def test_tiers_below_the_default_get_half_the_room_per_level():
    assert tier_share(1, default_priority=2) == 1.0
    assert tier_share(2, default_priority=2) == 1.0
    assert tier_share(3, default_priority=2) == 0.5
    assert tier_share(4, default_priority=2) == 0.25
    # A bulk request is refused where a default-tier one of the same size still fits.
    assert decide(POLICY, 25.0, 10.0, share=1.0).admitted
    assert not decide(POLICY, 25.0, 10.0, share=0.5).admitted


@pytest.mark.parametrize(("name", "slot"), [("embed_0_0", 0), ("embed_0_15", 15), ("embed_2_3", 131)])
def test_instance_names_map_to_stable_slots(name, slot):
    assert instance_slot(name) == slot


@pytest.mark.parametrize("name", ["embed", "embed_0_64", "embed_16_0"])
def test_instance_names_outside_the_slots_are_refused(name):
    with pytest.raises(ValueError):
        instance_slot(name)


def test_shared_work_sums_every_instance_and_a_restarted_instance_resets_its_slot(tmp_path):
    path = tmp_path / "work.bin"
    first, second = SharedWork(path, 0), SharedWork(path, 1)
    first.add(10.0)
    second.add(5.0)
    assert first.total_ms() == pytest.approx(15.0) == second.total_ms()
    second.add(-5.0)
    assert first.total_ms() == pytest.approx(10.0)
    restarted = SharedWork(path, 0)  # same instance name after a crash: its old work is gone
    assert restarted.total_ms() == pytest.approx(0.0)
    for work in (first, second, restarted):
        work.close()


def test_work_of_a_slot_opened_later_and_higher_is_counted_by_every_instance(tmp_path):
    # The sums read only the rows up to the highest slot opened: one opened after this
    # instance, far above it, still counts.
    path = tmp_path / "work.bin"
    first = SharedWork(path, 0, buckets=(16,))
    late = SharedWork(path, 900, buckets=(16,))
    late.add({16: 7.0})
    assert first.total_ms() == pytest.approx(7.0)
    assert first.ahead_by_bucket()[16] == pytest.approx(7.0)
    assert not first.admit(POLICY, 55.0).admitted  # 7 ms ahead + 55 ms: over the 60 ms bound
    for work in (first, late):
        work.close()


def test_shared_admit_counts_the_admitted_work_and_not_the_refused(tmp_path):
    work = SharedWork(tmp_path / "work.bin", 3)
    assert work.admit(POLICY, 40.0).admitted
    assert work.total_ms() == pytest.approx(40.0)
    assert not work.admit(POLICY, 30.0).admitted
    assert work.total_ms() == pytest.approx(40.0)
    work.close()


def test_threads_of_one_instance_admit_and_release_without_losing_work(tmp_path):
    # An instance's worker threads release work while its main thread admits more: every
    # admitted millisecond given back leaves the slot at zero, however the threads interleave.
    work = SharedWork(tmp_path / "work.bin", 0)
    policy = AdmissionPolicy(row_cost_ms={16: 1.0}, lanes=1, max_work_ms=1e9)
    sys_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        def cycle() -> None:
            for _ in range(2000):
                assert work.admit(policy, 0.5).admitted
                work.add(-0.5)

        threads = [threading.Thread(target=cycle) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(sys_interval)
    assert work.total_ms() == pytest.approx(0.0, abs=1e-6)
    work.close()


def _admit_many(path, slot, attempts, queue):
    work = SharedWork(path, slot)
    admitted = sum(work.admit(POLICY, 1.0).admitted for _ in range(attempts))
    queue.put(admitted)
    # Keep the admitted work counted: the processes exit without releasing it.


def test_admission_holds_across_processes_deciding_at_once(tmp_path):
    path = tmp_path / "work.bin"
    SharedWork(path, MAX_SLOTS - 1).add(1.0)  # not idle, so the idle rule does not apply
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_admit_many, args=(path, slot, 40, queue)) for slot in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    admitted = sum(queue.get(timeout=5) for _ in workers)
    # 1 ms already in flight + 59 requests of 1 ms fill the 60 ms exactly, never more.
    assert admitted == 59


CURVES = {16: LatencyCurve({1: 3.0, 4: 12.0}), 256: LatencyCurve({1: 80.0, 2: 150.0})}


def test_derived_bound_is_a_share_of_what_the_slo_leaves_after_overhead_and_the_slowest_row():
    admission = derive_admission(CURVES, preferred={16: 4, 256: 2}, lanes=2, slo_p95_ms=200.0, overhead_ms=5.0,
                                 peak_rps=100.0)
    wait_budget_ms = 200.0 - 5.0 - 80.0
    assert admission.policy.max_work_ms == pytest.approx(wait_budget_ms * ADMISSION_WORK_SHARE)
    assert admission.policy.row_cost_ms == {16: pytest.approx(3.0), 256: pytest.approx(75.0)}
    assert admission.policy.lanes == 2
    assert admission.policy.shared_lanes  # the buckets run side by side: work ahead counts as they share lanes
    assert "share the lanes" in admission.reasons["admission"]
    # Its floor: half a row of the slowest bucket (80 ms), per lane.
    assert admission.policy.adaptive and admission.policy.min_work_ms == pytest.approx(20.0)
    assert "0.5 of a row of bucket 256 (20.0 ms per lane)" in admission.reasons["admission_bound"]
    # While probing, one row of the slowest bucket on each lane ahead: 2 x 80 ms over 2 lanes.
    assert admission.policy.probe_ms == pytest.approx(80.0)
    assert "one row of bucket 256 on each lane ahead of it (80.0 ms per lane)" in admission.reasons["admission_bound"]
    assert admission.policy.max_limit_ms == pytest.approx(195.0)
    assert admission.policy.target_ms < 195.0  # room for the wait before the router takes a request
    # The router queue is a hand-off buffer: Little's law at peak over S - o, 100 x 195 ms.
    assert admission.max_queue_size == 20
    assert "c_256(1)" in admission.reasons["admission"] and "Little" not in admission.reasons["admission"]
    assert "at peak over S - o: 100 req/s" in admission.reasons["max_queue_size"]


def test_the_lateness_target_leaves_room_for_the_wait_admission_cannot_see():
    # W = 200 - 5 - 80 = 115 ms; the bound on work starts at half of it, and three quarters
    # of the other half is kept for the wait before the router takes a request.
    target = admission_target_ms(CURVES, slo_p95_ms=200.0, overhead_ms=5.0)
    assert target == pytest.approx(200.0 - 5.0 - 0.75 * 115.0 * (1 - ADMISSION_WORK_SHARE))
    admission = derive_admission(CURVES, {16: 4, 256: 2}, 2, 200.0, 5.0, 100.0)
    assert admission.policy.target_ms == pytest.approx(target)  # gen-config derives the lingers inside it
    with pytest.raises(ValueError, match="bucket 256"):
        admission_target_ms(CURVES, slo_p95_ms=80.0, overhead_ms=5.0)


def test_a_tighter_slo_admits_less_and_queues_less():
    loose = derive_admission(CURVES, {16: 4, 256: 2}, 2, 400.0, 5.0, 100.0)
    tight = derive_admission(CURVES, {16: 4, 256: 2}, 2, 150.0, 5.0, 100.0)
    assert tight.policy.max_work_ms < loose.policy.max_work_ms
    assert tight.max_queue_size <= loose.max_queue_size


def test_an_slo_the_slowest_row_alone_fills_is_an_error_naming_the_bucket():
    with pytest.raises(ValueError, match="bucket 256"):
        derive_admission(CURVES, {16: 4, 256: 2}, 2, 80.0, 5.0, 100.0)


ADAPTIVE = AdmissionPolicy(row_cost_ms={16: 4.0}, lanes=2, max_work_ms=60.0, target_ms=150.0, min_work_ms=20.0,
                           max_limit_ms=190.0, probe_ms=40.0)
BUSY = 25.0  # work in flight ahead of a request (ms per lane)


def test_the_bound_shrinks_on_a_late_answer_and_grows_slowly_on_time_ones():
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=151.0) == pytest.approx(95.0)
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=149.0) == pytest.approx(100.0 * (1 / 0.95) ** (1 / 19))


def test_while_probing_the_bound_climbs_fast_on_time_answers_and_still_shrinks_on_a_late_one():
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=149.0, probing=True) == pytest.approx(102.0)
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=151.0, probing=True) == pytest.approx(95.0)
    bound, answers = ADAPTIVE.max_work_ms, 0
    while bound < ADAPTIVE.max_limit_ms:
        bound, answers = adjust_bound(ADAPTIVE, bound, latency_ms=100.0, probing=True), answers + 1
    assert answers < 100  # from the starting guess to the ceiling within a few seconds of traffic


def test_the_bound_settles_where_one_answer_in_twenty_is_late():
    bound = 100.0
    for index in range(20_000):
        bound = adjust_bound(ADAPTIVE, bound, latency_ms=170.0 if index % 20 == 0 else 100.0)
    assert bound == pytest.approx(100.0, rel=0.05)  # 5% late: neither grows nor shrinks


def under(bound_ms: float, in_use_ms: float | None = None) -> AdmissionDecision:
    """The decision that admitted a request under `bound_ms` with `in_use_ms` in flight, its own work included."""
    in_use_ms = bound_ms if in_use_ms is None else in_use_ms
    return AdmissionDecision(True, in_use_ms - 2.0, 2.0, bound_ms, bound_ms=bound_ms)


def test_late_answers_of_requests_admitted_together_cut_the_bound_once():
    # A burst of late answers, all admitted under a bound of 100: one cut, not one per answer.
    bound = 100.0
    for _ in range(100):
        bound = adjust_bound(ADAPTIVE, bound, latency_ms=170.0, admitted=under(100.0))
    assert bound == pytest.approx(95.0)
    # A request admitted under the cut bound and late again cuts it once more.
    assert adjust_bound(ADAPTIVE, bound, latency_ms=170.0, admitted=under(bound)) == pytest.approx(90.25)
    # A late answer never raises the bound, whatever it was admitted under.
    assert adjust_bound(ADAPTIVE, 50.0, latency_ms=170.0, admitted=under(100.0)) == 50.0


def test_an_answer_that_missed_the_slo_cuts_by_how_late_it_was_down_to_half():
    # Target 150, S - o = 190: an answer at 250 ms cuts to 150/250 of the bound it was admitted under.
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=250.0, admitted=under(100.0)) == pytest.approx(60.0)
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=190.0, admitted=under(100.0)) == pytest.approx(95.0)
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=5000.0, admitted=under(100.0)) == pytest.approx(50.0)


def test_only_answers_admitted_while_the_bound_was_in_use_move_it():
    # On time, but admitted with 20 of 100 in use: says nothing about admitting more.
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=100.0, probing=True, admitted=under(100.0, 20.0)) == 100.0
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=100.0, admitted=under(100.0, 20.0)) == 100.0
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=100.0, probing=True, admitted=under(100.0, 60.0)) == \
        pytest.approx(102.0)
    # Late with little ahead of it: late for its own compute, which no bound shortens.
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=400.0, admitted=under(100.0, 20.0)) == 100.0
    assert adjust_bound(ADAPTIVE, 100.0, latency_ms=400.0, admitted=under(100.0, 60.0)) == pytest.approx(50.0)
    # A warm-up at a twentieth of the bound leaves it where it was.
    bound = ADAPTIVE.max_work_ms
    for _ in range(40):
        bound = adjust_bound(ADAPTIVE, bound, latency_ms=20.0, probing=True, admitted=under(bound, 3.0))
    assert bound == ADAPTIVE.max_work_ms


def test_the_bound_stays_between_its_limits():
    low = high = 60.0
    for _ in range(1000):
        low = adjust_bound(ADAPTIVE, low, latency_ms=1000.0)
        high = adjust_bound(ADAPTIVE, high, latency_ms=1.0)
    assert low == ADAPTIVE.min_work_ms and high == ADAPTIVE.max_limit_ms


def test_a_requests_wait_before_the_router_takes_its_share_of_the_room():
    # S - o = 190 ms: a request that waited 150 ms has 40 left, under the bound of 60.
    assert decide(ADAPTIVE, 20.0, 10.0, bound_ms=60.0, waited_ms=0.0).admitted
    assert decide(ADAPTIVE, 20.0, 10.0, bound_ms=60.0, waited_ms=150.0).admitted
    refused = decide(ADAPTIVE, 25.0, 20.0, bound_ms=60.0, waited_ms=150.0)
    assert not refused.admitted and refused.limit_ms == pytest.approx(40.0)
    assert "exceeds the 40 ms that still meets the latency SLO after its 150 ms wait" in refused.message()
    assert decide(ADAPTIVE, 25.0, 20.0, bound_ms=60.0, waited_ms=None).admitted  # no stamp: the bound alone


def test_a_request_that_waited_past_the_slo_is_refused_even_by_an_idle_server_before_any_work():
    late = deadline_passed(ADAPTIVE, 190.0)
    assert late is not None and not late.admitted
    assert "waited 190 ms before the router took it" in late.message()
    assert not decide(ADAPTIVE, 0.0, 5.0, waited_ms=195.0).admitted
    assert deadline_passed(ADAPTIVE, 189.0) is None and deadline_passed(ADAPTIVE, None) is None
    assert deadline_passed(ADMIT_ALL, 10_000.0) is None  # no admission, no refusals


def test_an_admitted_request_carries_its_deadline_to_each_bucket_queue_less_the_bucket_s_longest_batch():
    policy = AdmissionPolicy(row_cost_ms={16: 4.0, 256: 80.0}, lanes=2, max_work_ms=60.0, max_limit_ms=195.0,
                             batch_ms={16: 30.0, 256: 150.0})
    # Due S - o = 195 ms after it arrived: the router took it at t = 10 s after a 45 ms wait.
    deadline = answer_deadline_s(policy, 10.0, 45.0, {16: 2, 256: 1}, BUSY)
    assert deadline == pytest.approx(10.150)
    assert answer_deadline_s(policy, 10.0, None, {16: 1}, BUSY) == pytest.approx(10.195)  # no stamp: the router's clock
    # Sent 20 ms later: 130 ms left, of which the bucket's longest execution takes 30 (16) or
    # 150 (256), once for each of the request's chunks of that bucket still to run.
    assert queue_wait_ms(policy, 16, 10.020, deadline) == pytest.approx(100.0)
    assert queue_wait_ms(policy, 16, 10.020, deadline, chunks_left=2) == pytest.approx(70.0)
    assert queue_wait_ms(policy, 256, 10.020, deadline) == pytest.approx(-20.0)  # late already: not sent
    # No deadline travels without the longest batches, for a bucket whose queue takes none, or
    # without admission.
    assert queue_wait_ms(policy, 64, 10.020, deadline) is None
    assert answer_deadline_s(replace(policy, batch_ms={}), 10.0, 45.0, {16: 1}, BUSY) is None
    assert answer_deadline_s(replace(policy, max_work_ms=0.0), 10.0, 45.0, {16: 1}, BUSY) is None
    assert queue_wait_ms(policy, 16, 10.020, None) is None


def test_a_request_admitted_onto_an_idle_server_carries_no_deadline():
    policy = AdmissionPolicy(row_cost_ms={16: 4.0, 256: 80.0}, lanes=2, max_work_ms=60.0, max_limit_ms=195.0,
                             batch_ms={16: 30.0, 256: 150.0})
    # Nothing in flight ahead of it: dropping it would free nothing for anyone, so even a cold
    # server that spends the whole S - o on its first call serves it rather than say "busy".
    assert answer_deadline_s(policy, 10.0, 45.0, {16: 2, 256: 1}, 0.0) is None
    assert answer_deadline_s(policy, 10.0, 45.0, {16: 2, 256: 1}, 1e-12) is None  # what float sums leave
    assert answer_deadline_s(policy, 10.0, 45.0, {16: 2, 256: 1}, 1.9) is None  # less than one 16-token row
    assert answer_deadline_s(policy, 10.0, 45.0, {16: 2, 256: 1}, 2.0) == pytest.approx(10.150)


def test_a_request_too_large_to_meet_its_deadline_even_alone_carries_none_and_is_served_late():
    policy = AdmissionPolicy(row_cost_ms={16: 4.0, 256: 80.0}, lanes=2, max_work_ms=60.0, max_limit_ms=195.0,
                             batch_ms={16: 30.0, 256: 150.0})
    # Two chunks of bucket 256 run one after the other: 300 ms > the 195 ms left, at any load.
    assert answer_deadline_s(policy, 10.0, None, {16: 1, 256: 2}, BUSY) is None
    assert answer_deadline_s(policy, 10.0, 100.0, {16: 4}, BUSY) is None  # 120 ms of its own > 95 ms left
    assert answer_deadline_s(policy, 10.0, 100.0, {16: 3}, BUSY) == pytest.approx(10.095)


def test_derived_deadlines_name_each_bucket_s_longest_batch():
    admission = derive_admission(CURVES, preferred={16: 4, 256: 2}, lanes=2, slo_p95_ms=200.0, overhead_ms=5.0,
                                 peak_rps=100.0, batch_ms={16: 30.0})
    assert admission.policy.batch_ms == {16: 30.0}
    assert "16: 30.0 ms" in admission.reasons["deadlines"]
    plain = derive_admission(CURVES, preferred={16: 4, 256: 2}, lanes=2, slo_p95_ms=200.0, overhead_ms=5.0,
                             peak_rps=100.0)
    assert plain.policy.batch_ms == {} and "deadlines" not in plain.reasons


def test_the_bound_judges_an_answer_by_its_whole_time_when_its_stamp_says_how_long_it_waited():
    # No stamp: the router's own time; the rest of the SLO beyond the target (S - o - T = 40 ms)
    # stands for the wait before the router and the way back.
    assert seen_latency_ms(ADAPTIVE, 120.0, None) == 120.0
    # A stamp: the wait counts in full, and the 40 ms are left to the way back alone.
    assert seen_latency_ms(ADAPTIVE, 120.0, 30.0) == pytest.approx(150.0)
    assert adjust_bound(ADAPTIVE, 100.0, seen_latency_ms(ADAPTIVE, 120.0, 31.0)) < 100.0
    assert adjust_bound(ADAPTIVE, 100.0, seen_latency_ms(ADAPTIVE, 120.0, 29.0)) > 100.0
    assert seen_latency_ms(POLICY, 120.0, 500.0) == 120.0  # a fixed bound has no target


def test_the_shared_bound_starts_at_the_policy_and_follows_the_answers(tmp_path):
    work = SharedWork(tmp_path / "work.bin", 0)
    assert work.bound_ms(ADAPTIVE) == 60.0
    work.record_latency(ADAPTIVE, 170.0)
    assert work.bound_ms(ADAPTIVE) == pytest.approx(57.0)
    assert SharedWork(tmp_path / "work.bin", 1).bound_ms(ADAPTIVE) == pytest.approx(57.0)  # every instance sees it
    work.record_latency(POLICY, 500.0)  # a fixed policy ignores answers
    assert work.bound_ms(POLICY) == POLICY.max_work_ms


def test_the_shared_bound_probes_until_the_first_late_answer_of_any_instance_and_again_once_drained(tmp_path):
    first, second = SharedWork(tmp_path / "work.bin", 0), SharedWork(tmp_path / "work.bin", 1)
    first.add(10.0)  # work in flight all along: the server never drains
    first.record_latency(ADAPTIVE, 100.0)
    assert first.bound_ms(ADAPTIVE) == pytest.approx(60.0 * 1.02)  # probing: fast growth
    second.record_latency(ADAPTIVE, 170.0)  # late, on another instance: probing ends for all
    after_late = first.bound_ms(ADAPTIVE)
    assert after_late == pytest.approx(60.0 * 1.02 * 0.95)
    first.record_latency(ADAPTIVE, 100.0)
    slow = after_late * (1 / 0.95) ** (1 / 19)
    assert first.bound_ms(ADAPTIVE) == pytest.approx(slow)
    first.add(-10.0)  # the last request in flight comes back: drained
    first.record_latency(ADAPTIVE, 100.0)
    first.record_latency(ADAPTIVE, 100.0)
    assert first.bound_ms(ADAPTIVE) == pytest.approx(slow * (1 / 0.95) ** (1 / 19) * 1.02)  # probing again


def test_while_probing_a_request_with_one_longest_row_per_lane_ahead_is_admitted_as_by_an_idle_server():
    # Long rows overlapping at light load: one slowest row on each lane ahead (probe_ms: a row of
    # 40 ms is 20 ms per lane, on each of the 2 lanes) + 50 ms over the 60 ms bound.
    assert decide(ADAPTIVE, 40.0, 50.0, probing=True).admitted
    assert not decide(ADAPTIVE, 40.0, 50.0).admitted  # once an answer was late: the bound decides
    assert not decide(ADAPTIVE, 40.5, 50.0, probing=True).admitted  # more than a longest row per lane ahead
    assert not decide(ADAPTIVE, 20.5, 50.0, share=0.5, probing=True).admitted  # a lower tier: half of it
    assert decide(ADAPTIVE, 20.0, 50.0, share=0.5, probing=True).admitted
    assert not decide(POLICY, 1.0, 60.0, probing=True).admitted  # a fixed bound has no floor: only idle admits all
    # Admitted over the bound, it filled it: its answer moves the bound, on time or late.
    admitted = decide(ADAPTIVE, 20.0, 50.0, probing=True)
    assert adjust_bound(ADAPTIVE, 60.0, 100.0, probing=True, admitted=admitted) == pytest.approx(61.2)
    assert adjust_bound(ADAPTIVE, 60.0, 160.0, probing=True, admitted=admitted) == pytest.approx(57.0)


def test_three_users_at_light_load_are_not_refused_whatever_their_rows_while_probing():
    # The embed router's policy as gen-config derives it on 2 cores, its bound on its floor where
    # an earlier burst left it: a longest row arrives behind a longest row and a 128-token row.
    embed = AdmissionPolicy(row_cost_ms={16: 4.73, 32: 9.52, 64: 18.73, 128: 37.05, 256: 77.78}, lanes=2,
                            max_work_ms=58.5, target_ms=150.9, min_work_ms=19.4, max_limit_ms=194.8,
                            shared_lanes=True, probe_ms=77.78)
    own = embed.work_ms({256: 1})
    for rows_ahead in ({256: 1, 128: 1}, {256: 2}):
        ahead = shared_work_ahead_ms(embed, embed.work_by_bucket(rows_ahead), own)
        assert decide(embed, ahead, own, bound_ms=embed.min_work_ms, probing=True).admitted, rows_ahead
        assert not decide(embed, ahead, own, bound_ms=embed.min_work_ms).admitted  # after a late answer
    # A third longest row ahead is more than one per lane: the bound decides again.
    ahead = shared_work_ahead_ms(embed, embed.work_by_bucket({256: 3}), own)
    assert not decide(embed, ahead, own, bound_ms=embed.max_work_ms, probing=True).admitted


def test_the_shared_table_admits_past_the_bound_at_light_load_until_an_answer_is_late(tmp_path):
    work, other = SharedWork(tmp_path / "work.bin", 0), SharedWork(tmp_path / "work.bin", 1)
    other.add(20.0)  # one long row in flight on another instance
    assert work.refuses_any(ADAPTIVE) is None
    light = work.admit(ADAPTIVE, 50.0)
    assert light.admitted and light.filled > 1.0
    work.release(ADAPTIVE, 50.0, latency_ms=170.0, admitted=light)  # late, with work still in flight
    assert not work.admit(ADAPTIVE, 50.0).admitted  # no longer probing: 20 + 50 > the cut bound
    other.add(-20.0)
    work.record_latency(ADAPTIVE, 100.0)  # drained: probing again
    other.add(20.0)
    assert work.admit(ADAPTIVE, 50.0).admitted
    for table in (work, other):
        table.close()


def test_release_gives_the_work_back_and_feeds_the_latency_as_one_step(tmp_path):
    work, other = SharedWork(tmp_path / "work.bin", 0, (16,)), SharedWork(tmp_path / "work.bin", 1, (16,))
    other.add({16: 5.0})  # work in flight elsewhere: the server does not drain
    assert work.admit(ADAPTIVE, {16: 8.0}).admitted
    work.release(ADAPTIVE, {16: 8.0}, latency_ms=170.0)
    assert work.ahead_by_bucket()[16] == pytest.approx(5.0)  # only the other instance's work is left
    assert work.bound_ms(ADAPTIVE) == pytest.approx(57.0)  # the late answer shrank the bound
    assert work.admit(POLICY, {16: 8.0}).admitted
    work.release(POLICY, {16: 8.0}, latency_ms=500.0)  # a fixed policy: the work comes back, no bound moves
    assert work.total_ms() == pytest.approx(5.0) and work.bound_ms(POLICY) == POLICY.max_work_ms
    for table in (work, other):
        table.close()


def test_an_adaptive_policy_needs_ordered_limits():
    with pytest.raises(ValueError, match="min_work_ms <= max_work_ms <= max_limit_ms"):
        AdmissionPolicy(row_cost_ms={16: 1.0}, lanes=1, max_work_ms=60.0, target_ms=100.0, min_work_ms=80.0,
                        max_limit_ms=190.0)


def test_a_refusal_says_when_the_excess_work_has_drained():
    from tools.clients.retrying import retry_after_s

    policy = AdmissionPolicy(row_cost_ms={16: 10.0}, lanes=1, max_work_ms=50.0)
    refused = decide(policy, work_ahead_ms=70.0, own_work_ms=10.0)
    assert not refused.admitted and refused.retry_after_s == pytest.approx(0.030)  # 80 - 50 ms to drain
    assert retry_after_s(refused.message()) == pytest.approx(0.030)  # what the retrying client waits at least
    admitted = decide(policy, work_ahead_ms=20.0, own_work_ms=10.0)
    assert admitted.admitted and admitted.retry_after_s == 0.0
    # Refused right at the bound (another tier's share): at least a millisecond.
    assert decide(policy, 25.0, 10.0, share=0.5).retry_after_s == pytest.approx(0.010)
    assert decide(policy, 45.0, 5.0004).retry_after_s == 0.001  # a sliver over the bound
