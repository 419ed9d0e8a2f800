"""The `llm` model's request path through a fake of Triton's `pb_utils`: authentication,
validation, tokenization errors, the tenant's token quota and its refund, and the responses
streamed back. The engine is a small fake (the real one is tested in test_llm_engine*.py);
the input checks are the real `inputs_from_arrays`."""

from __future__ import annotations

import numpy as np
import pytest

from python_backends.common.errors import InvalidInput
from python_backends.common.quotas import TenantPolicy, TierPolicy
from python_backends.common.tenant_auth import AuthConfig, AuthMode
from python_backends.llm.config import LLMParameters
from python_backends.llm.engine import EngineStats, StepOutput
from python_backends.llm.scheduler import FinishReason, SamplingParams
from python_backends.llm.service import LLMMetrics, LLMService
from tests.fakes.pb_utils import FakeTriton, Request, TritonError

TIERS = TenantPolicy(tiers={"standard": TierPolicy("standard", 1, 0.0, 0.0, llm_tokens_per_s=0.001,
                                                   llm_token_burst=10.0)},
                     default_tier="standard")


class FakeEngine:
    """Tokenizes a character a token; generates `w<i> ` words, `stop_after` at most."""

    def __init__(self, stop_after: int | None = None, max_prompt: int = 40):
        self.requests: dict[str, list] = {}
        self.stop_after = stop_after
        self.max_prompt = max_prompt
        self.prepared = 0

    def use_threads(self) -> None:  # no torch threads to set
        pass

    def prepare(self, inputs):
        self.prepared += 1
        prompt = [ord(c) for c in (inputs.text_input or "")]
        if inputs.text_input == "crash":
            raise RuntimeError("tokenizer fell over")
        if len(prompt) > self.max_prompt:
            raise InvalidInput(f"prompt of {len(prompt)} tokens exceeds the {self.max_prompt} the model takes")
        return prompt, SamplingParams(max_tokens=inputs.max_tokens or 4)

    @property
    def has_work(self):
        return bool(self.requests)

    def add(self, request_id, prompt, params):
        self.requests[request_id] = [0, params.max_tokens, len(prompt)]

    def abort(self, request_id):
        self.requests.pop(request_id, None)
        return None

    def step(self):
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[0] += 1
            length_done = state[0] >= state[1]
            stop_done = self.stop_after is not None and state[0] >= self.stop_after
            finish = FinishReason.LENGTH if length_done else FinishReason.STOP if stop_done else None
            if finish is not None:
                del self.requests[request_id]
            outputs.append(StepOutput(request_id, f"w{state[0]} ", state[2], state[0], finish))
        return outputs

    def stats(self):
        return EngineStats(len(self.requests), 0, 0, 1, 0, 0)


@pytest.fixture
def start():
    services = []

    def make(engine=None, **kwargs):
        fake = FakeTriton()
        service = LLMService(fake, "llm", lambda: engine or FakeEngine(), **kwargs)
        services.append(service)
        return fake, service

    yield make
    for service in services:
        service.finalize(drain_timeout_s=5.0)


def request(text: str | None = "hello", parameters=None, **values) -> Request:
    inputs = {"text_input": np.array([text.encode()], dtype=np.object_)} if text is not None else {}
    for name, value in values.items():
        inputs[name] = np.array([value])
    return Request(inputs, parameters)


def final(service, req):
    assert service.execute([req]) is None
    return req.sender.final()


def text_of(response) -> str:
    return response.output("text_output")[0].decode()


def test_a_request_is_answered_once_with_the_whole_text(start):
    _fake, service = start()
    response = final(service, request(max_tokens=np.int32(3)))
    assert not response.has_error()
    assert text_of(response) == "w1 w2 w3 "
    assert response.output("finish_reason")[0] == b"length"
    assert response.output("prompt_tokens").tolist() == [5]
    assert response.output("completion_tokens").tolist() == [3]
    assert len(service.loop.engine.requests) == 0


