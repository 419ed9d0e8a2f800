"""Locust users that call tritonserver through tritonclient, and the run's SLO bookkeeping.

One abstract `TritonUser` times every call and reports it through Locust's request event
(`environment.events.request.fire`), so Locust's own statistics, CSV and HTML reports see
every call, and the SLO recorder sees the same calls with their model and tenant. Concrete
users: embeddings over gRPC and HTTP, LLM chat streamed over gRPC (time to first token and
time per output token reported as their own entries) and LLM chat over HTTP to the
non-decoupled `llm_infer`.

This module is imported by `locustfile.py` after gevent has patched the standard library and
gRPC has been told to cooperate with it.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from locust import User, constant_throughput, task

from loadtest.mix import LoadMix, ModelKind, ModelMix, Protocol, draw_tenant, draw_weighted
from loadtest.slo import Metric, Sample
from tools.clients.retrying import Outcome, classify
from tools.clients.tls import client_tls_kwargs
from tools.spec.workload import ChatWorkload, TextFactory, draw_chat, load_chat_workload, load_workload

TEXT_POOL_SIZE = 256  # texts made per embedding workload at start; requests draw from them


@dataclass
class RunContext:
    """What every user of this process needs, set once when the run starts."""

    mix: LoadMix
    grpc_url: str  # host:port of tritonserver's gRPC endpoint
    http_url: str  # host:port of its HTTP endpoint
    priorities: dict[str, int]  # tenant -> Triton priority of its tier (0: the model's default)
    credentials: dict[str, dict] = field(default_factory=dict)  # tenant -> request parameters naming it (its token)
    samples: list[Sample] = field(default_factory=list)  # recorded here, shipped to the master on a worker
    texts: dict[Path, list[list[str]]] = field(default_factory=dict)  # embedding workload -> request rows
    chats: dict[Path, ChatWorkload] = field(default_factory=dict)  # chat workload file -> its kinds
    clients: list = field(default_factory=list)  # the users' open tritonclient clients and streams
    grpc_tls_ca: Path | None = None  # gRPC over TLS trusting this CA certificate; None = plaintext

    def prepare(self) -> None:
        """Make every request body the mix can send: a pool of texts per embedding workload,
        the chat workloads read."""
        for model in self.mix.models:
            if model.kind is ModelKind.LLM:
                self.chats.setdefault(model.workload, load_chat_workload(model.workload))
            elif model.workload not in self.texts:
                workload = load_workload(model.workload)
                factory = TextFactory()
                lengths = workload.sample_lengths(TEXT_POOL_SIZE * workload.rows_per_request)
                text_rng = random.Random(workload.seed)
                texts = [factory.text(n, text_rng) for n in lengths]
                rows = workload.rows_per_request
                self.texts[model.workload] = [texts[i:i + rows] for i in range(0, len(texts), rows)]

    def request_rows(self, workload_path: Path, rng: random.Random) -> list[str]:
        return rng.choice(self.texts[workload_path])

    def chat_workload(self, path: Path) -> ChatWorkload:
        return self.chats[path]

    def close_clients(self) -> None:
        """Close every client still open. A user killed when the run stops skips its on_stop,
        and a gRPC channel left to the interpreter's exit can hang it once gevent's hub is gone."""
        while self.clients:
            client = self.clients.pop()
            try:
                client.close()
            except Exception as err:  # closing is best effort: the run's results are already in
                logging.getLogger("loadtest").debug("closing a client failed: %s", err)


CONTEXT: RunContext | None = None  # set by the locustfile's init listener


class CallError(Exception):
    """A failed call as Locust's error report shows it: kind and server message, numbers
    replaced so that the same error from many requests is counted on one line."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {NUMBERS.sub('N', message)[:300]}")
        self.kind = kind


NUMBERS = re.compile(r"\d+(\.\d+)?")


def as_call_error(err: Exception) -> CallError:
    message = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
    return CallError(error_kind(err), message or type(err).__name__)


