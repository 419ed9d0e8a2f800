"""The serving spec's schema: every rule's error names the file, the table and the key."""

import copy

import pytest
from pydantic import BaseModel

from tests.unit.test_gen_config import BASE, LLM, REPO
from tools.spec import serving
from tools.spec.serving import SpecError, parse_spec

SPEC = REPO / "serving.toml"


def with_changes(**changes) -> dict:
    """BASE with `changes` at dotted paths (`models__embed__slo_p95_ms`); None deletes a key."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        target = data
        for key in path:
            target = target.setdefault(key, {})
        if value is None:
            del target[last]
        else:
            target[last] = value
    return data


def error(data: dict) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(data, SPEC)
    return str(info.value)


@pytest.mark.parametrize(("changes", "message"), [
    ({"models__embed__max_request_rows": 1.5}, "[models.embed]: 'max_request_rows' must be a whole number, got 1.5"),
    ({"models__embed__slo_p95_ms": float("inf")}, "[models.embed]: 'slo_p95_ms' must be a finite number, got inf"),
    ({"models__embed__peak_rps": float("nan")}, "[models.embed]: 'peak_rps' must be a finite number, got nan"),
    ({"models__embed__encoder_prefix": 3}, "[models.embed]: 'encoder_prefix' must be a string, got 3"),
    ({"models__embed__workload": 5}, "[models.embed]: 'workload' must be a path, got 5"),
    ({"models__embed__workload": None}, "[models.embed]: missing 'workload'"),
    ({"models__embed__buckets": None}, "[models.embed]: missing 'buckets'"),
    ({"models__embed__buckets": [16, "long"]}, "[models.embed]: 'buckets[1]' must be a number, got 'long'"),
    ({"models__embed__buckets": [1, 16]},
     "[models.embed]: buckets: bucket lengths must be integers >= 2 (room for [CLS] and [SEP]), got 1"),
    ({"models__embed__buckets": []}, "[models.embed]: buckets: at least one bucket length is required"),
    ({"models__embed__buckets": "16"}, """[models.embed]: buckets must be a list of lengths or "derived", got '16'"""),
    ({"models__embed__bucket_count": 3},
     """[models.embed]: bucket_count applies to buckets = "derived" only; the buckets listed are the model's"""),
    ({"models__embed__buckets": "derived", "models__embed__bucket_count": 0},
     "[models.embed]: 'bucket_count' must be > 0, got 0"),
    ({"models__embed__buckets": "derived", "models__embed__workload": None}, "[models.embed]: missing 'workload'"),
    ({"models__embed__versions": ["one"]}, "[models.embed]: versions must be a non-empty list of integers >= 1"),
    ({"models__embed__expected_rps": "many"}, "[models.embed]: 'expected_rps' must be a number, got 'many'"),
    ({"models__embed": "router"}, "[models.embed]: must be a table, got 'router'"),
    ({"models": ["embed"]}, "[models]: must be a table, got ['embed']"),
    ({"hardware__cpu__max_instances": 0}, "[hardware.cpu]: 'max_instances' must be > 0, got 0"),
    ({"hardware__cpu__intra_op_threads": -1}, "[hardware.cpu]: 'intra_op_threads' must be >= 0, got -1"),
    ({"hardware__cpu__intra_op_threads": None}, "[hardware.cpu]: missing 'intra_op_threads'"),
    ({"hardware__cpu__ort_spinning": "no"}, "[hardware.cpu]: 'ort_spinning' must be true or false, got 'no'"),
    ({"hardware__cpu__compute_nice": 20}, "[hardware.cpu]: 'compute_nice' must be <= 19, got 20"),
    ({"hardware__cpu__instance_kind": "KIND_TPU"},
     "[hardware.cpu]: instance_kind must be KIND_CPU or KIND_GPU, got 'KIND_TPU'"),
    ({"tenants": "everyone"}, "[tenants]: must be a table, got 'everyone'"),
    ({"tenants__tiers": {}}, "[tenants]: needs at least one [tenants.tiers.<name>] table"),
    ({"tenants__tiers": {"a": {"priority": 1, "llm_tokens_per_s": 5}}},
     "[tenants.tiers.a]: tier 'a': llm_token_burst must be >= 1 when llm_tokens_per_s is set"),
    ({"tenants__tiers": {"a": {"priority": 1.5}}}, "[tenants.tiers.a]: 'priority' must be a whole number, got 1.5"),
    ({"tenants__tiers": {"a": {"priority": 1, "burst": float("inf")}}},
     "[tenants.tiers.a]: 'burst' must be a finite number, got inf"),
    ({"tenants__tiers": {"gold": {"priority": 1}}, "tenants__default_tier": "silver"},
     "[tenants]: default_tier 'silver' is not one of ['gold']"),
])
def test_each_rule_names_the_file_the_table_and_the_key(changes, message):
    assert error(with_changes(**changes)) == f"{SPEC} {message}"


