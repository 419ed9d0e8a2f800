"""When a stream's tokens go out (`python_backends.llm.streaming.send_now`): at once unless
requests wait, never the first or the last held, and no held token past the hold."""

from __future__ import annotations

import pytest

from python_backends.llm.streaming import send_now

BUSY = {"now_s": 10.0, "next_step_s": 0.25, "hold_s": 0.4, "requests_waiting": True}


def test_a_middle_token_is_held_while_requests_wait_and_the_hold_allows_one_more_step():
    assert not send_now(finished=False, num_output_tokens=5, held_since_s=None, **BUSY)


@pytest.mark.parametrize(("finished", "tokens"), [(True, 5), (False, 1), (True, 1)])
def test_the_first_and_the_last_token_are_never_held(finished, tokens):
    assert send_now(finished=finished, num_output_tokens=tokens, held_since_s=None, **BUSY)


@pytest.mark.parametrize("change", [{"requests_waiting": False}, {"hold_s": 0.0}])
def test_nothing_is_held_when_no_request_waits_or_holding_is_off(change):
    assert send_now(finished=False, num_output_tokens=5, held_since_s=9.9, **{**BUSY, **change})


@pytest.mark.parametrize(("held_since_s", "sent"), [
    (9.86, False),  # held 0.14 s; after the next step 0.39 s: within the hold
    (9.80, True),  # held 0.20 s; the next step would make it 0.45 s
    (None, False),  # only this step's token: 0.25 s after the next step
])
def test_held_tokens_go_out_before_the_next_step_would_keep_them_past_the_hold(held_since_s, sent):
    assert send_now(finished=False, num_output_tokens=5, held_since_s=held_since_s, **BUSY) is sent


def test_a_step_longer_than_the_hold_sends_every_token():
    assert send_now(finished=False, num_output_tokens=5, held_since_s=None, **{**BUSY, "next_step_s": 0.5})
