"""The goodput benchmark: its setups (generated configs, quotas taken out), where each step's
CPU went, and the ceiling's rows, for the built-in `embed`, a text-pair classifier and tensor
models (one bucketed by a variable axis, one of fixed shape)."""

import dataclasses
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from python_backends.common.regimes import REGIMES_PARAMETER
from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.buckets import choose_bucket, pad_rows, truncate_tokens
from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS
from python_backends.embed.router import EmbedRouter
from python_backends.tensor.router import TensorRouter
from tests import user_models
from tools.bench.goodput import (
    DEFAULT_MAX_BATCH,
    bucket_configs,
    bucket_key,
    bucket_rows,
    cpu_breakdown,
    goodput_options,
    measure_ceiling,
    median_index,
    median_ratio,
    model_plan,
    padded_only_plan,
    payload_fields,
    round_ratios,
    routed_requests,
    router_of,
    served_version,
    short_request_indices,
    stack_rows,
    tensor_bucket_configs,
    tensor_bucket_rows,
    tensor_router_of,
)
from tools.bench.harness import without_tenant_quotas
from tools.bench.loadgen import summarize_step
from tools.bench.payloads import TensorPayload, TextPayload, find_model, model_payload, model_texts
from tools.cli.bench import goodput_results
from tools.paths import DEFAULT_SPEC
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec, parse_spec
from tools.spec.workload import load_workload

RERANK_BUCKETS = (32, 128)


def plans():
    spec = load_spec()
    profile = load_profile(spec.profile)
    model = find_model(spec, "embed")
    return spec, {"slo_bucketed": model_plan(spec, profile, model),
                  "default_batching": padded_only_plan(spec, profile, model, batching=True)}


def test_the_router_loses_its_tenant_quotas_and_keeps_everything_else():
    spec, setups = plans()
    router = spec.models[0].name
    for setup, plan in setups.items():
        original = {m.name: m for m in plan}
        stripped = {m.name: m for m in without_tenant_quotas(plan, router)}
        assert set(stripped) == set(original), setup
        assert "tenants" in original[router].config.parameters  # the spec has quotas
        assert "tenants" not in stripped[router].config.parameters
        assert "tenant_auth" in stripped[router].config.parameters
        kept = dict(original[router].config.parameters)
        del kept["tenants"]
        assert dict(stripped[router].config.parameters) == kept
        assert stripped[router].config.dynamic_batching == original[router].config.dynamic_batching
        assert "quotas are taken out" in stripped[router].config_text()
        for name, model in original.items():
            if name != router:
                assert stripped[name] is model, name


def test_the_generated_plan_itself_is_left_alone():
    spec, setups = plans()
    plan = setups["slo_bucketed"]
    without_tenant_quotas(plan, spec.models[0].name)
    assert "tenants" in {m.name: m for m in plan}[spec.models[0].name].config.parameters


def test_cpu_breakdown_charges_each_part_per_request_sent():
    step = summarize_step(mode="open", load=100, duration_s=10.0, latencies_ms=[50.0] * 900, errors=[],
                          slo_ms=200, client_cpu_s=0.5, rejections=["busy"] * 100)
    before = {"tritonserver": 10.0, "embed": 4.0}
    after = {"tritonserver": 11.0, "embed": 6.0, "encoder_16": 3.0}  # a stub that started during the step
    cpu = cpu_breakdown(before, after, step, cores=2)
    assert cpu["cpu_ms_per_request"] == {"embed": 2.0, "encoder_16": 3.0, "load_generator": 0.5, "tritonserver": 1.0}
    assert cpu["cpu_ms_per_request_total"] == pytest.approx(6.5)
    assert cpu["cpu_utilization"] == pytest.approx(6.5 / 20.0)


def test_cpu_breakdown_of_a_step_that_sent_nothing_is_zero():
    step = summarize_step(mode="open", load=1, duration_s=1.0, latencies_ms=[], errors=[], slo_ms=200)
    cpu = cpu_breakdown({}, {"tritonserver": 0.1}, step, cores=2)
    assert cpu["cpu_ms_per_request"] == {"load_generator": 0.0, "tritonserver": 0.0}
    assert cpu["cpu_utilization"] == pytest.approx(0.05)


def test_median_index_picks_the_middle_round_and_the_lower_middle_of_an_even_count():
    assert median_index([170.0, 150.0, 190.0]) == 0
    assert median_index([5.0]) == 0
    assert median_index([4.0, 1.0, 3.0, 2.0]) == 3  # sorted 1, 2, 3, 4: the lower middle is 2.0, at index 3
    with pytest.raises(ValueError, match="no values"):
        median_index([])


