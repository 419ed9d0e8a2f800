"""The goodput benchmark's light-load and router-cost figures (the short requests, the
linger-free server's configs, the overhead and CPU arithmetic, the medians of rounds) and its
length mixes (which configs a mix gets, where its report goes, the command's refusals)."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.regimes import REGIMES_PARAMETER, express_model_name
from python_backends.embed.inline import INLINE_PARAMETER
from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS
from tests import user_models
from tools.bench.goodput import (
    FORWARD_ADAPTER,
    FORWARD_MODEL,
    LIGHT_LOAD_REQUESTS,
    OVERHEAD_REQUESTS,
    ROUTER_OVERHEAD_TARGET_MS,
    BucketCall,
    RoutedRequest,
    bucket_rows,
    direct_request_bytes,
    floor_overhead,
    for_mix,
    forward_request_bytes,
    goodput_options,
    interleaved_overhead,
    light_load_report,
    mix_results_path,
    model_plan,
    payload_subset,
    phase_cpu_ms,
    resolve_mix,
    routed_requests,
    router_cost_report,
    router_cpu_ms,
    router_request_bytes,
    server_split_ms,
    short_request_indices,
    stage_means_ms,
    stage_totals,
    text_router,
    unbatched_plan,
)
from tools.bench.payloads import TensorPayload, TextPayload, find_model, model_texts
from tools.cli import main
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec
from tools.spec.workload import DEFAULT_WORKLOAD, WORKLOAD_DIR, load_workload


@pytest.fixture(scope="module")
def embed():
    spec = load_spec()
    profile = load_profile(spec.profile)
    return spec, profile, find_model(spec, "embed")


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """The router's installed tokenizer, as build-models lays it out."""
    folder = tmp_path_factory.mktemp("repository")
    (folder / "embed" / "1").mkdir(parents=True)
    shutil.copyfile(user_models.minilm_tokenizer(), folder / "embed" / "1" / "tokenizer.json")
    return folder


# --------------------------------------------------------------------------- the short requests


def test_short_requests_are_those_whose_every_chunk_goes_to_the_smallest_bucket():
    assert short_request_indices([(16,), (32,), (16,), (256,), (16, 32)]) == [0, 2]


def test_short_requests_come_from_the_smallest_bucket_the_mix_uses():
    # A mix that sends nothing to the model's smallest bucket: its shortest requests are the next ones.
    assert short_request_indices([(64,), (32,), (256,), (32,)]) == [1, 3]
    assert short_request_indices([(0,), (0,)]) == [0, 1]  # a fixed-shape model: every request
    assert short_request_indices([]) == []


def test_a_subset_keeps_the_texts_their_pairs_or_the_requests_in_order():
    assert payload_subset(TextPayload(("a", "b", "c")), [2, 0]) == TextPayload(("c", "a"))
    assert payload_subset(TextPayload(("a", "b"), ("x", "y")), [1]) == TextPayload(("b",), ("y",))
    requests = tuple({"x": np.full((1, 2), i, np.float32)} for i in range(3))
    subset = payload_subset(TensorPayload(requests), [1])
    assert isinstance(subset, TensorPayload) and subset.requests == (requests[1],)


def test_each_text_goes_to_the_router_as_one_row_beside_the_tensors_the_router_sends_on(embed, repository):
    spec, profile, model = embed
    plan = model_plan(spec, profile, model)
    payload = model_texts(model, load_workload(model.workload), 40)
    routed = routed_requests(payload, plan, model, repository)
    assert len(routed) == 40
    for request, text in zip(routed, payload.texts, strict=True):
        assert set(request.inputs) == {"TEXT"} and request.inputs["TEXT"].tolist() == [[text.encode()]]
        assert len(request.calls) == 1
        call = request.calls[0]
        assert call.model_name == model.encoder_name(call.bucket_len)
        assert call.tensors[INPUT_IDS].shape == (1, call.bucket_len) and set(call.tensors) == {INPUT_IDS,
                                                                                             ATTENTION_MASK}
    # The same tensors as the ceiling's rows, bucket by bucket.
    rows = bucket_rows(payload, text_router(plan, model, repository))
    for length, bucket in rows.items():
        mine = [r.calls[0].tensors for r in routed if r.calls[0].bucket_len == length]
        assert len(mine) == len(bucket)
        for ours, theirs in zip(mine, bucket, strict=True):
            np.testing.assert_array_equal(ours[INPUT_IDS], theirs[INPUT_IDS])
    short = short_request_indices([r.bucket_lens for r in routed])
    assert short and all(routed[i].bucket_lens == (16,) for i in short)
    assert len(short) == sum(1 for r in routed if r.bucket_lens == (16,))  # half the mix is 16 tokens or fewer


