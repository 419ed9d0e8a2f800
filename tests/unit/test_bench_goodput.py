"""The goodput benchmark's setups: generated configs, quotas taken out, nothing else changed."""

from tools.bench import embed_plan, padded_only_plan, without_tenant_quotas
from tools.latency_profile import load_profile
from tools.spec import load_spec


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
