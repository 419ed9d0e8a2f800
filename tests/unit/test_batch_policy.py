"""Batch inference policy: validation, fingerprints, retries, batch formation and status, with hand-made numbers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.batch.policy import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    BatchLimits,
    BatchStatus,
    ItemCounts,
    ItemKind,
    OutcomeKind,
    RetryPolicy,
    Submission,
    SubmissionError,
    batch_status,
    form_batch,
    is_retryable,
    next_retry_delay_s,
    request_fingerprint,
    should_retry,
    validate_submission,
)

LIMITS = BatchLimits(max_items_per_batch=4, max_item_bytes=32, max_batch_bytes=100)


# -- validation -----------------------------------------------------------------------------------------------


def test_a_good_embed_submission_round_trips():
    raw = {"model": "embed", "version": 2, "idempotency_key": "order-17", "items": ["a", "bb"]}
    assert validate_submission(raw, LIMITS) == Submission(model="embed", items=("a", "bb"), version=2,
                                                          idempotency_key="order-17")


def test_a_good_llm_submission_round_trips_and_version_and_key_are_optional():
    items = [{"prompt": "hi"}, {"prompt": "why", "max_tokens": 8}]
    submission = validate_submission({"model": "llm", "items": items}, LIMITS)
    assert submission == Submission(model="llm", items=tuple(items))
    assert submission.version is None and submission.idempotency_key is None


@pytest.mark.parametrize(("raw", "where", "message"), [
    (["embed"], "body", "must be a JSON object, got list"),
    ({"model": "embed", "items": ["a"], "idempotencykey": "k"}, "body", r"unknown fields \['idempotencykey'\]"),
    ({"items": ["a"]}, "model", "model is required"),
    ({"model": 3, "items": ["a"]}, "model", "model must be a string, got int"),
    ({"model": "rerank", "items": ["a"]}, "model", "unknown model 'rerank'; known: embed, llm"),
    ({"model": "embed"}, "items", "items is required"),
    ({"model": "embed", "items": "abc"}, "items", "items must be a list, got str"),
    ({"model": "embed", "items": []}, "items", "items must not be empty"),
    ({"model": "embed", "items": ["a"] * 5}, "items", "items has 5 entries, more than the 4 allowed"),
    ({"model": "embed", "items": ["a", 7]}, "items[1]", r"items\[1\] must be a non-empty string .* got int"),
    ({"model": "embed", "items": ["a", ""]}, "items[1]", r"items\[1\] must be a non-empty string"),
    ({"model": "embed", "items": ["a", "x" * 40]}, "items[1]", r"items\[1\] is 42 bytes, more than the 32 allowed"),
    ({"model": "embed", "items": ["x" * 28] * 4}, "items", "items are 120 bytes together, more than the 100"),
    ({"model": "llm", "items": ["hi"]}, "items[0]", r"items\[0\] must be an object with a prompt .* got str"),
    ({"model": "llm", "items": [{"prompt": ""}]}, "items[0].prompt", r"items\[0\].prompt must be a non-empty"),
    ({"model": "llm", "items": [{"messages": []}]}, "items[0]", r"items\[0\] has unknown fields \['messages'\]"),
    ({"model": "llm", "items": [{"prompt": "a"}, {"prompt": "b", "max_tokens": 0}]}, "items[1].max_tokens",
     r"items\[1\].max_tokens must be a positive integer, got 0"),
    ({"model": "llm", "items": [{"prompt": "a", "max_tokens": True}]}, "items[0].max_tokens", "got True"),
    ({"model": "embed", "items": ["a"], "version": 0}, "version", "version must be a positive integer, got 0"),
    ({"model": "embed", "items": ["a"], "version": "2"}, "version", "got '2'"),
    ({"model": "embed", "items": ["a"], "version": True}, "version", "got True"),
    ({"model": "embed", "items": ["a"], "idempotency_key": ""}, "idempotency_key", "must be 1..200 printable ASCII"),
    ({"model": "embed", "items": ["a"], "idempotency_key": "k" * 201}, "idempotency_key", r"got 'k{40}\.\.\.'"),
    ({"model": "embed", "items": ["a"], "idempotency_key": "line\nbreak"}, "idempotency_key", "printable"),
    ({"model": "embed", "items": ["a"], "idempotency_key": 12}, "idempotency_key", "got 12"),
])
def test_each_bad_submission_names_its_field_and_problem(raw, where, message):
    with pytest.raises(SubmissionError, match=message) as error:
        validate_submission(raw, LIMITS)
    assert error.value.field == where
    assert isinstance(error.value, ValueError)  # the API maps every ValueError of validation to 422


def test_the_longest_allowed_idempotency_key_is_accepted():
    key = "k" * MAX_IDEMPOTENCY_KEY_CHARS
    submission = validate_submission({"model": "embed", "items": ["a"], "idempotency_key": key}, LIMITS)
    assert submission.idempotency_key == key


def test_item_size_counts_utf8_bytes_not_characters():
    # 11 characters of 3 bytes each: 33 bytes of text + 2 quotes, over the 32 allowed, though only 13 characters.
    with pytest.raises(SubmissionError, match=r"items\[0\] is 35 bytes"):
        validate_submission({"model": "embed", "items": ["€" * 11]}, LIMITS)


@given(st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.lists(st.integers()),
                 st.dictionaries(st.text(), st.one_of(st.none(), st.integers(), st.text()))))
def test_arbitrary_json_is_either_a_submission_or_a_submission_error(raw):
    try:
        submission = validate_submission(raw, LIMITS)
    except SubmissionError as error:
        assert error.field and str(error)
    else:
        assert submission.model in LIMITS.models and 1 <= len(submission.items) <= LIMITS.max_items_per_batch


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"models": {}}, "at least one model"),
    ({"models": {"embed": "image"}}, "model 'embed' has unknown item kind 'image'"),
    ({"max_items_per_batch": 0}, "max_items_per_batch must be >= 1, got 0"),
    ({"max_item_bytes": 0}, "max_item_bytes must be >= 1, got 0"),
    ({"max_item_bytes": 10, "max_batch_bytes": 5}, r"max_batch_bytes \(5\) must be >= max_item_bytes \(10\)"),
])
def test_limits_refuse_impossible_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchLimits(**kwargs)


def test_limits_take_a_copy_of_the_models_mapping():
    models = {"encoder": "embed"}
    limits = BatchLimits(models=models)
    models["chat"] = "llm"
    assert dict(limits.models) == {"encoder": ItemKind.EMBED}


# -- fingerprints ---------------------------------------------------------------------------------------------


def test_the_fingerprint_ignores_the_key_and_key_order_but_not_the_body():
    base = validate_submission({"model": "llm", "items": [{"prompt": "a", "max_tokens": 3}]}, LIMITS)
    same = validate_submission({"items": [{"max_tokens": 3, "prompt": "a"}], "model": "llm", "idempotency_key": "k"},
                               LIMITS)
    assert request_fingerprint(base) == request_fingerprint(same)
    assert len(request_fingerprint(base)) == 64
    other_items = Submission(model="llm", items=({"prompt": "b", "max_tokens": 3},))
    other_version = Submission(model="llm", items=base.items, version=2)
    reordered = (Submission(model="embed", items=("a", "b")), Submission(model="embed", items=("b", "a")))
    assert request_fingerprint(other_items) != request_fingerprint(base)
    assert request_fingerprint(other_version) != request_fingerprint(base)
    assert request_fingerprint(reordered[0]) != request_fingerprint(reordered[1])


# -- retries --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "retryable"), [
    ("rejected", True), ("timeout", True), ("crashed", True), ("unavailable", True),
    ("invalid", False), ("failed", False),
])
def test_server_side_failures_are_retryable_and_item_side_ones_are_not(kind, retryable):
    assert is_retryable(kind) is retryable
    assert is_retryable(OutcomeKind(kind)) is retryable


def test_an_unknown_outcome_kind_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown outcome kind 'oops'; known: rejected, timeout"):
        is_retryable("oops")


def test_a_retryable_failure_is_retried_until_the_last_attempt():
    assert should_retry("timeout", attempt=1, max_attempts=3)
    assert should_retry("timeout", attempt=2, max_attempts=3)
    assert not should_retry("timeout", attempt=3, max_attempts=3)
    assert not should_retry("invalid", attempt=1, max_attempts=3)
    with pytest.raises(ValueError, match="got 0 and 3"):
        should_retry("timeout", attempt=0, max_attempts=3)


def test_backoff_doubles_per_attempt_until_the_cap():
    delays = [next_retry_delay_s(attempt, base_s=0.5, max_s=5.0, jitter_fraction=0.0, rng_value=0.7)
              for attempt in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_backoff_of_a_huge_attempt_number_is_the_cap_not_an_overflow():
    assert next_retry_delay_s(100_000, base_s=0.5, max_s=5.0, jitter_fraction=0.0, rng_value=0.0) == 5.0


def test_jitter_takes_up_to_its_fraction_off_and_never_exceeds_the_cap():
    assert next_retry_delay_s(3, 0.5, 5.0, jitter_fraction=0.5, rng_value=0.0) == 2.0
    assert next_retry_delay_s(3, 0.5, 5.0, jitter_fraction=0.5, rng_value=0.5) == 1.5
    assert next_retry_delay_s(3, 0.5, 5.0, jitter_fraction=0.5, rng_value=1.0) == 1.0
    # At the cap the jitter still spreads the retries below it rather than around it.
    assert next_retry_delay_s(9, 0.5, 5.0, jitter_fraction=0.5, rng_value=0.5) == 3.75


@given(attempt=st.integers(1, 10_000), base_s=st.floats(1e-3, 10.0), factor=st.floats(1.0, 1e4),
       jitter=st.floats(0.0, 1.0), rng_value=st.floats(0.0, 1.0))
def test_backoff_stays_within_jitter_bounds_and_the_cap(attempt, base_s, factor, jitter, rng_value):
    max_s = base_s * factor
    delay = next_retry_delay_s(attempt, base_s, max_s, jitter, rng_value)
    ceiling = min(max_s, base_s * 2.0 ** min(attempt - 1, 64))
    assert ceiling * (1 - jitter) * (1 - 1e-12) <= delay <= ceiling * (1 + 1e-12) <= max_s * (1 + 1e-12)


@pytest.mark.parametrize(("args", "message"), [
    ((0, 0.5, 5.0, 0.1, 0.5), "attempt must be >= 1, got 0"),
    ((1, 0.0, 5.0, 0.1, 0.5), "need 0 < base_s <= max_s, got base_s=0.0, max_s=5.0"),
    ((1, 6.0, 5.0, 0.1, 0.5), "got base_s=6.0, max_s=5.0"),
    ((1, 0.5, 5.0, 1.5, 0.5), r"jitter_fraction must be in \[0, 1\], got 1.5"),
    ((1, 0.5, 5.0, 0.1, -0.1), r"rng_value must be in \[0, 1\], got -0.1"),
])
def test_backoff_refuses_impossible_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        next_retry_delay_s(*args)


def test_retry_policy_gives_a_retry_time_until_the_last_attempt():
    policy = RetryPolicy(max_attempts=3, base_s=1.0, max_s=10.0, jitter_fraction=0.0)
    assert policy.retry_at_s("crashed", attempt=1, rng_value=0.3, now_s=100.0) == 101.0
    assert policy.retry_at_s("crashed", attempt=2, rng_value=0.3, now_s=100.0) == 102.0
    assert policy.retry_at_s("crashed", attempt=3, rng_value=0.3, now_s=100.0) is None
    assert policy.retry_at_s("invalid", attempt=1, rng_value=0.3, now_s=100.0) is None


def test_busy_refusals_back_off_at_most_busy_max_s_while_crashes_back_off_to_max_s():
    policy = RetryPolicy(max_attempts=10, base_s=0.5, max_s=30.0, busy_max_s=1.0, jitter_fraction=0.0)
    assert [policy.retry_at_s("rejected", attempt=a, rng_value=0.0, now_s=0.0) for a in (1, 2, 3, 6)] == [
        0.5, 1.0, 1.0, 1.0]
    assert [policy.retry_at_s("crashed", attempt=a, rng_value=0.0, now_s=0.0) for a in (1, 2, 3, 6)] == [
        0.5, 1.0, 2.0, 16.0]
    # A cap below the base is the whole delay.
    assert RetryPolicy(base_s=0.5, busy_max_s=0.2, jitter_fraction=0.0).retry_at_s("rejected", 1, 0.0, 0.0) == 0.2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
    ({"base_s": 2.0, "max_s": 1.0}, "need 0 < base_s <= max_s"),
    ({"jitter_fraction": -0.5}, "jitter_fraction must be in"),
    ({"busy_max_s": 0.0}, "busy_max_s must be > 0, got 0.0"),
])
def test_retry_policy_refuses_impossible_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)


# -- batch formation ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pending:
    model: str = "embed"
    version: int | None = None


def test_a_full_batch_is_dispatched_at_once_and_only_its_size():
    decision = form_batch([Pending()] * 10, max_batch_items=8, max_wait_s=0.05, oldest_claimed_at_s=100.0,
                          now_s=100.0)
    assert (decision.dispatch, decision.num_items, decision.wait_s, decision.reason) == (True, 8, 0.0, "full")


def test_a_partial_batch_is_dispatched_once_its_oldest_item_has_waited_the_window():
    decision = form_batch([Pending()] * 3, max_batch_items=8, max_wait_s=0.05, oldest_claimed_at_s=100.0,
                          now_s=100.05)
    assert (decision.dispatch, decision.num_items, decision.reason) == (True, 3, "waited")


def test_a_partial_batch_waits_for_the_rest_of_the_window():
    decision = form_batch([Pending()] * 3, max_batch_items=8, max_wait_s=0.05, oldest_claimed_at_s=100.0,
                          now_s=100.02)
    assert (decision.dispatch, decision.num_items, decision.reason) == (False, 0, "filling")
    assert decision.wait_s == pytest.approx(0.03)


def test_a_clock_that_went_backwards_waits_at_most_one_window():
    decision = form_batch([Pending()], max_batch_items=8, max_wait_s=0.05, oldest_claimed_at_s=100.0, now_s=99.0)
    assert not decision.dispatch and decision.wait_s == pytest.approx(0.05)


def test_nothing_pending_waits_a_whole_window():
    decision = form_batch([], max_batch_items=8, max_wait_s=0.05, oldest_claimed_at_s=None, now_s=100.0)
    assert (decision.dispatch, decision.num_items, decision.wait_s, decision.reason) == (False, 0, 0.05, "empty")


def test_a_zero_window_dispatches_whatever_is_pending():
    decision = form_batch([Pending()], max_batch_items=8, max_wait_s=0.0, oldest_claimed_at_s=100.0, now_s=100.0)
    assert decision.dispatch and decision.num_items == 1


@pytest.mark.parametrize(("pending", "kwargs", "message"), [
    ([Pending()], {"max_batch_items": 0}, "max_batch_items must be >= 1, got 0"),
    ([Pending()], {"max_wait_s": -1.0}, "max_wait_s must be >= 0, got -1.0"),
    ([Pending()], {"oldest_claimed_at_s": None}, "oldest_claimed_at_s is required with 1 items pending"),
    ([Pending(), Pending(version=2)], {}, r"share one model and version, got \[\('embed', 2\), \('embed', None\)\]"),
    ([Pending(), Pending(model="llm")], {}, "must share one model and version"),
])
def test_batch_formation_refuses_impossible_arguments(pending, kwargs, message):
    arguments = {"max_batch_items": 8, "max_wait_s": 0.05, "oldest_claimed_at_s": 100.0, "now_s": 100.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        form_batch(pending, **arguments)


# -- batch status ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("counts", "cancelled", "status"), [
    (ItemCounts(num_queued=5), False, BatchStatus.QUEUED),
    (ItemCounts(num_queued=4, num_leased=1), False, BatchStatus.RUNNING),
    (ItemCounts(num_queued=4, num_ok=1), False, BatchStatus.RUNNING),
    (ItemCounts(num_ok=5), False, BatchStatus.COMPLETED),
    (ItemCounts(num_ok=4, num_failed=1), False, BatchStatus.COMPLETED_WITH_ERRORS),
    (ItemCounts(num_leased=1, num_cancelled=4), True, BatchStatus.CANCELLED),
    (ItemCounts(num_ok=1, num_cancelled=4), True, BatchStatus.CANCELLED),
])
def test_batch_status_follows_the_item_counts(counts, cancelled, status):
    assert batch_status(counts, cancelled) is status


def test_progress_counts_final_items_of_every_kind():
    counts = ItemCounts(num_queued=2, num_leased=1, num_ok=4, num_failed=2, num_cancelled=1)
    assert (counts.num_items, counts.num_pending, counts.num_done) == (10, 3, 7)
    assert counts.fraction_done == pytest.approx(0.7)


def test_counts_refuse_negative_values_and_status_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="num_ok must be >= 0, got -1"):
        ItemCounts(num_ok=-1)
    with pytest.raises(ValueError, match="at least one item"):
        batch_status(ItemCounts(), cancelled=False)