def test_the_router_request_and_the_direct_one_name_their_models_and_the_routed_version():
    call = BucketCall("encoder_16", 16, {INPUT_IDS: np.ones((1, 16), np.int64),
                                         ATTENTION_MASK: np.ones((1, 16), np.int64)})
    request = RoutedRequest({"TEXT": np.array([[b"hello"]], dtype=object)}, (call,))
    router = router_request_bytes("127.0.0.1", "embed", request)
    assert router.startswith(b"POST /v2/models/embed/infer HTTP/1.1\r\n") and router.endswith(b"hello")
    direct = direct_request_bytes("127.0.0.1", 1, call)
    assert direct.startswith(b"POST /v2/models/encoder_16/versions/1/infer HTTP/1.1\r\n")
    assert b'"name":"INPUT_IDS","shape":[1,16],"datatype":"INT64"' in direct
    assert len(direct.split(b"\r\n\r\n", 1)[1]) > 2 * 16 * 8  # both tensors, 8 bytes an element


# --------------------------------------------------------------------------- the linger-free server


def test_the_unbatched_server_has_the_generated_configs_without_linger(embed):
    spec, profile, model = embed
    plan = model_plan(spec, profile, model)
    before = [m.config.SerializeToString() for m in plan]
    unbatched = {m.name: m for m in unbatched_plan(plan, model)}
    generated = {m.name: m for m in plan}
    assert [m.config.SerializeToString() for m in plan] == before  # the generated plan is left alone
    # The router as generated, less its light-load regimes; no express model to send rows to.
    assert REGIMES_PARAMETER in generated["embed"].config.parameters
    router = mc.ModelConfig()
    router.CopyFrom(generated["embed"].config)
    del router.parameters[REGIMES_PARAMETER]
    limits = json.loads(router.parameters[INLINE_PARAMETER].string_value)
    del limits[express_model_name(model.encoder_prefix)]  # nor an inline limit for it
    router.parameters[INLINE_PARAMETER].string_value = json.dumps(limits)
    assert unbatched["embed"].config == router
    assert express_model_name(model.encoder_prefix) in generated
    assert express_model_name(model.encoder_prefix) not in unbatched
    assert any(generated[model.encoder_name(b)].config.dynamic_batching.max_queue_delay_microseconds
               for b in model.bucket_lens)  # what there is to take out
    for length in model.bucket_lens:
        ours, theirs = unbatched[model.encoder_name(length)].config, generated[model.encoder_name(length)].config
        assert ours.dynamic_batching.max_queue_delay_microseconds == 0
        assert list(ours.dynamic_batching.preferred_batch_size) == []
        # Everything else as generated: batch size, instances, warm-up, queue policy.
        ours.dynamic_batching.max_queue_delay_microseconds = theirs.dynamic_batching.max_queue_delay_microseconds
        ours.dynamic_batching.preferred_batch_size.extend(theirs.dynamic_batching.preferred_batch_size)
        assert ours == theirs
        assert "without linger" in unbatched[model.encoder_name(length)].header[-1]


def test_the_floor_is_a_python_model_with_the_buckets_tensors_that_forwards_to_it(embed):
    spec, profile, model = embed
    plan = model_plan(spec, profile, model)
    bucket = {m.name: m for m in plan}[model.encoder_name(16)]
    assert FORWARD_MODEL not in {m.name for m in unbatched_plan(plan, model)}  # only when asked for
    with_floor = unbatched_plan(plan, model, bucket.name)
    forward = with_floor[0]
    assert forward.name == FORWARD_MODEL and forward.adapter == FORWARD_ADAPTER and forward.versions == (1,)
    config = forward.config
    assert config.backend == "python" and config.max_batch_size == bucket.config.max_batch_size
    assert list(config.input) == list(bucket.config.input) and list(config.output) == list(bucket.config.output)
    assert config.parameters["forward_to"].string_value == bucket.name
    assert config.parameters["forward_version"].string_value == "1"  # the version the router calls
    router = {m.name: m for m in plan}["embed"].config
    assert [g.count for g in config.instance_group] == [sum(g.count for g in router.instance_group)]
    assert not config.HasField("dynamic_batching")  # a request goes to an instance as it comes
    assert [m.name for m in with_floor[1:]] == [m.name for m in unbatched_plan(plan, model)]  # the rest as before


