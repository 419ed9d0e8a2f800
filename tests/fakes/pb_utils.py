"""A small fake of `triton_python_backend_utils`, the API a Python backend gets from Triton.

`FakeTriton()` stands in for the module: the services under `python_backends` take it where
the adapters pass the real one. It keeps what the tests look at: every BLS call made, every
metric series with its value or observations, every log line. A BLS call
(`InferenceRequest(...).exec()`) is answered by `bls`, a function of the call; by default
`fake_encoder`, which answers like a bucket encoder with rows that say which row they
embed. Model readiness is the set `ready` of (model name, version) pairs, or everything
when it is None.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
EMBEDDING_DIM = 8  # the fake encoder's rows; the router does not care about the width


class TritonError(Exception):
    """Like pb_utils.TritonError: a message and a status code (default INTERNAL)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL):
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


CODE_NAMES = {TritonError.INTERNAL: "INTERNAL", TritonError.NOT_FOUND: "NOT_FOUND",
              TritonError.INVALID_ARG: "INVALID_ARG", TritonError.UNAVAILABLE: "UNAVAILABLE",
              TritonError.UNKNOWN: "UNKNOWN"}


class TritonModelException(Exception):
    """What a backend raises from `initialize` to fail the model load."""


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None):
        self._tensors = list(output_tensors or [])
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def output(self, name: str) -> np.ndarray:
        """The named output (a test helper; the real response has no such method)."""
        return get_output_tensor_by_name(self, name).as_numpy()


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_tensor_by_name(request: Request, name: str) -> Tensor | None:
    return request.inputs.get(name)


class ResponseSender:
    """Collects what a backend sends for one request."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.done = threading.Event()
        self.cancelled = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            raise RuntimeError("a response was sent after the final flag")
        self.sent.append((response, flags))
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def final(self, timeout_s: float = 10.0) -> InferenceResponse:
        """The response that came with the final flag (waits for a worker thread to send it)."""
        if not self.done.wait(timeout_s):
            raise AssertionError(f"no final response within {timeout_s} s")
        return self.sent[-1][0]


class Request:
    """A client request as a backend's `execute` receives it."""

    def __init__(self, inputs: Mapping[str, np.ndarray] | None = None, parameters: Mapping | str | None = None):
        self.inputs = {name: Tensor(name, array) for name, array in (inputs or {}).items()}
        self._parameters = parameters if isinstance(parameters, str) or parameters is None else json.dumps(parameters)
        self.sender = ResponseSender()

    def parameters(self) -> str:
        return self._parameters if self._parameters is not None else "{}"

    def get_response_sender(self) -> ResponseSender:
        return self.sender


@dataclass(eq=False)  # a series is itself, whatever its value (the router keys buffers on it)
class Metric:
    family: str
    labels: dict[str, str]
    buckets: list[float] | None = None
    value: float = 0.0
    observations: list[float] = field(default_factory=list)

    def increment(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.observations.append(value)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    registry: list[Metric]  # set per fake module

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: Mapping[str, str], buckets=None) -> Metric:  # spelled as in pb_utils
        metric = Metric(self.name, dict(labels), list(buckets) if buckets is not None else None)
        self.registry.append(metric)
        return metric


class Logger:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def log_info(self, message: str) -> None:
        self.lines.append(("info", message))

    def log_warn(self, message: str) -> None:
        self.lines.append(("warn", message))

    def log_error(self, message: str) -> None:
        self.lines.append(("error", message))


@dataclass(frozen=True)
class BlsCall:
    """One BLS call a backend made."""

    model_name: str
    model_version: int
    inputs: dict[str, np.ndarray]
    parameters: dict
    timeout_us: int = 0  # the request's timeout (0: none)


def fake_encoder(call: BlsCall) -> InferenceResponse:
    """Answers like a bucket encoder: one row per input row, holding (its real tokens, the
    version, its first token after [CLS], 1, ...), so a test can tell which row each is."""
    ids, mask = call.inputs["INPUT_IDS"], call.inputs["ATTENTION_MASK"]
    rows = np.ones((ids.shape[0], EMBEDDING_DIM), dtype=np.float32)
    rows[:, 0] = mask.sum(axis=1)
    rows[:, 1] = call.model_version
    rows[:, 2] = ids[:, 1]
    return InferenceResponse(output_tensors=[Tensor("EMBEDDING", rows)])


class FakeTriton:
    """The fake `pb_utils` module of one test."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = TRITONSERVER_RESPONSE_COMPLETE_FINAL
    TritonError = TritonError
    TritonModelException = TritonModelException
    Tensor = Tensor
    InferenceResponse = InferenceResponse
    get_input_tensor_by_name = staticmethod(get_input_tensor_by_name)
    get_output_tensor_by_name = staticmethod(get_output_tensor_by_name)

    def __init__(self, bls: Callable[[BlsCall], InferenceResponse | list[InferenceResponse]] = fake_encoder,
                 ready: set[tuple[str, int]] | None = None):
        self.bls = bls
        self.ready = ready
        self.calls: list[BlsCall] = []
        self.metrics: list[Metric] = []
        self.Logger = Logger()
        self.MetricFamily = type("MetricFamily", (MetricFamily,), {"registry": self.metrics})
        fake = self

        class InferenceRequest:
            def __init__(self, model_name: str, inputs: list[Tensor], requested_output_names=(),
                         model_version: int = -1, parameters: Mapping | None = None, timeout: int = 0, **_):
                self.call = BlsCall(model_name, int(model_version), {t.name(): t.as_numpy() for t in inputs},
                                    dict(parameters or {}), int(timeout))

            def exec(self, decoupled: bool = False):
                fake.calls.append(self.call)
                answer = fake.bls(self.call)
                if decoupled:
                    return iter(answer if isinstance(answer, list) else [answer])
                return answer

        self.InferenceRequest = InferenceRequest

    def is_model_ready(self, model_name: str, model_version: str = "") -> bool:
        return self.ready is None or (model_name, int(model_version or 0)) in self.ready

    def using_decoupled_model_transaction_policy(self, model_config: Mapping) -> bool:
        return bool(model_config.get("model_transaction_policy", {}).get("decoupled"))

    def metric(self, family: str, **labels: str) -> Metric:
        """The one series of `family` whose labels include `labels`."""
        found = [m for m in self.metrics if m.family == family and labels.items() <= m.labels.items()]
        if len(found) != 1:
            raise AssertionError(f"{len(found)} series of {family} with labels {labels}")
        return found[0]
