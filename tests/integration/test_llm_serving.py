"""The `llm` model through the real tritonserver: gRPC streaming, HTTP generate and
generate_stream, plain infer through `llm_infer`, concurrency, cancellation, bad input."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import LOG_DIR
from tests.integration.helpers import CHAT_QUESTIONS, as_tenant, metric, wait_for
from tools.clients.llm import LLMStream, llm_inputs

QUESTIONS = CHAT_QUESTIONS


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def shared_prefix(a: str, b: str) -> int:
    """Characters the two texts share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def generate_url(triton, stream: bool = False) -> str:
    return f"http://{triton.http_url}/v2/models/llm/generate{'_stream' if stream else ''}"


def test_a_streamed_generation_arrives_as_several_responses(triton):
    with LLMStream(triton.grpc_url) as stream:
        generation = stream.submit(messages=chat(QUESTIONS[3]), max_tokens=16)
        assert generation.done.wait(60), "no final response"
    assert generation.error is None
    assert len(generation.deltas) > 2  # several responses before the final one
    assert generation.finish_reason == "length" and generation.completion_tokens == 16
    assert generation.text.startswith("Here are three fruits")
    assert generation.prompt_tokens > 20  # the chat template's system turn included


def test_eight_concurrent_streams_each_get_their_own_greedy_text(triton):
    alone = {}
    with LLMStream(triton.grpc_url) as stream:
        for index, question in enumerate(QUESTIONS):
            generation = stream.submit(messages=chat(question), max_tokens=20)
            assert generation.done.wait(60) and generation.error is None
            alone[index] = generation.text
    assert len(set(alone.values())) == len(QUESTIONS)

    streams = [LLMStream(triton.grpc_url) for _ in QUESTIONS]
    try:
        generations = [s.submit(messages=chat(q), max_tokens=20) for s, q in zip(streams, QUESTIONS, strict=True)]
        assert all(g.done.wait(120) for g in generations)
    finally:
        for s in streams:
            s.close()
    assert all(g.error is None for g in generations)
    # Each stream gets its own answer: the one it got alone, or in bfloat16 (the engine's dtype
    # on a CPU that multiplies it in hardware) that answer up to a near tie between two tokens
    # that the batch's shape can tip either way, after the first few words (one tipped at the
    # sixth: "What's a joke about a " then "person ..." where alone it said "homeless ...";
    # one at the fifth: "The Rainbow: A " then "Miracle ..." where alone it said "Colorful ...").
    for index, generation in enumerate(generations):
        shared = {other: shared_prefix(generation.text, text) for other, text in alone.items()}
        own = shared.pop(index)
        assert own >= 12 and own > max(shared.values()), (index, generation.text, alone[index])


def test_cancelling_a_stream_returns_its_kv_blocks(triton):
    cancelled_before = metric(triton, "llm_requests_finished_total", finish_reason="cancelled")
    stream = LLMStream(triton.grpc_url)
    generation = stream.submit(text_input="Once upon a time", max_tokens=1000)
    assert wait_for(lambda: len(generation.deltas) >= 3)
    assert metric(triton, "llm_kv_blocks_used") > 0
    stream.close(cancel=True)
    assert wait_for(lambda: metric(triton, "llm_running_sequences") == 0 and metric(triton, "llm_kv_blocks_used") == 0)
    assert metric(triton, "llm_requests_finished_total", finish_reason="cancelled") == cancelled_before + 1
    assert generation.completion_tokens < 1000


