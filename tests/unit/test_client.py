"""The retrying client's pure parts: what an error means and how long to wait."""

import pytest

from tools.clients.retrying import NO_RETRIES, Outcome, RetryPolicy, classify, next_delay_s, retry_after_s

QUOTA = ("tenant 'a' is over its quota of 2 requests/s (tier standard, burst 2; this request needs 1); "
         "retry after 0.250 s")
BUSY = "server busy: 180.0 ms of work in flight (bound 150.0 ms); retry later"


@pytest.mark.parametrize(("status", "message", "outcome"), [
    ("StatusCode.UNAVAILABLE", QUOTA, Outcome.REJECTED),
    ("503", BUSY, Outcome.REJECTED),
    ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size", Outcome.REJECTED),
    ("StatusCode.INTERNAL", "Failed to process the request(s) for model 'embed_0_3', message: Stub process "
     "'embed_0_3' is not healthy.", Outcome.CRASHED),
    ("503", "bucket model encoder_16 crashed mid-request; retry", Outcome.CRASHED),
    ("StatusCode.INVALID_ARGUMENT", "row 0 of TEXT is empty", Outcome.FAILED),
    ("400", "unexpected inference input 'X'", Outcome.FAILED),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'nope' is not found", Outcome.FAILED),
    (None, "connection refused", Outcome.FAILED),
])
def test_classify_tells_retryable_refusals_and_crashes_from_failures(status, message, outcome):
    assert classify(status, message) is outcome


def test_retry_after_is_read_from_the_message():
    assert retry_after_s(QUOTA) == pytest.approx(0.25)
    assert retry_after_s(BUSY) == 0.0
    assert retry_after_s("retry after 12 s") == 12.0


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_attempts=0), "max_attempts must be >= 1, got 0"),
    (dict(base_backoff_s=0.0), "need 0 < base_backoff_s <= max_backoff_s"),
    (dict(base_backoff_s=1.0, max_backoff_s=0.5), "need 0 < base_backoff_s <= max_backoff_s"),
])
def test_bad_retry_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)


POLICY = RetryPolicy(max_attempts=4, base_backoff_s=0.1, max_backoff_s=0.3)


def test_backoff_is_full_jitter_on_a_doubling_cap():
    # Caps per attempt: 0.1, 0.2, 0.3 (max), scaled by the draw in [0, 1).
    assert next_delay_s(POLICY, 1, Outcome.REJECTED, BUSY, 0.0, 10.0, draw=0.5) == pytest.approx(0.05)
    assert next_delay_s(POLICY, 2, Outcome.CRASHED, BUSY, 0.0, 10.0, draw=0.5) == pytest.approx(0.1)
    assert next_delay_s(POLICY, 3, Outcome.REJECTED, BUSY, 0.0, 10.0, draw=0.99) == pytest.approx(0.297)
    assert next_delay_s(POLICY, 1, Outcome.REJECTED, BUSY, 0.0, 10.0, draw=0.0) == 0.0


def test_the_servers_retry_after_is_a_floor():
    assert next_delay_s(POLICY, 1, Outcome.REJECTED, QUOTA, 0.0, 10.0, draw=0.1) == pytest.approx(0.25)


def test_no_retry_for_failures_successes_spent_attempts_or_a_passed_deadline():
    assert next_delay_s(POLICY, 1, Outcome.FAILED, "bad input", 0.0, 10.0, draw=0.5) is None
    assert next_delay_s(POLICY, 1, Outcome.OK, "", 0.0, 10.0, draw=0.5) is None
    assert next_delay_s(POLICY, 4, Outcome.REJECTED, BUSY, 0.0, 10.0, draw=0.5) is None
    # The server asks for 0.25 s but only 0.2 s are left: the answer would be too late.
    assert next_delay_s(POLICY, 1, Outcome.REJECTED, QUOTA, 9.8, 10.0, draw=0.5) is None


def test_no_retries_policy_gives_up_at_once():
    assert next_delay_s(NO_RETRIES, 1, Outcome.REJECTED, BUSY, 0.0, 10.0, draw=0.5) is None