def test_ratios_pair_each_round_with_the_reference_of_the_same_round():
    # A machine that slows down between rounds: each round's ratio is steady, the ratio of
    # the medians is not what any round measured.
    ours, ceiling = [140.0, 120.0, 100.0], [200.0, 171.4, 142.9]
    assert round_ratios(ours, ceiling) == pytest.approx([0.70, 0.70, 0.70], abs=1e-3)
    assert median_ratio(ours, ceiling) == pytest.approx(0.70, abs=1e-3)
    assert round_ratios([10.0], [0.0]) == [0.0]  # a baseline that served nothing gives no ratio
    assert median_ratio([3.0, 9.0], [1.0, 1.0]) == pytest.approx(6.0)  # even count: the mean of the middle two
    with pytest.raises(ValueError, match="2 rounds of ours against 1"):
        round_ratios([1.0, 2.0], [1.0])


def test_the_short_form_is_one_round_of_short_steps_unless_rounds_are_asked_for():
    quick = goodput_options(quick=True, step_s=10.0, start_rps=8.0, max_steps=11, repeats=None, protocol="http")
    assert (quick.step_s, quick.max_steps, quick.num_texts, quick.ceiling_rows, quick.repeats) == (3.0, 4, 300, 200, 1)
    assert quick.start_rps == 8.0 and quick.protocol == "http"
    rounds = goodput_options(quick=True, step_s=10.0, start_rps=4.0, max_steps=11, repeats=2, protocol="grpc")
    assert rounds.repeats == 2
    full = goodput_options(quick=False, step_s=10.0, start_rps=4.0, max_steps=11, repeats=None, protocol="grpc")
    assert (full.step_s, full.max_steps, full.num_texts, full.ceiling_rows, full.repeats) == (10.0, 11, 2000, 1000, 3)
    assert full.protocol == "grpc"


def test_goodput_results_of_embed_stay_where_the_other_benchmarks_read_them():
    assert goodput_results("embed") == Path("results/goodput.json")
    assert goodput_results("rerank") == Path("results/goodput_rerank.json")


def test_the_ceiling_runs_the_version_that_takes_the_traffic():
    embed = find_model(load_spec(), "embed")
    assert served_version(embed) == 1  # traffic = { 1 = 100 }
    assert served_version(dataclasses.replace(embed, traffic={1: 10.0, 2: 90.0})) == 2
    assert served_version(dataclasses.replace(embed, traffic={1: 50.0, 2: 50.0})) == 1  # a tie: the first


def test_the_ceiling_feeds_embed_the_rows_it_always_did():
    # The router's code makes the ceiling's rows: for embed, the same tensors as tokenizing,
    # truncating to the largest bucket and padding each row to its bucket.
    spec = load_spec()
    profile = load_profile(spec.profile)
    embed = find_model(spec, "embed")
    plan = model_plan(spec, profile, embed)
    payload = model_texts(embed, load_workload(embed.workload), 60)
    tokenizer = TextTokenizer.from_file(user_models.minilm_tokenizer())
    rows = bucket_rows(payload, EmbedRouter(router_of(plan, embed), tokenizer))
    expected: dict[int, list[list[int]]] = {}
    for ids in tokenizer.encode(payload.texts):
        ids = truncate_tokens(ids, embed.bucket_lens[-1])
        expected.setdefault(choose_bucket(len(ids), embed.bucket_lens), []).append(ids)
    assert sorted(rows) == sorted(expected) and sum(map(len, rows.values())) == 60
    for length, bucket in rows.items():
        batch = stack_rows(bucket)
        assert set(batch) == {INPUT_IDS, ATTENTION_MASK}
        ids, mask = pad_rows(expected[length], length, tokenizer.pad_id)
        np.testing.assert_array_equal(batch[INPUT_IDS], ids)
        np.testing.assert_array_equal(batch[ATTENTION_MASK], mask)
    config = bucket_configs(plan, embed)[16]
    assert (config.inputs, config.output, config.onnx_output) == ((INPUT_IDS, ATTENTION_MASK), "EMBEDDING", "embedding")


# --------------------------------------------------------------------------- a text-pair classifier


