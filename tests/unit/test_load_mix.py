"""Load mixes: parsing, user-class weights, drawing models and tenants."""

import random
from collections import Counter

import pytest

from loadtest.mix import MIX_DIR, ModelKind, Protocol, draw_tenant, load_mix, parse_mix

WORKLOADS = MIX_DIR.parent / "workloads"


def mix_data(**overrides):
    data = {
        "name": "t",
        "user_rps": 4,
        "models": [
            {"model": "embed", "weight": 3, "protocols": {"grpc": 2, "http": 1}, "workload": "embed_mix.toml"},
            {"model": "llm", "weight": 1, "workload": "llm_chat.toml", "max_tokens_cap": 16},
        ],
        "tenants": [{"name": "a", "weight": 9}, {"name": "b", "weight": 1}],
    }
    data.update(overrides)
    return data


def test_user_weights_split_models_by_protocol():
    mix = parse_mix(mix_data(), "t.toml", WORKLOADS)
    assert mix.user_weights() == pytest.approx({
        (ModelKind.EMBED, Protocol.GRPC): 0.5, (ModelKind.EMBED, Protocol.HTTP): 0.25,
        (ModelKind.LLM, Protocol.GRPC): 0.25})
    llm = mix.models[1]
    assert llm.kind is ModelKind.LLM and llm.http_model == "llm_infer" and llm.max_tokens_cap == 16
    assert mix.models[0].http_model == "embed"
    assert mix.user_rps == 4 and mix.max_error_rate == 0.01 and mix.request_timeout_s == 30


def test_models_for_picks_only_that_kind_and_protocol():
    mix = parse_mix(mix_data(), "t.toml", WORKLOADS)
    assert [(m.model, w) for m, w in mix.models_for(ModelKind.EMBED, Protocol.HTTP)] == [("embed", pytest.approx(1))]
    assert mix.models_for(ModelKind.LLM, Protocol.HTTP) == []


def test_tenants_are_drawn_by_weight_and_none_without_tenants():
    mix = parse_mix(mix_data(), "t.toml", WORKLOADS)
    rng = random.Random(1)
    counts = Counter(draw_tenant(mix, rng) for _ in range(5000))
    assert counts["a"] / 5000 == pytest.approx(0.9, abs=0.02)
    assert draw_tenant(parse_mix(mix_data(tenants=[]), "t.toml", WORKLOADS), rng) is None


def test_the_shipped_mixes_parse():
    assert sorted(p.stem for p in MIX_DIR.glob("*.toml")) == ["embed", "llm", "mixed"]
    for name in ("embed", "llm", "mixed"):
        mix = load_mix(name)
        assert mix.models and all(m.workload.is_file() for m in mix.models)
    assert {m.model for m in load_mix("mixed").models} == {"embed", "llm"}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"models": []}, "at least one"),
    ({"models": [{"weight": 1, "workload": "embed_mix.toml"}]}, r"models\[0\].model must be"),
    ({"models": [{"model": "other", "workload": "embed_mix.toml"}]}, r"kind must be one of .* got 'other'"),
    ({"models": [{"model": "embed"}]}, "workload must name"),
    ({"models": [{"model": "embed", "workload": "missing.toml"}]}, "does not exist"),
    ({"models": [{"model": "embed", "workload": "embed_mix.toml", "weight": 0}]}, "weight must be a number > 0"),
    ({"models": [{"model": "embed", "workload": "embed_mix.toml", "protocols": {"udp": 1}}]}, "unknown protocol 'udp'"),
    ({"models": [{"model": "embed", "workload": "embed_mix.toml", "protocols": {"grpc": -1}}]}, "share > 0"),
    ({"models": [{"model": "llm", "workload": "llm_chat.toml", "max_tokens_cap": 0}]}, "max_tokens_cap"),
    ({"tenants": [{"weight": 1}]}, r"tenants\[0\].name"),
    ({"user_rps": 0}, "user_rps must be a number > 0"),
    ({"max_error_rate": 1}, r"max_error_rate must be in \[0, 1\)"),
])
def test_bad_mix_files_are_refused_with_the_reason(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(mix_data(**overrides), "t.toml", WORKLOADS)


def test_a_protocol_name_alone_means_all_of_that_model_over_it():
    data = mix_data(models=[{"model": "embed", "protocols": "http", "workload": "embed_mix.toml"}])
    assert parse_mix(data, "t.toml", WORKLOADS).models[0].protocols == ((Protocol.HTTP, 1.0),)


def test_a_tenant_may_carry_its_own_error_allowance():
    data = mix_data(tenants=[{"name": "a"}, {"name": "bulk", "max_error_rate": 0.5}])
    mix = parse_mix(data, "t.toml", WORKLOADS)
    assert mix.tenant_error_rates() == {"bulk": 0.5}
    with pytest.raises(ValueError, match=r"tenants\[0\]: max_error_rate"):
        parse_mix(mix_data(tenants=[{"name": "a", "max_error_rate": 2}]), "t.toml", WORKLOADS)