@pytest.mark.parametrize(("changes", "message"), [
    ({"versions": [1, 1]}, "[llm_models.llm]: versions [1, 1] repeat a version"),
    ({"versions": [0]}, "[llm_models.llm]: versions must be a non-empty list of integers >= 1"),
    ({"threads": -1}, "[llm_models.llm]: 'threads' must be >= 0, got -1"),
    ({"block_size": 0}, "[llm_models.llm]: 'block_size' must be > 0, got 0"),
    ({"ttft_p95_ms": "soon"}, "[llm_models.llm]: 'ttft_p95_ms' must be a number, got 'soon'"),
    ({"stream_hold_ms": -1}, "[llm_models.llm]: 'stream_hold_ms' must be >= 0, got -1"),
    ({"stream_hold_ms": float("inf")}, "[llm_models.llm]: 'stream_hold_ms' must be a finite number, got inf"),
])
def test_llm_rules_name_the_table(changes, message):
    assert error({**BASE, "llm_models": {"llm": {**LLM, **changes}}}) == f"{SPEC} {message}"


def test_every_problem_in_a_file_is_reported_at_once_one_per_line():
    lines = error(with_changes(models__embed__slo_p95_ms=0, hardware__cpu__max_instances=0)).splitlines()
    assert lines == [f"{SPEC} [hardware.cpu]: 'max_instances' must be > 0, got 0",
                     f"{SPEC} [models.embed]: 'slo_p95_ms' must be > 0, got 0"]


def test_rules_across_tables_name_the_file_only():
    assert error(with_changes(hardware={})) == f"{SPEC}: needs at least one [hardware.<kind>] table"
    assert parse_spec(with_changes(models={}), SPEC).models == ()  # what `add-model` starts from


def test_all_unknown_auth_keys_are_named_with_the_known_ones():
    assert error(with_changes(tenants__auth={"mdoe": "required", "key_file": "k.json"})) == (
        f"{SPEC} [tenants.auth]: unknown key(s) ['key_file', 'mdoe']; "
        "the keys are ['mode', 'keys_file', 'anonymous_tier', 'max_clock_skew_s', 'issuer', 'audience']")


def test_unknown_keys_outside_the_auth_table_are_ignored():
    spec = parse_spec(with_changes(models__embed__comment="x", hardware__cpu__note=1, tenants__owner="ops",
                                   colour="blue"), SPEC)
    assert spec.models[0].name == "embed"


def test_mode_off_skips_the_checks_of_authenticated_modes():
    # No anonymous tenant exists when authentication is off, so the reserved id is a plain member.
    spec = parse_spec(with_changes(tenants={"tiers": {"a": {"priority": 1}}, "members": {"anonymous": "a"},
                                            "auth": {"mode": "off", "anonymous_tier": "nowhere"}}), SPEC)
    assert spec.tenant_auth is None and spec.tenant_members == {"anonymous": "a"}


def test_hardware_defaults_follow_the_kind():
    spec = parse_spec(with_changes(hardware={"gpu": {"max_instances": 2, "intra_op_threads": 1},
                                             "cpu": {"max_instances": 1, "intra_op_threads": 0}}), SPEC)
    assert (spec.hardware["gpu"].instance_kind, spec.hardware["gpu"].ort_spinning) == ("KIND_GPU", True)
    assert (spec.hardware["cpu"].instance_kind, spec.hardware["cpu"].ort_spinning) == ("KIND_CPU", False)
    # On a CPU node the bucket models yield the cores to the front end and the router.
    assert (spec.hardware["cpu"].compute_nice, spec.hardware["gpu"].compute_nice) == (10, 0)
    spec = parse_spec(with_changes(hardware={"cpu": {"max_instances": 1, "intra_op_threads": 1, "compute_nice": 0}}),
                      SPEC)
    assert spec.hardware["cpu"].compute_nice == 0


