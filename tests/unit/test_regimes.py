"""The light and peak regimes of a bucketed model: the parameter, the state machine with its
hysteresis, the rate each router instance measures, and their derivation."""

from __future__ import annotations

import json

import pytest

from python_backends.common.regimes import (
    ArrivalRate,
    LingerRegimes,
    Regime,
    RegimeState,
    RegimeTracker,
    express_model_name,
    next_state,
)
from tools.planning.derivation import BatchingKnobs
from tools.planning.regimes import derive_express, derive_regimes, unbatched_capacity_rps
from tools.spec.profile import LatencyCurve

REGIMES = LingerRegimes(up_rps=40.0, down_rps=20.0, hold_s=30.0, instances=2, express="encoder_express",
                        peak_us={"encoder_16": 60000, "encoder_32": 40000})


def test_the_parameter_round_trips_through_json():
    text = REGIMES.to_json()
    assert json.loads(text) == {"up_rps": 40.0, "down_rps": 20.0, "hold_s": 30.0, "window_s": 5.0, "instances": 2,
                                "express": "encoder_express", "peak_us": {"encoder_16": 60000, "encoder_32": 40000}}
    assert LingerRegimes.from_json(text) == REGIMES


@pytest.mark.parametrize(("change", "message"), [
    ({"down_rps": 40.0}, "need 0 < down_rps < up_rps, got 40.0 and 40.0"),
    ({"hold_s": -1.0}, "need hold_s >= 0 and window_s > 0"),
    ({"instances": 0}, "need instances >= 1, got 0"),
    ({"express": ""}, "the express model needs a name"),
    ({"peak_us": {}}, "peak_us must name the lingering bucket models"),
    ({"peak_us": {"encoder_16": 0}}, "each with a linger > 0"),
    ({"express": "encoder_16"}, "the express model 'encoder_16' cannot also be a bucket model"),
])
def test_inconsistent_regimes_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        LingerRegimes(**{**REGIMES.__dict__, **change})


@pytest.mark.parametrize("text", ["not json", '{"up_rps": 40, "down_rps": 20, "hold_s": 30}', "[]"])
def test_a_malformed_parameter_names_itself(text):
    with pytest.raises(ValueError, match=r"^linger_regimes: "):
        LingerRegimes.from_json(text)


def test_light_sends_the_lingering_buckets_to_the_express_model_and_peak_to_their_own():
    assert REGIMES.target("encoder_16", Regime.LIGHT) == "encoder_express"
    assert REGIMES.target("encoder_64", Regime.LIGHT) == "encoder_64"  # it does not linger: no detour
    assert REGIMES.target("encoder_16", Regime.PEAK) == "encoder_16"
    assert express_model_name("audio_") == "audio_express"


def test_the_state_machine_goes_up_at_once_and_down_only_after_the_hold():
    light = RegimeState(Regime.LIGHT)
    assert next_state(light, 39.9, 0.0, REGIMES) == light
    assert next_state(light, 25.0, 0.0, REGIMES) == light  # between the thresholds, light stays light
    peak = next_state(light, 40.0, 0.0, REGIMES)
    assert peak == RegimeState(Regime.PEAK)
    assert next_state(peak, 25.0, 1.0, REGIMES) == peak  # between the thresholds, peak stays peak
    under = next_state(peak, 19.0, 10.0, REGIMES)
    assert under == RegimeState(Regime.PEAK, below_since=10.0)
    assert next_state(under, 5.0, 39.9, REGIMES) == RegimeState(Regime.PEAK, below_since=10.0)
    assert next_state(under, 5.0, 40.0, REGIMES) == RegimeState(Regime.LIGHT)
    # A rate back over down_rps restarts the hold.
    back = next_state(under, 21.0, 30.0, REGIMES)
    assert back == RegimeState(Regime.PEAK)
    assert next_state(next_state(back, 5.0, 31.0, REGIMES), 5.0, 60.0, REGIMES).regime is Regime.PEAK


def test_the_rate_counts_the_last_window():
    rate = ArrivalRate(window_s=5.0, num_slots=10)
    for tick in range(100):  # 10 per second for 10 s
        rate.add(tick / 10)
    assert rate.rate(9.95) == pytest.approx(10.0, rel=0.05)
    assert rate.rate(12.0) == pytest.approx(25 / 4.5)  # the full slots since 7.5 s: 25 arrivals in 4.5 s
    assert rate.rate(20.0) == 0.0
    rate.add(20.0)
    assert rate.rate(20.1) == pytest.approx(1 / 4.6)


def test_the_rate_starts_low_rather_than_high():
    rate = ArrivalRate(window_s=5.0)
    rate.add(100.0, 3)
    assert rate.rate(100.01) < 1.0  # 3 requests in the first 10 ms are not 300 req/s


@pytest.mark.parametrize(("window_s", "num_slots"), [(0.0, 10), (5.0, 1)])
def test_a_rate_needs_a_window_and_slots(window_s, num_slots):
    with pytest.raises(ValueError, match="need window_s > 0 and num_slots >= 2"):
        ArrivalRate(window_s, num_slots)


def steady(tracker: RegimeTracker, rps: float, start: float, seconds: float) -> Regime:
    regime = tracker.regime
    for index in range(int(rps * seconds)):
        regime = tracker.observe(start + index / rps)
    return regime


def test_an_instance_scales_its_own_arrivals_by_the_instances():
    tracker = RegimeTracker(REGIMES)  # two instances: 25 req/s here is 50 req/s for the model
    assert tracker.regime is Regime.LIGHT  # a server starts idle
    assert steady(tracker, 25.0, 0.0, 10.0) is Regime.PEAK
    assert tracker.model_rate(10.0) == pytest.approx(50.0, rel=0.05)
    alone = RegimeTracker(LingerRegimes(**{**REGIMES.__dict__, "instances": 1}))
    assert steady(alone, 25.0, 0.0, 10.0) is Regime.LIGHT


