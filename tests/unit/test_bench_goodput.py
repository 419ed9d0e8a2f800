"""The goodput benchmark: its setups (generated configs, quotas taken out) and where each step's CPU went."""

import pytest

from tools.bench.goodput import (
    cpu_breakdown,
    embed_plan,
    goodput_options,
    median_index,
    median_ratio,
    padded_only_plan,
    round_ratios,
)
from tools.bench.harness import without_tenant_quotas
from tools.bench.loadgen import summarize_step
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec


def plans():
    spec = load_spec()
    profile = load_profile(spec.profile)
    return spec, {"slo_bucketed": embed_plan(spec, profile),
                  "default_batching": padded_only_plan(spec, profile, batching=True)}


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
