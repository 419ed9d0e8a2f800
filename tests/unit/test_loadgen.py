"""The load generator's pure core: arrivals, percentiles, step summaries, server-side
deltas from Triton's statistics JSON, the goodput search; and the sweep's argument checks."""

import argparse
import itertools
import json
import random
import statistics

import numpy as np
import pytest

from python_backends.common.regimes import LingerRegimes
from tools.bench import sweep
from tools.bench.inputs import Fill
from tools.bench.loadgen import (
    LoadTarget,
    RateSearch,
    ServerTimes,
    StepResult,
    called_models,
    default_stats_models,
    duration_for_arrivals,
    flatten_step,
    http_parameters,
    percentile,
    plot_sweep,
    poisson_arrival_times,
    request_inputs,
    request_pair_rows,
    request_rows,
    server_times_delta,
    split_host_port,
    step_to_dict,
    summarize_step,
    wire_tensor,
)
from tools.cli import sweep as sweep_cli
from tools.clients.http_infer import bytes_tensor

# --------------------------------------------------------------------------- arrivals


def test_arrivals_have_the_requested_mean_rate_over_a_long_window():
    times = poisson_arrival_times(50.0, 400.0, random.Random(1))
    assert len(times) / 400.0 == pytest.approx(50.0, rel=0.03)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential gaps: mean 1/rate and standard deviation equal to the mean.
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)


def test_arrivals_are_sorted_inside_the_window_and_deterministic_for_a_seed():
    first = poisson_arrival_times(20.0, 5.0, random.Random(7))
    assert first == poisson_arrival_times(20.0, 5.0, random.Random(7))
    assert first != poisson_arrival_times(20.0, 5.0, random.Random(8))
    assert first == sorted(first)
    assert all(0 < t < 5.0 for t in first)


@pytest.mark.parametrize(("rate", "count", "seed"), [(4.0, 100, 7), (4.0, 20, 7), (50.0, 1, 0), (0.5, 13, 3)])
def test_a_step_can_be_as_long_as_a_given_number_of_arrivals(rate, count, seed):
    duration = duration_for_arrivals(rate, count, seed)
    assert len(poisson_arrival_times(rate, duration, random.Random(seed))) == count
    if count >= 100:  # about count / rate: a Poisson count's spread is its square root
        assert duration == pytest.approx(count / rate, rel=0.3)


@pytest.mark.parametrize(("rate", "count"), [(0, 10), (-1.0, 10), (1.0, 0)])
def test_a_number_of_arrivals_needs_a_positive_rate_and_count(rate, count):
    with pytest.raises(ValueError, match="must be"):
        duration_for_arrivals(rate, count, 0)


@pytest.mark.parametrize(("rate", "duration"), [(0, 1), (-1, 1), (1, 0)])
def test_arrivals_reject_non_positive_rate_or_duration(rate, duration):
    with pytest.raises(ValueError, match="must be > 0"):
        poisson_arrival_times(rate, duration, random.Random(0))


# --------------------------------------------------------------------------- percentiles


def test_percentile_interpolates_like_numpy():
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 0) == 15
    assert percentile(values, 50) == 35
    assert percentile(values, 100) == 50
    assert percentile(values, 40) == pytest.approx(29.0)  # numpy.percentile(values, 40)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 95) == 7.0
    assert percentile([3, 1, 2], 50) == 2  # order of the input does not matter


def test_percentile_rejects_empty_input_and_bad_q():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


# --------------------------------------------------------------------------- step summary


