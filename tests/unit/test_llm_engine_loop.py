"""The engine loop's threading contract, driven by a fake engine: outputs reach their sink in
order, cancellation and broken clients free the request, and a crashed engine fails every
waiting client instead of leaving it hanging; an engine made by the loop is made on its thread.
While requests wait, a stream's tokens are held and sent together, never longer than the hold.
Clients are sent to and asked on the loop's I/O thread: a slow one never stalls the steps."""

from __future__ import annotations

import threading
import time

import pytest

from python_backends.llm.engine import EngineLoop, EngineStats, StepOutput
from python_backends.llm.scheduler import FinishReason, SamplingParams


class FakeEngine:
    """Emits one output per request per step; finishes a request after its max_tokens steps."""

    def __init__(self, fail_at_step: int | None = None, waiting: int = 0, step_s: float = 0.0):
        self.requests: dict[str, list[int]] = {}  # request id -> [tokens so far, max tokens]
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.aborted: list[str] = []
        self.waiting = waiting  # what stats() says waits for a slot
        self.paused: set[str] = set()  # requests that make no output meanwhile (preempted)
        self.pause_after: dict[str, int] = {}  # request id -> the token after which it is paused
        self.now = 0.0  # the loop's clock: each step takes step_s
        self.step_s = step_s

    def use_threads(self) -> None:  # no torch threads to set
        pass

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, request_id, prompt, params):
        if request_id in self.requests:
            raise KeyError(f"request id {request_id!r} is already in the engine")
        self.requests[request_id] = [0, params.max_tokens]

    def abort(self, request_id):
        if self.requests.pop(request_id, None) is None:
            return None
        self.aborted.append(request_id)
        return StepOutput(request_id, "", 1, 0, FinishReason.CANCELLED)

    def step(self):
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("device lost")
        self.now += self.step_s
        outputs = []
        for request_id, state in list(self.requests.items()):
            if request_id in self.paused:
                continue
            state[0] += 1
            if state[0] == self.pause_after.get(request_id):
                self.paused.add(request_id)
            done = state[0] >= state[1]
            if done:
                del self.requests[request_id]
            outputs.append(StepOutput(request_id, f"t{state[0]} ", 1, state[0], FinishReason.LENGTH if done else None))
        return outputs

    def stats(self):
        return EngineStats(len(self.requests), self.waiting, 0, 1, 0, self.steps)

    def clock(self) -> float:
        return self.now


class Sink:
    def __init__(self, raise_on_send: bool = False, on_send=None):
        self.outputs: list[StepOutput] = []
        self.failure: str | None = None
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.raise_on_send = raise_on_send
        self.on_send = on_send  # called with each output sent, on the loop's thread
        self.cancel_checks = 0

    def send(self, output):
        if self.raise_on_send:
            raise ConnectionError("client went away")
        self.outputs.append(output)
        if self.on_send is not None:
            self.on_send(output)
        if output.finish_reason is not None:
            self.done.set()

    def fail(self, message):
        self.failure = message
        self.done.set()

    def cancelled(self):
        self.cancel_checks += 1
        return self.cancel.is_set()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def test_outputs_reach_their_sink_in_order_ending_with_the_final_one():
    engine = FakeEngine()
    stats: list[EngineStats] = []
    loop = EngineLoop(engine, on_step=stats.append, idle_wait_s=0.01).start()
    sinks = {rid: Sink() for rid in ("a", "b")}
    loop.submit("a", [1], params(3), sinks["a"])
    loop.submit("b", [1], params(5), sinks["b"])
    assert all(s.done.wait(5) for s in sinks.values())
    loop.stop()
    assert "".join(o.text_delta for o in sinks["a"].outputs) == "t1 t2 t3 "
    assert [o.finish_reason for o in sinks["b"].outputs] == [None] * 4 + [FinishReason.LENGTH]
    assert stats and loop.num_in_flight == 0


def test_a_cancelled_request_is_aborted_and_told_so():
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_wait_s=0.01).start()
    sink = Sink()
    sink.cancel.set()
    loop.submit("a", [1], params(10_000), sink)
    assert sink.done.wait(5)
    loop.stop()
    assert sink.outputs[-1].finish_reason is FinishReason.CANCELLED
    assert engine.aborted == ["a"] and not engine.requests


def test_a_client_that_went_away_is_aborted_and_the_others_continue():
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_wait_s=0.01).start()
    broken, healthy = Sink(raise_on_send=True), Sink()
    loop.submit("gone", [1], params(10_000), broken)
    loop.submit("ok", [1], params(3), healthy)
    assert healthy.done.wait(5)
    loop.stop()
    assert engine.aborted == ["gone"]
    assert healthy.outputs[-1].finish_reason is FinishReason.LENGTH


