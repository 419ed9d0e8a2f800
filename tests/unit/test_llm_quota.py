"""The LLM's generated-token quota: reserve max_tokens at admission, refund what was not generated."""

from __future__ import annotations

import pytest

from python_backends.common.quotas import (
    LocalBuckets,
    TenantPolicy,
    TierPolicy,
    admit_tokens,
    parse_tenant,
    refund_tokens,
    token_cost,
)

POLICY = TenantPolicy(
    tiers={"batch": TierPolicy("batch", 2, 0.0, 0.0, llm_tokens_per_s=50.0, llm_token_burst=500.0),
           "free": TierPolicy("free", 1, 0.0, 0.0)},
    default_tier="free", members={"bulk": "batch"})


def test_a_request_reserves_its_max_tokens_capped_at_the_burst():
    tier = POLICY.tiers["batch"]
    assert token_cost(tier, 100) == 100.0
    assert token_cost(tier, 5000) == 500.0


def test_the_burst_is_reserved_then_the_next_request_waits_for_the_refill():
    buckets = LocalBuckets()
    assert admit_tokens(POLICY, buckets, "bulk", 400, now_s=0.0).allowed
    refused = admit_tokens(POLICY, buckets, "bulk", 200, now_s=0.0)
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx((200 - 100) / 50.0)
    assert "over its quota of 50 generated tokens/s (tier batch, burst 500; this request needs 200)" in \
        refused.message("bulk")
    assert admit_tokens(POLICY, buckets, "bulk", 200, now_s=2.0).allowed


def test_what_a_request_did_not_generate_is_given_back():
    buckets = LocalBuckets()
    first = admit_tokens(POLICY, buckets, "bulk", 500, now_s=0.0)
    assert not admit_tokens(POLICY, buckets, "bulk", 300, now_s=0.0).allowed
    refund_tokens(POLICY, buckets, "bulk", first.cost, generated=120, now_s=0.0)  # stopped early
    assert admit_tokens(POLICY, buckets, "bulk", 300, now_s=0.0).allowed


def test_a_refund_never_fills_the_bucket_past_its_burst():
    buckets = LocalBuckets()
    refund_tokens(POLICY, buckets, "bulk", reserved=500.0, generated=0, now_s=0.0)
    assert admit_tokens(POLICY, buckets, "bulk", 500, now_s=0.0).allowed
    assert not admit_tokens(POLICY, buckets, "bulk", 1, now_s=0.0).allowed


def test_a_tier_without_a_token_quota_is_never_refused_and_tenants_are_independent():
    buckets = LocalBuckets()
    for _ in range(100):
        assert admit_tokens(POLICY, buckets, "someone", 2000, now_s=0.0).allowed
    assert admit_tokens(POLICY, buckets, "bulk", 500, now_s=0.0).allowed


@pytest.mark.parametrize(("params", "tenant"), [({}, "default"), ({"tenant": "team-a"}, "team-a"),
                                                 ({"Tenant": "team.b_1"}, "team.b_1")])
def test_the_tenant_comes_from_the_parameter_or_the_forwarded_header(params, tenant):
    assert parse_tenant(params) == tenant


@pytest.mark.parametrize("value", ["", "has space", "x" * 65, 7, None])
def test_a_malformed_tenant_is_an_error(value):
    with pytest.raises(ValueError, match="parameter 'tenant'"):
        parse_tenant({"tenant": value})
