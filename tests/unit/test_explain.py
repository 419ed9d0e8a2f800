"""explain's diagnosis on hand-built windows: each cause, its numbers and its knob."""

import pytest

from tools.observe.explain import (
    Cause,
    LLMWindow,
    QueueKnobs,
    ServiceWindow,
    diagnose,
    diagnose_llm,
    diagnose_queue,
    knobs_from_repository,
)
from tools.observe.metrics import QueueStats
from tools.spec.profile import LatencyCurve

KNOBS = QueueKnobs(model="encoder_16", max_batch_size=22, preferred_batch=4, max_queue_delay_ms=60.0, instances=2)
CURVE = LatencyCurve({1: 6.7, 2: 11.2, 4: 18.9, 8: 34.8})


def queue(model="encoder_16", version="1", requests=100.0, rows=None, batches=25.0, queue_ms=5.0, compute_ms=18.9,
          pending=0.0, duration_s=10.0) -> QueueStats:
    return QueueStats(model=model, version=version, duration_s=duration_s, num_requests=requests, num_failed=0.0,
                      num_rows=requests if rows is None else rows, num_batches=batches, queue_ms=queue_ms,
                      compute_ms=compute_ms, pending=pending)


def test_a_queue_waiting_past_linger_plus_a_batch_is_short_of_instances():
    (finding,) = diagnose_queue(queue(queue_ms=150.0), KNOBS, CURVE)
    assert finding.cause is Cause.CAPACITY_WAIT
    assert "150.0 ms" in finding.evidence and "2 instances" in finding.evidence
    assert "replicas" in finding.knob


def test_a_queue_released_by_the_timer_with_thin_batches_waits_to_batch():
    # 20 requests in 10 s, batches of 1.3 rows: the 60 ms timer closes them, not a full batch of 4.
    (finding,) = diagnose_queue(queue(requests=20.0, batches=15.0, queue_ms=45.0, compute_ms=8.0), KNOBS, CURVE)
    assert finding.cause is Cause.BATCH_WAIT
    assert "2.0 rows/s" in finding.evidence and "2000 ms to fill" in finding.evidence
    assert "max_queue_delay_microseconds" in finding.knob and "60000" in finding.knob


def test_full_batches_that_take_too_long_are_slow_compute():
    (finding,) = diagnose_queue(queue(batches=25.0, queue_ms=10.0, compute_ms=40.0), KNOBS, CURVE)
    assert finding.cause is Cause.SLOW_COMPUTE
    assert "profile gives 18.9 ms for 4 rows" in finding.evidence and "2.1x" in finding.evidence


def test_slow_compute_compares_with_the_profile_interpolated_at_the_mean_batch():
    # 3 rows per batch: c(3) = (11.2 + 18.9) / 2 = 15.05 ms; 21 ms is 1.4x of that, under the threshold.
    assert diagnose_queue(queue(rows=75.0, batches=25.0, queue_ms=10.0, compute_ms=21.0), KNOBS, CURVE) == []


def test_a_queue_on_budget_has_no_finding_and_a_quiet_one_says_nothing():
    assert diagnose_queue(queue(queue_ms=10.0), KNOBS, CURVE) == []
    assert diagnose_queue(queue(requests=2.0, queue_ms=500.0), KNOBS, CURVE) == []
    assert diagnose_queue(queue(queue_ms=500.0), None, CURVE) == []  # no knobs: nothing to compare with


def fragmented_view(p99_ms: float, earlier_p99_ms: float | None, queue_ms: float = 45.0) -> ServiceWindow:
    # 12 req/s over 10 queues (5 buckets x 2 versions): about one request per batch.
    models = [f"encoder_{n}" for n in (16, 32, 64, 128, 256)]
    knobs = {m: QueueKnobs(m, 22, 4, 60.0, 2) for m in models}
    queues = [queue(model=m, version=v, requests=12.0, batches=14.0, queue_ms=queue_ms, compute_ms=9.0)
              for m in models for v in ("1", "2")]
    return ServiceWindow(name="embed", duration_s=10.0, queues=queues, knobs=knobs, lanes=2, slo_p95_ms=200.0,
                         rate_rps=12.0, p95_ms=p99_ms * 0.8, p99_ms=p99_ms, earlier_p99_ms=earlier_p99_ms)


def test_lingering_thin_batches_over_many_queues_on_an_idle_device_is_fragmentation():
    diagnosis = diagnose(fragmented_view(p99_ms=170.0, earlier_p99_ms=60.0))
    fragmented = [f for f in diagnosis.findings if f.cause is Cause.FRAGMENTED]
    assert len(fragmented) == 1
    assert "10 queues (5 buckets x 2 versions)" in fragmented[0].evidence
    assert "100% of requests wait out the linger timer" in fragmented[0].evidence
    assert "p99 170 ms (was 60 ms)" in fragmented[0].evidence
    assert "do not add replicas" in fragmented[0].knob
    assert "device 6% busy" in diagnosis.summary  # 10 queues x 14 batches x 9 ms over 2 lanes x 10 s
    assert "most of the bucket time is waiting in the bucket queues (83%)" in diagnosis.summary


def test_a_split_whose_batches_close_before_the_timer_is_not_fragmentation():
    diagnosis = diagnose(fragmented_view(p99_ms=70.0, earlier_p99_ms=65.0, queue_ms=10.0))
    assert Cause.FRAGMENTED not in diagnosis.causes


def test_buckets_that_linger_as_planned_with_one_version_are_not_fragmentation():
    view = fragmented_view(p99_ms=170.0, earlier_p99_ms=60.0)
    planned = ServiceWindow(**{**view.__dict__, "queues": [q for q in view.queues if q.version == "1"][:2]})
    assert Cause.FRAGMENTED not in diagnose(planned).causes


