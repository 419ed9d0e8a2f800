"""The decisions of batch inference, as pure functions over plain data. No I/O, no clock.

A client submits a batch: one model (and optionally a version), up to `max_items_per_batch`
items, and optionally an idempotency key. `validate_submission` turns the decoded JSON into a
`Submission` or raises a `SubmissionError` naming the field or the item index at fault, so the
API can answer 422 with something a client can act on. `request_fingerprint` is what makes the
idempotency key safe: a retried POST with the same key and the same body gets the same batch,
while the same key with a different body is a client bug that must be refused rather than
silently answered with another request's results.

Workers then claim items, group them into Triton batches (`form_batch`: dispatch when the batch
is full or its oldest item has waited `max_wait_s`), and classify each failure: an overloaded,
timed-out, crashed or unavailable server is worth another try after a capped, jittered,
exponential backoff (`next_retry_delay_s`); an invalid input or a model error is not. After
`max_attempts` tries a retryable failure becomes final, so one poisonous item cannot keep a
batch open forever.

Every time-dependent function takes `now_s` (and the backoff takes its random draw) as an
argument: the decisions are then exact and testable with hand-written numbers, and the same
code runs unchanged under the worker's real clock and under a test's simulated one (vLLM's
scheduler is the model: it decides, it never reads the device or the clock).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

MAX_IDEMPOTENCY_KEY_CHARS = 200
SUBMISSION_FIELDS = ("model", "version", "idempotency_key", "items")
LLM_ITEM_FIELDS = ("prompt", "max_tokens")
WINDOW_TOLERANCE_S = 1e-9  # a batch window counts as closed this close to its end


class ItemKind(StrEnum):
    """What one item of a model looks like."""

    EMBED = "embed"  # a non-empty string to embed
    LLM = "llm"  # {"prompt": non-empty string, "max_tokens": positive int (optional)}


DEFAULT_MODELS: Mapping[str, ItemKind] = MappingProxyType({"embed": ItemKind.EMBED, "llm": ItemKind.LLM})


@dataclass(frozen=True)
class BatchLimits:
    """What one submission may contain."""

    models: Mapping[str, ItemKind] = field(default_factory=lambda: DEFAULT_MODELS)  # model name -> its item kind
    max_items_per_batch: int = 10_000  # items in one submission
    max_item_bytes: int = 16_384  # one item, as UTF-8 JSON
    max_batch_bytes: int = 32 * 1024 * 1024  # all items together, as UTF-8 JSON: bounds one insert transaction

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must name at least one model")
        kinds = {}
        for name, kind in self.models.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"model names must be non-empty strings, got {name!r}")
            try:
                kinds[name] = ItemKind(kind)
            except ValueError:
                raise ValueError(f"model {name!r} has unknown item kind {kind!r}; known: "
                                 f"{', '.join(k.value for k in ItemKind)}") from None
        # Frozen means frozen: a caller's dict mutated later must not change the limits.
        object.__setattr__(self, "models", MappingProxyType(kinds))
        if self.max_items_per_batch < 1:
            raise ValueError(f"max_items_per_batch must be >= 1, got {self.max_items_per_batch}")
        if self.max_item_bytes < 1:
            raise ValueError(f"max_item_bytes must be >= 1, got {self.max_item_bytes}")
        if self.max_batch_bytes < self.max_item_bytes:
            raise ValueError(f"max_batch_bytes ({self.max_batch_bytes}) must be >= max_item_bytes "
                             f"({self.max_item_bytes})")


class SubmissionError(ValueError):
    """A submission the API refuses (422); `field` is where the problem is, e.g. `items[3]`."""

    def __init__(self, where: str, message: str):
        super().__init__(message)
        self.field = where


@dataclass(frozen=True)
class Submission:
    """A validated batch request."""

    model: str
    items: tuple[object, ...]  # strings (embed) or {"prompt", "max_tokens"?} dicts (llm), in input order
    version: int | None = None  # None: whatever version the server serves by default
    idempotency_key: str | None = None


def _json_text(value: object) -> str:
    """The canonical JSON of a value: what is stored, measured and fingerprinted."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _is_int(value: object) -> bool:
    # JSON `true` decodes to a bool, which Python counts as an int; it is not a version or a token count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_item(item: object, kind: ItemKind, where: str) -> None:
    if kind is ItemKind.EMBED:
        if not isinstance(item, str) or not item:
            raise SubmissionError(where, f"{where} must be a non-empty string for an embed model, "
                                         f"got {type(item).__name__}")
        return
    if not isinstance(item, dict):
        raise SubmissionError(where, f"{where} must be an object with a prompt for an llm model, "
                                     f"got {type(item).__name__}")
    unknown = sorted(str(key) for key in item if key not in LLM_ITEM_FIELDS)
    if unknown:
        raise SubmissionError(where, f"{where} has unknown fields {unknown}; allowed: {list(LLM_ITEM_FIELDS)}")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise SubmissionError(f"{where}.prompt", f"{where}.prompt must be a non-empty string")
    if "max_tokens" in item:
        max_tokens = item["max_tokens"]
        if not _is_int(max_tokens) or max_tokens < 1:
            raise SubmissionError(f"{where}.max_tokens",
                                  f"{where}.max_tokens must be a positive integer, got {max_tokens!r}")