def test_summarize_step_counts_goodput_against_everything_sent():
    result = summarize_step(mode="open", load=10, duration_s=2.0, latencies_ms=[10, 20, 30, 150],
                            errors=["UNAVAILABLE: queue full", "UNAVAILABLE: queue full", "not sent: cap"],
                            slo_ms=100, send_lags_ms=[0.1, 0.2, 5.0], client_cpu_s=0.05)
    assert (result.offered_rps, result.concurrency) == (10.0, None)
    assert (result.num_sent, result.num_ok, result.num_errors, result.num_within_slo) == (7, 4, 3, 3)
    assert result.goodput_fraction == pytest.approx(3 / 7)
    assert result.throughput_rps == pytest.approx(2.0)  # ok responses per second
    assert result.p50_ms == pytest.approx(25.0)
    assert result.p99_ms == pytest.approx(percentile([10, 20, 30, 150], 99))
    assert result.send_lag_p99_ms == pytest.approx(percentile([0.1, 0.2, 5.0], 99))
    assert result.error_samples == ("UNAVAILABLE: queue full (x2)", "not sent: cap (x1)")
    assert result.load == 10.0


def test_summarize_step_with_nothing_ok_has_no_percentiles_and_zero_goodput():
    result = summarize_step(mode="closed", load=4, duration_s=1.0, latencies_ms=[], errors=["boom"] * 3, slo_ms=50)
    assert (result.concurrency, result.offered_rps) == (4, None)
    assert result.p50_ms is result.p95_ms is result.p99_ms is None
    assert result.goodput_fraction == 0.0 and result.throughput_rps == 0.0
    empty = summarize_step(mode="open", load=1, duration_s=1.0, latencies_ms=[], errors=[], slo_ms=50)
    assert empty.num_sent == 0 and empty.goodput_fraction == 0.0


def test_summarize_step_keeps_only_a_few_distinct_error_messages():
    errors = [f"error {i % 9}" for i in range(100)]
    result = summarize_step(mode="open", load=1, duration_s=1.0, latencies_ms=[], errors=errors, slo_ms=1)
    assert result.num_errors == 100
    assert len(result.error_samples) == 5


def test_summarize_step_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        summarize_step(mode="sideways", load=1, duration_s=1, latencies_ms=[1], errors=[], slo_ms=1)


def test_step_serialises_to_json_and_flat_csv_rows():
    times = ServerTimes(inference_count=8, execution_count=2, num_requests=8, num_failed=0,
                        mean_batch_size=4.0, queue_ms=1.5, compute_ms=9.0)
    result = summarize_step(mode="open", load=5, duration_s=1, latencies_ms=[5.0], errors=["x"], slo_ms=10,
                            server={"encoder_16": times})
    data = step_to_dict(result)
    assert data["server"]["encoder_16"]["queue_ms"] == 1.5
    assert data["error_samples"] == ["x (x1)"]
    row = flatten_step(result)
    assert row["server.encoder_16.mean_batch_size"] == 4.0
    assert "server" not in row and row["error_samples"] == "x (x1)"


# --------------------------------------------------------------------------- server stats

