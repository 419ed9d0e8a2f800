"""The [tenants] table of the serving spec: tiers, the default tier, members."""

import pytest

from python_backends.common.quotas import TierPolicy
from python_backends.common.tenant_auth import ANONYMOUS_TENANT, AUTH_OFF, AuthConfig, AuthMode
from tests.unit.test_gen_config import BASE, REPO
from tools.spec.serving import SpecError, parse_spec

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


# --- [tenants.auth] --------------------------------------------------------------------------

TIERS = {"tiers": {"gold": {"priority": 1}, "bronze": {"priority": 2}}}


def test_the_repository_spec_authenticates_and_serves_requests_without_a_token_as_anonymous():
    from tools.spec.serving import load_spec

    spec = load_spec(SPEC)
    assert spec.tenant_auth.mode is AuthMode.ANONYMOUS
    assert spec.tenant_auth.keys_file == REPO / "build" / "tenant_keys.json"
    assert spec.tenant_auth.anonymous_tier == "standard"
    assert spec.tenant_policy().tier_of(ANONYMOUS_TENANT).name == "standard"
    assert spec.auth_config() == AuthConfig(AuthMode.ANONYMOUS, "build/tenant_keys.json", 30.0)


def test_without_an_auth_table_bare_claims_are_not_trusted_and_anonymous_is_the_lowest_tier():
    spec = parse_spec(with_tenants(TIERS), SPEC)
    assert spec.tenant_auth.mode is AuthMode.ANONYMOUS and spec.tenant_auth.anonymous_tier == "bronze"
    assert spec.tenant_policy().tier_of(ANONYMOUS_TENANT).name == "bronze"
    assert spec.tenant_policy().metric_label(ANONYMOUS_TENANT) == ANONYMOUS_TENANT


def test_required_mode_has_no_anonymous_tenant():
    spec = parse_spec(with_tenants({**TIERS, "auth": {"mode": "required", "keys_file": "/etc/kit/keys.json"}}), SPEC)
    assert spec.tenant_auth.mode is AuthMode.REQUIRED
    assert ANONYMOUS_TENANT not in spec.tenant_policy().members
    # A keys file outside the kit is written as it is; one inside, relative to the kit's root.
    assert spec.auth_config().keys_file == "/etc/kit/keys.json"


def test_mode_off_trusts_the_tenant_parameter():
    spec = parse_spec(with_tenants({**TIERS, "auth": {"mode": "off"}}), SPEC)
    assert spec.tenant_auth is None and spec.auth_config() == AUTH_OFF


def test_the_keys_file_is_relative_to_the_spec():
    spec = parse_spec(with_tenants({**TIERS, "auth": {"keys_file": "secrets/k.json"}}), SPEC)
    assert spec.tenant_auth.keys_file == REPO / "secrets" / "k.json"
    assert spec.auth_config().keys_file == "secrets/k.json"
    spec = parse_spec(with_tenants({**TIERS, "auth": {"keys_file": "../outside/k.json"}}), SPEC)
    assert spec.auth_config().keys_file == str(REPO.parent / "outside" / "k.json")


def test_a_providers_issuer_and_audience_reach_the_models_auth_parameter():
    auth = {"keys_file": "idp/jwks.json", "issuer": "https://idp.example", "audience": "triton-kit"}
    config = parse_spec(with_tenants({**TIERS, "auth": auth}), SPEC).auth_config()
    assert (config.issuer, config.audience) == ("https://idp.example", "triton-kit")
    assert parse_spec(with_tenants({**TIERS, "auth": {}}), SPEC).auth_config().issuer == ""


@pytest.mark.parametrize(("auth", "members", "message"), [
    ({"mode": "sometimes"}, {}, r"\[tenants.auth\]: mode must be one of \['off', 'anonymous', 'required'\]"),
    ({"mdoe": "required"}, {}, r"\[tenants.auth\]: unknown key\(s\) \['mdoe'\]"),
    ({"keys_file": ""}, {}, "keys_file must be a path"),
    ({"keys_file": 7}, {}, "keys_file must be a path"),
    ({"anonymous_tier": "platinum"}, {}, r"anonymous_tier 'platinum' is not one of \['gold', 'bronze'\]"),
    ({"max_clock_skew_s": -1}, {}, r"max_clock_skew_s must be a number of seconds within \[0, 300\]"),
    ({"max_clock_skew_s": 301}, {}, "max_clock_skew_s"),
    ({"max_clock_skew_s": True}, {}, "max_clock_skew_s"),
    ({"issuer": 7}, {}, "issuer"),
    ({"audience": ["a", "b"]}, {}, "audience"),
    ({}, {"anonymous": "gold"}, "the tenant id 'anonymous' is reserved"),
    ({"mode": "required"}, {"anonymous": "gold"}, "the tenant id 'anonymous' is reserved"),
])
def test_auth_errors_name_the_table_and_the_value(auth, members, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(with_tenants({**TIERS, "auth": auth, "members": members}), SPEC)


def test_an_auth_value_that_is_not_a_table_is_refused():
    with pytest.raises(SpecError, match=r"\[tenants.auth\]: must be a table"):
        parse_spec(with_tenants({**TIERS, "auth": "required"}), SPEC)