def test_two_versions_of_one_bucket_both_lingering_are_fragmentation():
    view = fragmented_view(p99_ms=90.0, earlier_p99_ms=None)
    split = ServiceWindow(**{**view.__dict__, "queues": [q for q in view.queues if q.model == "encoder_16"]})
    assert Cause.FRAGMENTED in diagnose(split).causes


def test_one_queue_lingering_is_batch_wait_not_fragmentation():
    view = fragmented_view(p99_ms=170.0, earlier_p99_ms=60.0)
    single = ServiceWindow(**{**view.__dict__, "queues": view.queues[:1]})
    assert Cause.FRAGMENTED not in diagnose(single).causes
    assert Cause.BATCH_WAIT in diagnose(single).causes


def test_a_busy_device_is_not_fragmentation_even_with_thin_batches():
    view = fragmented_view(p99_ms=170.0, earlier_p99_ms=60.0)
    busy = ServiceWindow(**{**view.__dict__, "queues": [queue(model=q.model, version=q.version, requests=12.0,
                                                              batches=12.0, queue_ms=45.0, compute_ms=90.0)
                                                        for q in view.queues]})
    assert busy.busy_share > 0.5
    assert Cause.FRAGMENTED not in diagnose(busy).causes


def test_a_healthy_service_says_so_and_failures_are_reported():
    healthy = ServiceWindow(name="embed", duration_s=10.0, queues=[queue(queue_ms=10.0)], knobs={"encoder_16": KNOBS},
                            curves={"encoder_16": CURVE})
    assert diagnose(healthy).causes == {Cause.HEALTHY}
    failing = ServiceWindow(**{**healthy.__dict__, "num_failed": 3.0})
    assert Cause.FAILING in diagnose(failing).causes


def test_llm_waiting_with_a_full_cache_is_kv_bound():
    diagnosis = diagnose_llm(LLMWindow("llm", 2.5, running=20, waiting=7, blocks_used=260, blocks_total=267))
    assert diagnosis.causes == {Cause.KV_BOUND}
    assert "kv_cache_mb" in diagnosis.findings[0].knob


def test_llm_waiting_with_every_slot_taken_is_slot_bound_and_idle_is_healthy():
    slots = diagnose_llm(LLMWindow("llm", 1.0, running=48, waiting=3, blocks_used=100, blocks_total=267,
                                   max_num_seqs=48))
    assert slots.causes == {Cause.SLOT_BOUND}
    assert diagnose_llm(LLMWindow("llm", 0.3, running=2, waiting=0, blocks_used=10, blocks_total=267)).causes == {
        Cause.HEALTHY}


def test_knobs_come_from_the_committed_configs():
    from pathlib import Path

    repository = Path(__file__).resolve().parents[2] / "model_repository"
    knobs = knobs_from_repository(["encoder_16", "encoder_256", "missing"], repository)
    assert set(knobs) == {"encoder_16", "encoder_256"}
    assert knobs["encoder_16"].preferred_batch >= 1
    assert knobs["encoder_16"].max_queue_delay_ms > 0


def test_queue_knobs_read_triton_json_with_string_int64s():
    knobs = QueueKnobs.from_config({"name": "m", "max_batch_size": 8, "instance_group": [{"count": 2}, {"count": 1}],
                                    "dynamic_batching": {"preferred_batch_size": [2, 4],
                                                         "max_queue_delay_microseconds": "1500"}})
    assert knobs == QueueKnobs("m", 8, 4, 1.5, 3)
    bare = QueueKnobs.from_config({"name": "m", "max_batch_size": 8})
    assert (bare.preferred_batch, bare.max_queue_delay_ms, bare.instances) == (8, 0.0, 1)


@pytest.mark.parametrize("ratio", [1.4, 1.6])
def test_slow_compute_threshold_is_one_and_a_half_times_the_profile(ratio):
    findings = diagnose_queue(queue(queue_ms=10.0, compute_ms=18.9 * ratio), KNOBS, CURVE)
    assert (Cause.SLOW_COMPUTE in {f.cause for f in findings}) == (ratio > 1.5)


def test_formed_batches_are_the_statistics_api_difference_per_size():
    def stats(counts):
        return {"model_stats": [
            {"name": "encoder_16", "version": "1",
             "batch_stats": [{"batch_size": size, "compute_infer": {"count": str(n), "ns": "1"}}
                             for size, n in counts.items()]},
            {"name": "other", "version": "1", "batch_stats": [{"batch_size": 1, "compute_infer": {"count": "9"}}]}]}

    from tools.observe.explain import formed_batches

    delta = formed_batches(stats({1: 10, 4: 2}), stats({1: 25, 2: 3, 4: 2}), ["encoder_16"])
    assert delta == {"encoder_16": {1: 15, 2: 3}}
    # A reload resets the counters: what is there now counts from zero.
    assert formed_batches(stats({1: 10}), stats({1: 4}), ["encoder_16"]) == {"encoder_16": {1: 4}}


def test_waiting_to_batch_with_p95_headroom_asks_for_no_change():
    view = fragmented_view(p99_ms=100.0, earlier_p99_ms=None)
    single = ServiceWindow(**{**view.__dict__, "queues": view.queues[:1], "p95_ms": 90.0})
    (finding,) = [f for f in diagnose(single).findings if f.cause is Cause.BATCH_WAIT]
    assert finding.knob.startswith("none while p95 has headroom")
    tight = ServiceWindow(**{**single.__dict__, "p95_ms": 190.0})
    (finding,) = [f for f in diagnose(tight).findings if f.cause is Cause.BATCH_WAIT]
    assert finding.knob.startswith("lower max_queue_delay_microseconds on encoder_16")