# Recorded from tritonserver 2.51 (gRPC get_inference_statistics(as_json=True)) before and
# after 40 concurrent `embed` requests; trimmed. int64 come as strings; zero fields are left out.
STATS_BEFORE = {"model_stats": [
    {"name": "encoder_16", "version": "1", "last_inference": "1795318881140", "inference_count": "3",
     "execution_count": "3",
     "inference_stats": {"success": {"count": "3", "ns": "63141058"}, "fail": {},
                         "queue": {"count": "3", "ns": "6292339"},
                         "compute_input": {"count": "3", "ns": "59892"},
                         "compute_infer": {"count": "3", "ns": "56606826"},
                         "compute_output": {"count": "3", "ns": "171542"}, "cache_hit": {}, "cache_miss": {}},
     "batch_stats": [{"batch_size": "1", "compute_input": {"count": "3", "ns": "59892"},
                      "compute_infer": {"count": "3", "ns": "56606826"},
                      "compute_output": {"count": "3", "ns": "171542"}}]},
    {"name": "encoder_128", "version": "1",
     "inference_stats": {"success": {}, "fail": {}, "queue": {}, "compute_input": {}, "compute_infer": {},
                         "compute_output": {}, "cache_hit": {}, "cache_miss": {}}},
]}
STATS_AFTER = {"model_stats": [
    {"name": "encoder_16", "version": "1", "last_inference": "1795318902683", "inference_count": "43",
     "execution_count": "12",
     "inference_stats": {"success": {"count": "43", "ns": "963887105"}, "fail": {},
                         "queue": {"count": "43", "ns": "237610155"},
                         "compute_input": {"count": "43", "ns": "2561623"},
                         "compute_infer": {"count": "43", "ns": "684637310"},
                         "compute_output": {"count": "43", "ns": "32532900"}, "cache_hit": {}, "cache_miss": {}},
     "batch_stats": [
         {"batch_size": "1", "compute_input": {"count": "3", "ns": "59892"},
          "compute_infer": {"count": "3", "ns": "56606826"}, "compute_output": {"count": "3", "ns": "171542"}},
         {"batch_size": "3", "compute_input": {"count": "3", "ns": "127849"},
          "compute_infer": {"count": "3", "ns": "39555752"}, "compute_output": {"count": "3", "ns": "336201"}},
         {"batch_size": "4", "compute_input": {"count": "2", "ns": "152486"},
          "compute_infer": {"count": "2", "ns": "35340488"}, "compute_output": {"count": "2", "ns": "1517205"}},
         {"batch_size": "5", "compute_input": {"count": "1", "ns": "81022"},
          "compute_infer": {"count": "1", "ns": "17786232"}, "compute_output": {"count": "1", "ns": "2480681"}},
         {"batch_size": "6", "compute_input": {"count": "3", "ns": "183855"},
          "compute_infer": {"count": "3", "ns": "46511686"}, "compute_output": {"count": "3", "ns": "2146755"}}]},
    {"name": "encoder_128", "version": "1",
     "inference_stats": {"success": {}, "fail": {}, "queue": {}, "compute_input": {}, "compute_infer": {},
                         "compute_output": {}, "cache_hit": {}, "cache_miss": {}}},
]}


def test_server_times_delta_on_recorded_statistics():
    times = server_times_delta(STATS_BEFORE, STATS_AFTER)
    encoder = times["encoder_16"]
    assert (encoder.inference_count, encoder.execution_count, encoder.num_requests) == (40, 9, 40)
    assert encoder.mean_batch_size == pytest.approx(40 / 9)
    assert encoder.queue_ms == pytest.approx((237610155 - 6292339) / 40 / 1e6)
    # Per execution, from batch_stats (inference_stats would charge each row its whole batch).
    batch_ns = (127849 + 39555752 + 336201 + 152486 + 35340488 + 1517205 + 81022 + 17786232 + 2480681
                + 183855 + 46511686 + 2146755)
    assert encoder.compute_ms == pytest.approx(batch_ns / 9 / 1e6)
    idle = times["encoder_128"]
    assert (idle.inference_count, idle.execution_count, idle.mean_batch_size, idle.queue_ms, idle.compute_ms) == (
        0, 0, 0.0, 0.0, 0.0)


def test_server_times_delta_counts_new_and_reset_models_from_zero():
    loaded_later = server_times_delta({"model_stats": []}, STATS_AFTER)["encoder_16"]
    assert loaded_later.inference_count == 43 and loaded_later.execution_count == 12
    reset = server_times_delta(STATS_AFTER, STATS_BEFORE)["encoder_16"]  # counters went backwards
    assert reset.inference_count == 3 and reset.execution_count == 3


def test_server_times_delta_sums_versions_of_one_model():
    v2 = dict(STATS_AFTER["model_stats"][0], version="2")
    after = {"model_stats": [STATS_AFTER["model_stats"][0], v2]}
    times = server_times_delta(STATS_BEFORE, after)["encoder_16"]
    assert times.inference_count == 43 * 2 - 3


def router_config(lens: str, prefix: str | None = None) -> dict:
    """A router's config as `get_model_config(as_json=True)["config"]` gives it."""
    parameters = {"bucket_lens": {"string_value": lens}, "kind": {"string_value": "text-classifier"}}
    if prefix is not None:
        parameters["encoder_prefix"] = {"string_value": prefix}
    return {"name": "router", "backend": "python", "parameters": parameters}


