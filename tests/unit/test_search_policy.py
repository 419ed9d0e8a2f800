"""The knob search's pure policy: the grid, its pruning and order, the two phases, tune's
neighbourhood and climb, resuming, and choosing the best point."""

from __future__ import annotations

import math

import pytest

from tools.planning.search import (
    DELAY_LADDER_MS,
    JOINT,
    BucketSpace,
    KnobSet,
    Point,
    Proposal,
    StructuredSearch,
    TuneClimb,
    best_point,
    bucket_grid,
    config_key,
    joint_predicted_rps,
    merge_points,
    neighbours,
    predicted_goodput_rps,
    search_start_rps,
)
from tools.spec.profile import LatencyCurve

CURVE = LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0, 16: 20.0, 32: 39.0})
SLOW = LatencyCurve({1: 30.0, 2: 52.0, 4: 100.0})


def space(name: str = "encoder_16", share: float = 0.5, curve: LatencyCurve = CURVE, slo: float = 100.0,
          overhead: float = 4.0, max_instances: int = 8, lanes: int = 2) -> BucketSpace:
    return BucketSpace(name, share, curve, slo, overhead, max_instances, lanes)


def test_knobs_refuse_impossible_values_and_label_themselves():
    assert KnobSet(8, 1, 20000, 2).label() == "b8/p-/d20ms/i2"
    assert KnobSet(8, 4, 0, 1).label() == "b8/p4/d0ms/i1" and KnobSet(8, 4, 0, 1).target_batch == 4
    assert KnobSet(8, 1, 0, 1).target_batch == 8
    for bad in ((0, 1, 0, 1), (4, 8, 0, 1), (4, 1, -1, 1), (4, 1, 0, 0)):
        with pytest.raises(ValueError):
            KnobSet(*bad)
    assert KnobSet.from_dict(KnobSet(8, 4, 5000, 3).as_dict()) == KnobSet(8, 4, 5000, 3)


def test_the_grid_is_the_ladders_not_the_derivation():
    grid = bucket_grid(space())
    assert {k.max_batch_size for k in grid} == {1, 2, 4, 8, 16, 32}  # every power of two measured
    assert {k.max_queue_delay_us for k in grid} == {ms * 1000 for ms in DELAY_LADDER_MS}
    assert {k.instance_count for k in grid} == {1, 2, 3, 4}  # up to two per lane
    assert {k.preferred_batch_size for k in grid} == {1, 2, 4, 8, 16}
    assert len(grid) == len(set(grid))
    capped = bucket_grid(space(max_instances=3))
    assert max(k.instance_count for k in capped) == 3  # the spec's cap


def test_the_grid_prunes_what_cannot_meet_the_slo_and_duplicates():
    grid = bucket_grid(space(slo=30.0))
    # o + c(b) > S: 4 + 39 = 43 > 30 leaves out max_batch 32; 4 + 20 = 24 keeps 16.
    assert max(k.max_batch_size for k in grid) == 16
    # o + delay + c(1) > S: 4 + 4 + 20 ms = 28 <= 30 keeps a 20 ms delay, 40 ms is out.
    assert max(k.max_queue_delay_us for k in grid) == 20000
    # A batch of one waits for nobody: no delay, no preferred size.
    assert {(k.preferred_batch_size, k.max_queue_delay_us) for k in grid if k.max_batch_size == 1} == {(1, 0)}
    # A preferred size equal to max_batch_size is the same batcher as none.
    assert all(k.preferred_batch_size < k.max_batch_size or k.preferred_batch_size == 1 for k in grid)
    # A bucket whose one row alone fills the SLO keeps the smallest configuration only.
    assert {k.max_batch_size for k in bucket_grid(space(curve=SLOW, slo=40.0))} == {1}