@pytest.fixture(scope="module")
def rerank(tmp_path_factory):
    """The repo's spec with a second model, `rerank`: the suite's cross-encoder over text pairs,
    two buckets; its profile borrows embed's curves for them (the plan needs a curve per bucket)."""
    folder = tmp_path_factory.mktemp("rerank")
    onnx = user_models.cross_encoder_onnx(folder)
    data = tomllib.loads(DEFAULT_SPEC.read_text())
    data["models"]["rerank"] = {
        "kind": "text-classifier", "source": str(onnx), "tokenizer": str(user_models.minilm_tokenizer()),
        "inputs": {"token_types": "token_type_ids"}, "pairs": True, "labels": list(user_models.CROSS_ENCODER_LABELS),
        "slo_p95_ms": 200, "expected_rps": 10, "peak_rps": 20, "workload": "loadtest/workloads/embed_mix.toml",
        "buckets": list(RERANK_BUCKETS), "max_request_rows": 16, "max_router_instances": 2, "max_text_bytes": 65536}
    spec = parse_spec(data, DEFAULT_SPEC)
    profile = load_profile(spec.profile)
    profile = dataclasses.replace(
        profile, models={**profile.models, **{f"rerank_{n}": profile.models[f"encoder_{n}"] for n in RERANK_BUCKETS}},
        overhead={**profile.overhead, "rerank": profile.overhead["embed"]})
    return spec, profile, find_model(spec, "rerank"), onnx


@pytest.mark.parametrize("batching", [False, True])
def test_embeds_baselines_are_one_bucket_without_admission_or_light_load_regimes(batching):
    spec = load_spec()
    profile = load_profile(spec.profile)
    model = find_model(spec, "embed")
    generated = {m.name: m for m in model_plan(spec, profile, model)}
    assert REGIMES_PARAMETER in generated["embed"].config.parameters  # what there is to take out
    padded = {m.name: m for m in padded_only_plan(spec, profile, model, batching=batching)}
    assert set(padded) == {"embed", "encoder_256"}  # no express model either
    parameters = padded["embed"].config.parameters
    assert "admission" not in parameters and REGIMES_PARAMETER not in parameters
    router = router_of(list(padded.values()), model)  # what the served router reads: it loads
    assert router.bucket_lens == (256,) and router.model_for(256) == "encoder_256"


def test_a_second_models_setups_hold_its_own_router_and_buckets(rerank):
    spec, profile, model, _ = rerank
    plan = model_plan(spec, profile, model)
    assert [m.name for m in plan] == ["rerank", "rerank_32", "rerank_128"]
    padded = {m.name: m for m in padded_only_plan(spec, profile, model, batching=True)}
    assert set(padded) == {"rerank", "rerank_128"}
    assert padded["rerank"].config.parameters["bucket_lens"].string_value == "128"
    assert padded["rerank_128"].config.max_batch_size == 32 and "admission" not in padded["rerank"].config.parameters
    router = router_of(plan, model)
    assert router.pairs and router.token_types and router.encoder_prefix == "rerank_"
    config = bucket_configs(plan, model)[32]
    assert config.inputs == (INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS) and config.output == "LOGITS"
    stripped = {m.name: m for m in without_tenant_quotas(plan, "rerank")}
    assert "tenants" not in stripped["rerank"].config.parameters


def test_pairs_reach_the_ceiling_as_the_router_makes_them_with_token_types(rerank):
    spec, profile, model, _ = rerank
    workload = load_workload(model.workload)
    payload = model_texts(model, workload, 40)
    assert len(payload.pair_texts) == 40
    tokenizer = TextTokenizer.from_file(user_models.minilm_tokenizer())
    rows = bucket_rows(payload, EmbedRouter(router_of(model_plan(spec, profile, model), model), tokenizer))
    assert set(rows) <= set(RERANK_BUCKETS) and sum(map(len, rows.values())) == 40
    lengths = [min(n, RERANK_BUCKETS[-1]) for n in workload.sample_lengths(40)]
    # Each row, bucketed as its length in the mix says: the pair's tokens add up to the drawn length.
    assert sorted(len(rows.get(b, [])) for b in RERANK_BUCKETS) == sorted(
        sum(1 for n in lengths if choose_bucket(n, RERANK_BUCKETS) == b) for b in RERANK_BUCKETS)
    row = rows[RERANK_BUCKETS[0]][0]
    assert set(row) == {INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS}
    types, mask = row[TOKEN_TYPE_IDS][0], row[ATTENTION_MASK][0]
    assert types[0] == 0 and types.max() == 1 and not types[mask == 0].any()  # the passage is type 1, padding 0


