"""Reading the `X-Request-Start` stamp (`python_backends.common.request_start`)."""

from __future__ import annotations

import pytest

from python_backends.common.request_start import parse_request_start, request_start, stamp, waited_ms


@pytest.mark.parametrize(("value", "unix_s"), [
    ("t=1795714406.123", 1795714406.123),  # nginx's ${msec}: seconds with a fraction
    ("1795714406123", 1795714406.123),  # Heroku: milliseconds
    ("t=1795714406123456", 1795714406.123456),  # microseconds
    (" T=1795714406 ", 1795714406.0),
])
def test_a_stamp_in_seconds_milliseconds_or_microseconds_is_a_time_since_the_epoch(value, unix_s):
    assert parse_request_start(value) == pytest.approx(unix_s, abs=1e-6)


@pytest.mark.parametrize("value", ["t=soon", "", "t=-5", "t=nan", "t=inf"])
def test_a_stamp_that_is_no_time_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match="x-request-start"):
        parse_request_start(value)


def test_the_parameter_is_found_in_any_case_and_is_optional():
    assert request_start({"X-Request-Start": "t=1795714406"}) == 1795714406.0
    assert request_start({"x-request-start": 1795714406}) == 1795714406.0
    assert request_start({"tenant": "a"}) is None


def test_the_wait_is_from_the_stamp_to_now_and_a_clock_far_ahead_is_ignored():
    assert waited_ms(100.0, 100.25) == pytest.approx(250.0)
    assert waited_ms(100.5, 100.0) == 0.0  # a little ahead: skew, no wait
    assert waited_ms(102.0, 100.0) is None  # far ahead: the stamp cannot be trusted
    assert waited_ms(None, 100.0) is None


def test_a_stamp_written_is_read_back_to_the_microsecond():
    assert parse_request_start(stamp(1795714406.123456)) == pytest.approx(1795714406.123456, abs=1e-6)
