"""`python -m tools llm-api`: the OpenAI-compatible front of the `llm` model, driven by the
`openai` package against the session's tritonserver."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import openai
import pytest
import requests

from tests.doc_examples import run_shown, shell, shown
from tests.integration.conftest import LOG_DIR
from tests.integration.helpers import CHAT_QUESTIONS, as_tenant, metric, wait_for, wait_until_up
from tools.clients.llm import LLMStream
from tools.server.triton_server import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
QUESTION = CHAT_QUESTIONS[0]


API_COMMAND = shown("docs/serving.md", "python -m tools llm-api --port 9000 --triton-url localhost:8001")
CURL = shown("docs/serving.md", "curl -s localhost:9000/v1/chat/completions -H 'Authorization: Bearer anonymous' "
             "-H 'Content-Type: application/json' -d '{\"model\": \"llm\", \"messages\": [{\"role\": \"user\", "
             "\"content\": \"What is the capital of France?\"}], \"max_tokens\": 16}'")


@pytest.fixture(scope="module")
def api(triton):
    """The API as the doc starts it, on a free port, in front of the session server."""
    ports = {"llm_api": free_port(), "grpc": int(triton.grpc_url.rsplit(":", 1)[1])}
    argv, env = shell(API_COMMAND, ports)
    log = (LOG_DIR / "llm-api.log").open("w")
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{ports['llm_api']}"
    try:
        wait_until_up(f"{base}/health", process=process)
        yield {"url": f"{base}/v1", "ports": ports}
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_shown_request_gets_a_chat_completion(api):
    done = run_shown(CURL, ports=api["ports"])
    answer = json.loads(done.stdout)
    assert answer["object"] == "chat.completion" and "Paris" in answer["choices"][0]["message"]["content"], answer


def client(api: dict, key: str = "anonymous") -> openai.OpenAI:
    return openai.OpenAI(base_url=api["url"], api_key=key, max_retries=0, timeout=120)


def triton_greedy(triton, max_tokens: int, **request) -> str:
    with LLMStream(triton.grpc_url) as stream:
        generation = stream.submit(max_tokens=max_tokens, temperature=0.0, **request)
        assert generation.done.wait(120) and generation.error is None, generation.error
        return generation.text


def test_models_lists_the_llm(api):
    assert [model.id for model in client(api).models.list()] == ["llm"]


def test_a_chat_completion_is_the_models_own_greedy_answer_with_usage(api, triton):
    messages = [{"role": "user", "content": QUESTION}]
    answer = client(api, as_tenant("search-frontend")["tenant_token"]).chat.completions.create(
        model="llm", messages=messages, max_tokens=20, temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == triton_greedy(triton, 20,
                                                                                          messages=messages)
    assert choice.finish_reason in ("stop", "length") and answer.object == "chat.completion"
    assert answer.usage.prompt_tokens > 0 and 0 < answer.usage.completion_tokens <= 20
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_streamed_chat_sends_the_same_text_in_chunks_then_usage_and_done(api):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client(api).chat.completions.create(model="llm", messages=messages, max_tokens=20, temperature=0)
    chunks = list(client(api).chat.completions.create(model="llm", messages=messages, max_tokens=20, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(with_text) >= 2  # token by token, not one block
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in with_text) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = requests.post(f"{api['url']}/chat/completions", json={"model": "llm", "messages": messages, "max_tokens": 4,
                                                          "stream": True}, timeout=120)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_a_completion_continues_the_prompt_with_stop_and_seed(api, triton):
    prompt = "The three primary colours are"
    answer = client(api).completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0)
    assert answer.choices[0].text == triton_greedy(triton, 12, text_input=prompt)
    streamed = client(api).completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text
    stopped = client(api).completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    sampled = [client(api).completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
               .choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same sample


def test_closing_a_stream_cancels_its_generation_on_the_server(api, triton):
    cancelled_before = metric(triton, "llm_requests_finished_total", finish_reason="cancelled")
    stream = client(api).completions.create(model="llm", prompt="Once upon a time", max_tokens=1000, stream=True)
    for received, _chunk in enumerate(stream):
        if received == 3:
            break
    stream.close()
    assert wait_for(lambda: metric(triton, "llm_requests_finished_total", finish_reason="cancelled")
                    == cancelled_before + 1)
    assert wait_for(lambda: metric(triton, "llm_running_sequences") == 0 and metric(triton, "llm_kv_blocks_used") == 0)


@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"model": "gpt-4o"}, openai.NotFoundError, "model 'gpt-4o' is not served here; models: llm"),
    ({"temperature": 5}, openai.BadRequestError, "temperature"),
    ({"n": 2}, openai.BadRequestError, "n must be 1"),
    ({"max_tokens": 5000}, openai.BadRequestError, "exceeds the context of 2048 tokens"),
    ({"logprobs": True}, openai.BadRequestError, "'logprobs' is not supported"),
])
def test_bad_requests_get_openai_errors_naming_the_problem(api, kwargs, error, says):
    request = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(error) as refused:
        client(api).chat.completions.create(**request)
    assert says in refused.value.message, refused.value.message
    assert set(refused.value.body) >= {"message", "type", "code"}


def test_a_bad_token_is_401_and_a_tenant_over_its_quota_429(api, triton):
    with pytest.raises(openai.AuthenticationError) as refused:
        client(api, "v1.garbage").chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=4)
    assert "authentication failed: " in refused.value.message
    # The batch tier (nightly-backfill) may reserve 500 generated tokens at once (serving.toml).
    backfill = client(api, as_tenant("nightly-backfill")["tenant_token"])
    running = backfill.completions.create(model="llm", prompt="Count from 1 to 500:", max_tokens=500, stream=True)
    try:
        next(iter(running))
        with pytest.raises(openai.RateLimitError) as over:
            backfill.completions.create(model="llm", prompt="Hi", max_tokens=200)
        assert "over its quota of 50 generated tokens/s" in over.value.message
        assert over.value.code == "rate_limit_exceeded"
    finally:
        running.close()
    # Closing the stream cancelled the generation that held the reservation: nothing keeps running.
    assert wait_for(lambda: metric(triton, "llm_running_sequences") == 0)