def test_peak_holds_through_a_dip_and_gives_way_after_the_hold():
    tracker = RegimeTracker(REGIMES)
    steady(tracker, 30.0, 0.0, 10.0)
    assert tracker.regime is Regime.PEAK
    assert steady(tracker, 5.0, 10.0, 20.0) is Regime.PEAK  # 10 req/s for the model, for 20 s: under the hold
    assert steady(tracker, 5.0, 30.0, 20.0) is Regime.LIGHT


def test_after_a_quiet_spell_the_hold_counts_from_when_the_rate_fell():
    tracker = RegimeTracker(REGIMES)
    steady(tracker, 30.0, 0.0, 10.0)
    assert tracker.regime is Regime.PEAK
    # Nothing for a minute: the rate fell under down_rps within the window, so the next
    # request, though the first the instance has seen since, is served light.
    assert tracker.observe(70.0) is Regime.LIGHT
    peak_again = RegimeTracker(REGIMES)
    steady(peak_again, 30.0, 0.0, 10.0)
    assert peak_again.observe(25.0) is Regime.PEAK  # 15 s quiet: still within the hold


def test_the_unbatched_capacity_counts_single_rows_and_the_router():
    curves = {"a": LatencyCurve({1: 4.0, 2: 6.0}), "b": LatencyCurve({1: 10.0, 2: 18.0})}
    capacity = unbatched_capacity_rps({"a": 0.5, "b": 0.5}, curves, rows_per_request=1, lanes=2, router_cpu_ms=3.0,
                                      max_utilization=0.8)
    assert capacity == pytest.approx(0.8 * 2 * 1000 / (3.0 + 7.0))
    with pytest.raises(ValueError, match="need lanes >= 1"):
        unbatched_capacity_rps({"a": 1.0}, curves, 1, 0, 0.0, 0.8)


def test_regimes_are_derived_only_where_a_bucket_lingers_below_the_peak_rate():
    regimes, reason = derive_regimes({"e_16": 60000, "e_32": 0}, capacity_rps=100.0, peak_rps=120.0, instances=2,
                                     express="e_express")
    assert regimes == LingerRegimes(up_rps=50.0, down_rps=30.0, hold_s=30.0, instances=2, express="e_express",
                                    peak_us={"e_16": 60000})
    assert "to e_express, which does not linger" in reason and "each of the 2 router instance(s)" in reason
    none, reason = derive_regimes({"e_16": 0}, 100.0, 120.0, instances=2, express="e_express")
    assert none is None and reason == "no bucket lingers at peak, so light traffic waits for nothing"
    none, reason = derive_regimes({"e_16": 60000}, 300.0, 120.0, instances=2, express="e_express")
    assert none is None and "the derived lingers hold at every rate" in reason


def knobs(name: str, max_batch: int, queue: int, timeout_us: int = 0) -> BatchingKnobs:
    return BatchingKnobs(model_name=name, max_batch_size=max_batch, preferred_batch_size=4, max_queue_delay_us=60000,
                         default_timeout_us=timeout_us, max_queue_size=queue, instance_count=2)


def test_the_express_knobs_batch_as_the_largest_bucket_and_never_linger():
    express = derive_express("e_express", {16: knobs("e_16", 22, 91), 32: knobs("e_32", 11, 47)}, lanes=2)
    assert (express.max_batch_size, express.preferred_batch_size, express.max_queue_delay_us) == (22, 1, 0)
    assert (express.max_queue_size, express.instance_count, express.default_timeout_us) == (138, 2, 0)
    assert "e_16's 22" in express.reasons["max_batch_size"]
    timed = derive_express("e_express", {16: knobs("e_16", 22, 91, 90000), 32: knobs("e_32", 11, 47, 120000)}, 1)
    assert timed.default_timeout_us == 120000 and timed.instance_count == 1
    with pytest.raises(ValueError, match="need at least one lingering bucket"):
        derive_express("e_express", {}, 2)


def test_the_recent_rate_reads_the_last_slots_only():
    rate = ArrivalRate(window_s=5.0, num_slots=10)
    for tick in range(40):  # 10 per second for 4 s, then nothing
        rate.add(tick / 10)
    assert rate.rate(3.99, num_slots=2) == pytest.approx(10.0, rel=0.1)
    assert rate.rate(5.0, num_slots=2) == 0.0  # the last second was quiet
    assert rate.rate(5.0) == pytest.approx(35 / 4.5)  # the window (since 0.5 s) still holds 35 of them


def test_traffic_jumping_from_idle_to_peak_switches_up_within_a_second():
    tracker = RegimeTracker(REGIMES)
    tracker.observe(0.0)
    switched = next(index for index in range(500) if tracker.observe(60.0 + index / 48) is Regime.PEAK)
    assert switched / 48 < 1.0  # 48 req/s at this instance: 96 for the model
    quiet = RegimeTracker(REGIMES)
    assert steady(quiet, 2.0, 0.0, 60.0) is Regime.LIGHT  # 4 req/s for the model never goes up
    assert next_state(RegimeState(Regime.LIGHT), 10.0, 0.0, REGIMES, recent_rps=40.0).regime is Regime.PEAK
    assert next_state(RegimeState(Regime.PEAK), 10.0, 0.0, REGIMES, recent_rps=25.0) == RegimeState(
        Regime.PEAK, below_since=0.0)  # the recent rate never holds peak: the window decides the way down
