"""The router's buffered counters: net amounts per metric, handed over at most once per interval."""

import pytest

from python_backends.metric_buffer import DeltaBuffer


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
