"""The overload benchmark's accounting: where an admitted request's time went, and whose CPU it was."""

import pytest

from tests.unit.test_metrics import histogram_text, snap, triton_text
from tools.bench.overload import Record, cpu_share, summarize, wait_breakdown
from tools.observe.metrics import Window


def page(router_success: int, router_queue_us: int, latency_counts: dict[str, int], latency_sum_s: float,
         bucket_success: int, bucket_queue_us: int, bucket_compute_us: int) -> str:
    return (triton_text(router_success, router_queue_us, 0, router_success, router_success, model="embed")
            + triton_text(bucket_success, bucket_queue_us, bucket_compute_us, bucket_success, bucket_success,
                          model="encoder_16")
            + histogram_text("embed_request_duration_seconds", latency_counts, latency_sum_s))


def test_the_parts_of_the_admitted_mean_add_up_and_the_rest_is_unseen():
    start = snap(0.0, page(0, 0, {"0.05": 0, "0.1": 0, "+Inf": 0}, 0.0, 0, 0, 0))
    # 100 requests over the window: 20 ms each in the router's queue, 60 ms each on the
    # router's clock, of which 10 ms in encoder_16's queue and 30 ms computing.
    end = snap(10.0, page(100, 2_000_000, {"0.05": 20, "0.1": 100, "+Inf": 100}, 6.0, 100, 1_000_000, 3_000_000))
    parts = wait_breakdown(Window(start, end), "embed", ["encoder_16"], admitted_mean_ms=95.0)
    assert parts["router_queue_ms"] == pytest.approx(20.0)
    assert parts["router_ms"] == pytest.approx(60.0)
    assert parts["unseen_ms"] == pytest.approx(15.0)  # 95 - 20 - 60
    assert parts["buckets"] == {"encoder_16": {"requests": 100, "queue_ms": 10.0, "compute_ms": 30.0}}
    assert 50.0 <= parts["router_p95_ms"] <= 100.0


def test_a_window_without_router_traffic_leaves_the_parts_unknown():
    text = page(5, 100, {"0.05": 5, "0.1": 5, "+Inf": 5}, 0.1, 5, 10, 10)
    parts = wait_breakdown(Window(snap(0.0, text), snap(1.0, text)), "embed", ["encoder_16"], admitted_mean_ms=None)
    assert parts["router_queue_ms"] is None and parts["router_ms"] is None and parts["unseen_ms"] is None
    assert parts["buckets"] == {}


def test_cpu_shares_are_of_the_whole_machine_over_the_phase():
    share = cpu_share(load_generator_s=6.0, server_s=30.0, wall_s=20.0, cores=2)
    assert share["load_generator_share"] == pytest.approx(0.15) and share["server_share"] == pytest.approx(0.75)
    assert share["load_generator_max_share"] == 0.15 and share["load_generator_within_bound"]
    assert not cpu_share(load_generator_s=6.1, server_s=30.0, wall_s=20.0, cores=2)["load_generator_within_bound"]


def test_summaries_carry_the_admitted_mean():
    records = [Record("load", "t", 0.0, "ok", latency, 1, "") for latency in (10.0, 20.0, 60.0)]
    records.append(Record("load", "t", 0.0, "rejected", None, 1, "server busy"))
    assert summarize(records, 200.0)["admitted_mean_ms"] == pytest.approx(30.0)