def test_a_router_calls_the_bucket_models_its_config_names():
    assert called_models(router_config("16,32,64,128,256", "encoder_")) == (
        "encoder_16", "encoder_32", "encoder_64", "encoder_128", "encoder_256")
    assert called_models(router_config("32, 128", "rerank_")) == ("rerank_32", "rerank_128")
    assert called_models(router_config("16")) == ("encoder_16",)  # the router's default prefix
    assert called_models({"name": "encoder_16", "parameters": {"pooling": {"string_value": "none"}}}) == ()
    assert called_models({"name": "llm"}) == ()  # a model without parameters calls nothing
    tensor = {"inputs": {"string_value": "[]"}, "encoder_prefix": {"string_value": "image_"}}
    assert called_models({"name": "image", "parameters": tensor}) == ("image_fixed",)
    external = {**tensor, "fixed_model": {"string_value": "user_scorer"}}
    assert called_models({"name": "scorer", "parameters": external}) == ("user_scorer",)
    # A router whose buckets linger at peak also calls its express model.
    regimes = LingerRegimes(up_rps=40.0, down_rps=20.0, hold_s=30.0, instances=2, express="encoder_express",
                            peak_us={"encoder_16": 60000})
    lingering = router_config("16,32", "encoder_")
    lingering["parameters"]["linger_regimes"] = {"string_value": regimes.to_json()}
    assert called_models(lingering) == ("encoder_16", "encoder_32", "encoder_express")


def test_default_stats_models_add_the_routers_ready_buckets():
    index = [{"name": "embed", "state": "READY"}, {"name": "encoder_32", "state": "READY"},
             {"name": "encoder_16", "state": "READY"}, {"name": "encoder_64", "state": "UNAVAILABLE"},
             {"name": "llm", "state": "READY"}, {"name": "rerank_32", "state": "READY"}]
    embed_calls = called_models(router_config("16,32,64", "encoder_"))
    assert default_stats_models("embed", index, embed_calls) == ["embed", "encoder_16", "encoder_32"]
    # Another router's buckets, by its own prefix; the other router's buckets are not its own.
    assert default_stats_models("rerank", index, ("rerank_32", "rerank_128")) == ["rerank", "rerank_32"]
    assert default_stats_models("llm", index) == ["llm"]


# --------------------------------------------------------------------------- goodput search


def step(goodput: float = 1.0, errors: int = 0) -> StepResult:
    num_sent = 100
    return StepResult(mode="open", offered_rps=1.0, concurrency=None, duration_s=1.0, num_sent=num_sent,
                      num_ok=num_sent - errors, num_errors=errors, num_within_slo=round(goodput * num_sent),
                      p50_ms=1.0, p95_ms=1.0, p99_ms=1.0, throughput_rps=1.0, goodput_fraction=goodput,
                      slo_ms=100.0, send_lag_p99_ms=0.0)


def drive(search: RateSearch, capacity_rps: float) -> list[float]:
    """Run the search against a server that meets the SLO up to `capacity_rps`."""
    rates = []
    while (rate := search.next_rate()) is not None:
        rates.append(rate)
        search.record(rate, step(goodput=1.0 if rate <= capacity_rps else 0.5))
    return rates


def test_search_doubles_until_a_failure_then_bisects_to_the_tolerance():
    search = RateSearch(10, rel_tolerance=0.10, max_steps=20)
    rates = drive(search, capacity_rps=55)
    assert rates[:4] == [10, 20, 40, 80]  # doubling until 80 fails
    # Bisection between the highest pass and the lowest failure: [40, 80] -> 60 fails,
    # [40, 60] -> 50 passes, [50, 60] -> 55 passes, [55, 60] is within 10% of 60: done.
    assert rates[4:] == [60, 50, 55]
    assert search.best_rate == 55
    assert search.done


def test_search_stops_after_max_steps_with_the_best_so_far():
    search = RateSearch(1, max_steps=3)
    assert drive(search, capacity_rps=1000) == [1, 2, 4]
    assert search.best_rate == 4 and search.next_rate() is None