def error_kind(err: Exception) -> str:
    """A short label for a failed call: what the verdict's error breakdown counts."""
    from tritonclient.utils import InferenceServerException

    if isinstance(err, TimeoutError):
        return "timeout"
    if isinstance(err, InferenceServerException):
        status = str(err.status())
        if "DEADLINE_EXCEEDED" in status or "Deadline" in (err.message() or ""):
            return "timeout"
        outcome = classify(err.status(), err.message() or str(err))
        return {Outcome.REJECTED: "rejected", Outcome.CRASHED: "crashed"}.get(outcome, "failed")
    return "failed"


def client_module(protocol: Protocol):
    """tritonclient.grpc or tritonclient.http."""
    if protocol is Protocol.GRPC:
        import tritonclient.grpc as module
    else:
        import tritonclient.http as module
    return module


class TritonUser(User):
    """A client of tritonserver: picks a model of its kind and a tenant per request, times the
    call, and reports it to Locust and to the SLO recorder."""

    abstract = True
    kind: ModelKind
    protocol: Protocol
    wait_time = constant_throughput(1.0)  # replaced by the mix's user_rps when the run starts

    def __init__(self, environment):
        super().__init__(environment)
        if CONTEXT is None:
            raise RuntimeError("the load mix is not loaded: run this user through loadtest/locustfile.py")
        self.context = CONTEXT
        self.rng = random.Random()
        self.client = None

    def on_start(self) -> None:
        self.client = self.open_client()

    def on_stop(self) -> None:
        self.close_client()

    def open_client(self):
        client = self.make_client()
        self.context.clients.append(client)
        return client

    def close_client(self, **kwargs) -> None:
        if self.client is not None:
            if self.client in self.context.clients:
                self.context.clients.remove(self.client)
            self.client.close(**kwargs)
            self.client = None

    def make_client(self):
        timeout_s = self.context.mix.request_timeout_s
        if self.protocol is Protocol.GRPC:
            return client_module(self.protocol).InferenceServerClient(
                self.context.grpc_url, **client_tls_kwargs(self.context.grpc_tls_ca))
        return client_module(self.protocol).InferenceServerClient(
            self.context.http_url, connection_timeout=timeout_s, network_timeout=timeout_s)

    def pick(self) -> tuple[ModelMix, str | None]:
        model = draw_weighted(self.context.mix.models_for(self.kind, self.protocol), self.rng)
        return model, draw_tenant(self.context.mix, self.rng)

    def report(self, name: str, model: str, tenant: str | None, metric: Metric, sent_s: float, value_ms: float,
               error: Exception | None, response_length: int = 0) -> None:
        """One entry in Locust's statistics (`name`) and one SLO sample."""
        failure = as_call_error(error) if error is not None else None
        self.environment.events.request.fire(
            request_type="gRPC" if self.protocol is Protocol.GRPC else "HTTP", name=name,
            response_time=value_ms, response_length=response_length, exception=failure,
            context={"model": model, "tenant": tenant or "", "metric": metric.value})
        self.context.samples.append(Sample(at_s=sent_s, model=model, tenant=tenant or "", metric=metric,
                                           value_ms=value_ms, error=failure.kind if failure else ""))

    def parameters(self, tenant: str | None) -> dict | None:
        return self.context.credentials[tenant] if tenant else None

    def priority(self, tenant: str | None) -> int:
        return self.context.priorities.get(tenant or "", 0)


