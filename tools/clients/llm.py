"""A streaming client for the `llm` model: many generations over one gRPC stream.

Each response is timestamped on arrival, so a finished `Generation` knows its time to first
token and time per output token as the client saw them. Used by the benchmark and tests.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

STREAM_CLOSED = "stream closed"  # the error of a request still running when its stream was closed


@dataclass
class Generation:
    """One request's stream of responses, as received."""

    request_id: str
    sent_s: float  # time.monotonic() when it was sent
    deltas: list[str] = field(default_factory=list)  # text of each response, in order
    arrivals_s: list[float] = field(default_factory=list)  # when each response arrived
    token_counts: list[int] = field(default_factory=list)  # completion tokens so far, per response
    finish_reason: str | None = None  # set by the final response
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # the server's error, if the request failed
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals_s[0] - self.sent_s if self.arrivals_s else None

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2 or len(self.arrivals_s) < 2:
            return None
        return (self.arrivals_s[-1] - self.arrivals_s[0]) / (self.completion_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        return self.arrivals_s[-1] - self.sent_s if self.done.is_set() and self.arrivals_s else None


def llm_inputs(*, text_input: str | None = None, messages: list[dict] | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               stop: list[str] | None = None, stream: bool = True, infer_input=grpcclient.InferInput) -> list:
    """The request tensors; `infer_input` may be tritonclient.http.InferInput for HTTP."""

    def tensor(name: str, array: np.ndarray, datatype: str):
        item = infer_input(name, list(array.shape), datatype)
        item.set_data_from_numpy(array)
        return item

    inputs = []
    if text_input is not None:
        inputs.append(tensor("text_input", np.array([text_input.encode()], dtype=np.object_), "BYTES"))
    if messages is not None:
        inputs.append(tensor("messages", np.array([json.dumps(messages).encode()], dtype=np.object_), "BYTES"))
    if max_tokens is not None:
        inputs.append(tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"))
    if temperature is not None:
        inputs.append(tensor("temperature", np.array([temperature], dtype=np.float32), "FP32"))
    if top_p is not None:
        inputs.append(tensor("top_p", np.array([top_p], dtype=np.float32), "FP32"))
    if seed is not None:
        inputs.append(tensor("seed", np.array([seed], dtype=np.int64), "INT64"))
    if stop:
        inputs.append(tensor("stop", np.array([s.encode() for s in stop], dtype=np.object_), "BYTES"))
    if infer_input is grpcclient.InferInput:
        inputs.append(tensor("stream", np.array([stream]), "BOOL"))
    return inputs


class LLMStream:
    """Concurrent generations multiplexed over one gRPC stream, matched by request id."""

    def __init__(self, url: str, model: str = "llm", tls_ca: Path | None = None):
        from tools.clients.tls import client_tls_kwargs

        self.model = model
        self.client = grpcclient.InferenceServerClient(url, **client_tls_kwargs(tls_ca))
        self._pending: dict[str, Generation] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.client.start_stream(callback=self._on_response)

    def submit(self, parameters: dict | None = None, **request) -> Generation:
        """Send one request (keywords of `llm_inputs`; `parameters` such as the tenant); the
        Generation fills in as responses arrive."""
        with self._lock:
            request_id = str(next(self._ids))
            generation = Generation(request_id=request_id, sent_s=time.monotonic())
            self._pending[request_id] = generation
        self.client.async_stream_infer(self.model, llm_inputs(**request), request_id=request_id,
                                       parameters=parameters, enable_empty_final_response=False)
        return generation

    def _on_response(self, result, error) -> None:
        now = time.monotonic()
        if error is not None:
            request_id = getattr(error, "request_id", None) or ""
            with self._lock:
                generation = self._pending.pop(request_id, None)
                if generation is None and len(self._pending) == 1:  # errors may carry no id
                    generation = self._pending.pop(next(iter(self._pending)))
            if generation is not None:
                generation.error = str(error)
                generation.done.set()
            return
        response = result.get_response()
        with self._lock:
            generation = self._pending.get(response.id)
        if generation is None:
            return
        generation.deltas.append(result.as_numpy("text_output")[0].decode("utf-8"))
        generation.arrivals_s.append(now)
        generation.prompt_tokens = int(result.as_numpy("prompt_tokens")[0])
        generation.completion_tokens = int(result.as_numpy("completion_tokens")[0])
        generation.token_counts.append(generation.completion_tokens)
        reason = result.as_numpy("finish_reason")[0].decode()
        if reason:
            generation.finish_reason = reason
            with self._lock:
                self._pending.pop(response.id, None)
            generation.done.set()

    def close(self, cancel: bool = False) -> None:
        """End the stream; with `cancel`, requests still running are cancelled on the server."""
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()
        with self._lock:
            for generation in self._pending.values():
                generation.error = generation.error or STREAM_CLOSED
                generation.done.set()
            self._pending.clear()

    def __enter__(self) -> LLMStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