def test_candidates_are_ordered_by_prediction_and_shapes_come_before_repeats():
    one = space()
    grid = bucket_grid(one)
    predicted = [predicted_goodput_rps(k, one) for k in grid]
    assert predicted[0] == pytest.approx(max(predicted), rel=0.05)  # the most promising first
    first = grid[:10]
    shapes = [(k.target_batch, k.instance_count) for k in first]
    assert len(set(shapes)) == len(shapes)  # different batch sizes and instances before a second delay
    assert all(k.max_queue_delay_us == 0 for k in first)  # ties go to waiting less


def test_prediction_is_throughput_on_the_lanes_over_the_share_and_penalises_a_late_batch_ahead():
    one = space(share=0.5)
    # b = 8 on two lanes: 2 x 8 / 11 ms x 80% = 1163.6 rows/s, over a share of 0.5.
    assert predicted_goodput_rps(KnobSet(8, 1, 0, 2), one) == pytest.approx(2 * 8 / 11 * 1000 * 0.8 / 0.5)
    assert predicted_goodput_rps(KnobSet(8, 1, 0, 3), one) < predicted_goodput_rps(KnobSet(8, 1, 0, 2), one)
    assert predicted_goodput_rps(KnobSet(8, 4, 0, 2), one) == predicted_goodput_rps(KnobSet(4, 1, 0, 2), one)
    late = space(slo=50.0)  # o + 2·c(32) = 82 > 50: only (50 - 4 - 39) / 39 of a batch ahead fits
    assert predicted_goodput_rps(KnobSet(32, 1, 0, 1), late) == pytest.approx(32 / 39 * 800 * 7 / 39 / 0.5)
    assert math.isinf(predicted_goodput_rps(KnobSet(8, 1, 0, 1), space(share=0.0)))


def spaces_two() -> list[BucketSpace]:
    return [space("encoder_16", 0.7), space("encoder_256", 0.3, SLOW, slo=300.0)]


def test_phase_one_measures_each_bucket_alone_in_turn_largest_share_first():
    search = StructuredSearch(spaces_two(), points_per_bucket=2, top_k=1)
    order = []
    while (proposal := search.next_point()) is not None and proposal.phase == "bucket":
        assert list(proposal.config) == [proposal.bucket]  # one bucket's knobs, the others derived
        order.append(proposal.bucket)
        search.record(proposal, 10.0, 1.0)
    assert order == ["encoder_16", "encoder_256", "encoder_16", "encoder_256"]
    assert proposal.phase == "joint" and proposal.bucket == JOINT and set(proposal.config) == {"encoder_16",
                                                                                                "encoder_256"}


def test_phase_two_is_the_cartesian_product_of_each_buckets_top_k_best_first():
    search = StructuredSearch(spaces_two(), points_per_bucket=3, top_k=2)
    goodputs = {"encoder_16": [50.0, 80.0, 20.0], "encoder_256": [30.0, 10.0, 40.0]}
    measured = {"encoder_16": [], "encoder_256": []}
    while (proposal := search.next_point()) is not None and proposal.phase == "bucket":
        knobs = proposal.config[proposal.bucket]
        measured[proposal.bucket].append(knobs)
        search.record(proposal, goodputs[proposal.bucket][len(measured[proposal.bucket]) - 1], 1.0)
    kept = search.kept()
    assert [g for _, g in kept["encoder_16"]] == [80.0, 50.0] and [g for _, g in kept["encoder_256"]] == [40.0, 30.0]
    joint = search.phase2()
    assert len(joint) == 4
    best_16, best_256 = measured["encoder_16"][1], measured["encoder_256"][2]
    assert joint[0].config == {"encoder_16": best_16, "encoder_256": best_256}
    predicted = [joint_predicted_rps([kept_goodput(kept, p.config)]) for p in joint]
    assert predicted == sorted(predicted, reverse=True)
    for proposal in joint:
        search.record(proposal, 5.0 if proposal is not joint[1] else 9.0, 1.0)
    assert search.next_point() is None
    assert search.best().config == joint[1].config  # the best joint point wins, not the best prediction


def kept_goodput(kept, config) -> float:
    goodputs = [g for name, knobs in config.items() for k, g in kept[name] if k == knobs]
    return joint_predicted_rps(goodputs)