def test_search_where_every_rate_fails_halves_down_and_reports_zero():
    search = RateSearch(8, min_rps=1, max_steps=20)
    rates = drive(search, capacity_rps=0)
    assert rates == [8, 4, 2, 1]
    assert search.best_rate == 0.0
    assert search.history == [(8, False), (4, False), (2, False), (1, False)]


def test_search_finds_capacity_below_a_failing_start():
    search = RateSearch(100, rel_tolerance=0.2, max_steps=20)
    drive(search, capacity_rps=30)
    assert 25 <= search.best_rate <= 30


def test_a_single_error_fails_a_rate_even_with_full_goodput():
    search = RateSearch(10)
    search.record(10, step(goodput=0.99, errors=1))
    assert search.best_rate == 0.0
    assert search.next_rate() == 5  # halves after the failure
    lenient = RateSearch(10, max_errors=1)
    lenient.record(10, step(goodput=0.99, errors=1))
    assert lenient.best_rate == 10


def test_goodput_threshold_is_a_parameter():
    search = RateSearch(10, min_goodput=0.99)
    search.record(10, step(goodput=0.98))
    assert search.best_rate == 0.0
    assert RateSearch(10).passes(step(goodput=0.95))


def test_search_stops_at_max_rps_and_when_results_disagree():
    capped = RateSearch(10, max_rps=30)
    assert drive(capped, capacity_rps=1000) == [10, 20, 30]
    assert capped.best_rate == 30
    noisy = RateSearch(10)
    noisy.record(10, step(goodput=0.5))
    noisy.record(20, step(goodput=1.0))  # a pass above a failure: stop, keep the pass
    assert noisy.next_rate() is None and noisy.best_rate == 20


def test_search_takes_verdicts_of_the_callers_own_criteria():
    # The LLM benchmark judges a rate by finished share, failures, TTFT and TPOT p95, not by a
    # StepResult: the same doubling and bisection run on its verdicts.
    by_verdict, by_result = RateSearch(1, max_steps=20), RateSearch(1, max_steps=20)
    while (rate := by_verdict.next_rate()) is not None:
        assert rate == by_result.next_rate()
        by_verdict.record_verdict(rate, rate <= 3)
        by_result.record(rate, step(goodput=1.0 if rate <= 3 else 0.5))
    assert by_verdict.history == by_result.history
    assert by_verdict.best_rate == by_result.best_rate == 3
    assert by_result.done


@pytest.mark.parametrize("kwargs", [{"start_rps": 0}, {"start_rps": 1, "min_goodput": 1.5},
                                    {"start_rps": 1, "rel_tolerance": 0}, {"start_rps": 1, "max_steps": 0},
                                    {"start_rps": 1, "max_errors": -1}, {"start_rps": 1, "min_rps": 2}])
def test_search_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        RateSearch(**kwargs)


# --------------------------------------------------------------------------- target, plot


def test_load_target_validates_its_fields():
    with pytest.raises(ValueError, match="payload"):
        LoadTarget(grpc_url="x:1", model="embed", texts=(), slo_ms=10)
    with pytest.raises(ValueError, match="payload"):
        LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=10, tensors=({"X": np.zeros((1, 2))},))
    with pytest.raises(ValueError, match="pair each of the 2 texts, got 1"):
        LoadTarget(grpc_url="x:1", model="rerank", texts=("a", "b"), pair_texts=("c",), slo_ms=10)
    with pytest.raises(ValueError, match=r"tensors\[1\] must give every input the same number of rows"):
        LoadTarget(grpc_url="x:1", model="m", texts=(), slo_ms=10,
                   tensors=({"X": np.zeros((2, 3))}, {"X": np.zeros((2, 3)), "Y": np.zeros((1, 3))}))
    with pytest.raises(ValueError, match="slo_ms"):
        LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=0)
    with pytest.raises(ValueError, match="rows_per_request"):
        LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=1, rows_per_request=0)
    with pytest.raises(ValueError, match="host:port for the HTTP endpoint, got 'localhost'"):
        LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=1, http_url="localhost")


