"""The batch workers' calls to tritonserver: one async caller per model kind.

A caller takes the payloads of a formed batch and returns one `CallOutcome` per payload, in
order, and never raises for a failed call: a failure is an outcome with its kind (what
`tools.clients.retrying.classify` makes of Triton's status and message), which the worker turns into
a retry or a final error. Embedding items go to the router as the rows of one request (the
router splits them over its buckets, up to `max_request_rows` per request); generations go
one request each to `llm_infer`, the non-decoupled front of the LLM engine, whose continuous
batching forms the batch on the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tools.clients.retrying import Outcome, classify


@dataclass(frozen=True)
class CallOutcome:
    result: dict | None  # the item's result when the call succeeded
    error_kind: str = ""  # "rejected", "crashed", "timeout", "failed" when it did not
    error: str = ""  # the server's message

    @property
    def ok(self) -> bool:
        return self.result is not None


def failure_of(err: Exception) -> CallOutcome:
    """What a failed call means for its items."""
    from tritonclient.utils import InferenceServerException

    if isinstance(err, asyncio.TimeoutError | TimeoutError):
        return CallOutcome(None, "timeout", "no answer within the call timeout")
    if isinstance(err, InferenceServerException):
        message = err.message() or str(err)
        status = str(err.status())
        if "DEADLINE_EXCEEDED" in status:
            return CallOutcome(None, "timeout", message)
        outcome = classify(status, message)
        kind = {Outcome.REJECTED: "rejected", Outcome.CRASHED: "crashed"}.get(outcome, "failed")
        if kind == "failed" and ("StatusCode.UNAVAILABLE" in status or "failed to connect" in message.lower()):
            kind = "unavailable"
        return CallOutcome(None, kind, message)
    return CallOutcome(None, "unavailable", f"{type(err).__name__}: {err}")


class EmbedCaller:
    """Embedding items (texts) as the rows of `embed` requests."""

    def __init__(self, client, model: str = "embed", max_rows: int = 128, timeout_s: float = 30.0):
        self.client = client  # tritonclient.grpc.aio.InferenceServerClient
        self.model = model
        self.max_rows = max_rows
        self.timeout_s = timeout_s

    async def __call__(self, payloads: Sequence[str], version: int | None = None) -> list[CallOutcome]:
        chunks = [payloads[i:i + self.max_rows] for i in range(0, len(payloads), self.max_rows)]
        results = await asyncio.gather(*(self._call(chunk, version) for chunk in chunks))
        return [outcome for chunk in results for outcome in chunk]

    async def _call(self, texts: Sequence[str], version: int | None) -> list[CallOutcome]:
        import tritonclient.grpc as grpcclient

        tensor = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1))
        parameters = {"version": version} if version is not None else None
        try:
            response = await self.client.infer(self.model, [tensor], parameters=parameters,
                                               client_timeout=self.timeout_s)
        except Exception as err:  # every failure becomes an outcome the worker can retry or record
            return [failure_of(err)] * len(texts)
        embeddings = response.as_numpy("EMBEDDING")
        return [CallOutcome({"embedding": [float(x) for x in row]}) for row in embeddings]


class LLMCaller:
    """Generation items ({"prompt" or "messages", "max_tokens"?}), one `llm_infer` request each."""

    def __init__(self, client, model: str = "llm_infer", timeout_s: float = 300.0):
        self.client = client  # tritonclient.grpc.aio.InferenceServerClient
        self.model = model
        self.timeout_s = timeout_s

    async def __call__(self, payloads: Sequence[dict], version: int | None = None) -> list[CallOutcome]:
        return list(await asyncio.gather(*(self._call(payload) for payload in payloads)))

    async def _call(self, payload: dict) -> CallOutcome:
        import tritonclient.grpc as grpcclient

        from tools.clients.llm import llm_inputs

        inputs = llm_inputs(text_input=payload.get("prompt"), messages=payload.get("messages"),
                            max_tokens=payload.get("max_tokens"), temperature=payload.get("temperature"),
                            seed=payload.get("seed"), stream=False, infer_input=grpcclient.InferInput)
        inputs = [tensor for tensor in inputs if tensor.name() != "stream"]  # llm_infer has no stream input
        try:
            response = await self.client.infer(self.model, inputs, client_timeout=self.timeout_s)
        except Exception as err:  # every failure becomes an outcome the worker can retry or record
            return failure_of(err)
        text = response.as_numpy("text_output").reshape(-1)[0]
        reason = response.as_numpy("finish_reason").reshape(-1)[0]
        return CallOutcome({
            "text": text.decode() if isinstance(text, bytes) else str(text),
            "finish_reason": reason.decode() if isinstance(reason, bytes) else str(reason),
            "completion_tokens": int(response.as_numpy("completion_tokens").reshape(-1)[0]),
        })
