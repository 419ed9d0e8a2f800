"""Metrics snapshots, windows and histogram quantiles, on hand-written exposition text."""

import json
import math

import pytest

from tools.observe.metrics import (
    Snapshot,
    Window,
    parse_exposition,
    queue_stats,
    read_recording,
    windows,
)
from tools.planning.samples import histogram_quantile


def triton_text(success: int, queue_us: int, compute_us: int, rows: int, batches: int, pending: int = 0,
                model: str = "encoder_16", version: str = "1") -> str:
    labels = f'model="{model}",version="{version}"'
    return "\n".join([
        "# HELP nv_inference_request_success Number of successful inference requests",
        "# TYPE nv_inference_request_success counter",
        f"nv_inference_request_success{{{labels}}} {success}",
        "# TYPE nv_inference_request_failure counter",
        f'nv_inference_request_failure{{{labels},reason="REJECTED"}} 0',
        "# TYPE nv_inference_count counter",
        f"nv_inference_count{{{labels}}} {rows}",
        "# TYPE nv_inference_exec_count counter",
        f"nv_inference_exec_count{{{labels}}} {batches}",
        "# TYPE nv_inference_queue_duration_us counter",
        f"nv_inference_queue_duration_us{{{labels}}} {queue_us}",
        "# TYPE nv_inference_compute_infer_duration_us counter",
        f"nv_inference_compute_infer_duration_us{{{labels}}} {compute_us}",
        "# TYPE nv_inference_pending_request_count gauge",
        f"nv_inference_pending_request_count{{{labels}}} {pending}",
        "",
    ])


def histogram_text(name: str, counts: dict[str, int], total_sum: float, labels: str = 'model="embed",version="1"'):
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{le}"}} {count}' for le, count in counts.items()]
    lines += [f"{name}_sum{{{labels}}} {total_sum}", f"{name}_count{{{labels}}} {counts['+Inf']}", ""]
    return "\n".join(lines)


def snap(at_s: float, text: str) -> Snapshot:
    return Snapshot(at_s, parse_exposition(text))


def test_parse_exposition_keeps_names_labels_and_values():
    series = parse_exposition(triton_text(success=10, queue_us=500, compute_us=2000, rows=12, batches=4))
    assert series[("nv_inference_request_success", (("model", "encoder_16"), ("version", "1")))] == 10
    assert series[("nv_inference_request_failure",
                   (("model", "encoder_16"), ("reason", "REJECTED"), ("version", "1")))] == 0


def test_parse_exposition_filter_drops_unwanted_samples():
    series = parse_exposition(triton_text(1, 1, 1, 1, 1), keep=lambda name: name.endswith("_count"))
    assert {name for name, _ in series} == {"nv_inference_count", "nv_inference_exec_count",
                                            "nv_inference_pending_request_count"}


def test_parse_exposition_rejects_garbage_with_a_clear_error():
    with pytest.raises(ValueError, match="unreadable metrics text"):
        parse_exposition("this is { not prometheus\n")
    with pytest.raises(ValueError, match="line 2: 'not a sample'"):
        parse_exposition("# HELP x a help line is fine\nnot a sample\n")


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = [(0.1, 50.0), (0.2, 90.0), (0.4, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.15)  # 20 of the 40 between 0.1 and 0.2
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.3)


def test_histogram_quantile_in_the_inf_bucket_returns_the_highest_finite_bound():
    assert histogram_quantile(0.99, [(0.1, 5.0), (0.2, 6.0), (math.inf, 10.0)]) == pytest.approx(0.2)


def test_histogram_quantile_of_nothing_is_none_and_bad_q_is_refused():
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    with pytest.raises(ValueError, match=r"quantile must be in \[0, 1\]"):
        histogram_quantile(1.5, [(1.0, 1.0)])


def test_window_increase_is_the_counter_difference():
    window = Window(snap(0, triton_text(10, 1000, 5000, 12, 4)), snap(10, triton_text(30, 3000, 25000, 52, 14)))
    assert window.duration_s == 10
    assert window.increase("nv_inference_request_success", model="encoder_16") == 20
    assert window.increase("nv_inference_request_success", model="encoder_32") == 0


def test_window_counts_a_counter_that_went_down_as_a_restart():
    window = Window(snap(0, triton_text(100, 0, 0, 100, 100)), snap(5, triton_text(7, 0, 0, 7, 7)))
    assert window.increase("nv_inference_request_success") == 7


def test_window_needs_a_later_end():
    with pytest.raises(ValueError, match="later end"):
        Window(snap(5, ""), snap(5, ""))


def test_window_label_match_accepts_a_set_of_values():
    text = triton_text(4, 0, 0, 4, 4, model="encoder_16") + triton_text(6, 0, 0, 6, 6, model="encoder_32")
    window = Window(snap(0, ""), snap(1, text))
    assert window.increase("nv_inference_request_success", model={"encoder_16", "encoder_32"}) == 10
    assert window.increase_by("model", "nv_inference_request_success") == {"encoder_16": 4, "encoder_32": 6}