@pytest.mark.parametrize(("url", "expected"), [
    ("localhost:8000", ("localhost", 8000)), ("http://10.0.0.7:8000/", ("10.0.0.7", 8000)),
    ("[::1]:8000", ("::1", 8000)),
])
def test_http_endpoints_split_into_host_and_port(url, expected):
    assert split_host_port(url) == expected


@pytest.mark.parametrize("url", ["localhost", ":8000", "[]:8000", "localhost:http", "localhost:0", "localhost:70000"])
def test_http_endpoints_without_a_usable_port_are_refused(url):
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(url)


def test_requests_take_consecutive_texts_as_rows_and_cycle_through_all_of_them():
    target = LoadTarget(grpc_url="x:1", model="embed", texts=("a", "b", "c", "d", "e"), slo_ms=1, rows_per_request=2)
    assert request_rows(target) == [[b"a", b"b"], [b"c", b"d"]]
    one_text = LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=1, rows_per_request=3)
    assert request_rows(one_text) == [[b"a", b"a", b"a"]]


def test_pairs_cycle_row_for_row_beside_their_texts():
    target = LoadTarget(grpc_url="x:1", model="rerank", texts=("q1", "q2", "q3"), pair_texts=("p1", "p2", "p3"),
                        slo_ms=1, rows_per_request=2)
    assert request_rows(target) == [[b"q1", b"q2"]]
    assert request_pair_rows(target) == [[b"p1", b"p2"]]
    wraps = LoadTarget(grpc_url="x:1", model="rerank", texts=("q1", "q2", "q3"), pair_texts=("p1", "p2", "p3"),
                       slo_ms=1, rows_per_request=4)
    assert request_rows(wraps) == [[b"q1", b"q2", b"q3", b"q1"]]
    assert request_pair_rows(wraps) == [[b"p1", b"p2", b"p3", b"p1"]]  # each text keeps its partner
    [inputs] = request_inputs(wraps)
    assert set(inputs) == {"TEXT", "TEXT_PAIR"}
    assert inputs["TEXT"].shape == inputs["TEXT_PAIR"].shape == (4, 1)
    assert inputs["TEXT_PAIR"][:, 0].tolist() == [b"p1", b"p2", b"p3", b"p1"]
    singles = LoadTarget(grpc_url="x:1", model="embed", texts=("a", "b"), slo_ms=1, input_name="QUERY")
    assert request_pair_rows(singles) == []
    assert [list(inputs) for inputs in request_inputs(singles)] == [["QUERY"], ["QUERY"]]


def test_tensor_payloads_are_sent_as_given_and_encoded_little_endian():
    requests = ({"IMAGE": np.ones((2, 3), dtype=np.float32), "MASK": np.array([[1], [0]], dtype=np.int64)},)
    target = LoadTarget(grpc_url="x:1", model="vision", texts=(), slo_ms=1, tensors=requests)
    [inputs] = request_inputs(target)
    assert inputs.keys() == requests[0].keys() and inputs["IMAGE"] is requests[0]["IMAGE"]
    image = wire_tensor("IMAGE", requests[0]["IMAGE"])
    assert (image.datatype, image.shape, image.data) == ("FP32", (2, 3), np.ones(6, dtype="<f4").tobytes())
    assert wire_tensor("MASK", np.array([[1], [0]], dtype=">i8")).data == np.array([1, 0], dtype="<i8").tobytes()
    text = wire_tensor("TEXT", np.array([[b"a"], [b"bc"]], dtype=object))
    assert (text.datatype, text.shape, text.data) == ("BYTES", (2, 1), bytes_tensor([b"a", b"bc"]))


def test_http_requests_carry_tritons_priority_and_timeout_among_their_parameters():
    target = LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=1, parameters={"tenant_token": "t"},
                        priority=2, timeout_us=5000)
    assert http_parameters(target) == {"tenant_token": "t", "priority": 2, "timeout": 5000}
    plain = LoadTarget(grpc_url="x:1", model="embed", texts=("a",), slo_ms=1)
    assert http_parameters(plain) == {}


