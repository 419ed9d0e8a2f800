"""The [tenants] table of the serving spec: tiers, the default tier, members."""

import pytest

from python_backends.quotas import TierPolicy
from tests.unit.test_gen_config import BASE, REPO
from tools.spec import SpecError, parse_spec

SPEC = REPO / "serving.toml"


def with_tenants(tenants: dict) -> dict:
    return {**BASE, "tenants": tenants}


def test_tiers_are_ordered_by_priority_with_their_quotas():
    spec = parse_spec(with_tenants({
        "default_tier": "standard",
        "tiers": {"batch": {"priority": 2, "requests_per_s": 5, "burst": 5},
                  "standard": {"priority": 1, "requests_per_s": 100, "burst": 50, "llm_tokens_per_s": 200,
                               "llm_token_burst": 1000}},
        "members": {"nightly-backfill": "batch"},
    }), SPEC)
    assert [t.name for t in spec.tiers] == ["standard", "batch"]
    assert spec.tiers[0] == TierPolicy("standard", 1, 100.0, 50.0, 200.0, 1000.0)
    assert spec.default_tier == "standard" and spec.tenant_members == {"nightly-backfill": "batch"}


def test_without_a_tenants_table_everyone_is_one_unlimited_tier():
    spec = parse_spec({key: value for key, value in BASE.items() if key != "tenants"}, SPEC)
    assert [(t.name, t.requests_per_s) for t in spec.tiers] == [("standard", 0.0)]
    assert spec.default_tier == "standard" and spec.tenant_members == {}


def test_the_default_tier_defaults_to_the_lowest_priority():
    spec = parse_spec(with_tenants({"tiers": {"gold": {"priority": 1}, "bronze": {"priority": 2}}}), SPEC)
    assert spec.default_tier == "bronze"


@pytest.mark.parametrize(("tenants", "message"), [
    ({"tiers": {"a": {"priority": 1}, "b": {"priority": 1}}}, r"priorities must be 1..2 without gaps, got \[1, 1\]"),
    ({"tiers": {"a": {}}}, r"\[tenants.tiers.a\]: missing 'priority'"),
    ({"tiers": {"a": {"priority": 0}}}, r"\[tenants.tiers.a\]: 'priority' must be > 0"),
    ({"tiers": {"a": {"priority": 1, "requests_per_s": -1}}}, r"\[tenants.tiers.a\]: 'requests_per_s' must be"),
    ({"tiers": {"a": {"priority": 1, "requests_per_s": "lots"}}}, "'requests_per_s' must be a number"),
    ({"tiers": {"a": {"priority": 1, "requests_per_s": 10}}}, "burst must be >= 1 when requests_per_s is set"),
    ({"tiers": {"a": {"priority": 1}}, "members": {"acme": "gold"}},
     r"\[tenants.members\]: tenant 'acme' is in tier 'gold', which is not one of \['a'\]"),
    ({"tiers": {"a": {"priority": 1}}, "members": {"team a": "a"}}, r"tenant id 'team a' must be 1-64 letters"),
    ({"tiers": {"a": {"priority": 1}}, "members": {"équipe": "a"}}, "tenant id 'équipe'"),
])
def test_tenant_errors_name_the_table_and_the_value(tenants, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(with_tenants(tenants), SPEC)