def test_window_quantile_uses_only_the_observations_inside_the_window():
    before = histogram_text("embed_request_duration_seconds", {"0.05": 100, "0.1": 100, "0.2": 100, "+Inf": 100}, 3.0)
    after = histogram_text("embed_request_duration_seconds", {"0.05": 100, "0.1": 150, "0.2": 200, "+Inf": 200}, 18.0)
    window = Window(snap(0, before), snap(10, after))
    # All 100 new observations are between 0.05 and 0.2 s; half of them under 0.1 s.
    assert window.quantile(0.5, "embed_request_duration_seconds", model="embed") == pytest.approx(0.1)
    assert window.mean("embed_request_duration_seconds") == pytest.approx(0.15)


def test_queue_stats_gives_means_per_request_and_batch_sizes():
    window = Window(snap(0, triton_text(10, 1000, 5000, 12, 4, pending=1)),
                    snap(10, triton_text(30, 41000, 205000, 52, 14, pending=3)))
    (q,) = queue_stats(window)
    assert (q.model, q.version) == ("encoder_16", "1")
    assert q.rate_rps == pytest.approx(2.0)
    assert q.queue_ms == pytest.approx(2.0)  # 40,000 us over 20 requests
    assert q.compute_ms == pytest.approx(10.0)  # 200,000 us over 20 requests: each carries its batch's time
    assert q.mean_batch_rows == pytest.approx(4.0)  # 40 rows in 10 batches
    assert q.busy_s == pytest.approx(0.1)  # 10 batches of 10 ms
    assert q.pending == 3


def test_queue_stats_filters_models():
    text = triton_text(4, 0, 0, 4, 4, model="encoder_16") + triton_text(6, 0, 0, 6, 6, model="embed")
    window = Window(snap(0, ""), snap(1, text))
    assert [q.model for q in queue_stats(window, {"embed"})] == ["embed"]


def test_snapshot_json_round_trip_and_recording(tmp_path):
    first, second = snap(1.0, triton_text(1, 2, 3, 4, 5)), snap(3.0, triton_text(2, 3, 4, 5, 6))
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(s.to_json()) for s in (second, first)) + "\n")
    loaded = read_recording(path)
    assert [s.at_s for s in loaded] == [1.0, 3.0]  # sorted by time
    assert loaded[0].series == first.series


def test_read_recording_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(snap(1.0, "").to_json()) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_recording(path)
    path.write_text(json.dumps(snap(1.0, "").to_json()) + "\n")
    with pytest.raises(ValueError, match="at least two snapshots"):
        read_recording(path)


def test_windows_slide_over_a_recording_with_the_requested_span():
    snapshots = [snap(float(t), "") for t in range(0, 31, 2)]
    spans = [(w.start.at_s, w.end.at_s) for w in windows(snapshots, 10.0)]
    assert spans[0] == (0.0, 10.0)
    assert spans[-1] == (20.0, 30.0)
    assert all(end - start == pytest.approx(10.0) for start, end in spans)


def test_parse_exposition_unescapes_label_values_and_reads_special_values():
    text = ('embed_tenant_requests_total{tenant="a\\"b\\\\c",outcome="ok"} 3\n'
            'llm_kv_blocks_used{model="llm"} NaN\n'
            'x_bucket{le="+Inf"} +Inf 1700000000000\n')
    series = parse_exposition(text)
    assert series[("embed_tenant_requests_total", (("outcome", "ok"), ("tenant", 'a"b\\c')))] == 3
    assert math.isnan(series[("llm_kv_blocks_used", (("model", "llm"),))])
    assert series[("x_bucket", (("le", "+Inf"),))] == math.inf


def bucket_text(rows: int, express: int) -> str:
    labels = 'model="embed",bucket="16"'
    return "\n".join([
        "# TYPE embed_bucket_rows_total counter", f"embed_bucket_rows_total{{{labels}}} {rows}",
        "# TYPE embed_bucket_real_tokens_total counter", f"embed_bucket_real_tokens_total{{{labels}}} {rows * 8}",
        "# TYPE embed_bucket_padded_tokens_total counter", f"embed_bucket_padded_tokens_total{{{labels}}} {rows * 16}",
        "# TYPE embed_bucket_express_rows_total counter", f"embed_bucket_express_rows_total{{{labels}}} {express}", ""])


def test_top_shows_the_share_of_a_bucket_s_rows_the_express_model_served():
    from tools.observe.top import padding_rows

    window = Window(snap(0, bucket_text(100, 40)), snap(10, bucket_text(200, 115)))
    assert padding_rows(window) == [("embed", "16", 10.0, 2.0, 0.75)]
