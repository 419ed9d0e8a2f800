"""The `llm` model's request path: authentication, validation, tokenization and the tenant's
token quota in front of the engine loop, and the responses the loop streams back.

`LLMService` takes the Triton API as a parameter, `pb`: the `triton_python_backend_utils`
module in the server, a fake of it in the unit tests (`tests/fakes/pb_utils.py`). It uses
`pb.Tensor`, `pb.InferenceResponse`, `pb.TritonError` and its codes,
`pb.get_input_tensor_by_name`, `pb.MetricFamily`, `pb.Logger` and
`pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL`; nothing here imports Triton. Its I/O: the
response senders (from the engine loop's thread), Triton's metrics, the keys file.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from python_backends.common.allocator import retain_freed_memory
from python_backends.common.artifacts import verify_artifacts
from python_backends.common.errors import INVALID_REQUEST, InvalidInput
from python_backends.common.quotas import UNLIMITED, LocalBuckets, TenantPolicy, admit_tokens, refund_tokens
from python_backends.common.tenant_auth import (
    AUTH_OFF,
    AuthConfig,
    AuthError,
    AuthMode,
    KeySource,
    VerifiedTokens,
    resolve_tenant,
)
from python_backends.llm.config import REQUIRED_FILES, LLMParameters
from python_backends.llm.engine import EngineLoop, EngineStats, LLMEngine, StepOutput, inputs_from_arrays

INPUT_NAMES = ("text_input", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream")
TTFT_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0]
TPOT_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


def response_of(pb, text: str, output: StepOutput):
    reason = output.finish_reason.value if output.finish_reason is not None else ""
    return pb.InferenceResponse(output_tensors=[
        pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)),
        pb.Tensor("prompt_tokens", np.array([output.num_prompt_tokens], dtype=np.int32)),
        pb.Tensor("completion_tokens", np.array([output.num_output_tokens], dtype=np.int32)),
    ])


class TritonSink:
    """One request's response sender, as the engine loop's `RequestSink`."""

    def __init__(self, pb, sender, stream: bool, metrics: LLMMetrics, on_done=None):
        self.pb = pb
        self.sender = sender
        self.stream = stream
        self.metrics = metrics
        self.on_done = on_done  # called once with the tokens generated (the quota refund)
        self.text: list[str] = []  # the whole text, when not streaming

    def _finish(self, generated: int) -> None:
        if self.on_done is not None:
            self.on_done(generated)
            self.on_done = None

    def send(self, output: StepOutput) -> None:
        done = output.finish_reason is not None
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if done:
            self.metrics.finished(output)
            self._finish(output.num_output_tokens)
        if self.stream:
            self.sender.send(response_of(self.pb, output.text_delta, output), flags=final if done else 0)
        else:
            self.text.append(output.text_delta)
            if done:
                self.sender.send(response_of(self.pb, "".join(self.text), output), flags=final)

    def fail(self, message: str) -> None:
        self._finish(0)
        error = self.pb.TritonError(message, self.pb.TritonError.UNAVAILABLE)
        self.sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        return self.sender.is_cancelled()


class LLMMetrics:
    """The engine's custom metrics (Triton exports them on its metrics port)."""

    def __init__(self, pb, model: str):
        labels = {"model": model}
        family = pb.MetricFamily
        # A MetricFamily must outlive its Metrics: keep the families on the instance.
        self.families = [
            family("llm_time_to_first_token_seconds", "Arrival to first output token", family.HISTOGRAM),
            family("llm_time_per_output_token_seconds", "Mean time per output token after the first",
                   family.HISTOGRAM),
            family("llm_running_sequences", "Sequences in the running batch", family.GAUGE),
            family("llm_waiting_sequences", "Sequences waiting for KV-cache blocks or a batch slot", family.GAUGE),
            family("llm_kv_blocks_used", "KV-cache blocks held by sequences", family.GAUGE),
            family("llm_kv_blocks_total", "KV-cache blocks in the pool", family.GAUGE),
            family("llm_preemptions_total", "Sequences evicted for KV blocks and recomputed", family.COUNTER),
            family("llm_generated_tokens_total", "Output tokens generated", family.COUNTER),
            family("llm_requests_finished_total", "Finished requests by finish reason", family.COUNTER),
            family("llm_prefix_cache_hit_tokens_total", "Prompt tokens taken from the prefix cache, not computed",
                   family.COUNTER),
        ]
        (ttft, tpot, running, waiting, used, total, preemptions, tokens, finished, cached) = self.families
        self.ttft = ttft.Metric(labels=labels, buckets=TTFT_BUCKETS_S)
        self.tpot = tpot.Metric(labels=labels, buckets=TPOT_BUCKETS_S)
        self.running = running.Metric(labels=labels)
        self.waiting = waiting.Metric(labels=labels)
        self.blocks_used = used.Metric(labels=labels)
        self.blocks_total = total.Metric(labels=labels)
        self.preemptions = preemptions.Metric(labels=labels)
        self.tokens = tokens.Metric(labels=labels)
        self.cached_tokens = cached.Metric(labels=labels)
        self.finished_by_reason = {reason: finished.Metric(labels={**labels, "finish_reason": reason})
                                   for reason in ("stop", "length", "cancelled")}
        self._last = EngineStats(0, 0, 0, 0, 0, 0)

    def step(self, stats: EngineStats) -> None:
        """Update what changed since the last stats: each update is a round trip to the Triton
        process, made from the engine loop's I/O thread once a step."""
        last = self._last
        for gauge, now, before in ((self.running, stats.num_running, last.num_running),
                                   (self.waiting, stats.num_waiting, last.num_waiting),
                                   (self.blocks_used, stats.num_blocks_used, last.num_blocks_used),
                                   (self.blocks_total, stats.num_blocks, last.num_blocks)):
            if now != before:
                gauge.set(now)
        for counter, now, before in ((self.preemptions, stats.num_preemptions, last.num_preemptions),
                                     (self.tokens, stats.num_generated_tokens, last.num_generated_tokens),
                                     (self.cached_tokens, stats.num_cached_prompt_tokens,
                                      last.num_cached_prompt_tokens)):
            if now != before:
                counter.increment(now - before)
        self._last = stats

    def finished(self, output: StepOutput) -> None:
        self.finished_by_reason[output.finish_reason.value].increment(1)
        if output.ttft_s is not None:
            self.ttft.observe(output.ttft_s)
        if output.tpot_s is not None:
            self.tpot.observe(output.tpot_s)


