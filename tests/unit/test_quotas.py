"""Tenant tiers and token buckets (python_backends/quotas.py): the clock is passed in."""

import multiprocessing

import pytest

from python_backends.common.quotas import (
    OTHER_TENANTS,
    UNLIMITED,
    BucketState,
    LocalBuckets,
    SharedBuckets,
    TenantPolicy,
    TierPolicy,
    admit,
    charge,
    take,
)

PREMIUM = TierPolicy("premium", 1, requests_per_s=10.0, burst=5.0)
STANDARD = TierPolicy("standard", 2, requests_per_s=2.0, burst=2.0)
POLICY = TenantPolicy(tiers={"premium": PREMIUM, "standard": STANDARD}, default_tier="standard",
                      members={"search-frontend": "premium"})


# --- tiers and policy ------------------------------------------------------------------------------

@pytest.mark.parametrize(("tier", "message"), [
    (TierPolicy("t", 0, 1.0, 1.0), "tier 't': priority must be >= 1, got 0"),
    (TierPolicy("t", 1, -1.0, 1.0), "tier 't': requests_per_s must be a finite number >= 0, got -1.0"),
    (TierPolicy("t", 1, float("inf"), 1.0), "requests_per_s must be a finite number >= 0, got inf"),
    (TierPolicy("t", 1, float("nan"), 1.0), "requests_per_s must be a finite number >= 0, got nan"),
    (TierPolicy("t", 1, 5.0, 0.5), "burst must be >= 1 when requests_per_s is set, got 0.5"),
    (TierPolicy("t", 1, 0.0, 0.0, llm_tokens_per_s=10.0, llm_token_burst=0.0), "llm_token_burst must be >= 1"),
])
def test_a_bad_tier_is_refused_naming_the_field(tier, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tier.verify()


def test_a_tier_without_limits_is_valid():
    TierPolicy("free", 3, 0.0, 0.0).verify()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tiers={}, default_tier="x"), "at least one tenant tier is needed"),
    (dict(tiers={"standard": STANDARD}, default_tier="gold"), "default tier 'gold' is not one of the tiers"),
    (dict(tiers={"standard": STANDARD}, default_tier="standard", members={"a b": "standard"}),
     "tenant id 'a b' must be 1-64 letters"),
    (dict(tiers={"standard": STANDARD}, default_tier="standard", members={"acme": "gold"}),
     "tenant 'acme' is in tier 'gold', which is not one of"),
    (dict(tiers={"bad": TierPolicy("bad", 0, 0.0, 0.0)}, default_tier="bad"), "priority must be >= 1"),
])
def test_a_bad_policy_is_refused_with_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TenantPolicy(**kwargs)


def test_members_get_their_tier_and_everyone_else_the_default():
    assert POLICY.tier_of("search-frontend") is PREMIUM
    assert POLICY.tier_of("someone-else") is STANDARD
    assert POLICY.tier_of("default") is STANDARD


def test_metric_labels_name_members_and_group_the_rest():
    assert POLICY.metric_label("search-frontend") == "search-frontend"
    assert POLICY.metric_label("random-1234") == OTHER_TENANTS == "other"


def test_policy_json_round_trips():
    assert TenantPolicy.from_json(POLICY.to_json()) == POLICY
    assert TenantPolicy.from_json(UNLIMITED.to_json()) == UNLIMITED


@pytest.mark.parametrize("text", ["not json", "[]", '{"tiers": {}}', '{"default_tier": "a", "tiers": {"a": {}}}',
                                  '{"default_tier": "a", "tiers": {"a": {"priority": "one"}}}'])
def test_bad_policy_json_is_one_clear_error(text):
    with pytest.raises(ValueError, match="tenant policy is not valid"):
        TenantPolicy.from_json(text)


# --- the pure bucket -------------------------------------------------------------------------------

def test_a_new_tenant_starts_with_a_full_bucket():
    state, wait_s = take(None, 1.0, rate_per_s=2.0, burst=3.0, now_s=100.0)
    assert wait_s == 0.0 and state == BucketState(2.0, 100.0)


def test_an_empty_bucket_says_how_long_until_the_cost_is_there_and_takes_nothing():
    state, wait_s = take(BucketState(0.5, 10.0), 2.0, rate_per_s=2.0, burst=4.0, now_s=10.0)
    assert wait_s == pytest.approx(0.75)  # 1.5 tokens missing at 2/s
    assert state.tokens == 0.5


def test_the_bucket_refills_at_its_rate_up_to_the_burst():
    state, _ = take(BucketState(0.0, 0.0), 0.0, rate_per_s=2.0, burst=3.0, now_s=1.0)
    assert state.tokens == pytest.approx(2.0)
    state, _ = take(state, 0.0, rate_per_s=2.0, burst=3.0, now_s=100.0)
    assert state.tokens == 3.0  # capped at the burst


