"""The OpenAI API's shapes and their mapping to the `llm` model (tools.llm_api.protocol): pure."""

from __future__ import annotations

import pytest

from python_backends.common.tenant_auth import TOKEN_PARAMETER
from tools.llm_api.protocol import (
    INVALID_REQUEST,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    chat_chunk,
    chat_response,
    error_of_triton,
    generation_inputs,
    parse,
    tenant_parameters,
    usage_chunk,
)

CHAT = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}]}


def test_the_llm_model_starts_bad_input_errors_as_the_front_expects():
    from python_backends.llm import service

    assert service.INVALID_REQUEST == INVALID_REQUEST


def test_a_chat_request_becomes_the_models_inputs():
    request = parse(ChatRequest, {**CHAT, "messages": [{"role": "developer", "content": "Be brief."},
                                                       {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                  "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                  "stop": "\n", "stream": True, "user": "someone"})
    assert generation_inputs(request) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"], "stream": True}


def test_a_completion_request_sends_its_prompt_as_text_input():
    request = parse(CompletionRequest, {"model": "llm", "prompt": ["Once"], "max_tokens": 5})
    inputs = generation_inputs(request)
    assert inputs["text_input"] == "Once" and inputs["max_tokens"] == 5 and "messages" not in inputs
    with pytest.raises(ApiError, match="prompt must be one string"):
        generation_inputs(parse(CompletionRequest, {"model": "llm", "prompt": ["a", "b"]}))


@pytest.mark.parametrize(("body", "says"), [
    ([1, 2], "must be a JSON object"),
    ({"model": "llm"}, "messages: Field required"),
    ({**CHAT, "temperature": 3}, "temperature: Input should be less than or equal to 2"),
    ({**CHAT, "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop sequences"),
    ({**CHAT, "n": 3}, "n must be 1"),
    ({**CHAT, "tools": [{"type": "function"}]}, "'tools' is not supported"),
    ({**CHAT, "presence_penalty": 0.5}, "'presence_penalty' is not supported by this server (only 0)"),
])
def test_bad_requests_are_400_naming_the_field(body, says):
    with pytest.raises(ApiError) as refused:
        parse(ChatRequest, body)
    assert refused.value.status == 400 and says in refused.value.message
    assert set(refused.value.body()["error"]) == {"message", "type", "param", "code"}


def test_harmless_fields_are_accepted():
    parse(ChatRequest, {**CHAT, "user": "u1", "presence_penalty": 0, "logprobs": False,
                        "response_format": {"type": "text"}, "metadata": {"k": "v"}})


def test_image_content_is_refused():
    request = parse(ChatRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    with pytest.raises(ApiError, match="content parts of type 'image_url'"):
        generation_inputs(request)


def test_the_api_key_is_the_tenant_token_and_anonymous_sends_none():
    assert tenant_parameters("Bearer v1.abc.def") == {TOKEN_PARAMETER: "v1.abc.def"}
    assert tenant_parameters("Bearer anonymous") == {} and tenant_parameters(None) == {}
    for bad in ("Basic dXNlcg==", "Bearer "):
        with pytest.raises(ApiError) as refused:
            tenant_parameters(bad)
        assert refused.value.status == 401


@pytest.mark.parametrize(("status", "message", "http", "code"), [
    (None, "authentication failed: the tenant token is malformed", 401, "invalid_api_key"),
    (None, "tenant 'x' is over its quota of 50 generated tokens/s (tier batch, burst 500; this request needs "
           "200); retry after 3.000 s", 429, "rate_limit_exceeded"),
    (None, "invalid request: max_tokens must be >= 1", 400, None),
    ("StatusCode.INVALID_ARGUMENT", "bad shape", 400, None),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'x' is not found", 404, "model_not_found"),
    ("StatusCode.UNAVAILABLE", "server busy", 503, "overloaded"),
    (None, "preparing the request failed: boom", 500, None),
])
def test_triton_errors_become_openai_errors(status, message, http, code):
    error = error_of_triton(status, message)
    assert (error.status, error.code) == (http, code)
    assert error.message == message.removeprefix(INVALID_REQUEST)


def test_chunks_and_responses_have_openais_shape():
    first = Reply("Hel", "", 5, 1)
    assert chat_chunk("c1", "llm", 7, first, first=True)["choices"][0] == {
        "index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}
    last = Reply("", "length", 5, 4)
    assert chat_chunk("c1", "llm", 7, last, first=False)["choices"][0]["delta"] == {}
    whole = chat_response("c1", "llm", 7, "Hello", last)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert usage_chunk("c1", "llm", 7, last, chat=True)["choices"] == []