BAD_REQUESTS = [
    ({"text_input": ""}, "text_input is empty"),
    ({"text_input": "Hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"text_input": "Hi", "max_tokens": 5000}, "exceeds the context of 2048 tokens"),
    ({"text_input": "word " * 3000}, "the context holds 2048"),
    ({"messages": "[{\"role\": \"user\"}"}, "messages is not valid JSON"),
    ({"messages": "[{\"role\": \"user\"}]"}, "must be an object with string 'role' and 'content'"),
    ({"text_input": "Hi", "messages": "[]"}, "exactly one of text_input"),
]


def test_bad_input_is_refused_clearly_while_another_stream_keeps_going(triton):
    with LLMStream(triton.grpc_url) as stream:
        running = stream.submit(messages=chat(QUESTIONS[2]), max_tokens=40)
        for body, message in BAD_REQUESTS:
            reply = requests.post(generate_url(triton), json=body, timeout=30)
            assert reply.status_code == 400, (body, reply.text)
            assert message in reply.json()["error"], reply.text
        assert running.done.wait(120)
    assert running.error is None and running.finish_reason == "length" and running.completion_tokens == 40


def test_bad_input_over_the_grpc_stream_gets_an_error_response(triton):
    with LLMStream(triton.grpc_url) as stream:
        generation = stream.submit(text_input="Hi", max_tokens=0)
        assert generation.done.wait(30)
    assert "max_tokens must be >= 1" in generation.error


def test_http_generate_returns_the_whole_text(triton):
    body = {"messages": json.dumps(chat(QUESTIONS[0])), "max_tokens": 20}
    reply = requests.post(generate_url(triton), json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["text_output"] == "The capital of France is Paris."
    assert answer["finish_reason"] == "stop" and answer["completion_tokens"] == 8


def test_http_generate_stream_sends_server_sent_events(triton):
    body = {"text_input": "The capital of France is", "max_tokens": 6, "stream": True}
    with requests.post(generate_url(triton, stream=True), json=body, stream=True, timeout=60) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert len(events) >= 3
    assert [e["finish_reason"] for e in events[:-1]] == [""] * (len(events) - 1)
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 6
    assert "".join(e["text_output"] for e in events).startswith(" Paris")


def test_plain_infer_through_llm_infer(triton, http_client):
    result = http_client.infer("llm_infer", llm_inputs(messages=chat(QUESTIONS[0]), max_tokens=20,
                                                       infer_input=httpclient.InferInput))
    assert result.as_numpy("text_output")[0].decode() == "The capital of France is Paris."
    assert result.as_numpy("finish_reason")[0].decode() == "stop"
    with pytest.raises(InferenceServerException, match="invalid request: max_tokens must be >= 1") as error:
        http_client.infer("llm_infer", llm_inputs(text_input="Hi", max_tokens=0, infer_input=httpclient.InferInput))
    assert error.value.status() == "400"


def test_plain_infer_calls_batch_in_the_engine(triton):
    clients = [httpclient.InferenceServerClient(triton.http_url, network_timeout=120) for _ in range(4)]
    results: dict[int, str] = {}

    def call(index: int) -> None:
        answer = clients[index].infer("llm_infer", llm_inputs(messages=chat(QUESTIONS[index]), max_tokens=12,
                                                              infer_input=httpclient.InferInput))
        results[index] = answer.as_numpy("text_output")[0].decode()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: metric(triton, "llm_running_sequences") >= 2, timeout_s=30)
    for thread in threads:
        thread.join(120)
    for client in clients:
        client.close()
    assert sorted(results) == [0, 1, 2, 3] and all(results.values())


def test_engine_metrics_are_exported(triton):
    assert metric(triton, "llm_kv_blocks_total") > 0
    assert metric(triton, "llm_generated_tokens_total") > 0
    assert metric(triton, "llm_time_to_first_token_seconds_count") > 0
    assert metric(triton, "llm_time_per_output_token_seconds_count") > 0
    assert metric(triton, "llm_preemptions_total") >= 0
    assert metric(triton, "llm_waiting_sequences") >= 0


def test_an_http_client_that_disconnects_mid_stream_frees_its_sequence(triton):
    cancelled_before = metric(triton, "llm_requests_finished_total", finish_reason="cancelled")
    body = {"text_input": "Once upon a time", "max_tokens": 1000, "stream": True}
    with requests.post(generate_url(triton, stream=True), json=body, stream=True, timeout=60) as reply:
        events = 0
        for line in reply.iter_lines():
            events += bool(line)
            if events == 3:
                break  # leaving the block closes the connection mid-generation
    assert wait_for(lambda: metric(triton, "llm_requests_finished_total", finish_reason="cancelled")
                    == cancelled_before + 1)
    assert wait_for(lambda: metric(triton, "llm_running_sequences") == 0 and metric(triton, "llm_kv_blocks_used") == 0)


def test_a_tenant_over_its_generated_token_quota_is_refused_while_others_generate(triton, http_client):
    """serving.toml: the batch tier (nightly-backfill) may take 500 generated tokens at once,
    50/s after that; a request reserves its max_tokens and gets back what it did not use."""
    stream = LLMStream(triton.grpc_url)
    try:
        first = stream.submit(text_input="Count from 1 to 500, separated by commas:", max_tokens=500,
                              parameters=as_tenant("nightly-backfill"))
        assert wait_for(lambda: len(first.deltas) >= 2), first.error
        second = llm_inputs(text_input="Hi", max_tokens=200, infer_input=httpclient.InferInput)
        with pytest.raises(InferenceServerException, match="over its quota of 50 generated tokens/s") as refused:
            http_client.infer("llm_infer", second, parameters=as_tenant("nightly-backfill"))
        assert refused.value.status() == "503" and "retry after" in refused.value.message()
        other = http_client.infer("llm_infer", llm_inputs(messages=chat(QUESTIONS[0]), max_tokens=20,
                                                          infer_input=httpclient.InferInput),
                                  parameters=as_tenant("search-frontend"))
        assert other.as_numpy("text_output")[0].decode() == "The capital of France is Paris."
    finally:
        stream.close(cancel=True)
    # Cancelling gave back the reservation it did not use: the tenant is served again.
    assert wait_for(lambda: metric(triton, "llm_running_sequences") == 0)
    again = http_client.infer("llm_infer", llm_inputs(text_input="Hi", max_tokens=8, infer_input=httpclient.InferInput),
                              parameters=as_tenant("nightly-backfill"))
    assert again.as_numpy("finish_reason")[0].decode() in ("stop", "length")


def test_a_bad_tenant_credential_is_refused_before_anything_is_generated(triton, http_client):
    """serving.toml authenticates tenants (anonymous mode): a forged, expired or malformed
    token, or a bare `tenant` claim, is a 400 on every way into the engine; nothing is generated."""
    from tools.clients.tenant_token import issue
    from tools.paths import DEFAULT_SPEC
    from tools.spec.serving import load_spec

    keys_file = load_spec(DEFAULT_SPEC).tenant_auth.keys_file
    valid = as_tenant("search-frontend")["tenant_token"]
    expired, _, _ = issue(keys_file, "search-frontend", ttl_s=1, now_s=time.time() - 3600)
    forged = valid[:-2] + ("AA" if not valid.endswith("AA") else "BB")
    generated_before = metric(triton, "llm_generated_tokens_total")
    body = {"messages": json.dumps(chat("Say hello.")), "max_tokens": 4}
    for parameters, reason in (({"tenant_token": forged}, "signature does not match"),
                               ({"tenant_token": expired}, "expired"),
                               ({"tenant_token": "v1.garbage"}, "malformed"),
                               ({"tenant": "search-frontend"}, "without a tenant token")):
        reply = requests.post(generate_url(triton), json={**body, **parameters}, timeout=60)
        assert reply.status_code == 400 and "authentication failed: " in reply.text and reason in reply.text, reply.text
        with pytest.raises(InferenceServerException) as refused:
            http_client.infer("llm_infer", llm_inputs(text_input="Hi", max_tokens=4, infer_input=httpclient.InferInput),
                              parameters=parameters)
        assert refused.value.status() == "400" and reason in refused.value.message()
    # The header carries the token through infer (Triton 2.51 forwards headers there, not on
    # generate, whose JSON body carries it instead).
    for token, served in ((forged, False), (valid, True)):
        inputs = llm_inputs(text_input="Hi", max_tokens=4, infer_input=httpclient.InferInput)
        if served:
            assert http_client.infer("llm_infer", inputs, headers={"tenant-token": token}).as_numpy("text_output")
        else:
            with pytest.raises(InferenceServerException, match="signature does not match"):
                http_client.infer("llm_infer", inputs, headers={"tenant-token": token})
    reply = requests.post(generate_url(triton), json={**body, "tenant_token": valid}, timeout=120)
    assert reply.status_code == 200, reply.text
    # Only the two valid requests generated anything.
    assert metric(triton, "llm_generated_tokens_total") - generated_before <= 8
    # At its default verbosity the server logs neither the prompts nor the tokens.
    log = (LOG_DIR / "tritonserver.log").read_text(errors="replace")
    assert "Say hello" not in log and not any(question in log for question in QUESTIONS)
    assert valid not in log and forged not in log and expired not in log
