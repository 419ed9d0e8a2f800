"""The router's queue wait: read from /metrics by one instance, shared, and added to what admission steers by."""

import dataclasses

import pytest

from python_backends.embed.admission import AdmissionPolicy, SharedWork, steering
from python_backends.embed.queue_wait import (
    QueueCounters,
    QueueWaitProbe,
    metrics_url_of,
    queue_counters,
    smoothed,
    window_wait_ms,
)

POLICY = AdmissionPolicy(row_cost_ms={16: 4.0}, lanes=2, max_work_ms=60.0, target_ms=150.0, min_work_ms=20.0,
                         max_limit_ms=190.0, measured_target_ms=185.0)


def page(queue_us: dict[str, float], success: dict[str, float]) -> str:
    lines = ["# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds",
             "# TYPE nv_inference_queue_duration_us counter"]
    lines += [f'nv_inference_queue_duration_us{{model="{m}",version="{v}"}} {value}'
              for (m, v), value in ((key.split(":"), value) for key, value in queue_us.items())]
    lines += ["# TYPE nv_inference_request_success counter"]
    lines += [f'nv_inference_request_success{{model="{m}",version="{v}"}} {value}'
              for (m, v), value in ((key.split(":"), value) for key, value in success.items())]
    lines += ['nv_inference_request_failure{model="embed",reason="REJECTED",version="1"} 7', ""]
    return "\n".join(lines)


@pytest.mark.parametrize(("argv", "url"), [
    (["tritonserver", "--model-repository=/m", "--metrics-port=9102", "--metrics-address=127.0.0.1"],
     "http://127.0.0.1:9102/metrics"),
    (["tritonserver", "--metrics-port", "9102"], "http://127.0.0.1:9102/metrics"),
    (["tritonserver", "--model-repository=/m"], "http://127.0.0.1:8002/metrics"),  # Triton's default port
    (["tritonserver", "--metrics-address=0.0.0.0", "--metrics-port=9"], "http://127.0.0.1:9/metrics"),
    (["tritonserver", "--allow-metrics=false", "--metrics-port=9102"], None),
])
def test_the_metrics_url_comes_from_the_server_s_command_line(argv, url):
    assert metrics_url_of(argv) == url


def test_the_counters_of_the_router_are_summed_over_its_versions_and_no_other_model():
    text = page({"embed:1": 3000.0, "embed:2": 1000.0, "encoder_16:1": 99999.0},
                {"embed:1": 30.0, "embed:2": 10.0, "encoder_16:1": 5.0})
    assert queue_counters(text, "embed") == QueueCounters(queue_us=4000.0, requests=40.0)
    with pytest.raises(ValueError, match="no nv_inference_queue_duration_us"):
        queue_counters(text, "absent")


def test_the_window_mean_and_its_smoothing():
    assert window_wait_ms(QueueCounters(1000.0, 10.0), QueueCounters(21000.0, 20.0)) == pytest.approx(2.0)
    assert window_wait_ms(QueueCounters(1000.0, 10.0), QueueCounters(1000.0, 10.0)) is None  # no request
    assert window_wait_ms(QueueCounters(9000.0, 90.0), QueueCounters(10.0, 1.0)) is None  # reloaded: reset
    assert smoothed(None, 8.0) == 8.0 and smoothed(8.0, None) == 8.0
    assert smoothed(8.0, 4.0) == pytest.approx(6.0)


def test_the_probe_publishes_each_window_and_survives_an_unreadable_page():
    pages = iter([page({"embed:1": 0.0}, {"embed:1": 0.0}), page({"embed:1": 50_000.0}, {"embed:1": 10.0}),
                  "<html>proxy error</html>", page({"embed:1": 50_000.0}, {"embed:1": 10.0}),
                  page({"embed:1": 60_000.0}, {"embed:1": 20.0})])
    published, errors = [], []
    probe = QueueWaitProbe("http://x/metrics", "embed", lambda wait, at: published.append((wait, at)),
                           fetch=lambda url: next(pages), clock=lambda: 42.0, on_error=errors.append)
    for _ in range(5):
        probe.step()
    # 5 ms mean in the first window; the unreadable page is skipped; the idle window keeps
    # the wait; then the 1 ms window smooths it to (5 + 1) / 2.
    assert published == [(5.0, 42.0), (5.0, 42.0), (3.0, 42.0)]
    assert probe.errors == 1 and "cannot read http://x/metrics" in errors[0]  # reported, not raised


def test_a_fresh_measured_wait_is_added_to_the_latency_and_judged_by_the_measured_target(tmp_path):
    assert steering(POLICY, 100.0, 30.0) == (130.0, 185.0)
    assert steering(POLICY, 100.0, None) == (100.0, 150.0)  # no measurement: the fixed margin
    unmeasured = dataclasses.replace(POLICY, measured_target_ms=0.0)
    assert steering(unmeasured, 100.0, 30.0) == (100.0, 150.0)
    work, other = SharedWork(tmp_path / "work.bin", 0), SharedWork(tmp_path / "work.bin", 1)
    try:
        assert work.queue_wait_ms(now=10.0) is None  # never measured
        work.set_queue_wait(40.0, now=10.0)
        assert other.queue_wait_ms(now=11.0) == 40.0  # every instance reads it
        assert other.queue_wait_ms(now=20.0) is None  # stale: the probe stopped
        # 160 ms on the router's clock + the 40 ms wait = 200 ms from arrival: late against 185.
        other.record_latency(POLICY, 160.0, now=11.0)
        assert other.bound_ms(POLICY) == pytest.approx(57.0)
        # 120 ms + 40 ms = 160 ms: on time against 185 (the fixed target, 150, would call it late).
        other.record_latency(POLICY, 120.0, now=11.0)
        assert other.bound_ms(POLICY) > 57.0
    finally:
        work.close()
        other.close()