def test_ending_phase_one_early_fills_unmeasured_buckets_with_their_first_candidate():
    search = StructuredSearch(spaces_two(), points_per_bucket=4, top_k=2)
    proposal = search.next_point()
    search.record(proposal, 60.0, 1.0)
    search.end_phase1()
    joint = search.next_point()
    assert joint.phase == "joint"
    assert joint.config["encoder_256"] == search.grids["encoder_256"][0]
    assert joint.config["encoder_16"] == proposal.config["encoder_16"]


def test_a_single_bucket_is_measured_with_the_full_mix_down_its_grid():
    search = StructuredSearch([space("audio_fixed", 1.0)], points_per_bucket=2, top_k=1)
    proposals = []
    for _ in range(3):
        proposal = search.next_point()
        proposals.append(proposal)
        search.record(proposal, 1.0, 1.0)
    assert all(p.phase == "joint" and p.bucket == JOINT for p in proposals)
    assert [p.config["audio_fixed"] for p in proposals] == search.grids["audio_fixed"][:3]


def test_a_bucket_without_traffic_is_not_measured_alone():
    search = StructuredSearch([space("encoder_16", 1.0), space("encoder_32", 0.0)], points_per_bucket=2, top_k=1)
    assert {p.bucket for p in search.phase1} == {"encoder_16"}


def test_other_edges_are_measured_with_the_full_mix_after_phase_one_and_can_win():
    other = {"encoder_24": KnobSet(8, 4, 5000, 2), "encoder_256": KnobSet(2, 1, 0, 2)}
    search = StructuredSearch(spaces_two(), points_per_bucket=1, top_k=1, edge_points={(24, 256): other})
    phases = []
    while (proposal := search.next_point()) is not None:
        phases.append(proposal.phase)
        if proposal.phase == "edges":
            assert proposal.bucket == JOINT and proposal.edges == (24, 256) and proposal.config == other
        search.record(proposal, 70.0 if proposal.phase == "edges" else 50.0, 1.0)
    assert phases == ["bucket", "bucket", "edges", "joint"]
    best = search.best()
    assert best.edges == (24, 256) and best.config == other
    assert Point.from_dict(best.to_dict()) == best and best.to_dict()["edges"] == [24, 256]
    resumed = StructuredSearch(spaces_two(), points_per_bucket=1, top_k=1, edge_points={(24, 256): other},
                               measured=search.points)
    assert resumed.next_point() is None  # the edges point is known by its edges too


def test_a_tie_goes_to_the_models_own_edges():
    own = point(60.0)
    other = Point("edges", JOINT, own.config, 61.0, 10.0, edges=(24, 256))
    assert best_point([other, own]) is own
    assert own.key != other.key and Point.from_dict(own.to_dict()).edges == ()


def test_joint_prediction_adds_up_each_buckets_share_of_the_device():
    assert joint_predicted_rps([100.0, 100.0]) == pytest.approx(50.0)
    assert joint_predicted_rps([60.0, 0.0]) == 0.0


def point(goodput: float, instances: int = 2, delay_us: int = 0, measure_s: float = 10.0, phase: str = "joint",
          bucket: str = JOINT) -> Point:
    return Point(phase, bucket, {"encoder_16": KnobSet(8, 1, delay_us, instances)}, goodput, measure_s)


def test_resuming_measures_nothing_twice_and_keeps_the_first_result():
    search = StructuredSearch(spaces_two(), points_per_bucket=2, top_k=1)
    first = search.next_point()
    earlier = [Point(first.phase, first.bucket, first.config, 42.0, 9.0)]
    resumed = StructuredSearch(spaces_two(), points_per_bucket=2, top_k=1, measured=earlier)
    assert resumed.next_point().key != first.key
    again = Point(first.phase, first.bucket, first.config, 1.0, 1.0)
    merged = merge_points(earlier, [again, point(5.0)])
    assert [p.goodput_rps for p in merged] == [42.0, 5.0]
    assert Point.from_dict(earlier[0].to_dict()) == earlier[0]