def test_the_forwarding_request_sends_the_buckets_tensors_to_the_forwarding_model():
    call = BucketCall("encoder_16", 16, {INPUT_IDS: np.ones((1, 16), np.int64),
                                         ATTENTION_MASK: np.ones((1, 16), np.int64)})
    forward, direct = forward_request_bytes("h", call), direct_request_bytes("h", 1, call)
    assert f"POST /v2/models/{FORWARD_MODEL}/versions/1/infer ".encode() in forward
    assert forward.split(b"\r\n\r\n", 1)[1] == direct.split(b"\r\n\r\n", 1)[1]  # the same body


# --------------------------------------------------------------------------- the arithmetic


def test_the_floor_and_the_routers_own_work_come_from_triples():
    # router, forward, direct; the third triple lost its forwarding answer and is left out
    latencies = [12.0, 11.0, 10.0, 24.0, 21.5, 21.0, 20.0, None, 10.0, 13.0, 11.5, 10.0]
    floor = floor_overhead(latencies)
    # triple by triple: forward - direct 1, 0.5, 1.5; router - direct 2, 3, 3; router - forward 1, 2.5, 1.5
    assert floor["num_triples"] == 3
    assert (floor["p50"], floor["router_p50"], floor["own_p50"]) == (1.0, 3.0, 1.5)
    assert floor["p95"] == pytest.approx(np.percentile([1.0, 0.5, 1.5], 95), abs=1e-3)
    assert floor["router_p95"] == pytest.approx(np.percentile([2.0, 3.0, 3.0], 95), abs=1e-3)
    assert floor_overhead([None, 1.0, 1.0])["p50"] is None
    with pytest.raises(ValueError, match="in triples, got 4"):
        floor_overhead([1.0, 2.0, 3.0, 4.0])



def test_the_server_side_split_comes_from_tritons_statistics():
    def stats(queue_ns, infer_ns, count):
        figures = {"queue": {"count": count, "ns": queue_ns}, "compute_input": {"count": count, "ns": count * 30_000},
                   "compute_infer": {"count": count, "ns": infer_ns}, "compute_output": {"count": count, "ns": 0}}
        return {"model_stats": [{"version": "1", "inference_stats": figures}]}

    before = {"embed": stage_totals(stats(0, 0, 0)), "encoder_16": stage_totals(stats(0, 0, 0))}
    # 100 router requests of 9.5 ms compute; the bucket served 200 (router's and others') of 8 ms
    after = {"embed": stage_totals(stats(10_000_000, 950_000_000, 100)),
             "encoder_16": stage_totals(stats(20_000_000, 1_600_000_000, 200))}
    means = {name: stage_means_ms(before[name], after[name]) for name in before}
    assert means["encoder_16"] == {"queue": 0.1, "compute_input": 0.03, "compute_infer": 8.0, "compute_output": 0.0}
    # in the stub: 9.5 ms less the bucket's whole 8.13 ms
    assert server_split_ms(means, "embed", "encoder_16") == {"queue": 0.1, "input": 0.03, "in_stub": 1.37,
                                                             "output": 0.0}
    assert stage_means_ms(before["embed"], before["embed"])["queue"] == 0.0  # no request, no mean
    # A router that answered from its workers: execute returned before the bucket did; no split.
    means["embed"]["compute_infer"] = 2.0
    assert server_split_ms(means, "embed", "encoder_16")["in_stub"] is None


def test_the_overhead_is_a_percentile_of_the_differences_pair_by_pair():
    latencies = [12.0, 10.0, 14.0, 11.0, 30.0, 12.0, 13.0, 10.5]  # router, direct, router, direct, ...
    overhead = interleaved_overhead(latencies)
    differences = [2.0, 3.0, 18.0, 2.5]
    assert overhead["p50"] == pytest.approx(float(np.percentile(differences, 50)), abs=1e-3)
    assert overhead["p95"] == pytest.approx(float(np.percentile(differences, 95)), abs=1e-3)
    assert overhead["router_ms"]["p50_ms"] == 13.5 and overhead["direct_ms"]["p50_ms"] == 10.75
    assert overhead["num_pairs"] == 4