class EmbedUser(TritonUser):
    abstract = True
    kind = ModelKind.EMBED

    @task
    def embed(self) -> None:
        model, tenant = self.pick()
        rows = self.context.request_rows(model.workload, self.rng)
        tensor = client_module(self.protocol).InferInput("TEXT", [len(rows), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([row.encode() for row in rows], dtype=np.object_).reshape(-1, 1))
        options = {"parameters": self.parameters(tenant), "priority": self.priority(tenant)}
        if self.protocol is Protocol.GRPC:
            options["client_timeout"] = self.context.mix.request_timeout_s
        sent_s, start = time.time(), time.perf_counter()
        error, length = None, 0
        try:
            result = self.client.infer(model.model, [tensor], **options)
            length = result.as_numpy("EMBEDDING").nbytes
        except Exception as err:  # every failure is reported, none stops the user
            error = err
        self.report(model.model, model.model, tenant, Metric.LATENCY, sent_s, (time.perf_counter() - start) * 1e3,
                    error, length)


class EmbedGrpcUser(EmbedUser):
    protocol = Protocol.GRPC


class EmbedHttpUser(EmbedUser):
    protocol = Protocol.HTTP


def _chat_request(model: ModelMix, context: RunContext, rng: random.Random) -> dict:
    chat = draw_chat(context.chat_workload(model.workload), rng)
    max_tokens = min(chat.max_tokens, model.max_tokens_cap or chat.max_tokens)
    return {"messages": list(chat.messages), "max_tokens": max_tokens, "temperature": 0.0}


class LLMStreamUser(TritonUser):
    """Chat completions streamed over gRPC: one stream per user, one generation at a time."""

    kind = ModelKind.LLM
    protocol = Protocol.GRPC

    def make_client(self):
        from tools.clients.llm import LLMStream

        return LLMStream(self.context.grpc_url, tls_ca=self.context.grpc_tls_ca)

    @task
    def chat(self) -> None:
        model, tenant = self.pick()
        self.client.model = model.model
        request = _chat_request(model, self.context, self.rng)
        sent_s, start = time.time(), time.perf_counter()
        generation = self.client.submit(parameters=self.parameters(tenant), **request)
        finished = generation.done.wait(self.context.mix.request_timeout_s)
        error: Exception | None = None
        if not finished:
            error = TimeoutError(f"no final response within {self.context.mix.request_timeout_s:g} s")
            self.close_client(cancel=True)  # frees its sequence on the server; a fresh stream next time
            self.client = self.open_client()
        elif generation.error is not None:
            from tritonclient.utils import InferenceServerException

            error = InferenceServerException(generation.error, status=_status_of(generation.error))
        elapsed_ms = (time.perf_counter() - start) * 1e3
        name = model.model
        self.report(name, name, tenant, Metric.LATENCY, sent_s, elapsed_ms, error,
                    response_length=generation.completion_tokens)
        if error is None and generation.ttft_s is not None:
            self.report(f"{name} ttft", name, tenant, Metric.TTFT, sent_s, generation.ttft_s * 1e3, None)
            if generation.tpot_s is not None:
                self.report(f"{name} tpot", name, tenant, Metric.TPOT, sent_s, generation.tpot_s * 1e3, None)


def _status_of(message: str) -> str | None:
    """The gRPC status named in a stream error's text ("[StatusCode.UNAVAILABLE] ...")."""
    if message.startswith("[StatusCode."):
        return message[1:message.index("]")]
    return None


class LLMHttpUser(TritonUser):
    """Chat completions over HTTP to the non-decoupled twin (`llm_infer`): one answer each, so
    only the whole request's latency is known."""

    kind = ModelKind.LLM
    protocol = Protocol.HTTP

    @task
    def chat(self) -> None:
        from tools.clients.llm import llm_inputs

        model, tenant = self.pick()
        request = _chat_request(model, self.context, self.rng)
        sent_s, start = time.time(), time.perf_counter()
        error, tokens = None, 0
        try:
            inputs = llm_inputs(**request, infer_input=client_module(self.protocol).InferInput)
            result = self.client.infer(model.http_model, inputs, parameters=self.parameters(tenant),
                                       priority=self.priority(tenant))
            tokens = int(result.as_numpy("completion_tokens")[0])
        except Exception as err:  # every failure is reported, none stops the user
            error = err
        self.report(model.model, model.model, tenant, Metric.LATENCY, sent_s, (time.perf_counter() - start) * 1e3,
                    error, tokens)


USER_CLASSES: dict[tuple[ModelKind, Protocol], type[TritonUser]] = {
    (ModelKind.EMBED, Protocol.GRPC): EmbedGrpcUser,
    (ModelKind.EMBED, Protocol.HTTP): EmbedHttpUser,
    (ModelKind.LLM, Protocol.GRPC): LLMStreamUser,
    (ModelKind.LLM, Protocol.HTTP): LLMHttpUser,
}
