"""When the router serves a request on `execute`'s thread (`python_backends.embed.inline`)."""

from __future__ import annotations

import pytest

from python_backends.embed.inline import InlinePolicy, check_inline, held_off, record_inline, serves_inline


@pytest.mark.parametrize(("batch_size", "in_flight", "num_chunks", "inline"), [
    (1, 0, 1, True),
    (2, 0, 1, False),  # others of the call wait for the handoff
    (1, 1, 1, False),  # the instance is busy: the workers keep the concurrency
    (1, 0, 2, False),  # lanes run side by side on the workers
])
def test_only_a_lone_one_chunk_request_of_an_idle_instance_is_served_inline(batch_size, in_flight, num_chunks,
                                                                              inline):
    assert serves_inline(batch_size, in_flight, num_chunks) is inline


def test_a_target_slow_twice_in_a_row_goes_to_the_workers_until_its_hold_off_ends():
    policy = InlinePolicy(max_ms_by_target={"encoder_16": 15.0}, hold_off_s=30.0)
    until: dict[str, float] = {}
    strikes: dict[str, int] = {}
    record_inline(policy, "encoder_16", 14.9, until, strikes, 100.0)
    assert not held_off(policy, "encoder_16", until, 100.0)
    record_inline(policy, "encoder_16", 60.0, until, strikes, 100.0)  # one slow call: jitter, not a linger
    assert not held_off(policy, "encoder_16", until, 100.0)
    record_inline(policy, "encoder_16", 60.0, until, strikes, 100.0)  # slow again: it lingers
    assert held_off(policy, "encoder_16", until, 129.9)
    assert not held_off(policy, "encoder_32", until, 129.9)  # only that target
    assert not held_off(policy, "encoder_16", until, 130.0)  # tried again
    record_inline(policy, "encoder_16", 60.0, until, strikes, 130.0)  # and the count starts over
    assert not held_off(policy, "encoder_16", until, 130.0)


def test_a_call_within_the_limit_clears_the_count_of_slow_ones():
    policy = InlinePolicy(max_ms_by_target={"encoder_16": 15.0})
    until: dict[str, float] = {}
    strikes: dict[str, int] = {}
    for elapsed_ms in (40.0, 9.0, 40.0, 9.0, 40.0):
        record_inline(policy, "encoder_16", elapsed_ms, until, strikes, 100.0)
    assert not held_off(policy, "encoder_16", until, 100.0)


def test_each_target_has_its_own_limit_and_zero_keeps_it_off_the_inline_path():
    policy = InlinePolicy(max_ms_by_target={"encoder_16": 18.5, "encoder_256": 0.0}, max_ms=15.0)
    assert policy.limit_ms("encoder_16") == 18.5
    assert policy.limit_ms("encoder_32") == 15.0  # not named: the default
    assert held_off(policy, "encoder_256", {}, 0.0)
    assert not held_off(policy, "encoder_16", {}, 0.0)


def test_the_parameter_round_trips_and_names_only_the_routers_targets():
    policy = InlinePolicy(max_ms_by_target={"encoder_16": 18.5, "encoder_express": 20.0})
    assert InlinePolicy.from_json(policy.to_json()) == policy
    check_inline(policy, ["encoder_16", "encoder_express"])
    with pytest.raises(ValueError, match=r"names \['encoder_express'\], which this router does not call"):
        check_inline(policy, ["encoder_16"])
    with pytest.raises(ValueError, match="inline_max_ms"):
        InlinePolicy.from_json("[1, 2]")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_ms": 0.0}, "max_ms must be > 0"),
    ({"max_ms": -1.0}, "max_ms must be > 0"),
    ({"hold_off_s": -1.0}, "hold_off_s >= 0"),
    ({"max_ms_by_target": {"encoder_16": -1.0}}, "each target's limit >= 0"),
    ({"max_ms_by_target": {"encoder_16": float("nan")}}, "each target's limit >= 0"),
    ({"strikes": 0}, "strikes must be >= 1"),
])
def test_a_policy_out_of_bounds_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        InlinePolicy(**kwargs)