def test_a_mix_of_bucket_latencies_does_not_inflate_the_overhead():
    # Half the pairs are a short bucket's (about 10 ms), half a longer one's (20 ms), 1 ms of
    # overhead but one 3.5 ms. Each side's p50 falls between the two buckets, at the short
    # bucket's slowest request: the difference of the p50s would be that outlier's.
    router = [11.0, 11.0, 11.0, 14.0, 21.0, 21.0, 21.0, 21.0]
    direct = [10.0, 10.0, 10.0, 10.5, 20.0, 20.0, 20.0, 20.0]
    assert np.percentile(router, 50) - np.percentile(direct, 50) == pytest.approx(2.25)
    overhead = interleaved_overhead([x for pair in zip(router, direct, strict=True) for x in pair])
    assert overhead["p50"] == pytest.approx(1.0)


def test_a_pair_with_a_failed_request_is_left_out_of_the_overhead():
    overhead = interleaved_overhead([12.0, 10.0, None, 11.0, 20.0, None, 14.0, 11.0])
    assert overhead["num_pairs"] == 2 and overhead["p50"] == pytest.approx(2.5)
    nothing = interleaved_overhead([None, 1.0])
    assert nothing["p50"] is None and nothing["p95"] is None and nothing["num_pairs"] == 0


def test_the_overhead_needs_its_requests_in_pairs():
    with pytest.raises(ValueError, match="in pairs, got 3 latencies"):
        interleaved_overhead([1.0, 2.0, 3.0])


def test_a_phases_cpu_is_ms_per_request_by_part():
    before = {"tritonserver": 10.0, "embed": 2.0}
    after = {"tritonserver": 10.5, "embed": 2.25, "encoder_16": 0.1}  # a part new in the phase counts from zero
    assert phase_cpu_ms(before, after, 100) == {"embed": 2.5, "encoder_16": 1.0, "tritonserver": 5.0}
    with pytest.raises(ValueError, match="num_requests must be >= 1"):
        phase_cpu_ms(before, after, 0)


def test_the_router_paths_cpu_leaves_the_bucket_models_out():
    router_phase = {"tritonserver": 1.0, "embed": 0.9, "encoder_16": 2.8, "encoder_256": 1.7}
    direct_phase = {"tritonserver": 0.7, "embed": 0.0, "encoder_16": 3.0, "encoder_256": 1.7}
    assert router_cpu_ms(router_phase, direct_phase, {"encoder_16", "encoder_256"}) == pytest.approx(1.2)
    assert router_cpu_ms(router_phase, direct_phase, ()) == pytest.approx(1.0)


def test_light_load_is_the_median_of_rounds_and_the_median_of_paired_ratios():
    light = [{"p50_ms": 60.0, "p95_ms": 90.0, "num_requests": 100, "num_errors": 0},
             {"p50_ms": 20.0, "p95_ms": 40.0, "num_requests": 100, "num_errors": 1},
             {"p50_ms": 30.0, "p95_ms": 45.0, "num_requests": 100, "num_errors": 0}]
    alone = [{"p50_ms": 10.0, "p95_ms": 12.0, "num_requests": 100, "num_errors": 0},
             {"p50_ms": 5.0, "p95_ms": 6.0, "num_requests": 100, "num_errors": 0},
             {"p50_ms": 20.0, "p95_ms": 22.0, "num_requests": 100, "num_errors": 0}]
    report = light_load_report(4.0, "16", light, alone)
    assert (report["rate_rps"], report["p50_ms"], report["p95_ms"]) == (4.0, 30.0, 45.0)
    assert (report["unbatched_p50_ms"], report["unbatched_p95_ms"]) == (10.0, 12.0)
    assert report["by_round"]["ratio"] == [6.0, 4.0, 1.5] and report["ratio"] == 4.0  # paired, not 30 / 10
    assert report["num_errors"] == 1 and report["num_requests"] == [100, 100, 100] and report["rounds"] == 3
    assert report["short_bucket"] == "16" and report["target_ratio"] == 2.0
    with pytest.raises(ValueError, match="3 rounds of light load against 2 unbatched"):
        light_load_report(4.0, "16", light, alone[:2])


