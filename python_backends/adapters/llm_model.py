"""Triton adapter for `llm`: a decoupled model whose requests feed one continuous-batching engine.

`execute` only validates and tokenizes each request and hands it to the engine loop; the
loop thread streams the responses back through each request's response sender. All
decisions (scheduling, sampling, stop strings, text deltas) live in
`python_backends.llm.engine` and `python_backends.llm.scheduler`.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.common.artifacts import verify_artifacts
from python_backends.common.errors import InvalidInput
from python_backends.common.quotas import UNLIMITED, LocalBuckets, TenantPolicy, admit_tokens, refund_tokens
from python_backends.common.tenant_auth import AuthError, AuthMode, KeySource, parse_auth_parameter, resolve_tenant
from python_backends.llm.engine import (
    EngineLoop,
    EngineStats,
    LLMEngine,
    StepOutput,
    inputs_from_arrays,
    parse_engine_config,
)

INPUT_NAMES = ("text_input", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream")
TTFT_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0]
TPOT_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Starts every bad-input error, so a BLS caller (whose errors all arrive as INTERNAL) can tell.
INVALID_REQUEST = "invalid request: "


def _response(text: str, output: StepOutput) -> pb_utils.InferenceResponse:
    reason = output.finish_reason.value if output.finish_reason is not None else ""
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)),
        pb_utils.Tensor("prompt_tokens", np.array([output.num_prompt_tokens], dtype=np.int32)),
        pb_utils.Tensor("completion_tokens", np.array([output.num_output_tokens], dtype=np.int32)),
    ])


class TritonSink:
    """One request's response sender, as the engine loop's `RequestSink`."""

    def __init__(self, sender, stream: bool, metrics: LLMMetrics, on_done=None):
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
        if done:
            self.metrics.finished(output)
            self._finish(output.num_output_tokens)
        if self.stream:
            self.sender.send(_response(output.text_delta, output), flags=FINAL if done else 0)
        else:
            self.text.append(output.text_delta)
            if done:
                self.sender.send(_response("".join(self.text), output), flags=FINAL)

    def fail(self, message: str) -> None:
        self._finish(0)
        error = pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
        self.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def cancelled(self) -> bool:
        return self.sender.is_cancelled()


class LLMMetrics:
    """The engine's custom metrics (Triton exports them on its metrics port)."""

    def __init__(self, model: str):
        labels = {"model": model}
        family = pb_utils.MetricFamily
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
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_used.set(stats.num_blocks_used)
        self.blocks_total.set(stats.num_blocks)
        self.preemptions.increment(stats.num_preemptions - self._last.num_preemptions)
        self.tokens.increment(stats.num_generated_tokens - self._last.num_generated_tokens)
        self.cached_tokens.increment(stats.num_cached_prompt_tokens - self._last.num_cached_prompt_tokens)
        self._last = stats

    def finished(self, output: StepOutput) -> None:
        self.finished_by_reason[output.finish_reason.value].increment(1)
        if output.ttft_s is not None:
            self.ttft.observe(output.ttft_s)
        if output.tpot_s is not None:
            self.tpot.observe(output.tpot_s)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(f"model {name!r} must be decoupled (it streams tokens)")
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = parse_engine_config(name, params)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        verify_artifacts(version_dir, name, required=["model.safetensors", "config.json", "tokenizer.json"])
        self.engine = LLMEngine.from_dir(version_dir, config)
        try:
            self.tenants = TenantPolicy.from_json(params["tenants"]) if params.get("tenants") else UNLIMITED
        except ValueError as err:
            raise pb_utils.TritonModelException(f"model {name!r}: parameter tenants: {err}") from None
        try:
            self.auth = parse_auth_parameter(name, params.get("tenant_auth", ""))
        except ValueError as err:
            raise pb_utils.TritonModelException(str(err)) from None
        self.key_source = (KeySource(self.auth.keys_path())
                           if self.auth.mode is not AuthMode.OFF else None)
        self.token_buckets = LocalBuckets()  # one instance owns the engine, so its buckets are local
        self.metrics = LLMMetrics(name)
        self.ids = itertools.count()
        self.loop = EngineLoop(self.engine, on_step=self.metrics.step).start()
        self.metrics.step(self.engine.stats())
        pb_utils.Logger.log_info(
            f"{name}: {config.policy.value} batching, {self.engine.scheduler.config.num_blocks} KV blocks of "
            f"{config.block_size} tokens, up to {config.max_num_seqs} sequences")

    def _tenant_of(self, request):
        keys = self.key_source.keys(time.monotonic(), on_error=pb_utils.Logger.log_warn) if self.key_source else {}
        params = json.loads(request.parameters() or "{}")
        return resolve_tenant(params, self.auth, keys, time.time())

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                # Who it is from, first: a request that fails authentication is not even tokenized.
                tenant = self._tenant_of(request)
                arrays = {}
                for input_name in INPUT_NAMES:
                    tensor = pb_utils.get_input_tensor_by_name(request, input_name)
                    if tensor is not None:
                        arrays[input_name] = tensor.as_numpy()
                inputs = inputs_from_arrays(arrays)
                prompt, params = self.engine.prepare(inputs)
            except AuthError as err:
                # Not retryable, and never counted against a tenant: INVALID_ARG (HTTP 400).
                error = pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            except (InvalidInput, ValueError) as err:
                error = pb_utils.TritonError(f"{INVALID_REQUEST}{err}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            except Exception as err:  # answer this request, keep serving the others
                error = pb_utils.TritonError(f"preparing the request failed: {err}", pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            if self.loop.error is not None:
                message = f"the LLM engine stopped: {self.loop.error}"
                error = pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            quota = admit_tokens(self.tenants, self.token_buckets, tenant, params.max_tokens, time.monotonic())
            if not quota.allowed:
                error = pb_utils.TritonError(quota.message(tenant), pb_utils.TritonError.UNAVAILABLE)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue

            def refund(generated, tenant=tenant, reserved=quota.cost):
                refund_tokens(self.tenants, self.token_buckets, tenant, reserved, generated, time.monotonic())

            self.loop.submit(str(next(self.ids)), prompt, params,
                             TritonSink(sender, inputs.stream, self.metrics, on_done=refund))
        return None

    def finalize(self):
        self.loop.stop(drain_timeout_s=30.0)