class LLMService:
    """The `llm` model's instance: one engine, driven by one loop thread."""

    def __init__(self, pb, model: str, make_engine: Callable[[], LLMEngine], tenants: TenantPolicy = UNLIMITED,
                 auth: AuthConfig = AUTH_OFF, stream_hold_s: float = 0.0):
        """`make_engine` runs on the engine loop's thread (`EngineLoop.build` says why);
        `stream_hold_s`: how long the loop may hold a stream's tokens while requests wait."""
        self.pb = pb
        self.tenants = tenants
        self.auth = auth
        self.key_source = KeySource(auth.keys_path()) if auth.mode is not AuthMode.OFF else None
        self.verified_tokens = VerifiedTokens()  # tokens whose signatures were checked already
        self.token_buckets = LocalBuckets()  # one instance owns the engine, so its buckets are local
        self.model = model
        self.metrics = LLMMetrics(pb, model)
        self.ids = itertools.count()
        self.loop = EngineLoop.build(make_engine, on_step=self.metrics.step, stream_hold_s=stream_hold_s)
        self.engine = self.loop.engine
        self.metrics.step(self.engine.stats())

    @classmethod
    def from_args(cls, pb, args: Mapping[str, str]) -> LLMService:
        """The service of the model instance Triton describes in `initialize(args)`; a bad
        config fails the load with `pb.TritonModelException` naming the model."""
        model_config = json.loads(args["model_config"])
        name = args["model_name"]
        if not pb.using_decoupled_model_transaction_policy(model_config):
            raise pb.TritonModelException(f"model {name!r} must be decoupled (it streams tokens)")
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        try:
            parameters = LLMParameters.from_parameters(name, params)
            config = parameters.engine_config()
        except ValueError as err:
            raise pb.TritonModelException(str(err)) from None
        version_dir = Path(args["model_repository"]) / args["model_version"]
        verify_artifacts(version_dir, name, required=REQUIRED_FILES)
        retained = retain_freed_memory()  # a step's freed tensors are reused, not faulted in again
        service = cls(pb, name, lambda: LLMEngine.from_dir(version_dir, config), parameters.tenants,
                      parameters.tenant_auth, stream_hold_s=parameters.stream_hold_ms / 1000)
        engine = service.engine
        pb.Logger.log_info(
            f"{name}: {config.policy.value} batching, {engine.scheduler.config.num_blocks} KV blocks of "
            f"{config.block_size} tokens, up to {config.max_num_seqs} sequences"
            + (f"; while requests wait, a stream's tokens are held up to {parameters.stream_hold_ms:g} ms"
               if parameters.stream_hold_ms else "")
            + (f"; {engine.model.attention_note}" if engine.model.attention_note else "")
            + (f"; freed memory kept for reuse ({', '.join(retained)})" if retained else ""))
        return service

    def _tenant_of(self, request) -> str:
        keys = self.key_source.keys(time.monotonic(), on_error=self.pb.Logger.log_warn) if self.key_source else {}
        params = json.loads(request.parameters() or "{}")
        return resolve_tenant(params, self.auth, keys, time.time(), self.verified_tokens)

    def _refuse(self, sender, message: str, code) -> None:
        error = self.pb.TritonError(message, code)
        sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests) -> None:
        codes = self.pb.TritonError
        for request in requests:
            sender = request.get_response_sender()
            try:
                # Who it is from, first: a request that fails authentication is not even tokenized.
                tenant = self._tenant_of(request)
                arrays = {}
                for input_name in INPUT_NAMES:
                    tensor = self.pb.get_input_tensor_by_name(request, input_name)
                    if tensor is not None:
                        arrays[input_name] = tensor.as_numpy()
                inputs = inputs_from_arrays(arrays)
                prompt, params = self.engine.prepare(inputs)
            except AuthError as err:
                # Not retryable, and never counted against a tenant: INVALID_ARG (HTTP 400).
                self._refuse(sender, str(err), codes.INVALID_ARG)
                continue
            except (InvalidInput, ValueError) as err:
                self._refuse(sender, f"{INVALID_REQUEST}{err}", codes.INVALID_ARG)
                continue
            except Exception as err:  # answer this request, keep serving the others
                self._refuse(sender, f"preparing the request failed: {err}", codes.INTERNAL)
                continue
            if self.loop.error is not None:
                self._refuse(sender, f"the LLM engine stopped: {self.loop.error}", codes.INTERNAL)
                continue
            quota = admit_tokens(self.tenants, self.token_buckets, tenant, params.max_tokens, time.monotonic())
            if not quota.allowed:
                self._refuse(sender, quota.message(tenant), codes.UNAVAILABLE)
                continue

            def refund(generated, tenant=tenant, reserved=quota.cost):
                refund_tokens(self.tenants, self.token_buckets, tenant, reserved, generated, time.monotonic())

            self.loop.submit(str(next(self.ids)), prompt, params,
                             TritonSink(self.pb, sender, inputs.stream, self.metrics, on_done=refund))
        return None

    def finalize(self, drain_timeout_s: float = 20.0) -> None:
        """Let in-flight generations finish (up to the timeout; the rest are told to retry) and
        stop the loop; the server log says how many were in flight and how long it took."""
        started, in_flight = time.monotonic(), self.loop.num_in_flight
        self.pb.Logger.log_info(f"{self.model}: unloading, {in_flight} requests in flight")
        self.loop.stop(drain_timeout_s=drain_timeout_s)
        self.pb.Logger.log_info(f"{self.model}: stopped in {time.monotonic() - started:.1f} s, "
                                f"{self.loop.num_in_flight} requests left")
