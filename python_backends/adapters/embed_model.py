"""Triton adapter for `embed`: tensors in, BLS calls to the bucket models, tensors out.

All decisions (validation, tokenization, bucket choice, padding, reassembly, which
encoder version serves) live in `python_backends.embed.router`, `python_backends.embed.buckets` and
`python_backends.embed.routing`.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.common.artifacts import verify_artifacts
from python_backends.common.errors import InvalidInput
from python_backends.common.metric_buffer import DeltaBuffer, ObservationBuffer
from python_backends.common.quotas import SharedBuckets, admit
from python_backends.common.shared_files import server_run, shared_dir, shared_file_name, sweep_stale
from python_backends.common.tenant_auth import AuthError, AuthFailure, AuthMode, KeySource, resolve_tenant
from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.admission import SharedWork, instance_slot, tier_share
from python_backends.embed.buckets import reassemble
from python_backends.embed.router import (
    AUTH_FAILURE_COUNTER,
    BUCKET_COUNTERS,
    COSINE_BUCKETS,
    LATENCY_BUCKETS_S,
    ROUTER_COUNTERS,
    SHADOW_COSINE,
    TENANT_COUNTER,
    UNAUTHENTICATED_LABELS,
    VERSION_COUNTER,
    VERSION_INFLIGHT,
    VERSION_LATENCY,
    EmbedRouter,
    PreparedRequest,
    is_instance_crash,
    is_scheduler_rejection,
    parse_request_options,
    parse_router_config,
    row_cosines,
)
from python_backends.embed.routing import RoutingSource, RoutingTable

MAX_SHADOWS_IN_FLIGHT = 2  # per instance: shadowing must never pile extra load on a busy server


@dataclass(frozen=True)
class Accepted:
    """A request that passed its checks and admission, waiting for a worker to serve it."""

    prepared: PreparedRequest  # its chunks, bucket by bucket
    version: int  # the encoder version that serves it
    pinned: int | None  # the version the client pinned, if any
    table: RoutingTable  # the routing table it was routed by (for shadowing)
    own_work: dict[int, float]  # its work as admission counted it (ms per lane by bucket); given back when answered
    started: float  # time.monotonic() when the router took it

    @property
    def tenant(self):
        return self.prepared.options.tenant


class BufferedCounter:
    """A counter or gauge whose increments go to the instance's `DeltaBuffer`, not to Triton
    one call at a time (see `python_backends.common.metric_buffer`)."""

    __slots__ = ("metric", "sink")

    def __init__(self, metric, sink):
        self.metric = metric
        self.sink = sink

    def increment(self, amount):
        self.sink(self.metric, amount)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = parse_router_config(args["model_name"], params)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        verify_artifacts(version_dir, args["model_name"], required=["tokenizer.json"])
        self.router = EmbedRouter(config, TextTokenizer.from_file(version_dir / "tokenizer.json"))
        self.routing = RoutingSource(Path(args["model_repository"]) / config.routing_file, config.default_routing)
        self.logger = pb_utils.Logger
        self.model = args["model_name"]
        # A MetricFamily must outlive its Metrics: keep the families on the instance.
        counter, gauge, histogram = (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE,
                                     pb_utils.MetricFamily.HISTOGRAM)
        self.metric_families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=counter)
            for name, text in ROUTER_COUNTERS.items()
        }
        for (name, text), kind in ((VERSION_COUNTER, counter), (TENANT_COUNTER, counter), (VERSION_INFLIGHT, gauge),
                                   (VERSION_LATENCY, histogram), (SHADOW_COSINE, histogram),
                                   (AUTH_FAILURE_COUNTER, counter)):
            self.metric_families[name] = pb_utils.MetricFamily(name=name, description=text, kind=kind)
        # Counter and gauge increments are summed here and handed to Triton by a flusher
        # thread every half second: one call per moved series instead of several per request.
        # Latency observations wait for the same flush: it replays them off the request's path.
        self.metric_lock = threading.Lock()
        self.metric_create_lock = threading.Lock()  # series made on first use, from any thread
        self.metric_deltas = DeltaBuffer()
        self.observations = ObservationBuffer()
        self.flusher_stop = threading.Event()
        self.flusher = threading.Thread(target=self._flush_loop, name="metric-flush", daemon=True)
        self.truncated = self._buffered(
            self.metric_families["embed_truncated_rows_total"].Metric(labels={"model": self.model}))
        self.bucket_metrics = {
            length: tuple(
                self._buffered(self.metric_families[name].Metric(labels={"model": self.model, "bucket": str(length)}))
                for name in BUCKET_COUNTERS
            )
            for length in config.bucket_lens
        }
        self.version_metrics = {}
        self.shadow_metrics = {}
        self.tenant_metrics = {}
        # `execute` checks and admits each request and hands it to a worker thread, which
        # makes its blocking BLS calls and answers through the request's response sender: an
        # instance holds no request, so the router's concurrency is the workers', and
        # admission alone decides what waits on the cores. Chunks of one request bound for
        # different buckets go out side by side on the lane threads; shadows run after the
        # answer, at most MAX_SHADOWS_IN_FLIGHT at a time.
        self.request_pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="request")
        self.lane_pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="lane")
        self.shadow_pool = ThreadPoolExecutor(MAX_SHADOWS_IN_FLIGHT, thread_name_prefix="shadow")
        self.shadow_slots = threading.BoundedSemaphore(MAX_SHADOWS_IN_FLIGHT)
        # Tenant authentication: each instance reads the keys file itself (a stat a second at
        # most), so a rotated key reaches every instance without a restart.
        self.auth = config.auth
        self.key_source = (KeySource(config.auth.keys_path())
                           if config.auth.mode is not AuthMode.OFF else None)
        self.unauthenticated = self._buffered(self.metric_families[TENANT_COUNTER[0]].Metric(
            labels={"model": self.model, **UNAUTHENTICATED_LABELS}))
        self.auth_failures = {
            reason: self._buffered(self.metric_families[AUTH_FAILURE_COUNTER[0]].Metric(
                labels={"model": self.model, "reason": reason.value}))
            for reason in AuthFailure
        }
        # Quotas hold across every instance of the router (each its own process) of this
        # server run (the stub's parent), so the buckets live in one shared file, named for
        # the run so that no later server inherits it (see `python_backends.common.shared_files`).
        directory, run = shared_dir(), server_run(os.getppid())
        sweep_stale(directory)
        self.tenants = config.tenants
        self.quota_buckets = SharedBuckets(directory / shared_file_name(run, self.model, "quotas"))
        # Admission counts the work in flight across the router's instances the same way.
        self.admission = config.admission
        self.work = SharedWork(directory / shared_file_name(run, self.model, "work"),
                               instance_slot(args["model_instance_name"]), config.bucket_lens)
        self.flusher.start()

    def finalize(self):
        self.request_pool.shutdown(wait=True)  # every accepted request is answered first
        self.flusher_stop.set()
        self.flusher.join()
        self.shadow_pool.shutdown(wait=True)
        self.lane_pool.shutdown(wait=True)
        self._flush()  # what moved since the last flush, shadows included
        self.quota_buckets.close()
        self.work.close()

    def _buffered(self, metric):
        return BufferedCounter(metric, self._add_delta)

    def _add_delta(self, metric, amount):
        with self.metric_lock:
            self.metric_deltas.add(metric, amount)

    def _observe(self, metric, value):
        with self.metric_lock:
            self.observations.add(metric, value)

    def _flush(self):
        with self.metric_lock:
            now = time.monotonic()
            moved = self.metric_deltas.drain(now) if self.metric_deltas.due(now) or self.flusher_stop.is_set() else []
            observed, dropped = self.observations.drain()
        for metric, amount in moved:
            metric.increment(amount)
        for metric, value in observed:
            metric.observe(value)
        if dropped:
            self.logger.log_warn(f"{dropped} latency observations dropped: the metrics flush fell behind")

    def _flush_loop(self):
        while not self.flusher_stop.wait(self.metric_deltas.interval_s):
            try:
                self._flush()
            except Exception as err:  # a metrics hiccup must not stop the flusher (or serving)
                self.logger.log_warn(f"flushing router metrics failed: {err}")

    def _tenant_outcome(self, tenant, outcome):
        label = self.tenants.metric_label(tenant)
        key = (label, outcome)
        with self.metric_create_lock:
            if key not in self.tenant_metrics:
                tier = self.tenants.tier_of(tenant).name if label != "other" else self.tenants.default_tier
                self.tenant_metrics[key] = self._buffered(self.metric_families[TENANT_COUNTER[0]].Metric(
                    labels={"model": self.model, "tenant": label, "tier": tier, "outcome": outcome}))
            metric = self.tenant_metrics[key]
        metric.increment(1)

    def _metrics_of(self, version):
        """Outcome counters, latency histogram and in-flight gauge of one encoder version."""
        with self.metric_create_lock:
            if version not in self.version_metrics:
                labels = {"model": self.model, "version": str(version)}
                outcomes = {outcome: self._buffered(self.metric_families[VERSION_COUNTER[0]].Metric(
                    labels={**labels, "outcome": outcome})) for outcome in ("ok", "error", "rejected")}
                # The in-flight gauge is buffered like the counters (a rollout draining a version
                # allows for the flush interval); latencies are replayed one by one at the flush.
                latency = self.metric_families[VERSION_LATENCY[0]].Metric(
                    labels=labels, buckets=list(LATENCY_BUCKETS_S))
                inflight = self._buffered(self.metric_families[VERSION_INFLIGHT[0]].Metric(labels=labels))
                self.version_metrics[version] = (outcomes, latency, inflight)
            return self.version_metrics[version]

    def _shadow_metric(self, baseline, candidate):
        key = (baseline, candidate)
        with self.metric_create_lock:
            if key not in self.shadow_metrics:
                labels = {"model": self.model, "baseline": str(baseline), "candidate": str(candidate)}
                self.shadow_metrics[key] = self.metric_families[SHADOW_COSINE[0]].Metric(
                    labels=labels, buckets=list(COSINE_BUCKETS))
            return self.shadow_metrics[key]

    def _not_served(self, version, model_name=None):
        """The client pinned a version this server does not serve (or no longer does)."""
        detail = f" ({model_name} v{version} is not loaded)" if model_name else ""
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(
            f"version {version} of '{self.model}' is not being served{detail}; pin a served version or "
            "leave 'version' out", pb_utils.TritonError.NOT_FOUND))

    def _bucket_error(self, model_name, version, error, pinned):
        code = error.code()
        message = error.message()
        if not pb_utils.is_model_ready(model_name, str(version)):
            if pinned:
                return self._not_served(version, model_name)
            # Routed to a version that is being loaded or unloaded: retry.
            code = pb_utils.TritonError.UNAVAILABLE
        elif is_scheduler_rejection(message):
            # Rejected by the bucket's queue policy: the server is busy, not broken; retry.
            code = pb_utils.TritonError.UNAVAILABLE
        elif is_instance_crash(message):
            # The instance died under the request; the supervisor reloads it, the other
            # instances keep serving: a retry succeeds.
            code = pb_utils.TritonError.UNAVAILABLE
            message = f"{message} The instance crashed while serving this request; retry."
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError(f"bucket model {model_name} v{version}: {message}", code)
        )

    def execute(self, requests):
        # Every request is answered through its response sender, refusals at once, admitted
        # requests by a worker when their buckets are back; returning None tells Triton so.
        # Blocking BLS calls on worker threads cost the stub less CPU than asyncio round
        # trips through an executor (measured: 1.9 -> 1.3 CPU ms per request on 2 vCPU).
        for request in requests:
            sender = request.get_response_sender()
            try:
                accepted = self._accept(request)
            except Exception as err:  # a bug must cost one request its answer, not the instance
                self._answer(sender, self._internal_error(err))
                continue
            if isinstance(accepted, pb_utils.InferenceResponse):
                self._answer(sender, accepted)
            else:
                try:
                    self.request_pool.submit(self._finish, sender, accepted)
                except RuntimeError:  # the pool is shutting down with the model: serve it here
                    self._finish(sender, accepted)
        return None

    def _answer(self, sender, response):
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as err:  # the client is gone or the server is stopping: nothing to tell
            self.logger.log_warn(f"embed router: could not send a response: {err}")

    def _internal_error(self, err):
        self.logger.log_error(f"embed router: {type(err).__name__}: {err}")
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(
            f"internal error in the router: {type(err).__name__}: {err}", pb_utils.TritonError.INTERNAL))

    def _finish(self, sender, accepted):
        try:
            response = self._serve_admitted(accepted)
        except Exception as err:
            response = self._internal_error(err)
        self._tenant_outcome(accepted.tenant, self._outcome(response))
        self._answer(sender, response)

    @staticmethod
    def _outcome(response):
        if not response.has_error():
            return "ok"
        return "rejected" if response.error().code() == pb_utils.TritonError.UNAVAILABLE else "error"

    def _run_chunks(self, prepared, version):
        """Send every chunk to `version` of its bucket model.

        Returns ((model name, error) of the first failure, None), or (None, the reassembled embedding).
        """
        responses = [None] * len(prepared.chunks)

        def run_lane(lane):
            for index in lane:
                chunk = prepared.chunks[index]
                responses[index] = pb_utils.InferenceRequest(
                    model_name=chunk.model_name,
                    model_version=version,
                    inputs=[
                        pb_utils.Tensor("INPUT_IDS", chunk.input_ids),
                        pb_utils.Tensor("ATTENTION_MASK", chunk.attention_mask),
                    ],
                    requested_output_names=["EMBEDDING"],
                ).exec()
                if responses[index].has_error():
                    return

        first, *others = prepared.lanes()
        pending = [self.lane_pool.submit(run_lane, lane) for lane in others]
        run_lane(first)
        for lane in pending:
            lane.result()
        # A lane stops at its first failed chunk (later ones stay None); report that failure.
        for chunk, response in zip(prepared.chunks, responses, strict=True):
            if response is not None and response.has_error():
                return (chunk.model_name, response.error()), None
        outputs = [pb_utils.get_output_tensor_by_name(r, "EMBEDDING").as_numpy() for r in responses]
        return None, reassemble(len(prepared.token_counts), prepared.chunk_plan, outputs)

    def _tenant_of(self, params):
        keys = self.key_source.keys(time.monotonic(), on_error=self.logger.log_warn) if self.key_source else {}
        return resolve_tenant(params, self.auth, keys, time.time())

    def _accept(self, request):
        """Check, prepare and admit one request: an error response to send at once, or the
        `Accepted` request for a worker to serve."""
        started = time.monotonic()
        try:
            options = parse_request_options(request.parameters(), self._tenant_of)
        except InvalidInput as err:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG))
        except AuthError as err:
            # Triton has no UNAUTHENTICATED code: INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT),
            # not retryable, with a message starting "authentication failed: ".
            self.unauthenticated.increment(1)
            self.auth_failures[err.reason].increment(1)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG))
        # The quota first: a tenant over it costs the server no tokenization and no queue slot.
        quota = admit(self.tenants, self.quota_buckets, options.tenant, started)
        if not quota.allowed:
            self._tenant_outcome(options.tenant, "over_quota")
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                quota.message(options.tenant), pb_utils.TritonError.UNAVAILABLE))
        accepted = self._admit(request, options, started)
        if isinstance(accepted, pb_utils.InferenceResponse):
            self._tenant_outcome(options.tenant, self._outcome(accepted))
        return accepted

    def _admit(self, request, options, started):
        try:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            prepared = self.router.prepare(text.reshape(-1).tolist(), None, options)
        except InvalidInput as err:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG))
        table = self.routing.current(on_error=self.logger.log_warn)
        pinned = prepared.options.version
        if pinned is not None and not pb_utils.is_model_ready(prepared.chunks[0].model_name, str(pinned)):
            return self._not_served(pinned)
        version = pinned if pinned is not None else table.pick(random.random())
        own_work = self.admission.work_by_bucket(prepared.rows_by_bucket()) if self.admission.max_work_ms else {}
        tier = self.tenants.tier_of(prepared.options.tenant)
        share = tier_share(tier.priority, self.tenants.tiers[self.tenants.default_tier].priority)
        admission = self.work.admit(self.admission, own_work, share)
        if not admission.admitted:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                admission.message(), pb_utils.TritonError.UNAVAILABLE))
        self._metrics_of(version)[2].increment(1)  # in flight from admission on
        return Accepted(prepared, version, pinned, table, own_work, started)

    def _serve_admitted(self, accepted):
        prepared, version, pinned, started = accepted.prepared, accepted.version, accepted.pinned, accepted.started
        outcomes, latency, inflight = self._metrics_of(version)
        try:
            failure, embedding = self._run_chunks(prepared, version)
        finally:
            inflight.increment(-1)
            self.work.add({bucket: -ms for bucket, ms in accepted.own_work.items()})
            self.work.record_latency(self.admission, (time.monotonic() - started) * 1000.0)
        if failure is not None:
            model_name, error = failure
            response = self._bucket_error(model_name, version, error, pinned is not None)
            code = response.error().code()
            if code != pb_utils.TritonError.NOT_FOUND:  # a retired pinned version is the client's mistake
                outcomes["rejected" if code == pb_utils.TritonError.UNAVAILABLE else "error"].increment(1)
            return response
        self._observe(latency, time.monotonic() - started)
        outcomes["ok"].increment(1)
        baseline = accepted.table.shadows(version, random.random()) if pinned is None else None
        if baseline is not None and self.shadow_slots.acquire(blocking=False):
            # Repeat the request on the baseline after answering: the client never waits for it.
            self.shadow_pool.submit(self._shadow, prepared, embedding, baseline, version)
        for chunk in prepared.chunks:
            rows, real, padded = self.bucket_metrics[chunk.chunk.bucket_len]
            rows.increment(len(chunk.chunk.row_indices))
            real.increment(chunk.num_real_tokens)
            padded.increment(chunk.input_ids.size)
        if prepared.num_truncated:
            self.truncated.increment(prepared.num_truncated)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("EMBEDDING", embedding),
                pb_utils.Tensor("TOKENS", prepared.token_counts.reshape(-1, 1)),
                pb_utils.Tensor("VERSION", np.full((len(prepared.token_counts), 1), version, dtype=np.int32)),
            ]
        )

    def _shadow(self, prepared, served, baseline, candidate):
        try:
            failure, reference = self._run_chunks(prepared, baseline)
            if failure is not None:
                return  # the baseline was busy or is going away: no sample
            metric = self._shadow_metric(baseline, candidate)
            for cosine in row_cosines(served, reference):
                metric.observe(float(cosine))
        except Exception as err:  # a shadow must never take the router down
            self.logger.log_warn(f"shadow request on version {baseline} failed: {err}")
        finally:
            self.shadow_slots.release()