def test_a_round_without_answers_has_no_ratio():
    light = [{"p50_ms": None, "p95_ms": None, "num_requests": 10, "num_errors": 10}]
    alone = [{"p50_ms": 5.0, "p95_ms": 6.0, "num_requests": 10, "num_errors": 0}]
    report = light_load_report(4.0, "16", light, alone)
    assert report["p50_ms"] is None and report["ratio"] is None and report["num_errors"] == 10


def test_the_router_cost_is_the_median_of_rounds():
    def run(p50, p95, cpu):
        return {"overhead": {"p50": p50, "p95": p95, "router_ms": {"p50_ms": 10 + p50, "p95_ms": 20 + p95},
                             "direct_ms": {"p50_ms": 10.0, "p95_ms": 20.0}, "num_pairs": 200},
                "router_cpu_ms_per_request": cpu, "cpu_router_phase": {"embed": cpu},
                "cpu_direct_phase": {"embed": 0.0}, "num_errors": 0}

    report = router_cost_report([run(2.0, 5.0, 1.5), run(1.0, 3.0, 0.5), run(3.0, 4.0, 1.0)])
    assert report["router_overhead_ms"] == {"p50": 2.0, "p95": 4.0}
    assert report["router_cpu_ms_per_request"] == 1.0
    detail = report["router_overhead"]
    assert detail["cpu_ms_per_request_router_phase"] == {"embed": 1.0}  # the median round's
    assert detail["router_ms"] == {"p50_ms": 12.0, "p95_ms": 24.0} and detail["num_pairs"] == [200, 200, 200]
    assert detail["target_p50_ms"] == ROUTER_OVERHEAD_TARGET_MS
    assert detail["by_round"] == [{"p50": 2.0, "p95": 5.0}, {"p50": 1.0, "p95": 3.0}, {"p50": 3.0, "p95": 4.0}]
    assert detail["python_floor_ms"] is None  # no forwarding model on that server


def test_the_python_floor_is_the_median_of_the_rounds_that_measured_it():
    def run(floor):
        return {"overhead": {"p50": 2.0, "p95": 3.0, "router_ms": {"p50_ms": 12.0, "p95_ms": 13.0},
                             "direct_ms": {"p50_ms": 10.0, "p95_ms": 10.0}, "num_pairs": 200},
                "router_cpu_ms_per_request": 1.0, "cpu_router_phase": {}, "cpu_direct_phase": {}, "num_errors": 0,
                "floor": floor}

    def floor(p50, router_p50):
        return {"p50": p50, "p95": p50 + 1, "router_p50": router_p50, "router_p95": router_p50 + 1,
                "own_p50": round(router_p50 - p50, 3), "num_triples": 200, "bucket": "encoder_16"}

    report = router_cost_report([run(floor(1.0, 2.0)), run(floor(0.8, 1.9)), run(None), run(floor(1.2, 2.4))])
    python_floor = report["router_overhead"]["python_floor_ms"]
    assert (python_floor["p50"], python_floor["router_p50"], python_floor["own_p50"]) == (1.0, 2.0, 1.1)
    assert python_floor["bucket"] == "encoder_16" and python_floor["num_triples"] == [200, 200, 200]
    assert [r["own_p50"] for r in python_floor["by_round"]] == [1.0, 1.1, 1.2]
    assert "server_ms" not in python_floor  # rounds recorded before the server-side split had none

    def split(in_stub):
        return {"queue": 0.05, "input": 0.03, "in_stub": in_stub, "output": 0.06}

    rounds = [run({**floor(1.0, 2.0), "server_ms": {"router": split(stub), "forward": split(stub / 2)}})
              for stub in (1.2, 1.4, 1.3)]
    server = router_cost_report(rounds)["router_overhead"]["python_floor_ms"]["server_ms"]
    assert server["router"]["in_stub"] == 1.3 and server["forward"]["in_stub"] == 0.65


def test_the_short_form_sends_fewer_light_load_and_router_requests():
    quick = goodput_options(quick=True, step_s=10.0, start_rps=8.0, max_steps=11, repeats=None, protocol="http")
    full = goodput_options(quick=False, step_s=10.0, start_rps=8.0, max_steps=11, repeats=None, protocol="http")
    assert (full.light_load_requests, full.overhead_requests) == (LIGHT_LOAD_REQUESTS, OVERHEAD_REQUESTS)
    assert full.light_load_requests >= 100 and full.overhead_requests >= 200
    assert 0 < quick.light_load_requests < full.light_load_requests
    assert 0 < quick.overhead_requests < full.overhead_requests
    assert (quick.light_load_rounds, full.light_load_rounds) == (1, None)  # one more server start, not one a round


