"""When the router serves a request on `execute`'s thread (`python_backends.embed.inline`)."""

from __future__ import annotations

import pytest

from python_backends.embed.inline import InlinePolicy, held_off, record_inline, serves_inline


@pytest.mark.parametrize(("batch_size", "in_flight", "num_chunks", "inline"), [
    (1, 0, 1, True),
    (2, 0, 1, False),  # others of the call wait for the handoff
    (1, 1, 1, False),  # the instance is busy: the workers keep the concurrency
    (1, 0, 2, False),  # lanes run side by side on the workers
])
def test_only_a_lone_one_chunk_request_of_an_idle_instance_is_served_inline(batch_size, in_flight, num_chunks,
                                                                              inline):
    assert serves_inline(batch_size, in_flight, num_chunks) is inline


def test_a_target_whose_call_took_too_long_goes_to_the_workers_until_its_hold_off_ends():
    policy = InlinePolicy(max_ms=15.0, hold_off_s=30.0)
    held_off_until: dict[str, float] = {}
    record_inline(policy, "encoder_16", 14.9, held_off_until, 100.0)
    assert not held_off("encoder_16", held_off_until, 100.0)
    record_inline(policy, "encoder_16", 60.0, held_off_until, 100.0)  # it lingered: a lone request waits its delay
    assert held_off("encoder_16", held_off_until, 129.9)
    assert not held_off("encoder_32", held_off_until, 129.9)  # only that target
    assert not held_off("encoder_16", held_off_until, 130.0)  # tried again


@pytest.mark.parametrize(("max_ms", "hold_off_s"), [(0.0, 1.0), (-1.0, 1.0), (1.0, -1.0)])
def test_a_policy_without_a_positive_bound_is_refused(max_ms, hold_off_s):
    with pytest.raises(ValueError, match="max_ms must be > 0"):
        InlinePolicy(max_ms=max_ms, hold_off_s=hold_off_s)