def test_the_best_point_breaks_ties_towards_smaller_knobs_then_less_measuring():
    assert best_point([]) is None
    assert best_point([point(50.0), point(60.0)]).goodput_rps == 60.0
    tied = [point(60.0, instances=4), point(58.0, instances=2), point(40.0, instances=1)]
    assert best_point(tied).goodput_rps == 58.0  # within 5% of the best, fewer instances
    same = [point(60.0, measure_s=30.0), point(59.0, measure_s=12.0)]
    assert best_point(same).measure_s == 12.0
    waits_less = best_point([point(60.0, delay_us=5000), point(59.5, delay_us=0)])
    assert waits_less.config["encoder_16"].max_queue_delay_us == 0


def test_neighbours_step_each_knob_of_one_bucket_along_its_ladder():
    one = space()
    config = {"encoder_16": KnobSet(22, 4, 60000, 2), "encoder_32": KnobSet(11, 2, 40000, 2)}
    found = {n["encoder_16"] for n in neighbours(config, one)}
    assert all(n["encoder_32"] == config["encoder_32"] for n in neighbours(config, one))  # one bucket at a time
    assert found == {
        KnobSet(16, 4, 60000, 2), KnobSet(32, 4, 60000, 2),  # 22 is between the ladder's 16 and 32
        KnobSet(22, 2, 60000, 2), KnobSet(22, 8, 60000, 2),
        KnobSet(22, 4, 40000, 2), KnobSet(22, 4, 80000, 2),
        KnobSet(22, 4, 60000, 1), KnobSet(22, 4, 60000, 3),
    }


def test_neighbours_leave_out_what_the_slo_or_the_knobs_rule_out():
    tight = space(slo=40.0, max_instances=1)
    found = {n["encoder_16"] for n in neighbours({"encoder_16": KnobSet(16, 8, 5000, 1)}, tight)}
    assert KnobSet(32, 8, 5000, 1) not in found  # o + c(32) = 4 + 39 ms > 40
    assert KnobSet(16, 8, 10000, 1) in found
    assert all(k.instance_count == 1 for k in found)  # the spec allows one
    assert all(k.preferred_batch_size < k.max_batch_size or k.preferred_batch_size == 1 for k in found)
    small = {n["encoder_16"] for n in neighbours({"encoder_16": KnobSet(2, 1, 0, 1)}, space())}
    assert KnobSet(1, 1, 0, 1) in small and KnobSet(2, 1, 2000, 1) in small


def climb_to_end(climb: TuneClimb, goodput) -> list:
    proposals = []
    while (proposal := climb.next_point()) is not None:
        proposals.append(proposal)
        climb.record(proposal, goodput(proposal.config), 1.0)
        assert len(proposals) < 500
    return proposals


def test_tune_measures_the_derived_configuration_first_and_keeps_it_when_nothing_beats_it():
    seed = {"encoder_16": KnobSet(8, 1, 0, 2)}
    climb = TuneClimb(seed, [space()], rounds=3)
    proposals = climb_to_end(climb, lambda config: 50.0)
    assert proposals[0].phase == "derived" and proposals[0].config == seed
    assert {p.phase for p in proposals[1:]} == {"neighbour"}
    assert climb.incumbent == seed and climb.changed_knobs() == {}


def test_tune_keeps_a_neighbour_only_when_its_median_beats_the_incumbent_by_more_than_the_noise():
    seed = {"encoder_16": KnobSet(8, 1, 0, 2)}
    better = KnobSet(16, 1, 0, 2)

    def goodput(config):  # 16 is 20% better; 32 is better still, but only once (a lucky search)
        knobs = config["encoder_16"]
        return {16: 60.0, 32: 70.0}.get(knobs.max_batch_size, 50.0) if knobs.instance_count == 2 else 40.0

    climb = TuneClimb(seed, [space()], rounds=3)
    proposals = climb_to_end(climb, goodput)
    confirms = [p for p in proposals if p.phase == "confirm"]
    assert confirms and climb.count(seed) == 3 and climb.median(seed) == 50.0
    assert climb.incumbent["encoder_16"].max_batch_size == 32  # climbed 8 -> 16 -> 32, each confirmed
    assert climb.changed_knobs() == {"encoder_16": {"max_batch_size": 32}}
    assert climb.count({"encoder_16": better}) >= 3