def test_plot_sweep_writes_a_png(tmp_path):
    results = [summarize_step(mode="open", load=rate, duration_s=1, latencies_ms=[rate, 2 * rate, 3 * rate],
                              errors=[], slo_ms=50) for rate in (5, 10, 20)]
    results.append(summarize_step(mode="open", load=40, duration_s=1, latencies_ms=[], errors=["x"], slo_ms=50))
    path = plot_sweep(results, 50, tmp_path / "sub" / "sweep.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- sweep CLI checks


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [["--rates", "5,0"], ["--rates", "a"], ["--rates", ","],
                                  ["--concurrency", "1,2.5"], ["--duration", "0"], ["--warmup", "-1"],
                                  ["--out", "results.txt"], ["--plot", "plot.jpg"], ["--parameters", "[1]"],
                                  ["--parameters", "{bad"], ["--parameters", '{"tenant": [1]}'],
                                  ["--parameters", '{"priority": -1}'], ["--min-goodput", "2"],
                                  ["--mode", "sideways"], ["--http-url", "localhost"]])
def test_sweep_rejects_bad_arguments_where_declared(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_sweep_parses_lists_and_splits_triton_request_fields():
    args = parse("--rates", "5, 10,20", "--parameters", '{"tenant": "a", "priority": 1, "timeout": 5000}')
    assert args.rates == (5.0, 10.0, 20.0)
    assert sweep.split_parameters(args.parameters) == ({"tenant": "a"}, 1, 5000)
    assert sweep.split_parameters({}) == ({}, 0, None)


@pytest.mark.parametrize(("argv", "message"), [
    (["--mode", "closed", "--rates", "5"], "--mode open"),
    (["--mode", "open", "--concurrency", "2"], "--mode closed"),
    (["--rates", "5", "--search", "5"], "not both"),
])
def test_sweep_rejects_options_of_the_other_mode(argv, message, capsys):
    assert sweep_cli.run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def metadata(name: str, *inputs: tuple[str, str, list[int]]) -> dict:
    """A model's metadata as `get_model_metadata(as_json=True)` gives it (int64 dims as strings)."""
    return {"name": name, "inputs": [{"name": n, "datatype": t, "shape": [str(d) for d in shape]}
                                     for n, t, shape in inputs]}


def test_pick_inputs_finds_the_text_input_in_model_metadata():
    embed = sweep.pick_inputs(metadata("embed", ("TEXT", "BYTES", [-1, 1])))
    assert (embed.text, embed.pair) == ("TEXT", None)
    query = sweep.pick_inputs(metadata("search", ("QUERY", "BYTES", [-1, 1]), ("TOP_K", "INT32", [-1, 1])))
    assert (query.text, query.pair) == ("QUERY", None)
    with pytest.raises(sweep.SweepError, match=r"several texts .*A, B.*--input"):
        sweep.pick_inputs(metadata("two", ("A", "BYTES", [-1, 1]), ("B", "BYTES", [-1, 1])))
    assert sweep.pick_inputs(metadata("two", ("A", "BYTES", [-1, 1]), ("B", "BYTES", [-1, 1])), "B").text == "B"


def test_a_model_with_text_and_text_pair_is_sent_pairs_unless_an_input_is_named():
    rerank = metadata("rerank", ("TEXT", "BYTES", [-1, 1]), ("TEXT_PAIR", "BYTES", [-1, 1]))
    assert (sweep.pick_inputs(rerank).text, sweep.pick_inputs(rerank).pair) == ("TEXT", "TEXT_PAIR")
    assert (sweep.pick_inputs(rerank, "TEXT").text, sweep.pick_inputs(rerank, "TEXT").pair) == ("TEXT", None)
    with pytest.raises(sweep.SweepError, match=r"--input QUERY: model 'rerank' has no BYTES input QUERY .*"
                                               r"it takes TEXT \(BYTES \[-1, 1\]\), TEXT_PAIR"):
        sweep.pick_inputs(rerank, "QUERY")


def test_a_model_that_takes_no_texts_is_sent_tensors_of_its_declared_types_and_shapes():
    encoder = sweep.pick_inputs(metadata("encoder_16", ("INPUT_IDS", "INT64", [-1, 16]),
                                         ("ATTENTION_MASK", "INT64", [-1, 16])))
    assert encoder.text is None and encoder.pair is None
    assert [(t.name, t.type_name, t.shape) for t in encoder.tensors] == [
        ("INPUT_IDS", "TYPE_INT64", (None, 16)), ("ATTENTION_MASK", "TYPE_INT64", (None, 16))]
    requests = sweep.tensor_requests(encoder, Fill.RANDOM, rows=3, seed=1)
    assert len(requests) == sweep.NUM_TENSOR_REQUESTS
    assert {name: (a.shape, a.dtype) for name, a in requests[0].items()} == {
        "INPUT_IDS": ((3, 16), np.int64), "ATTENTION_MASK": ((3, 16), np.int64)}
    assert not np.array_equal(requests[0]["INPUT_IDS"], requests[1]["INPUT_IDS"])  # distinct requests
    [zeros] = sweep.tensor_requests(encoder, Fill.ZEROS, rows=2)
    assert not zeros["INPUT_IDS"].any()
    with pytest.raises(sweep.SweepError, match="data type 'COMPLEX'"):
        sweep.pick_inputs(metadata("odd", ("X", "COMPLEX", [-1, 2])))
    with pytest.raises(sweep.SweepError, match="declares no inputs"):
        sweep.pick_inputs(metadata("empty"))


def test_tensor_requests_size_free_axes_or_say_how(tmp_path):
    audio = sweep.pick_inputs(metadata("audio", ("FRAMES", "FP32", [-1, -1, 40])))
    [request, *_] = sweep.tensor_requests(audio, Fill.RANDOM, rows=2, variable_len=50)
    assert request["FRAMES"].shape == (2, 50, 40) and request["FRAMES"].dtype == np.float32
    with pytest.raises(sweep.SweepError, match=r"FRAMES: axis 1 .* is free.*--variable-len N"):
        sweep.tensor_requests(audio, Fill.RANDOM, rows=2)


def test_tensor_requests_take_a_sample_files_rows_in_turn(tmp_path):
    rerank = sweep.pick_inputs(metadata("rerank", ("TEXT", "BYTES", [-1, 1]), ("TEXT_PAIR", "BYTES", [-1, 1])))
    samples = tmp_path / "pairs.json"
    samples.write_text(json.dumps({"data": [{"TEXT": [f"q{i}"], "TEXT_PAIR": [f"p{i}"]} for i in (1, 2, 3)]}))
    requests = sweep.tensor_requests(rerank, samples, rows=1)
    assert [r["TEXT_PAIR"].tolist() for r in requests] == [[[b"p1"]], [[b"p2"]], [[b"p3"]]]
    [both] = sweep.tensor_requests(rerank, samples, rows=2)
    assert both["TEXT"].tolist() == [[b"q1"], [b"q2"]]
    with pytest.raises(sweep.SweepError, match=r"pairs.json: data\[0\]: no tensor TEXT_PAIR"):
        samples.write_text(json.dumps({"data": [{"TEXT": ["q1"]}]}))
        sweep.tensor_requests(rerank, samples, rows=1)


def test_format_step_shows_latency_errors_and_server_queue_vs_compute():
    times = ServerTimes(inference_count=8, execution_count=2, num_requests=8, num_failed=0,
                        mean_batch_size=4.0, queue_ms=1.5, compute_ms=9.0)
    idle = ServerTimes(0, 0, 0, 0, 0.0, 0.0, 0.0)
    result = summarize_step(mode="open", load=20, duration_s=1, latencies_ms=[5.0, 7.0], errors=["UNAVAILABLE: x"],
                            slo_ms=10, server={"encoder_16": times, "encoder_256": idle})
    line = sweep.format_step(result)
    assert "20 rps" in line and "p95" in line and "errors 1" in line
    assert "encoder_16 1.5/9.0 (4.0)" in line and "encoder_256" not in line
    assert "UNAVAILABLE: x (x1)" in line
