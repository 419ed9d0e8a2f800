"""The OpenAI-compatible front (FastAPI, served by uvicorn) in front of the `llm` model.

    GET  /v1/models             the LLM models this front serves
    POST /v1/chat/completions   chat messages through the model's own chat template
    POST /v1/completions        a raw prompt
    GET  /health                200 while tritonserver is live

Each request is one generation of the model over Triton's gRPC stream, so the engine, the
tenant's token quota, the metrics and the authentication are the model's own: the API key
(`Authorization: Bearer ...`) is sent as the tenant token. A streamed answer is server-sent
events ending in `data: [DONE]`; a client that closes its stream cancels the generation on
the server (the engine frees its KV blocks and counts it `finish_reason="cancelled"`).
Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
request, 401 for a bad token, 404 for an unknown model, 429 over the tenant's quota, 503
when the server is busy. An error after the first event of a stream is sent as an event
with that body, then the stream ends.

The shapes and mappings are `tools.llm_api.protocol` (pure); this module does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import tritonclient.grpc.aio as grpcaio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tritonclient.utils import InferenceServerException

from tools.clients.llm import llm_inputs
from tools.clients.tls import client_tls_kwargs
from tools.llm_api.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_of_triton,
    generation_inputs,
    models_list,
    new_id,
    parse,
    tenant_parameters,
    usage_chunk,
)


class TritonLLM:
    """Generations of Triton's LLM models, each over its own gRPC stream."""

    def __init__(self, url: str, tls_ca: Path | None = None):
        self.client = grpcaio.InferenceServerClient(url, **client_tls_kwargs(tls_ca))

    async def live(self) -> bool:
        try:
            return await self.client.is_server_live()
        except InferenceServerException:
            return False

    async def generate(self, model: str, inputs: dict, parameters: dict[str, str]) -> AsyncIterator[Reply]:
        """The model's responses to one request, as they arrive; an `ApiError` for its error.
        Closing the iterator before the last response cancels the request on the server."""
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": llm_inputs(**inputs), "parameters": parameters or None}
            await finished.wait()  # the stream stays open until the last response (or a cancel)

        call = self.client.stream_infer(requests())
        answered = False  # the last response came: the stream is ended, not cancelled
        try:
            async for result, error in call:
                if error is not None:
                    raise error_of_triton(error.status(), error.message())
                reply = Reply(delta=result.as_numpy("text_output")[0].decode("utf-8"),
                              finish_reason=result.as_numpy("finish_reason")[0].decode(),
                              prompt_tokens=int(result.as_numpy("prompt_tokens")[0]),
                              completion_tokens=int(result.as_numpy("completion_tokens")[0]))
                answered = bool(reply.finish_reason)
                yield reply
                if answered:
                    return
        except InferenceServerException as err:  # the stream itself failed (server gone, TLS, ...)
            raise error_of_triton(err.status(), err.message()) from None
        finally:
            finished.set()  # ends the request side of the stream
            if answered:
                # Let the server end the finished stream rather than cancel it. A tritonserver
                # whose `llm` had served one completion here (answered, then cancelled) twice
                # failed to unload it on stop: the model's finalize never ran, the server still
                # held a request of it until its exit timeout.
                try:
                    await asyncio.wait_for(_drained(call), timeout=STREAM_END_TIMEOUT_S)
                except Exception:  # the answer is in: a stream that does not end is cut
                    call.cancel()
            else:
                call.cancel()

    async def close(self) -> None:
        await self.client.close()


async def _drained(call) -> None:
    """Until the server ends the stream (nothing more comes after the last response)."""
    async for _ in call:
        pass


SHUTDOWN_S = 10  # on SIGTERM, streams still open after this long are cut
STREAM_END_TIMEOUT_S = 5.0  # how long a finished generation's stream may take to end


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(triton_url: str, models: Sequence[str] = ("llm",), tls_ca: Path | None = None) -> FastAPI:
    """The API in front of the LLM `models` of the tritonserver at `triton_url` (gRPC)."""
    backend: dict[str, TritonLLM] = {}
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        backend["llm"] = TritonLLM(triton_url, tls_ca)
        try:
            yield
        finally:
            await backend.pop("llm").close()

    app = FastAPI(title="triton-slo-kit OpenAI-compatible LLM API", version="1.0", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.get("/health")
    async def health() -> JSONResponse:
        live = await backend["llm"].live()
        return JSONResponse({"status": "ok" if live else "tritonserver is not live"}, status_code=200 if live else 503)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return models_list(list(models), started)

    async def body_of(request: Request) -> object:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not JSON: {err}") from None

    async def complete(request: Request, kind: type[ChatRequest] | type[CompletionRequest]):
        parsed = parse(kind, await body_of(request))
        if parsed.model not in models:
            raise ApiError(404, f"model '{parsed.model}' is not served here; models: {', '.join(models)}",
                           code="model_not_found", param="model")
        parameters = tenant_parameters(request.headers.get("authorization"))
        chat = kind is ChatRequest
        request_id, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        replies = backend["llm"].generate(parsed.model, generation_inputs(parsed), parameters)
        # The first response before the status line: a refusal is an HTTP error, not an event.
        try:
            first = await anext(replies)
        except StopAsyncIteration:
            raise ApiError(502, "the model ended the stream without an answer", "server_error") from None
        if not parsed.stream:
            text, last = [first.delta], first
            async for reply in replies:
                text.append(reply.delta)
                last = reply
            shape = chat_response if chat else completion_response
            return JSONResponse(shape(request_id, parsed.model, created, "".join(text), last))
        return StreamingResponse(_events(replies, first, parsed, request_id, created, chat),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, CompletionRequest)

    return app


async def _events(replies: AsyncIterator[Reply], first: Reply, request: ChatRequest | CompletionRequest,
                  request_id: str, created: int, chat: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer. When the client goes away, the server
    stops this generator, and closing `replies` cancels the generation."""
    model, last, opening = request.model, first, True
    try:
        reply: Reply | None = first
        while reply is not None:
            last = reply
            if reply.delta or reply.finish_reason or opening:
                yield _event(chat_chunk(request_id, model, created, reply, opening) if chat
                             else completion_chunk(request_id, model, created, reply))
                opening = False
            reply = await anext(replies, None)
        if request.include_usage():
            yield _event(usage_chunk(request_id, model, created, last, chat))
    except ApiError as err:
        yield _event(err.body())
    finally:
        await replies.aclose()
    yield "data: [DONE]\n\n"


def serve(triton_url: str, host: str, port: int, models: Sequence[str], tls_ca: Path | None = None) -> None:
    """The API until SIGINT or SIGTERM."""
    import uvicorn

    uvicorn.run(create_app(triton_url, models, tls_ca), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=SHUTDOWN_S)