def test_tune_turns_down_a_neighbour_whose_confirmation_falls_back():
    seed = {"encoder_16": KnobSet(8, 1, 0, 2)}
    results = {}

    def goodput(config):  # the neighbour measures 70 once, then 50 like the seed
        key = config_key(config)
        results[key] = results.get(key, 0) + 1
        lucky = config["encoder_16"] == KnobSet(16, 1, 0, 2) and results[key] == 1
        return 70.0 if lucky else 50.0

    climb = TuneClimb(seed, [space()], rounds=3)
    climb_to_end(climb, goodput)
    assert climb.incumbent == seed


def test_tune_rounds_must_be_positive():
    with pytest.raises(ValueError):
        TuneClimb({"encoder_16": KnobSet(8, 1, 0, 2)}, [space()], rounds=0)


def test_a_search_point_starts_near_the_goodput_expected_of_it():
    every = {s.model_name: s for s in spaces_two()}
    first = Proposal("bucket", "encoder_16", {"encoder_16": KnobSet(8, 1, 0, 2)})
    assert search_start_rps(first, [], every, 8.0) == 8.0  # nothing known yet
    done = Point("bucket", "encoder_16", first.config, 100.0, 20.0)
    weaker = Point("bucket", "encoder_16", {"encoder_16": KnobSet(4, 1, 0, 2)}, 60.0, 20.0)
    assert search_start_rps(first, [done, weaker], every, 8.0) == pytest.approx(90.0)  # the bucket's best
    other = Proposal("bucket", "encoder_256", {"encoder_256": KnobSet(2, 1, 0, 2)})
    calibration = 100.0 / predicted_goodput_rps(KnobSet(8, 1, 0, 2), every["encoder_16"])
    assert search_start_rps(other, [done], every, 8.0) == pytest.approx(
        predicted_goodput_rps(KnobSet(2, 1, 0, 2), every["encoder_256"]) * calibration * 0.9)
    joint = Proposal("joint", JOINT, {**first.config, **other.config})
    second = Point("bucket", "encoder_256", other.config, 100.0, 20.0)
    assert search_start_rps(joint, [done, second], every, 8.0) == pytest.approx(50.0 * 0.9)
    measured = Point("joint", JOINT, joint.config, 40.0, 20.0)
    assert search_start_rps(joint, [done, second, measured], every, 8.0) == pytest.approx(36.0)


def test_tune_starts_its_neighbours_alike_and_a_confirmation_near_the_better_median():
    seed = {"encoder_16": KnobSet(8, 1, 0, 2)}
    climb = TuneClimb(seed, [space()], rounds=2)
    first = climb.next_point()
    assert climb.start_rps(first, 8.0) == 8.0
    climb.record(first, 40.0, 1.0)
    neighbour = climb.next_point()
    assert neighbour.phase == "neighbour" and climb.start_rps(neighbour, 8.0) == pytest.approx(36.0)
    climb.record(neighbour, 60.0, 1.0)
    while (proposal := climb.next_point()).phase == "neighbour":
        assert climb.start_rps(proposal, 8.0) == pytest.approx(36.0)
        climb.record(proposal, 30.0, 1.0)
    assert proposal.phase == "confirm" and climb.start_rps(proposal, 8.0) == pytest.approx(54.0)


def test_a_search_with_no_configuration_that_can_meet_the_slo_says_so_before_measuring():
    # A profile whose router overhead alone is over the SLO: every candidate is pruned.
    with pytest.raises(ValueError, match=r"no configuration of encoder_16, encoder_32 can meet the 100 ms p95 SLO "
                                         r"by the profile: the router overhead 504.0 ms"):
        StructuredSearch([space("encoder_16", overhead=504.0), space("encoder_32", overhead=504.0)],
                         points_per_bucket=2, top_k=1)
