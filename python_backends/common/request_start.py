"""When a request started, from the `X-Request-Start` stamp of the proxy or client in front.

A router sees a request when one of its instances takes it; the wait before that (a client's
send queue, a proxy, Triton's HTTP or gRPC front end on busy cores, the router's own queue)
is invisible to it, and under overload it is where the time goes. Load balancers stamp the
moment they accepted a request in the `X-Request-Start` header (nginx: `proxy_set_header
X-Request-Start "t=${msec}";`, Heroku's router, HAProxy), and clients can stamp their send
time the same way; tritonserver forwards the header into the request's parameters
(`--http-header-forward-pattern`, `--grpc-header-forward-pattern`, which `tools.server`
sets), where the router reads how long the request has already waited.

The stamp is `t=` (optional) and a time since the Unix epoch in seconds, milliseconds or
microseconds, told apart by magnitude as the monitoring agents that read it do: nginx's
`${msec}` is seconds with a fraction, Heroku's milliseconds, others microseconds. Clocks of
two hosts disagree a little: a stamp up to `max_skew_s` in the future counts as no wait, and
one further ahead is ignored (the request is judged by the router's own clock, as without one).
Pure: no Triton, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

REQUEST_START = "x-request-start"  # the header, and the request parameter tritonserver forwards it as
MAX_SKEW_S = 1.0  # a stamp this far ahead of the router's clock still counts (as no wait)
_MS_FROM = 1e11  # a stamp at least this large is in milliseconds (1e11 s is the year 5138)
_US_FROM = 1e14  # ... at least this large, in microseconds


def parse_request_start(value: object) -> float:
    """The stamp's time in seconds since the epoch; ValueError naming the stamp when it is none."""
    text = str(value).strip()
    number = text[2:] if text[:2].lower() == "t=" else text
    try:
        stamp = float(number)
    except ValueError:
        raise ValueError(f"{REQUEST_START} {text!r} is not t=<time since the epoch>") from None
    if not math.isfinite(stamp) or stamp <= 0:
        raise ValueError(f"{REQUEST_START} {text!r} is not a time since the epoch")
    if stamp >= _US_FROM:
        return stamp / 1e6
    if stamp >= _MS_FROM:
        return stamp / 1e3
    return stamp


def request_start(parameters: Mapping[str, object]) -> float | None:
    """The request's stamp (seconds since the epoch) among its parameters, the name in any
    case; None without one. ValueError for a stamp that is not a time."""
    value = parameters.get(REQUEST_START)
    if value is None:
        for name, candidate in parameters.items():
            if isinstance(name, str) and name.lower() == REQUEST_START:
                value = candidate
                break
    return None if value is None else parse_request_start(value)


def waited_ms(started_at_s: float | None, now_s: float, max_skew_s: float = MAX_SKEW_S) -> float | None:
    """How long the request waited before `now_s` (the router's wall clock): None without a
    stamp or with one over `max_skew_s` in the future, 0 for one less far ahead."""
    if started_at_s is None or started_at_s - now_s > max_skew_s:
        return None
    return max(0.0, (now_s - started_at_s) * 1000.0)


def stamp(unix_s: float) -> str:
    """The header value for a request that started at `unix_s`, in microseconds."""
    return f"t={round(unix_s * 1e6)}"