def test_a_clock_that_goes_backwards_adds_nothing():
    state, wait_s = take(BucketState(1.0, 50.0), 1.0, rate_per_s=10.0, burst=5.0, now_s=40.0)
    assert wait_s == 0.0 and state.tokens == 0.0
    state, wait_s = take(state, 1.0, rate_per_s=10.0, burst=5.0, now_s=39.0)
    assert wait_s > 0 and state.tokens == 0.0


def test_a_cost_above_the_burst_never_fits():
    _, wait_s = take(None, 6.0, rate_per_s=1.0, burst=5.0, now_s=0.0)
    assert wait_s == pytest.approx(1.0)  # the bucket can never hold 6: callers cap costs at the burst


def test_charge_takes_even_below_zero_and_a_refund_never_overfills():
    state = charge(BucketState(1.0, 0.0), 3.0, rate_per_s=1.0, burst=5.0, now_s=0.0)
    assert state.tokens == -2.0
    _, wait_s = take(state, 1.0, rate_per_s=1.0, burst=5.0, now_s=0.0)
    assert wait_s == pytest.approx(3.0)  # pays back the debt first
    refunded = charge(BucketState(4.0, 0.0), -10.0, rate_per_s=1.0, burst=5.0, now_s=0.0)
    assert refunded.tokens == 5.0


# --- admission and the two stores ------------------------------------------------------------------

def test_admit_refuses_past_the_burst_with_the_wait_and_a_message():
    buckets = LocalBuckets()
    decisions = [admit(POLICY, buckets, "someone", now_s=0.0) for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    refused = decisions[-1]
    assert refused.retry_after_s == pytest.approx(0.5) and refused.tier is STANDARD
    assert refused.message("someone") == ("tenant 'someone' is over its quota of 2 requests/s (tier standard, "
                                          "burst 2; this request needs 1); retry after 0.500 s")
    assert admit(POLICY, buckets, "someone", now_s=0.5).allowed  # refilled one token


def test_tenants_do_not_share_buckets_and_unlimited_tiers_are_never_refused():
    buckets = LocalBuckets()
    for _ in range(2):
        admit(POLICY, buckets, "a", now_s=0.0)
    assert not admit(POLICY, buckets, "a", now_s=0.0).allowed
    assert admit(POLICY, buckets, "b", now_s=0.0).allowed
    assert all(admit(UNLIMITED, buckets, "a", now_s=0.0).allowed for _ in range(1000))


def test_shared_buckets_are_one_state_for_every_opener(tmp_path):
    path = tmp_path / "quotas.bin"
    first, second = SharedBuckets(path), SharedBuckets(path)
    try:
        assert first.take("req:a", 1.0, 1.0, 2.0, now_s=0.0) == 0.0
        assert second.take("req:a", 1.0, 1.0, 2.0, now_s=0.0) == 0.0
        assert first.take("req:a", 1.0, 1.0, 2.0, now_s=0.0) == pytest.approx(1.0)
        assert second.take("req:b", 1.0, 1.0, 2.0, now_s=0.0) == 0.0  # another tenant, its own slot
    finally:
        first.close()
        second.close()


def test_shared_buckets_hold_many_tenants_in_a_small_table(tmp_path):
    buckets = SharedBuckets(tmp_path / "q.bin", num_slots=64)
    try:
        for i in range(64):  # every slot used, collisions resolved by probing
            assert buckets.take(f"req:t{i}", 1.0, 1.0, 1.0, now_s=0.0) == 0.0
        for i in range(64):  # each tenant found its own bucket again: all empty now
            assert buckets.take(f"req:t{i}", 1.0, 1.0, 1.0, now_s=0.0) > 0.0
        # A full table: a newcomer shares a slot rather than getting a fresh, full bucket.
        assert buckets.take("req:newcomer", 1.0, 1.0, 1.0, now_s=0.0) > 0.0
    finally:
        buckets.close()


def _take_many(path: str, count: int, results) -> None:
    buckets = SharedBuckets(path)
    try:
        results.put(sum(1 for _ in range(count) if buckets.take("req:flood", 1.0, 0.001, 50.0, now_s=0.0) == 0.0))
    finally:
        buckets.close()


def test_processes_sharing_the_file_never_admit_more_than_the_burst(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_take_many, args=(str(tmp_path / "q.bin"), 40, results)) for _ in range(4)]
    for worker in workers:
        worker.start()
    admitted = sum(results.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    assert admitted == 50  # 160 attempts, a burst of 50, no refill to speak of
