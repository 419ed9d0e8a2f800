"""The router's buffered counters: net amounts per metric, handed over at most once per interval."""

import pytest

from python_backends.common.metric_buffer import DeltaBuffer, ObservationBuffer


def test_increments_add_up_per_metric_and_drain_empties_the_buffer():
    buffer: DeltaBuffer[str] = DeltaBuffer(interval_s=1.0)
    buffer.add("ok", 1)
    buffer.add("rows_16", 3)
    buffer.add("ok", 1)
    assert buffer.drain(now_s=10.0) == [("ok", 2.0), ("rows_16", 3.0)]
    assert len(buffer) == 0
    assert buffer.drain(now_s=10.5) == []


def test_moves_that_cancel_out_are_not_handed_over():
    buffer: DeltaBuffer[str] = DeltaBuffer(interval_s=1.0)
    buffer.add("gauge", 1)
    buffer.add("gauge", -1)
    buffer.add("ok", 1)
    assert buffer.drain(now_s=0.0) == [("ok", 1.0)]


def test_due_once_per_interval_and_only_with_something_to_hand_over():
    buffer: DeltaBuffer[str] = DeltaBuffer(interval_s=0.5)
    assert not buffer.due(now_s=0.0)  # nothing moved yet
    buffer.add("ok", 1)
    assert buffer.due(now_s=0.0)  # never drained: hand it over at once
    buffer.drain(now_s=0.0)
    buffer.add("ok", 1)
    assert not buffer.due(now_s=0.3)
    assert buffer.due(now_s=0.5)


def test_counts_are_never_lost_across_drains():
    buffer: DeltaBuffer[int] = DeltaBuffer(interval_s=0.1)
    handed_over = 0.0
    for step in range(1000):
        buffer.add(7, 1)
        if buffer.due(now_s=step * 0.01):
            handed_over += sum(amount for _, amount in buffer.drain(now_s=step * 0.01))
    handed_over += sum(amount for _, amount in buffer.drain(now_s=100.0))
    assert handed_over == 1000


@pytest.mark.parametrize("interval_s", [0.0, -1.0])
def test_a_non_positive_interval_is_refused(interval_s):
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        DeltaBuffer(interval_s=interval_s)


def test_observations_are_replayed_one_by_one_in_the_order_made():
    buffer: ObservationBuffer[str] = ObservationBuffer()
    buffer.add("latency_v1", 0.05)
    buffer.add("latency_v2", 0.2)
    buffer.add("latency_v1", 0.05)  # equal values stay two observations
    assert buffer.drain() == ([("latency_v1", 0.05), ("latency_v2", 0.2), ("latency_v1", 0.05)], 0)
    assert len(buffer) == 0
    assert buffer.drain() == ([], 0)


def test_a_stalled_flush_drops_the_oldest_observations_and_counts_them():
    buffer: ObservationBuffer[str] = ObservationBuffer(max_pending=3)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        buffer.add("latency", value)
    observed, dropped = buffer.drain()
    assert [value for _, value in observed] == [3.0, 4.0, 5.0]
    assert dropped == 2
    buffer.add("latency", 6.0)
    assert buffer.drain() == ([("latency", 6.0)], 0)  # each drop is reported once


def test_an_observation_buffer_needs_room_for_one():
    with pytest.raises(ValueError, match="max_pending must be >= 1"):
        ObservationBuffer(max_pending=0)