def test_a_refused_request_fails_its_own_sink_only():
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_wait_s=0.01).start()
    first, duplicate = Sink(), Sink()
    loop.submit("a", [1], params(50), first)
    loop.submit("a", [1], params(5), duplicate)
    assert duplicate.done.wait(5) and "already in the engine" in duplicate.failure
    assert first.done.wait(5) and first.failure is None
    loop.stop()


def test_a_crashed_engine_fails_every_waiting_client_and_reports_why():
    engine = FakeEngine(fail_at_step=2)
    loop = EngineLoop(engine, idle_wait_s=0.01)
    sinks = [Sink(), Sink()]
    loop.submit("a", [1], params(100), sinks[0])
    loop.submit("b", [1], params(100), sinks[1])
    loop.start()
    assert all(s.done.wait(5) for s in sinks)
    assert all("the LLM engine stopped: RuntimeError: device lost" in s.failure for s in sinks)
    loop.stop(drain_timeout_s=0.1)
    assert isinstance(loop.error, RuntimeError)


def test_build_makes_the_engine_on_the_loop_thread_and_serves_with_it():
    made_on = []

    def make():
        made_on.append(threading.current_thread().name)
        return FakeEngine()

    loop = EngineLoop.build(make, idle_wait_s=0.01)
    sink = Sink()
    loop.submit("a", [1], params(2), sink)
    assert sink.done.wait(5)
    loop.stop()
    assert made_on == ["llm-engine"]
    assert sink.outputs[-1].finish_reason is FinishReason.LENGTH


def test_build_raises_what_making_the_engine_raised():
    def make():
        raise ValueError("max_model_len 9000 exceeds the model's 2048 positions")

    with pytest.raises(ValueError, match="exceeds the model's 2048 positions"):
        EngineLoop.build(make)


def test_a_loop_takes_an_engine_or_a_maker_not_both():
    with pytest.raises(ValueError, match="not both"):
        EngineLoop(FakeEngine(), make_engine=FakeEngine)
    with pytest.raises(ValueError, match="not both"):
        EngineLoop(None)


def hold_loop(engine: FakeEngine, hold_s: float) -> EngineLoop:
    """Sinks called as the loop decides to send, so `engine.now` in a sink is when it sent."""
    return EngineLoop(engine, idle_wait_s=0.01, stream_hold_s=hold_s, clock=engine.clock, io_thread=False)


def test_while_requests_wait_tokens_are_held_and_sent_together_first_and_last_at_once():
    engine = FakeEngine(waiting=3, step_s=0.1)
    loop = hold_loop(engine, hold_s=10.0).start()
    sink = Sink()
    loop.submit("a", [1], params(6), sink)
    assert sink.done.wait(5)
    loop.stop()
    assert [o.text_delta for o in sink.outputs] == ["t1 ", "t2 t3 t4 t5 t6 "]
    assert [o.num_output_tokens for o in sink.outputs] == [1, 6]
    assert sink.outputs[-1].finish_reason is FinishReason.LENGTH


def test_with_nothing_waiting_or_no_hold_every_token_is_sent_as_it_is_made():
    for engine, hold_s in ((FakeEngine(waiting=0, step_s=0.1), 10.0), (FakeEngine(waiting=3, step_s=0.1), 0.0)):
        loop = hold_loop(engine, hold_s).start()
        sink = Sink()
        loop.submit("a", [1], params(4), sink)
        assert sink.done.wait(5)
        loop.stop()
        assert [o.text_delta for o in sink.outputs] == ["t1 ", "t2 ", "t3 ", "t4 "]


def test_no_held_token_waits_longer_than_the_hold():
    engine = FakeEngine(waiting=3, step_s=0.1)
    sent: list[tuple[float, int]] = []  # (when, tokens so far) of each response
    loop = hold_loop(engine, hold_s=0.35).start()
    sink = Sink(on_send=lambda output: sent.append((engine.now, output.num_output_tokens)))
    loop.submit("a", [1], params(12), sink)
    assert sink.done.wait(5)
    loop.stop()
    made_at = {token: round(0.1 * token, 9) for token in range(1, 13)}  # token n is made by step n
    before = 0
    for when, tokens in sent:
        assert all(when - made_at[token] <= 0.35 + 1e-9 for token in range(before + 1, tokens + 1)), sent
        before = tokens
    assert before == 12 and len(sent) < 12, sent  # all of them, in fewer responses than tokens
    assert "".join(o.text_delta for o in sink.outputs) == "".join(f"t{n} " for n in range(1, 13))


