"""A batch worker: pull items from the store, batch them, call tritonserver, record outcomes.

The loop is thin glue around pure pieces: the store's `claim` leases items, `form_batch`
decides when a (model, version) queue is worth a Triton request (full, or its oldest item
has waited the window), a caller from `triton_calls` sends it, and the outcomes go back in
one transaction per request: results with `complete_many` (the first writer wins, so an
item a dead worker had leased and another finished keeps exactly one result), failures with
`fail_many`, retryable ones after `RetryPolicy`'s capped, jittered backoff. An item that
failed goes out again in a smaller request (`request_items`): the server admits a small
request where a large one does not fit, so an item it keeps refusing ends up alone.

At most `max_in_flight` requests are in flight at once, and the worker leases no more than
it can send soon, so a second worker on the same store shares the queue instead of finding
it hoarded. Leases of requests still running are extended; a SIGKILLed worker's leases
expire and its items are claimed again (at-least-once), which is why results are written
first-writer-wins. SIGTERM stops claiming, sends what is pending and waits for what is in
flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.batch.policy import ItemKind, RetryPolicy, form_batch, request_items
from tools.batch.store_base import BatchQueue, ClaimedItem
from tools.batch.triton_calls import CallOutcome

log = logging.getLogger("tools.batch.worker")

Caller = Callable[[Sequence[object], int | None], Awaitable[list[CallOutcome]]]


def next_window(window: float, rejected: bool, max_in_flight: int) -> float:
    """Requests a worker may have in flight after an answer: halved when the server turned a
    request away as busy, else grown by one request per window's worth of answers (TCP's
    additive increase, multiplicative decrease). The server's admission protects its online
    SLO; a bulk client that kept sending at full concurrency would only collect refusals."""
    if rejected:
        return max(1.0, window / 2.0)
    return min(float(max_in_flight), window + 1.0 / window)


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str  # names this worker's leases; unique per process
    # Items per Triton request. Small: the router's admission judges each answer against the
    # online latency target, and the server's dynamic batchers batch small requests anyway.
    max_batch_items: int = 4
    max_wait_s: float = 0.05  # the batch window: how long the oldest claimed item may wait for company
    max_in_flight: int = 8  # Triton requests in flight at once (at most: see next_window)
    lease_s: float = 120.0  # an item's lease; extended while its request runs
    poll_s: float = 0.25  # sleep when the queue is empty
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=20))

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.max_batch_items < 1 or self.max_in_flight < 1:
            raise ValueError(f"max_batch_items and max_in_flight must be >= 1, got {self.max_batch_items}, "
                             f"{self.max_in_flight}")
        if not (self.max_wait_s >= 0 and self.lease_s > 0 and self.poll_s > 0):
            raise ValueError(f"need max_wait_s >= 0, lease_s > 0, poll_s > 0; got {self.max_wait_s}, "
                             f"{self.lease_s}, {self.poll_s}")


@dataclass
class WorkerStats:
    requests: int = 0  # Triton requests sent
    items_ok: int = 0
    items_retried: int = 0
    items_failed: int = 0
    superseded: int = 0  # outcomes not written: the item already had one


class BatchWorker:
    def __init__(self, store: BatchQueue, config: WorkerConfig, callers: Mapping[str, Caller],
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None):
        self.store = store
        self.config = config
        self.callers = dict(callers)  # model name -> caller
        self.clock = clock
        self.rng = rng or random.Random()
        self.stats = WorkerStats()
        self._pending: dict[tuple[str, int | None], list[ClaimedItem]] = {}
        self._in_flight: dict[asyncio.Task, list[ClaimedItem]] = {}
        self._stopping = asyncio.Event()
        self._window = float(config.max_in_flight)  # requests allowed in flight now (next_window)

    def stop(self) -> None:
        self._stopping.set()

    @property
    def num_held(self) -> int:
        return sum(len(items) for items in self._pending.values()) + sum(len(i) for i in self._in_flight.values())

    async def run(self) -> WorkerStats:
        extender = asyncio.create_task(self._extend_leases())
        try:
            while not self._stopping.is_set():
                claimed = self._claim()
                wait_s = self._dispatch_ready()
                if not claimed and not self._pending:
                    wait_s = self.config.poll_s
                await self._sleep(wait_s)
            # Stopping: send what is already leased (the window still applies), then wait.
            while self._pending:
                self._dispatch_ready(flush=True)
                if self._in_flight:
                    await asyncio.wait(list(self._in_flight), return_when=asyncio.FIRST_COMPLETED)
            if self._in_flight:
                await asyncio.gather(*self._in_flight, return_exceptions=True)
        finally:
            extender.cancel()
        return self.stats

    async def _sleep(self, wait_s: float) -> None:
        waits = [asyncio.ensure_future(self._stopping.wait())]
        if self._in_flight:
            waits.append(asyncio.ensure_future(asyncio.wait(list(self._in_flight),
                                                            return_when=asyncio.FIRST_COMPLETED)))
        _, pending = await asyncio.wait(waits, timeout=max(wait_s, 0.001), return_when=asyncio.FIRST_COMPLETED)
        for future in pending:
            future.cancel()

    def _claim(self) -> int:
        """Lease, in one transaction, what fills the free slots of the in-flight window, and never
        more than one round of requests (max_in_flight x max_batch_items) held at once.

        Claiming one request's worth per loop would add one request per answer received, so
        the window would never fill: the worker would run one or two requests at a time."""
        per_request = self.config.max_batch_items
        room = self.config.max_in_flight * per_request - self.num_held
        pending = sum(len(items) for items in self._pending.values())
        free_slots = max(1, int(self._window)) - len(self._in_flight)
        wanted = min(room, free_slots * per_request - pending)
        if wanted <= 0:
            return 0
        items = self.store.claim(self.config.worker_id, wanted, self.config.lease_s, self.clock())
        for item in items:
            self._pending.setdefault((item.model, item.version), []).append(item)
        return len(items)

    def _dispatch_ready(self, flush: bool = False) -> float:
        """Send every queue that is ready; returns how long until the next one may be."""
        next_wait_s = self.config.poll_s
        for target in list(self._pending):
            queue = self._pending[target]
            while queue and len(self._in_flight) < max(1, int(self._window)):
                size = request_items(self.config.max_batch_items,
                                     [item.attempt for item in queue[:self.config.max_batch_items]])
                decision = form_batch(queue, size, 0.0 if flush else self.config.max_wait_s,
                                      queue[0].claimed_at_s, self.clock())
                if not decision.dispatch:
                    next_wait_s = min(next_wait_s, decision.wait_s)
                    break
                batch, queue[:] = queue[:decision.num_items], queue[decision.num_items:]
                task = asyncio.create_task(self._send(target, batch))
                self._in_flight[task] = batch
                task.add_done_callback(self._in_flight.pop)
            if not queue:
                del self._pending[target]
        return next_wait_s if not flush else 0.0

    async def _send(self, target: tuple[str, int | None], items: list[ClaimedItem]) -> None:
        model, version = target
        caller = self.callers.get(model)
        if caller is None:
            outcomes = [CallOutcome(None, "failed", f"this worker serves no model {model!r}")] * len(items)
        else:
            try:
                outcomes = await caller([item.payload for item in items], version)
            except Exception as err:  # a caller bug must not leave items leased until their lease expires
                log.exception("calling %s failed", model)
                outcomes = [CallOutcome(None, "failed", f"{type(err).__name__}: {err}")] * len(items)
        self.stats.requests += 1
        self._window = next_window(self._window, any(o.error_kind == "rejected" for o in outcomes),
                                   self.config.max_in_flight)
        self._record(items, outcomes)

    def _record(self, items: Sequence[ClaimedItem], outcomes: Sequence[CallOutcome]) -> None:
        now_s = self.clock()
        worker_id = self.config.worker_id
        done = [(item.key, outcome.result) for item, outcome in zip(items, outcomes, strict=True) if outcome.ok]
        if done:
            written = self.store.complete_many(done, worker_id, now_s)
            self.stats.items_ok += sum(written)
            self.stats.superseded += len(written) - sum(written)
        # Items of one request fail together, with one error: one backoff draw for them all.
        failed: dict[tuple[str, str, int], list[ClaimedItem]] = {}
        for item, outcome in zip(items, outcomes, strict=True):
            if not outcome.ok:
                failed.setdefault((outcome.error_kind, outcome.error, item.attempt), []).append(item)
        for (kind, error, attempt), group in failed.items():
            retry_at_s = self.config.retry.retry_at_s(kind, attempt, self.rng.random(), now_s)
            message = f"{kind}: {error}"
            changed = self.store.fail_many([item.key for item in group], worker_id, message,
                                           retryable=retry_at_s is not None, retry_at_s=retry_at_s, now_s=now_s)
            if retry_at_s is not None:
                self.stats.items_retried += sum(changed)
            else:
                self.stats.items_failed += sum(changed)

    async def _extend_leases(self) -> None:
        """Keep the leases of items in requests that outlive a lease (long generations)."""
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            keys = [item.key for items in (*self._pending.values(), *self._in_flight.values()) for item in items]
            if keys:
                self.store.extend_leases(keys, self.config.worker_id, self.config.lease_s, self.clock())


def make_callers(grpc_url: str, models: Mapping[str, ItemKind], max_rows: int,
                 tls_ca: Path | None = None) -> tuple[dict[str, Caller], object]:
    """One gRPC client (over TLS when `tls_ca` is given) and a caller per model; returns
    (callers, client) so the caller can close it."""
    import tritonclient.grpc.aio as grpcaio

    from tools.batch.triton_calls import EmbedCaller, LLMCaller
    from tools.clients.tls import client_tls_kwargs

    client = grpcaio.InferenceServerClient(grpc_url, **client_tls_kwargs(tls_ca))
    callers: dict[str, Caller] = {}
    for name, kind in models.items():
        if kind is ItemKind.EMBED:
            callers[name] = EmbedCaller(client, model=name, max_rows=max_rows)
        else:
            callers[name] = LLMCaller(client, model=f"{name}_infer")
    return callers, client
