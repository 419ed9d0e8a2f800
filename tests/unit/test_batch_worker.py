"""The batch worker's loop with a fake Triton caller and a real queue (SQLite, then PostgreSQL)."""

from __future__ import annotations

import asyncio

import pytest

from tools.batch.engines import open_store
from tools.batch.policy import BatchLimits, RetryPolicy, request_items, validate_submission
from tools.batch.store_base import BatchQueue
from tools.batch.triton_calls import CallOutcome
from tools.batch.worker import BatchWorker, WorkerConfig, next_window


def test_the_window_halves_on_a_busy_answer_and_grows_back_one_request_per_window():
    assert next_window(8.0, rejected=True, max_in_flight=8) == 4.0
    assert next_window(1.0, rejected=True, max_in_flight=8) == 1.0  # never below one request
    assert next_window(4.0, rejected=False, max_in_flight=8) == pytest.approx(4.25)
    assert next_window(8.0, rejected=False, max_in_flight=8) == 8.0


def test_a_worker_config_refuses_impossible_values():
    with pytest.raises(ValueError, match="max_batch_items and max_in_flight"):
        WorkerConfig(worker_id="w", max_batch_items=0)
    with pytest.raises(ValueError, match="worker_id"):
        WorkerConfig(worker_id="")


class FakeCaller:
    """Answers each text with its length; the texts named in `busy` are refused `busy[text]` times."""

    def __init__(self, busy: dict[str, int] | None = None, broken: frozenset[str] = frozenset()):
        self.busy = dict(busy or {})
        self.broken = broken
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[list[str]] = []

    async def __call__(self, payloads, version=None):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.requests.append(list(payloads))
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        outcomes = []
        for text in payloads:
            if self.busy.get(text, 0) > 0:
                self.busy[text] -= 1
                outcomes.append(CallOutcome(None, "rejected", "server busy"))
            elif text in self.broken:
                outcomes.append(CallOutcome(None, "failed", "bad input"))
            else:
                outcomes.append(CallOutcome({"length": len(text)}))
        return outcomes


def run_until_done(store: BatchQueue, worker: BatchWorker, batch_id: str, timeout_s: float = 20.0) -> None:
    async def main():
        task = asyncio.create_task(worker.run())
        deadline = asyncio.get_running_loop().time() + timeout_s
        while store.get_batch(batch_id).counts.num_pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        worker.stop()
        await task

    asyncio.run(main())


def submit(store: BatchQueue, items: list[str]) -> str:
    batch_id, _ = store.submit(validate_submission({"model": "embed", "items": items}, BatchLimits()), 0.0)
    return batch_id


def fast(**overrides) -> WorkerConfig:
    values = {"worker_id": "w", "max_batch_items": 4, "max_wait_s": 0.0, "max_in_flight": 3, "poll_s": 0.01,
              "retry": RetryPolicy(max_attempts=3, base_s=0.01, max_s=0.02)}
    return WorkerConfig(**{**values, **overrides})


def test_every_item_gets_its_own_result_in_requests_of_the_batch_size(db):
    with open_store(db) as store:
        items = [f"text {i}" * (1 + i % 3) for i in range(30)]
        batch_id = submit(store, items)
        caller = FakeCaller()
        worker = BatchWorker(store, fast(), {"embed": caller})
        run_until_done(store, worker, batch_id)
        results = store.results(batch_id)
    assert [r.result for r in results] == [{"length": len(text)} for text in items]
    assert all(len(request) <= 4 for request in caller.requests) and sum(map(len, caller.requests)) == 30
    # The window fills: with work queued, the worker keeps all of its requests in flight, not one.
    assert caller.max_in_flight == 3


def test_busy_answers_are_retried_and_shrink_the_window_and_bad_ones_fail_at_once(db):
    with open_store(db, max_attempts=3) as store:
        batch_id = submit(store, ["ok", "busy twice", "broken", "busy forever"])
        caller = FakeCaller(busy={"busy twice": 2, "busy forever": 99}, broken=frozenset({"broken"}))
        worker = BatchWorker(store, fast(max_batch_items=1), {"embed": caller})
        run_until_done(store, worker, batch_id)
        results = {r.index: r for r in store.results(batch_id)}
    assert results[0].status == "ok"
    assert results[1].status == "ok" and results[1].attempts == 3  # two refusals, then served
    assert results[2].status == "failed" and results[2].attempts == 1 and "bad input" in results[2].error
    assert results[3].status == "failed" and "server busy" in results[3].error  # gave up after max attempts
    assert worker.stats.items_retried >= 4 and worker.stats.items_failed == 2


class AdmissionLikeCaller(FakeCaller):
    """Refuses, as busy, every request that carries a long text and anything beside it, the
    way the router's admission refuses a request whose own work does not fit while smaller
    ones keep getting in; a request fails as a whole."""

    async def __call__(self, payloads, version=None):
        self.requests.append(list(payloads))
        await asyncio.sleep(0.001)
        if len(payloads) > 1 and any(text.startswith("long") for text in payloads):
            return [CallOutcome(None, "rejected", "server busy")] * len(payloads)
        return [CallOutcome({"length": len(text)}) for text in payloads]


def test_an_item_refused_as_busy_goes_out_in_smaller_requests_until_it_is_alone(db):
    with open_store(db, max_attempts=3) as store:
        items = ["long " * 200] + [f"short {i}" for i in range(11)]
        batch_id = submit(store, items)
        caller = AdmissionLikeCaller()
        worker = BatchWorker(store, fast(), {"embed": caller})
        run_until_done(store, worker, batch_id)
        results = store.results(batch_id)
    assert [r.status for r in results] == ["ok"] * 12  # in four-item requests it would fail on every try
    assert results[0].attempts == 3
    sizes = [len(request) for request in caller.requests if items[0] in request]
    assert sizes == [4, 2, 1]  # halved after each refusal


def test_request_items_halve_with_each_try_of_the_most_tried_item_next_in_line():
    assert request_items(4, [1, 1, 1, 1]) == 4
    assert request_items(4, [1, 2, 1]) == 2
    assert request_items(4, [3]) == 1
    assert request_items(4, []) == 4
    assert request_items(8, [1000]) == 1  # no overflow, never below one
    assert request_items(1, [5]) == 1
    with pytest.raises(ValueError, match="max_batch_items must be >= 1"):
        request_items(0, [1])
    with pytest.raises(ValueError, match="1-based"):
        request_items(4, [0])


def test_items_of_a_model_the_worker_does_not_serve_fail_with_a_clear_error(db):
    with open_store(db) as store:
        batch_id = submit(store, ["a"])
        worker = BatchWorker(store, fast(), {"other": FakeCaller()})
        run_until_done(store, worker, batch_id)
        (result,) = store.results(batch_id)
    assert result.status == "failed" and "serves no model 'embed'" in result.error


def test_a_stopped_worker_sends_what_it_holds_before_it_returns(db):
    with open_store(db) as store:
        batch_id = submit(store, [f"t{i}" for i in range(12)])
        caller = FakeCaller()
        worker = BatchWorker(store, fast(max_batch_items=20, max_in_flight=1, max_wait_s=60.0), {"embed": caller})

        async def main():
            task = asyncio.create_task(worker.run())
            while not worker.num_held:  # it has leased items and is waiting for a fuller request
                await asyncio.sleep(0.005)
            held = worker.num_held
            worker.stop()
            await task
            return held

        held = asyncio.run(main())
        counts = store.get_batch(batch_id).counts
    assert held == 12 and counts.num_leased == 0 and counts.num_ok == 12  # not left to a lease expiry