def test_the_ceiling_of_a_pair_classifier_runs_its_installed_graph(rerank, tmp_path):
    spec, profile, model, onnx = rerank
    for name in ("rerank_32", "rerank_128"):
        (tmp_path / name / "1").mkdir(parents=True)
        shutil.copyfile(onnx, tmp_path / name / "1" / "model.onnx")
    (tmp_path / "rerank" / "1").mkdir(parents=True)
    shutil.copyfile(user_models.minilm_tokenizer(), tmp_path / "rerank" / "1" / "tokenizer.json")
    payload = model_texts(model, load_workload(model.workload), 24)
    ceiling = measure_ceiling(TextPayload(payload.texts, payload.pair_texts), profile, model,
                              model_plan(spec, profile, model), repository=tmp_path)
    assert ceiling["rows"] == 24 and ceiling["rows_per_s"] > 0
    assert set(ceiling["buckets"]) <= {"32", "128"}
    assert sum(bucket["rows"] for bucket in ceiling["buckets"].values()) == 24


# --------------------------------------------------------------------------- tensor models

AUDIO_BUCKETS = (16, 64)
FRAMES_MIX = """name = "frames"
rows_per_request = 2

[[lengths]]
min_tokens = 5
max_tokens = 80
weight = 1.0
"""


@pytest.fixture(scope="module")
def tensors(tmp_path_factory):
    """The repo's spec with the suite's audio model (bucketed by frames, 16 and 64) and image
    model (fixed shape); their profile borrows embed's curves (the plan needs a curve per bucket)."""
    folder = tmp_path_factory.mktemp("tensor-models")
    audio, image = user_models.audio_conv_onnx(folder), user_models.image_classifier_onnx(folder)
    (folder / "frames.toml").write_text(FRAMES_MIX)
    data = tomllib.loads(DEFAULT_SPEC.read_text())
    common = {"kind": "tensor", "tolerance": 0.001, "slo_p95_ms": 200, "expected_rps": 10, "peak_rps": 20,
              "max_request_rows": 16, "max_router_instances": 2}
    data["models"]["audio"] = {**common, "source": str(audio), "variable_axis": 0,
                               "pad": {"features": 0.0, "frame_mask": 0.0}, "buckets": list(AUDIO_BUCKETS),
                               "workload": str(folder / "frames.toml")}
    data["models"]["image"] = {**common, "source": str(image)}
    spec = parse_spec(data, DEFAULT_SPEC)
    profile = load_profile(spec.profile)
    borrowed = {"audio_16": "encoder_16", "audio_64": "encoder_64", "image_fixed": "encoder_32"}
    profile = dataclasses.replace(
        profile, models={**profile.models, **{name: profile.models[source] for name, source in borrowed.items()}},
        overhead={**profile.overhead, "audio": profile.overhead["embed"], "image": profile.overhead["embed"]})
    repository = folder / "repository"  # the installed graphs, as add-model lays them out
    for name, graph in (("audio_16", audio), ("audio_64", audio), ("image_fixed", image)):
        (repository / name / "1").mkdir(parents=True)
        shutil.copyfile(graph, repository / name / "1" / "model.onnx")
    return spec, profile, repository


@pytest.mark.parametrize("batching", [False, True])
def test_a_tensor_models_baselines_pad_to_its_largest_bucket(tensors, batching):
    spec, profile, _ = tensors
    model = find_model(spec, "audio")
    padded = {m.name: m for m in padded_only_plan(spec, profile, model, batching=batching)}
    assert set(padded) == {"audio", "audio_64"}
    assert (padded["audio"].adapter, padded["audio_64"].adapter) == ("tensor_router_model", "tensor_bucket_model")
    bucket = padded["audio_64"].config
    assert bucket.max_batch_size == (DEFAULT_MAX_BATCH if batching else 1)
    generated = [w.batch_size for w in {m.name: m for m in model_plan(spec, profile, model)}["audio_64"].config
                 .model_warmup]
    assert len(generated) == 2 and max(generated) > 1  # one row, and a full batch of the derived max
    # Triton loads no model with a warm-up batch above its max_batch_size: those are left out.
    assert [w.batch_size for w in bucket.model_warmup] == [b for b in generated if b <= bucket.max_batch_size]
    assert 1 in [w.batch_size for w in bucket.model_warmup]
    assert bucket.HasField("dynamic_batching") == batching
    if batching:  # Triton's defaults: nothing set
        assert bucket.dynamic_batching == type(bucket.dynamic_batching)()
    router = padded["audio"].config
    assert "admission" not in router.parameters and not router.dynamic_batching.HasField("default_queue_policy")
    parsed = tensor_router_of(list(padded.values()), model)  # what the served router reads
    assert parsed.bucket_lens == (64,) and parsed.bucket_max_batch == {64: bucket.max_batch_size}
    assert parsed.model_for(64) == "audio_64"