def test_a_streamed_request_gets_a_response_per_delta_and_the_final_flag_on_the_last(start):
    fake, service = start()
    req = request(max_tokens=np.int32(3), stream=True)
    final(service, req)
    sent = req.sender.sent
    assert [text_of(r) for r, _ in sent] == ["w1 ", "w2 ", "w3 "]
    assert [flags for _, flags in sent] == [0, 0, fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert [r.output("finish_reason")[0] for r, _ in sent] == [b"", b"", b"length"]
    service.finalize()
    assert fake.metric("llm_requests_finished_total", finish_reason="length").value == 1


@pytest.mark.parametrize(
    ("req", "code", "message"),
    [
        (request(None), TritonError.INVALID_ARG,
         "invalid request: send exactly one of text_input (a prompt) or messages (a JSON chat)"),
        (request("   "), TritonError.INVALID_ARG, "invalid request: text_input is empty"),
        (request(max_tokens=np.int32(0)), TritonError.INVALID_ARG, "invalid request: max_tokens must be >= 1, got 0"),
        (request("x" * 41), TritonError.INVALID_ARG,
         "invalid request: prompt of 41 tokens exceeds the 40 the model takes"),
        (request("crash"), TritonError.INTERNAL, "preparing the request failed: tokenizer fell over"),
    ],
)
def test_a_bad_request_is_refused_with_the_reason_and_never_reaches_the_engine(start, req, code, message):
    _fake, service = start()
    response = final(service, req)
    assert (response.error().code(), response.error().message()) == (code, message)
    assert service.loop.num_in_flight == 0


def test_a_request_without_a_required_token_is_refused_before_it_is_tokenized(start, tmp_path):
    engine = FakeEngine()
    _fake, service = start(engine, auth=AuthConfig(mode=AuthMode.REQUIRED, keys_file=str(tmp_path / "keys.json")))
    response = final(service, request())
    assert response.error().code() == TritonError.INVALID_ARG
    assert response.error().message().startswith("authentication failed: this model requires a tenant token")
    assert engine.prepared == 0


def test_a_tenant_reserves_its_max_tokens_and_gets_back_what_it_did_not_generate(start):
    engine = FakeEngine(stop_after=2)
    _fake, service = start(engine, tenants=TIERS)
    # Reserves 8 of the 10-token burst, generates 2: 6 come back, so 8 more fit.
    assert text_of(final(service, request(max_tokens=np.int32(8)))) == "w1 w2 "
    assert not final(service, request(max_tokens=np.int32(8))).has_error()
    # 2 + 2 generated: 6 left, so a request for 8 waits (the refill is a token in 1000 s).
    response = final(service, request(max_tokens=np.int32(8)))
    assert response.error().code() == TritonError.UNAVAILABLE
    assert response.error().message().startswith(
        "tenant 'default' is over its quota of 0.001 generated tokens/s (tier standard, burst 10; "
        "this request needs 8); retry after")
    assert not final(service, request(max_tokens=np.int32(6))).has_error()


def test_a_stopped_engine_refuses_new_requests(start):
    _fake, service = start()
    service.loop.error = RuntimeError("device lost")
    response = final(service, request())
    assert (response.error().code(), response.error().message()) == (
        TritonError.INTERNAL, "the LLM engine stopped: device lost")


def test_the_tenants_and_auth_parameters_are_read_with_the_engine_ones_and_errors_name_the_model():
    parameters = LLMParameters.from_parameters("llm", {"kv_cache_mb": "8", "tenants": TIERS.to_json()})
    assert parameters.tenants == TIERS
    assert parameters.tenant_auth.mode is AuthMode.OFF
    with pytest.raises(ValueError, match="model 'llm_v2': bad config parameters: parameter tenants: tenant policy "
                                         "is not valid"):
        LLMParameters.from_parameters("llm_v2", {"kv_cache_mb": "8", "tenants": "{not json"})
    with pytest.raises(ValueError, match="model 'llm_v2': parameter tenant_auth: "):
        LLMParameters.from_parameters("llm_v2", {"kv_cache_mb": "8", "tenant_auth": '{"mode": "sometimes"}'})


def test_the_engine_metrics_are_updated_only_where_a_step_changed_them():
    updates = []

    class Metric:
        def __init__(self, name):
            self.name = name

        def set(self, value):
            updates.append((self.name, value))

        def increment(self, amount):
            updates.append((self.name, amount))

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):  # spelled as in pb_utils
            return Metric(self.name)

    metrics = LLMMetrics(type("pb", (), {"MetricFamily": MetricFamily}), "llm")
    metrics.step(EngineStats(num_running=3, num_waiting=0, num_blocks_used=10, num_blocks=100, num_preemptions=0,
                             num_generated_tokens=5))
    assert updates == [("llm_running_sequences", 3), ("llm_kv_blocks_used", 10), ("llm_kv_blocks_total", 100),
                       ("llm_generated_tokens_total", 5)]
    updates.clear()
    metrics.step(EngineStats(num_running=3, num_waiting=2, num_blocks_used=10, num_blocks=100, num_preemptions=1,
                             num_generated_tokens=8, num_cached_prompt_tokens=16))
    assert updates == [("llm_waiting_sequences", 2), ("llm_preemptions_total", 1), ("llm_generated_tokens_total", 3),
                       ("llm_prefix_cache_hit_tokens_total", 16)]
    updates.clear()
    metrics.step(EngineStats(3, 2, 10, 100, 1, 8, 16))
    assert updates == []
