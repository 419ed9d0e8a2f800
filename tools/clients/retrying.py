"""A client for the served models that retries what is safe to retry.

Inference has no side effects, so a request that failed because the server was busy, the
tenant was briefly over quota, or the instance serving it crashed can simply be sent again.
`RetryPolicy` and `next_delay_s` decide (pure: attempt number, error, clock and a random
draw in, a delay or "give up" out): exponential backoff with full jitter, never past the
request's deadline, at least the "retry after" the server asked for, and never for an
error that would fail again (bad input, unknown model). `EmbedClient` is the thin
tritonclient (gRPC) wrapper around it.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

RETRY_AFTER = re.compile(r"retry after ([0-9.]+) s")


class Outcome(StrEnum):
    OK = "ok"
    REJECTED = "rejected"  # the server refused it on purpose (busy, over quota): retryable
    CRASHED = "crashed"  # the instance serving it died: retryable
    FAILED = "failed"  # anything else: bad input, unknown model, internal error


def classify(status: str | None, message: str) -> Outcome:
    """What an error means, from tritonclient's status (HTTP code or gRPC status name) and message."""
    if "Stub process" in message and "is not healthy" in message:
        return Outcome.CRASHED  # raised by Triton itself when a router instance dies (500 / INTERNAL)
    if status in ("503", "StatusCode.UNAVAILABLE", "UNAVAILABLE"):
        return Outcome.REJECTED if "crashed" not in message else Outcome.CRASHED
    return Outcome.FAILED


def retry_after_s(message: str) -> float:
    """The wait the server asked for (quota errors say "retry after N s"), else 0."""
    match = RETRY_AFTER.search(message)
    return float(match.group(1)) if match else 0.0


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try. Defaults suit an online request with a budget of about a second."""

    max_attempts: int = 6  # first try included
    base_backoff_s: float = 0.025  # backoff cap of the first retry; doubles each retry
    max_backoff_s: float = 0.5  # backoff cap never grows past this

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.base_backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < base_backoff_s <= max_backoff_s, got {self.base_backoff_s}, "
                             f"{self.max_backoff_s}")


NO_RETRIES = RetryPolicy(max_attempts=1)


def next_delay_s(policy: RetryPolicy, attempt: int, outcome: Outcome, message: str, now_s: float,
                 deadline_s: float, draw: float) -> float | None:
    """Seconds to wait before attempt `attempt + 1` (attempts count from 1), or None to give up.

    Full jitter (`draw` in [0, 1) times the capped exponential) spreads the retries of many
    clients that failed together, so they do not come back as one wave.
    """
    if outcome in (Outcome.OK, Outcome.FAILED) or attempt >= policy.max_attempts:
        return None
    cap_s = min(policy.max_backoff_s, policy.base_backoff_s * 2 ** (attempt - 1))
    delay_s = max(draw * cap_s, retry_after_s(message))
    if now_s + delay_s >= deadline_s:
        return None  # the answer would come too late to be of use
    return delay_s


@dataclass
class Attempts:
    """What one call went through."""

    outcomes: list[Outcome]  # one per attempt, in order
    last_error: str = ""  # message of the last failed attempt


class CallFailed(RuntimeError):
    """Every attempt failed, or the deadline came first; `attempts` says what happened."""

    def __init__(self, message: str, attempts: Attempts):
        super().__init__(message)
        self.attempts = attempts


class EmbedClient:
    """`embed(texts)` against the `embed` model over gRPC, with retries per `policy`.

    `tenant_token` (from `python -m tools tenant-token`) says who the client is; a bare
    `tenant` is only taken by a server whose spec turns tenant authentication off.
    """

    def __init__(self, grpc_url: str, tenant: str | None = None, priority: int = 0,
                 policy: RetryPolicy | None = None, model: str = "embed", seed: int | None = None,
                 tls_ca: Path | None = None, tenant_token: str | None = None):
        import tritonclient.grpc as grpcclient

        from tools.clients.tls import client_tls_kwargs

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(grpc_url, **client_tls_kwargs(tls_ca))
        self.tenant = tenant
        self.tenant_token = tenant_token
        self.priority = priority  # Triton priority level of the tenant's tier (0: the model default)
        self.policy = policy or RetryPolicy()
        self.model = model
        self.rng = random.Random(seed)

    def embed(self, texts: Sequence[str], deadline_s: float = 2.0, version: int | None = None):
        """Embeddings [rows, 384] for `texts`; raises CallFailed when no attempt succeeded in time."""
        import numpy as np
        from tritonclient.utils import InferenceServerException

        tensor = self._grpc.InferInput("TEXT", [len(texts), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1))
        parameters = {key: value for key, value in (("tenant", self.tenant), ("tenant_token", self.tenant_token),
                                                    ("version", version)) if value is not None}
        deadline = time.monotonic() + deadline_s
        attempts = Attempts(outcomes=[])
        while True:
            remaining_s = deadline - time.monotonic()
            try:
                result = self.client.infer(self.model, [tensor], parameters=parameters or None,
                                           priority=self.priority, client_timeout=max(remaining_s, 0.001))
                attempts.outcomes.append(Outcome.OK)
                return result.as_numpy("EMBEDDING")
            except InferenceServerException as err:
                message = err.message() or str(err)
                outcome = classify(err.status(), message)
                attempts.outcomes.append(outcome)
                attempts.last_error = message
            delay_s = next_delay_s(self.policy, len(attempts.outcomes), outcome, message, time.monotonic(),
                                   deadline, self.rng.random())
            if delay_s is None:
                raise CallFailed(f"{len(attempts.outcomes)} attempt(s) failed: {message}", attempts)
            time.sleep(delay_s)

    def close(self) -> None:
        self.client.close()