def test_a_fixed_shape_models_baselines_keep_its_one_bucket(tensors):
    spec, profile, _ = tensors
    model = find_model(spec, "image")
    padded = {m.name: m for m in padded_only_plan(spec, profile, model, batching=False)}
    assert set(padded) == {"image", "image_fixed"}
    assert "bucket_lens" not in padded["image"].config.parameters
    parsed = tensor_router_of(list(padded.values()), model)
    assert parsed.variable_axis is None and parsed.bucket_max_batch == {0: 1}


def test_a_tensor_models_rows_reach_the_ceiling_padded_to_their_bucket_as_the_router_pads_them(tensors):
    spec, profile, _ = tensors
    model = find_model(spec, "audio")
    plan = model_plan(spec, profile, model)
    payload = model_payload(model, load_workload(model.workload), 40)
    rows = tensor_bucket_rows(payload, TensorRouter(tensor_router_of(plan, model)))
    lengths = [n for n in payload.lengths for _ in range(2)]  # two rows a request
    assert {b: len(r) for b, r in rows.items()} == {
        b: sum(1 for n in lengths if choose_bucket(n, AUDIO_BUCKETS) == b) for b in AUDIO_BUCKETS}
    real = {b: [n for n in lengths if choose_bucket(n, AUDIO_BUCKETS) == b] for b in AUDIO_BUCKETS}
    for bucket_len, bucket in rows.items():
        batch = stack_rows(bucket)
        assert batch["features"].shape == (len(bucket), bucket_len, user_models.AUDIO_NUM_FEATURES)
        assert batch["frame_mask"].sum(axis=1).tolist() == real[bucket_len]  # ones for real frames, zeros padding
        assert not batch["features"][batch["frame_mask"] == 0].any()
    configs = tensor_bucket_configs(plan, model)
    assert configs[16].input_names == ("features", "frame_mask") and configs[16].output_names == ("logits",)
    assert configs[16].inputs[0].dims == (16, user_models.AUDIO_NUM_FEATURES)


def test_a_tensor_models_requests_reach_the_router_whole_and_their_bucket_as_the_router_pads_them(tensors):
    spec, profile, _ = tensors
    model = find_model(spec, "audio")
    payload = model_payload(model, load_workload(model.workload), 30)
    routed = routed_requests(payload, model_plan(spec, profile, model), model)
    assert len(routed) == len(payload.requests)
    for request, sent, length in zip(routed, payload.requests, payload.lengths, strict=True):
        assert request.inputs.keys() == sent.keys() and request.inputs["features"] is sent["features"]
        bucket = choose_bucket(length, AUDIO_BUCKETS)
        assert request.bucket_lens == (bucket,) and request.calls[0].model_name == f"audio_{bucket}"
        assert request.calls[0].tensors["features"].shape == (2, bucket, user_models.AUDIO_NUM_FEATURES)
    short = short_request_indices([r.bucket_lens for r in routed])
    assert short == [i for i, n in enumerate(payload.lengths) if n <= AUDIO_BUCKETS[0]]
    image = find_model(spec, "image")  # a fixed-shape model: every request is a short one
    fixed = routed_requests(model_payload(image, None, 4), model_plan(spec, profile, image), image)
    assert {r.bucket_lens for r in fixed} == {(0,)} and short_request_indices([r.bucket_lens for r in fixed]) == [
        0, 1, 2, 3]


@pytest.mark.parametrize(("name", "buckets"), [("audio", {"16", "64"}), ("image", {"fixed"})])
def test_the_ceiling_of_a_tensor_model_runs_its_installed_graph(tensors, name, buckets):
    spec, profile, repository = tensors
    model = find_model(spec, name)
    workload = load_workload(model.workload) if model.workload else None
    payload = model_payload(model, workload, 24).first_rows(30)
    ceiling = measure_ceiling(payload, profile, model, model_plan(spec, profile, model), repository=repository)
    assert ceiling["rows"] == payload.num_rows >= 30 and ceiling["rows_per_s"] > 0
    assert set(ceiling["buckets"]) <= buckets and sum(b["rows"] for b in ceiling["buckets"].values()) == ceiling["rows"]


def test_the_load_sends_texts_or_each_requests_tensors():
    texts = TextPayload(("a", "b"), ("c", "d"))
    assert payload_fields(texts) == {"texts": ("a", "b"), "pair_texts": ("c", "d")}
    request = {"x": np.zeros((1, 2), np.float32)}
    assert payload_fields(TensorPayload((request,))) == {"texts": (), "tensors": (request,)}
    assert (bucket_key(16), bucket_key(0)) == ("16", "fixed")