# --------------------------------------------------------------------------- mixes


def test_a_mix_is_a_file_or_the_name_of_one_in_the_workloads_folder():
    assert resolve_mix("embed_long_tail") == WORKLOAD_DIR / "embed_long_tail.toml"
    assert resolve_mix("mine.toml") == Path("mine.toml")
    assert resolve_mix("some/where/mix") == Path("some/where/mix")
    with pytest.raises(ValueError, match="empty mix name"):
        resolve_mix(" ")


def test_the_default_mix_keeps_the_result_file_and_another_goes_beside_it():
    out = Path("results/goodput.json")
    assert mix_results_path(out, DEFAULT_WORKLOAD, DEFAULT_WORKLOAD) == out
    assert mix_results_path(out, Path("loadtest/workloads/../workloads/embed_mix.toml"), DEFAULT_WORKLOAD) == out
    assert mix_results_path(out, None, None) == out  # a fixed-shape model without a workload
    assert mix_results_path(out, WORKLOAD_DIR / "embed_long_tail.toml", DEFAULT_WORKLOAD) == Path(
        "results/goodput.embed_long_tail.json")
    assert mix_results_path(Path("results/goodput_search.json"), WORKLOAD_DIR / "embed_bimodal.toml",
                            DEFAULT_WORKLOAD) == Path("results/goodput_search.embed_bimodal.json")
    assert mix_results_path(out, WORKLOAD_DIR / "embed_bimodal.toml", None) == Path(
        "results/goodput.embed_bimodal.json")


@pytest.mark.parametrize(("mix", "shares"), [
    ("embed_mix", {16: 0.50, 32: 0.25, 64: 0.13, 128: 0.08, 256: 0.04}),
    ("embed_long_tail", {16: 0.40, 32: 0.20, 64: 0.14, 128: 0.12, 256: 0.14}),
    ("embed_bimodal", {16: 0.70, 32: 0.0, 64: 0.0, 128: 0.0, 256: 0.30}),
])
def test_the_configs_of_a_mix_are_derived_for_its_bucket_shares(embed, mix, shares):
    spec, profile, model = embed
    model = dataclasses.replace(model, bucket_count=0)  # the spec's edges listed: a mix moves only the shares
    workload = load_workload(resolve_mix(mix))
    assert workload.name == mix
    assert workload.bucket_shares(model.bucket_lens) == pytest.approx(shares)
    mixed = for_mix(model, resolve_mix(mix))
    assert mixed.workload == (WORKLOAD_DIR / f"{mix}.toml").resolve()
    assert dataclasses.replace(mixed, workload=model.workload) == model  # nothing else changes
    plan = {m.name: m for m in model_plan(spec, profile, mixed)}
    for length, share in shares.items():
        header = " ".join(plan[model.encoder_name(length)].header)
        assert f"{mix}.toml: {share:.1%}" in header
    assert for_mix(model, None) is model  # a model without a workload keeps none


def run_goodput(*args: str) -> int:
    return main(["bench", "goodput", *args])


def test_workload_and_mixes_together_are_refused(capsys):
    assert run_goodput("--workload", str(DEFAULT_WORKLOAD), "--mixes", "embed_bimodal") == 2
    assert "--workload and --mixes: give the mix with one of them" in capsys.readouterr().err


def test_an_unknown_mix_is_refused_before_any_server_starts(capsys):
    assert run_goodput("--mixes", "embed_mix,embed_longtail") == 2
    err = capsys.readouterr().err
    assert "embed_longtail.toml" in err and len(err.strip().splitlines()) == 1


def test_an_empty_mix_list_is_refused(capsys):
    assert run_goodput("--mixes", ",") == 2
    assert "--mixes needs at least one workload file or name" in capsys.readouterr().err


def test_one_mix_named_twice_is_refused(capsys):
    assert run_goodput("--mixes", f"embed_bimodal,{WORKLOAD_DIR / 'embed_bimodal.toml'}") == 2
    assert "names one mix twice" in capsys.readouterr().err
