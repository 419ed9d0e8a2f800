"""The OpenAI API's shapes, and their mapping to the `llm` model's tensors and errors: pure.

The front (`tools.llm_api.app`) parses a request body into `ChatRequest` or `CompletionRequest`
(pydantic: a field of the wrong type is a 400 naming it), turns it into the model's inputs
with `generation_inputs`, and shapes what the model streams back with `chat_chunk`,
`chat_response`, `completion_chunk` and `completion_response`. A Triton error becomes an
OpenAI error body and HTTP status with `error_of_triton`.

Supported: `messages` (chat) or `prompt` (completions), `max_tokens` (or
`max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`, `stream` and
`stream_options.include_usage`. Fields that would change what is generated in a way the
engine does not do (`n` > 1, `logprobs`, `tools`, penalties other than 0) are refused with a
400 naming them, not silently ignored; fields that change nothing here (`user`, `metadata`)
are accepted.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from python_backends.common.errors import INVALID_REQUEST
from python_backends.common.tenant_auth import TOKEN_PARAMETER

ANONYMOUS_KEY = "anonymous"  # the API key that means "no tenant token": the spec's anonymous tenant
MAX_STOP_SEQUENCES = 4  # as OpenAI's API


class ApiError(Exception):
    """An error to answer with: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported: send text",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    """What chat and completion requests share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """A 400 for a field that would change the output in a way the engine does not do."""
        if self.n != 1:
            raise ApiError(400, "n must be 1: each request generates one choice", param="n")
        extra = self.model_extra or {}
        for name in ("logprobs", "top_logprobs", "tools", "functions", "tool_choice", "function_call",
                     "response_format", "logit_bias", "best_of", "suffix", "echo"):
            value = extra.get(name)
            if value not in (None, False, [], {}) and not (name == "response_format" and value == {"type": "text"}):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        for name in ("presence_penalty", "frequency_penalty"):
            if extra.get(name) not in (None, 0, 0.0):
                raise ApiError(400, f"'{name}' is not supported by this server (only 0)", param=name)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str]

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "prompt must be one string (a list of several prompts is not supported)",
                           param="prompt")
        return self.prompt[0]


def parse(model: type[ChatRequest] | type[CompletionRequest], body: object) -> ChatRequest | CompletionRequest:
    """The request, or a 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
    request.refuse_unsupported()
    return request


def generation_inputs(request: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The `llm` model's inputs (keywords of `tools.clients.llm.llm_inputs`)."""
    inputs: dict[str, Any] = {"max_tokens": request.max_new_tokens(), "temperature": request.temperature,
                              "top_p": request.top_p, "seed": request.seed, "stop": request.stop_list(),
                              "stream": True}
    if isinstance(request, ChatRequest):
        inputs["messages"] = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                              for m in request.messages]
    else:
        inputs["text_input"] = request.prompt_text()
    return inputs


def tenant_parameters(authorization: str | None) -> dict[str, str]:
    """The request parameters that carry the tenant: the API key (`Authorization: Bearer KEY`)
    is the tenant's token; no key, or `anonymous`, sends none (the anonymous tenant, where
    the spec allows one)."""
    if not authorization:
        return {}
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "send the tenant token as 'Authorization: Bearer <token>'", code="invalid_api_key")
    return {} if key == ANONYMOUS_KEY else {TOKEN_PARAMETER: key}


def error_of_triton(status: str | None, message: str) -> ApiError:
    """The OpenAI error for a Triton error, the server's message kept. `status` is the code as
    tritonclient gives it ("StatusCode.X" or an HTTP code), or None where it gives none (an
    error inside a gRPC stream carries only its message, so the message decides: the `llm`
    model starts each kind of refusal with its own words)."""
    code = (status or "").rsplit(".", 1)[-1].upper()
    if message.startswith("authentication failed"):
        return ApiError(401, message, code="invalid_api_key")
    if " is over its quota " in message:
        return ApiError(429, message, "rate_limit_error", "rate_limit_exceeded")
    if message.startswith(INVALID_REQUEST) or code in ("INVALID_ARGUMENT", "400"):
        return ApiError(400, message.removeprefix(INVALID_REQUEST))
    if "unknown model" in message or code in ("NOT_FOUND", "404"):
        return ApiError(404, message, code="model_not_found")
    if code in ("UNAVAILABLE", "503") or "retry" in message:
        return ApiError(503, message, "server_error", "overloaded")
    return ApiError(500, message, "server_error")


@dataclass(frozen=True)
class Reply:
    """What one request has generated so far (`delta` is the newest text)."""

    delta: str
    finish_reason: str  # "" until the last
    prompt_tokens: int
    completion_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def chat_chunk(request_id: str, model: str, created: int, reply: Reply, first: bool) -> dict:
    delta: dict[str, str] = {"role": "assistant"} if first else {}
    if reply.delta:
        delta["content"] = reply.delta
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": reply.finish_reason or None}]}


def chat_response(request_id: str, model: str, created: int, text: str, last: Reply) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": last.finish_reason}],
            "usage": usage(last)}


def completion_chunk(request_id: str, model: str, created: int, reply: Reply) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": reply.delta, "logprobs": None,
                         "finish_reason": reply.finish_reason or None}]}


def completion_response(request_id: str, model: str, created: int, text: str, last: Reply) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}],
            "usage": usage(last)}


def usage_chunk(request_id: str, model: str, created: int, last: Reply, chat: bool) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(last)}


def models_list(models: list[str], created: int) -> dict:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "triton-slo-kit"}
                     for name in models]}