def validate_submission(raw: object, limits: BatchLimits) -> Submission:
    """The submission in `raw` (decoded JSON), or a `SubmissionError` naming what is wrong.

    Unknown top-level fields are refused rather than ignored: a misspelt `idempotency_key`
    ignored would silently turn a safe retry into a second batch.
    """
    if not isinstance(raw, dict):
        raise SubmissionError("body", f"the submission must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(str(key) for key in raw if key not in SUBMISSION_FIELDS)
    if unknown:
        raise SubmissionError("body", f"unknown fields {unknown}; allowed: {list(SUBMISSION_FIELDS)}")

    model = raw.get("model")
    if model is None:
        raise SubmissionError("model", "model is required")
    if not isinstance(model, str):
        raise SubmissionError("model", f"model must be a string, got {type(model).__name__}")
    if model not in limits.models:
        raise SubmissionError("model", f"unknown model {model!r}; known: {', '.join(sorted(limits.models))}")

    version = raw.get("version")
    if version is not None and (not _is_int(version) or version < 1):
        raise SubmissionError("version", f"version must be a positive integer, got {version!r}")

    key = raw.get("idempotency_key")
    if key is not None and not (isinstance(key, str) and 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS
                                and all(" " <= char <= "~" for char in key)):
        # Printable ASCII only: the key also travels as an HTTP header (Idempotency-Key) and in logs.
        shown = key[:40] + "..." if isinstance(key, str) and len(key) > 40 else key
        raise SubmissionError("idempotency_key", f"idempotency_key must be 1..{MAX_IDEMPOTENCY_KEY_CHARS} "
                                                 f"printable ASCII characters, got {shown!r}")

    items = raw.get("items")
    if items is None:
        raise SubmissionError("items", "items is required")
    if not isinstance(items, list):
        raise SubmissionError("items", f"items must be a list, got {type(items).__name__}")
    if not items:
        raise SubmissionError("items", "items must not be empty")
    if len(items) > limits.max_items_per_batch:
        raise SubmissionError("items", f"items has {len(items)} entries, more than the "
                                       f"{limits.max_items_per_batch} allowed in one batch")
    kind = limits.models[model]
    total_bytes = 0
    for index, item in enumerate(items):
        where = f"items[{index}]"
        _check_item(item, kind, where)
        num_bytes = len(_json_text(item).encode())
        if num_bytes > limits.max_item_bytes:
            raise SubmissionError(where, f"{where} is {num_bytes} bytes, more than the "
                                         f"{limits.max_item_bytes} allowed per item")
        total_bytes += num_bytes
    if total_bytes > limits.max_batch_bytes:
        raise SubmissionError("items", f"items are {total_bytes} bytes together, more than the "
                                       f"{limits.max_batch_bytes} allowed per batch")
    return Submission(model=model, items=tuple(items), version=version, idempotency_key=key)


def request_fingerprint(submission: Submission) -> str:
    """sha256 of the canonical JSON of what the batch computes (model, version, items).

    The idempotency key itself is left out: it names the request, the fingerprint says what
    it asks for. Key order and whitespace do not matter; item order does (results are returned
    in input order, so a reordered body is a different request).
    """
    body = {"model": submission.model, "version": submission.version, "items": list(submission.items)}
    return hashlib.sha256(_json_text(body).encode()).hexdigest()


class OutcomeKind(StrEnum):
    """Why one attempt at an item did not produce a result."""

    REJECTED = "rejected"  # the server is busy: HTTP 503 / gRPC UNAVAILABLE from admission or a full queue
    TIMEOUT = "timeout"  # no answer within the request's deadline
    CRASHED = "crashed"  # the model instance died while running the request
    UNAVAILABLE = "unavailable"  # the server or model is not reachable or not ready
    INVALID = "invalid"  # HTTP 400 / INVALID_ARG: the item itself is at fault
    FAILED = "failed"  # any other error from the model; retrying would repeat it


_RETRYABLE = frozenset({OutcomeKind.REJECTED, OutcomeKind.TIMEOUT, OutcomeKind.CRASHED, OutcomeKind.UNAVAILABLE})


def is_retryable(outcome_kind: str) -> bool:
    """Whether another attempt could succeed: the server was the problem, not the item."""
    try:
        return OutcomeKind(outcome_kind) in _RETRYABLE
    except ValueError:
        raise ValueError(f"unknown outcome kind {outcome_kind!r}; known: "
                         f"{', '.join(k.value for k in OutcomeKind)}") from None


def should_retry(outcome_kind: str, attempt: int, max_attempts: int) -> bool:
    """Whether attempt number `attempt` (1-based) that ended in `outcome_kind` gets another try."""
    if attempt < 1 or max_attempts < 1:
        raise ValueError(f"attempt and max_attempts must be >= 1, got {attempt} and {max_attempts}")
    return is_retryable(outcome_kind) and attempt < max_attempts


def next_retry_delay_s(attempt: int, base_s: float, max_s: float, jitter_fraction: float, rng_value: float) -> float:
    """Delay before the next try after failed attempt number `attempt` (1-based).

    The ceiling doubles per attempt from `base_s` up to `max_s`; the jitter then takes up to
    `jitter_fraction` of it off (`rng_value` in [0, 1) is the caller's random draw). Jitter
    is subtracted rather than added around the ceiling so that the delay never exceeds `max_s`
    and so that capped retries stay spread out instead of piling up at exactly `max_s`: a
    server that shed load from many workers at once must not get them all back at once.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if not 0 < base_s <= max_s:
        raise ValueError(f"need 0 < base_s <= max_s, got base_s={base_s}, max_s={max_s}")
    if not 0 <= jitter_fraction <= 1:
        raise ValueError(f"jitter_fraction must be in [0, 1], got {jitter_fraction}")
    if not 0 <= rng_value <= 1:
        raise ValueError(f"rng_value must be in [0, 1], got {rng_value}")
    # Compare exponents rather than computing 2**attempt: attempt 5000 must not overflow a float.
    doublings = attempt - 1
    ceiling_s = max_s if doublings >= math.log2(max_s / base_s) else base_s * 2.0 ** doublings
    return ceiling_s * (1.0 - jitter_fraction * rng_value)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently an item is retried."""

    max_attempts: int = 5  # attempts per item, the first included; then a retryable failure is final
    base_s: float = 0.5  # delay after the first failed attempt (before jitter)
    max_s: float = 30.0  # longest delay
    jitter_fraction: float = 0.5  # up to this share of the delay is taken off at random
    # Longest delay after a busy refusal. Admission refuses while the work in flight is over its
    # bound, and that work drains within about one latency target: waiting longer only stretches
    # the batch's tail. What slows a worker down under refusals is its in-flight window
    # (`worker.next_window`), not this delay. Crashes, timeouts and an unreachable server still
    # back off up to `max_s`.
    busy_max_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.busy_max_s > 0:
            raise ValueError(f"busy_max_s must be > 0, got {self.busy_max_s}")
        # Reuse the function's checks so the policy and the function can never disagree.
        next_retry_delay_s(1, self.base_s, self.max_s, self.jitter_fraction, 0.0)

    def retry_at_s(self, outcome_kind: str, attempt: int, rng_value: float, now_s: float) -> float | None:
        """When the item may be tried again, or None when this failure is final."""
        if not should_retry(outcome_kind, attempt, self.max_attempts):
            return None
        max_s = min(self.max_s, self.busy_max_s) if outcome_kind == OutcomeKind.REJECTED else self.max_s
        return now_s + next_retry_delay_s(attempt, min(self.base_s, max_s), max_s, self.jitter_fraction, rng_value)


class Batchable(Protocol):
    """What batch formation needs of a claimed item."""

    @property
    def model(self) -> str: ...

    @property
    def version(self) -> int | None: ...


@dataclass(frozen=True)
class BatchDecision:
    """What to do with the items waiting for one (model, version)."""

    dispatch: bool  # send now
    num_items: int  # how many from the front of the pending items to send (0 when waiting)
    wait_s: float  # when waiting: time until the oldest item's window closes (0 when dispatching)
    reason: str  # "full", "waited", "filling" or "empty"


def request_items(max_batch_items: int, attempts: Sequence[int]) -> int:
    """Items the next request may carry, given the tries of the items next in line (1 = first try).

    Halved for each earlier try of the most-tried of them, down to one. The server's admission
    counts a request's own work, and it admits a small request into room a large one does not
    find: under steady traffic from other requests, a four-item request of long texts can be
    refused as busy try after try while one-item requests keep getting in. An item the server
    turns away again therefore goes out in ever smaller requests and, by its third try, alone;
    the same isolates an item whose request crashed or timed out. Items on their first try
    share requests as before.
    """
    if max_batch_items < 1:
        raise ValueError(f"max_batch_items must be >= 1, got {max_batch_items}")
    if any(attempt < 1 for attempt in attempts):
        raise ValueError(f"attempts are 1-based, got {sorted(attempts)[0]}")
    halvings = max(attempts, default=1) - 1
    return max(1, max_batch_items >> min(halvings, max_batch_items.bit_length()))


def form_batch(pending: Sequence[Batchable], max_batch_items: int, max_wait_s: float,
               oldest_claimed_at_s: float | None, now_s: float) -> BatchDecision:
    """Dispatch when `max_batch_items` are pending or the oldest has waited `max_wait_s`, else wait.

    `pending` is one queue, in claim order, of items that can share a Triton request: one
    model and one version (a mixed queue is refused, since one request goes to one model).
    With nothing pending the worker waits a whole window before looking again. A clock that
    went backwards counts as no wait at all rather than a negative one.

    The items stay leased while they wait, so the worker's lease must cover `max_wait_s` plus
    the request's own deadline.
    """
    if max_batch_items < 1:
        raise ValueError(f"max_batch_items must be >= 1, got {max_batch_items}")
    if not max_wait_s >= 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
    if not pending:
        return BatchDecision(dispatch=False, num_items=0, wait_s=max_wait_s, reason="empty")
    targets = {(item.model, item.version) for item in pending}
    if len(targets) > 1:
        raise ValueError(f"pending items must share one model and version, got {sorted(targets, key=str)}")
    if oldest_claimed_at_s is None:
        raise ValueError(f"oldest_claimed_at_s is required with {len(pending)} items pending")
    if len(pending) >= max_batch_items:
        return BatchDecision(dispatch=True, num_items=max_batch_items, wait_s=0.0, reason="full")
    waited_s = max(0.0, now_s - oldest_claimed_at_s)
    # A worker that slept exactly the `wait_s` it was told must find the window closed, though
    # float subtraction may leave it a hair short (100.05 - 100.0 < 0.05).
    if waited_s >= max_wait_s - WINDOW_TOLERANCE_S:
        return BatchDecision(dispatch=True, num_items=len(pending), wait_s=0.0, reason="waited")
    return BatchDecision(dispatch=False, num_items=0, wait_s=max_wait_s - waited_s, reason="filling")


class BatchStatus(StrEnum):
    QUEUED = "queued"  # no item has been taken yet
    RUNNING = "running"  # some items taken or finished, some not
    COMPLETED = "completed"  # every item has a result
    COMPLETED_WITH_ERRORS = "completed_with_errors"  # every item is final, some failed
    CANCELLED = "cancelled"  # the client cancelled it; items in flight may still finish


@dataclass(frozen=True)
class ItemCounts:
    """Items of one batch by where they are."""

    num_queued: int = 0  # waiting to be claimed (also: waiting out a retry backoff)
    num_leased: int = 0  # held by a worker
    num_ok: int = 0  # final: a result
    num_failed: int = 0  # final: an error
    num_cancelled: int = 0  # final: never run because the batch was cancelled

    def __post_init__(self) -> None:
        for name in ("num_queued", "num_leased", "num_ok", "num_failed", "num_cancelled"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def num_items(self) -> int:
        return self.num_pending + self.num_done

    @property
    def num_pending(self) -> int:
        return self.num_queued + self.num_leased

    @property
    def num_done(self) -> int:
        return self.num_ok + self.num_failed + self.num_cancelled

    @property
    def fraction_done(self) -> float:
        return self.num_done / self.num_items if self.num_items else 0.0


def batch_status(counts: ItemCounts, cancelled: bool) -> BatchStatus:
    """The status a client sees.

    A cancelled batch reads `cancelled` at once, even while leased items finish (their results
    are kept and show in the counts). A batch reads `queued` whenever every item is queued,
    which includes the moment after its only taken items were put back for a retry.
    """
    if counts.num_items == 0:
        raise ValueError("a batch has at least one item, got counts of zero")
    if cancelled:
        return BatchStatus.CANCELLED
    if counts.num_pending == 0:
        if counts.num_failed or counts.num_cancelled:
            return BatchStatus.COMPLETED_WITH_ERRORS
        return BatchStatus.COMPLETED
    if counts.num_queued == counts.num_items:
        return BatchStatus.QUEUED
    return BatchStatus.RUNNING