def test_a_stream_that_makes_no_output_gets_what_it_holds_by_the_hold():
    engine = FakeEngine(waiting=3, step_s=0.1)
    engine.pause_after = {"a": 3}  # preempted holding tokens 2 and 3; "b" keeps the loop stepping
    loop = hold_loop(engine, hold_s=0.35).start()
    held, other = Sink(), Sink()
    loop.submit("a", [1], params(50), held)
    loop.submit("b", [1], params(40), other)
    assert other.done.wait(5)
    loop.stop(drain_timeout_s=0.0)
    assert [o.text_delta for o in held.outputs] == ["t1 ", "t2 t3 "]


def cancel_at_token(engine: FakeEngine, target: Sink, num_tokens: int, cancelled_at: list[float]):
    """An on_send callback: once a sent output has `num_tokens` tokens, cancel `target` and
    note the engine's time in `cancelled_at`."""

    def on_send(output):
        if output.num_output_tokens >= num_tokens and not cancelled_at:
            cancelled_at.append(engine.now)
            target.cancel.set()

    return on_send


def test_while_requests_wait_a_cancelled_stream_is_found_within_the_cancel_check_and_not_asked_every_step():
    engine = FakeEngine(waiting=3, step_s=0.1)
    loop = hold_loop(engine, hold_s=0.35)
    cancelled_at: list[float] = []
    sink = Sink()
    sink.on_send = cancel_at_token(engine, sink, 5, cancelled_at)
    loop.submit("a", [1], params(10_000), sink)
    loop.start()
    assert sink.done.wait(5)
    loop.stop()
    assert sink.outputs[-1].finish_reason is FinishReason.CANCELLED and engine.aborted == ["a"]
    assert engine.now - cancelled_at[0] <= loop.cancel_check_s + engine.step_s + 1e-9
    assert sink.cancel_checks <= engine.now / loop.cancel_check_s + 2 < engine.steps  # once per check, not per step


def test_while_requests_wait_a_queued_request_s_cancellation_is_noticed_within_the_cancel_check():
    engine = FakeEngine(waiting=3, step_s=0.1)
    engine.paused.add("queued")  # never admitted: it makes no output to be sent
    loop = hold_loop(engine, hold_s=0.35)
    queued = Sink()
    cancelled_at: list[float] = []
    running = Sink(on_send=cancel_at_token(engine, queued, 3, cancelled_at))
    queued.on_send = lambda output: cancelled_at.append(engine.now)  # when it was found
    loop.submit("queued", [1], params(50), queued)
    loop.submit("running", [1], params(40), running)
    loop.start()
    assert queued.done.wait(5) and running.done.wait(5)
    loop.stop()
    assert queued.outputs[-1].finish_reason is FinishReason.CANCELLED
    asked, found = cancelled_at
    assert found - asked <= loop.cancel_check_s + 0.1 + 1e-9  # within the check (and a step), never having made a token


def test_a_slow_client_does_not_hold_up_the_steps_and_still_gets_every_output_in_order():
    engine = FakeEngine()
    release = threading.Event()
    slow = Sink(on_send=lambda output: release.wait(5))  # its first send blocks until released
    asked = threading.Event()

    class SlowToAsk(Sink):
        def cancelled(self):
            asked.set()
            release.wait(5)
            return False

    loop = EngineLoop(engine, idle_wait_s=0.01).start()
    loop.submit("slow", [1], params(20), slow)
    loop.submit("asked", [1], params(30), SlowToAsk())
    deadline = time.monotonic() + 5
    while engine.steps < 30 and time.monotonic() < deadline:  # the engine finishes both meanwhile
        time.sleep(0.01)
    assert engine.steps >= 30 and not engine.requests and not slow.done.is_set()
    release.set()
    assert slow.done.wait(5)
    loop.stop()
    assert [o.num_output_tokens for o in slow.outputs] == list(range(1, 21))
    assert asked.is_set()


def test_a_failing_on_step_does_not_stop_the_outputs():
    def broken_metrics(stats):
        raise RuntimeError("metrics endpoint gone")

    loop = EngineLoop(FakeEngine(), on_step=broken_metrics, idle_wait_s=0.01).start()
    sink = Sink()
    loop.submit("a", [1], params(5), sink)
    assert sink.done.wait(5)
    loop.stop()
    assert [o.num_output_tokens for o in sink.outputs] == [1, 2, 3, 4, 5]