def test_paths_resolve_against_the_spec_and_buckets_are_ascending():
    spec = parse_spec(with_changes(models__embed__buckets=[32, 16], profile="profiles/h100.json"), SPEC)
    assert spec.profile == REPO / "profiles" / "h100.json"
    assert spec.models[0].workload == REPO / "loadtest" / "workloads" / "embed_mix.toml"
    assert spec.models[0].bucket_lens == (16, 32)


def test_derived_buckets_are_the_workloads_best_edges_capped_by_max_length():
    (model,) = parse_spec(with_changes(models__embed__buckets="derived"), SPEC).models
    assert (model.bucket_lens, model.bucket_count) == ((16, 32, 64, 128, 256), 5)  # embed_mix's bands end there
    assert model.bucket_names == ("embed_16", "embed_32", "embed_64", "embed_128", "embed_256")
    (model,) = parse_spec(with_changes(models__embed__buckets="derived", models__embed__bucket_count=3,
                                       models__embed__max_length=100), SPEC).models
    assert (model.bucket_lens, model.bucket_count) == ((16, 32, 100), 3)  # longer texts are truncated into 100
    assert parse_spec(with_changes(models__embed__buckets=[32, 16]), SPEC).models[0].bucket_count == 0


def test_derived_buckets_name_the_workload_that_cannot_be_read(tmp_path):
    broken = tmp_path / "mix.toml"
    broken.write_text("[[lengths]]\nmin_tokens = 4\nmax_tokens = 2\nweight = 1\n")
    assert error(with_changes(models__embed__buckets="derived", models__embed__workload=str(broken))) == (
        f'{SPEC} [models.embed]: buckets = "derived" derives the edges from the workload: '
        f"{broken} [lengths[0]]: needs 3 <= min_tokens <= max_tokens, got 4 and 2")


def test_a_derived_tensor_model_is_bucketed_along_its_variable_axis(tmp_path):
    frames = tmp_path / "frames.toml"
    frames.write_text("[[lengths]]\nmin_tokens = 5\nmax_tokens = 16\nweight = 0.6\n"
                      "[[lengths]]\nmin_tokens = 17\nmax_tokens = 64\nweight = 0.4\n")
    table = {"kind": "tensor", "source": "audio.onnx", "variable_axis": 0, "pad": {"features": 0.0},
             "tolerance": 0.01, "buckets": "derived", "bucket_count": 2, "workload": str(frames),
             "slo_p95_ms": 100, "expected_rps": 10, "peak_rps": 20, "max_request_rows": 8, "max_router_instances": 1}
    (model,) = parse_spec(with_changes(models={"audio": table}), SPEC).models
    assert model.bucket_lens == (16, 64) and model.bucket_names == ("audio_16", "audio_64")
    del table["variable_axis"]
    assert error(with_changes(models={"audio": table})) == (
        f"{SPEC} [models.audio]: buckets need a variable_axis: a tensor model without one has a single bucket model")


def test_llm_defaults():
    (llm,) = parse_spec({**BASE, "llm_models": {"llm": LLM}}, SPEC).llm_models
    assert (llm.name, llm.versions, llm.batching) == ("llm", (1,), "continuous")
    assert llm.stream_hold_ms == LLM["tpot_p95_ms"]  # a held token waits no longer than a token may take


def test_llm_stream_hold_may_be_set_or_turned_off():
    for hold in (0, 150):
        (llm,) = parse_spec({**BASE, "llm_models": {"llm": {**LLM, "stream_hold_ms": hold}}}, SPEC).llm_models
        assert llm.stream_hold_ms == hold


def tables() -> list[type[BaseModel]]:
    return [value for value in vars(serving).values()
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == serving.__name__]


@pytest.mark.parametrize("table", tables(), ids=lambda table: table.__name__)
def test_every_key_of_the_schema_is_described(table):
    assert table.__doc__
    assert {name for name, field in table.model_fields.items() if not field.description} == set()
