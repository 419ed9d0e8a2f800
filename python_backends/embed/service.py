"""A router's request pipeline (`embed`'s and every other bucketed model's): authentication,
quota, admission, version routing, bucket lanes over BLS, reassembly, shadowing and the mapping
of failures to Triton errors. What a row is and what the answer carries is the codec's
(`TextCodec` here; `python_backends.tensor.codec.TensorCodec` for tensor and external models).

`EmbedService` takes the Triton API as a parameter, `pb`: the `triton_python_backend_utils`
module in the server, a fake of it in the unit tests (`tests/fakes/pb_utils.py`). It uses
`pb.InferenceRequest(...).exec()` for the BLS calls, `pb.Tensor`, `pb.InferenceResponse`,
`pb.TritonError` and its codes, `pb.is_model_ready`, `pb.get_input_tensor_by_name`,
`pb.get_output_tensor_by_name`, `pb.MetricFamily`, `pb.Logger` and
`pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL`; nothing here imports Triton.

The decisions are made by the pure modules (`router`, `buckets`, `routing`, `admission`,
`common.quotas`, `common.regimes`: which model serves a lingering bucket's rows); this module
does their I/O: BLS calls on worker threads, the routing file, the quota and admission tables
shared by the router's instances, the keys file.
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from python_backends.common.artifacts import verify_artifacts
from python_backends.common.drift import drift_rows
from python_backends.common.errors import InvalidInput
from python_backends.common.quotas import SharedBuckets, admit
from python_backends.common.regimes import Regime, RegimeTracker
from python_backends.common.request_start import waited_ms
from python_backends.common.shared_files import server_run, shared_dir, shared_file_name, sweep_stale
from python_backends.common.tenant_auth import AuthError, AuthMode, KeySource, VerifiedTokens, resolve_tenant
from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.admission import (
    AdmissionDecision,
    SharedWork,
    answer_deadline_s,
    deadline_passed,
    instance_slot,
    queue_wait_ms,
    seen_latency_ms,
    tier_share,
)
from python_backends.embed.buckets import reassemble
from python_backends.embed.inline import held_off, record_inline, serves_inline
from python_backends.embed.kinds import labels_of
from python_backends.embed.metrics import RouterMetrics
from python_backends.embed.router import (
    LATE_BEFORE_SENT,
    EmbedRouter,
    PreparedRequest,
    RouterConfig,
    is_instance_crash,
    is_scheduler_rejection,
    parse_request_options,
    parse_router_config,
)
from python_backends.embed.routing import RoutingSource, RoutingTable

MAX_SHADOWS_IN_FLIGHT = 2  # per instance: shadowing must never pile extra load on a busy server


class TextCodec:
    """What a text model's rows are and what its answer carries: TEXT (and TEXT_PAIR) rows in,
    tokenized by the router; the bucket models' one output back, with TOKENS and, for a
    classifier with label names, LABEL. A tensor model has its own (`python_backends.tensor`):
    the service calls only these methods."""

    def __init__(self, router: EmbedRouter):
        self.router = router
        self.config = router.config
        self.output_names = (router.config.output,)
        self.drift = router.config.kind.drift

    def prepare(self, pb, request, options) -> PreparedRequest:
        text = pb.get_input_tensor_by_name(request, "TEXT").as_numpy()
        pair = pb.get_input_tensor_by_name(request, "TEXT_PAIR")
        pairs = pair.as_numpy().reshape(-1).tolist() if pair is not None else None
        return self.router.prepare(text.reshape(-1).tolist(), None, options, pairs)

    def reassemble(self, prepared: PreparedRequest, chunk_outputs: list[dict[str, np.ndarray]]) -> dict:
        output = self.config.output
        return {output: reassemble(len(prepared.token_counts), prepared.chunk_plan,
                                   [outputs[output] for outputs in chunk_outputs])}

    def answer(self, prepared: PreparedRequest, outputs: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
        served = outputs[self.config.output]
        tensors = [(self.config.output, served), ("TOKENS", prepared.token_counts.reshape(-1, 1))]
        if self.config.labels:
            tensors.append(("LABEL", labels_of(served, self.config.labels)))
        return tensors

    def compared(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """What a shadow compares between versions: the output, row by row."""
        return outputs[self.config.output]

    @staticmethod
    def padded(prepared_chunk) -> int:
        return int(prepared_chunk.input_ids.size)


def text_codec(model: str, parameters: Mapping[str, str], version_dir: Path) -> tuple[RouterConfig, TextCodec]:
    """A text model's router config and codec, from its parameters and its version folder's tokenizer."""
    config = parse_router_config(model, parameters)
    verify_artifacts(version_dir, model, required=["tokenizer.json"])
    return config, TextCodec(EmbedRouter(config, TextTokenizer.from_file(version_dir / "tokenizer.json")))


def string_parameters(model_config: Mapping) -> dict[str, str]:
    """The `parameters` of a model config in Triton's JSON form, as plain strings."""
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


@dataclass(frozen=True)
class Accepted:
    """A request that passed its checks and admission, waiting for a worker to serve it."""

    prepared: PreparedRequest  # its chunks, bucket by bucket
    version: int  # the encoder version that serves it
    pinned: int | None  # the version the client pinned, if any
    table: RoutingTable  # the routing table it was routed by (for shadowing)
    own_work: dict[int, float]  # its work as admission counted it (ms per lane by bucket); given back when answered
    started: float  # time.monotonic() when the router took it
    waited_ms: float | None = None  # how long it waited before that (its X-Request-Start stamp); None: unknown
    admission: AdmissionDecision | None = None  # the decision that admitted it; None: none taken
    deadline_s: float | None = None  # time.monotonic() when its answer turns late; None: no deadline travels

    @property
    def tenant(self):
        return self.prepared.options.tenant


class EmbedService:
    """One instance of a model's router (`embed`, or any text, tensor or external model's: its
    codec says what a row is)."""

    def __init__(self, pb, config: RouterConfig, tokenizer: TextTokenizer | None, *, model: str, instance_name: str,
                 routing: RoutingSource, quota_path: Path, work_path: Path,
                 draw: Callable[[], float] = random.random, codec=None):
        self.pb = pb
        self.model = model
        # What a row is: texts through the tokenizer, or a tensor model's own tensors (`codec`).
        self.codec = codec if codec is not None else TextCodec(EmbedRouter(config, tokenizer))
        self.output_names = list(self.codec.output_names)  # what a BLS call asks its bucket model for
        self.routing = routing
        self.logger = pb.Logger
        self.draw = draw  # uniform [0, 1): the version a request is routed to, and whether it is shadowed
        self.metrics = RouterMetrics(pb, model, config.bucket_lens, config.tenants)
        # `execute` checks and admits each request and hands it to a worker thread, which
        # makes its blocking BLS calls and answers through the request's response sender: an
        # instance holds no request, so the router's concurrency is the workers', and
        # admission alone decides what waits on the cores (a lone request of an idle instance
        # is served where it arrived: `python_backends.embed.inline`). Chunks of one request bound for
        # different buckets go out side by side on the lane threads; shadows run after the
        # answer, at most MAX_SHADOWS_IN_FLIGHT at a time.
        self.request_pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="request")
        self.lane_pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="lane")
        self.shadow_pool = ThreadPoolExecutor(MAX_SHADOWS_IN_FLIGHT, thread_name_prefix="shadow")
        self.shadow_slots = threading.BoundedSemaphore(MAX_SHADOWS_IN_FLIGHT)
        # A lone request of an idle instance is served on the execute thread (`inline`).
        self.inline = config.inline
        self.inline_held_off: dict[str, float] = {}  # target model -> until when workers serve it
        self.inline_strikes: dict[str, int] = {}  # target model -> its inline calls over the limit in a row
        self.in_flight = 0  # requests handed to the workers and not yet answered
        self.in_flight_lock = threading.Lock()
        # Tenant authentication: each instance reads the keys file itself (a stat a second at
        # most), so a rotated key reaches every instance without a restart.
        self.auth = config.auth
        self.key_source = KeySource(config.auth.keys_path()) if config.auth.mode is not AuthMode.OFF else None
        self.verified_tokens = VerifiedTokens()  # tokens whose signatures were checked already
        # Quotas hold across every instance of the router (each its own process) of this
        # server run, so the buckets live in one shared file; admission counts the work in
        # flight across the instances the same way.
        self.tenants = config.tenants
        default_priority = config.tenants.tiers[config.tenants.default_tier].priority
        self.share_of_tier = {name: tier_share(tier.priority, default_priority)  # of the admission bound
                              for name, tier in config.tenants.tiers.items()}
        self.quota_buckets = SharedBuckets(quota_path)
        self.admission = config.admission
        self.work = SharedWork(work_path, instance_slot(instance_name), config.bucket_lens)
        # At light load the rows of buckets that linger go to the express model, which does
        # not: each instance tracks the regime from its own arrivals (`common.regimes`).
        regimes = config.linger_regimes
        self.regimes = RegimeTracker(regimes) if regimes is not None else None
        self.regime_gauge = self.metrics.linger_regime() if regimes is not None else None
        self.metrics.start()

    @classmethod
    def from_args(cls, pb, args: Mapping[str, str], make_codec=text_codec) -> EmbedService:
        """The service of the model instance Triton describes in `initialize(args)`;
        `make_codec(model, parameters, version folder)` gives the router config and the codec of
        the model's kind (text by default).

        The shared files are named for the server run (the stub's parent), so that no later
        server inherits them (see `python_backends.common.shared_files`).
        """
        model = args["model_name"]
        version_dir = Path(args["model_repository"]) / args["model_version"]
        config, codec = make_codec(model, string_parameters(json.loads(args["model_config"])), version_dir)
        directory, run = shared_dir(), server_run(os.getppid())
        sweep_stale(directory)
        service = cls(pb, config, None, codec=codec, model=model,
                      instance_name=args["model_instance_name"],
                      routing=RoutingSource(Path(args["model_repository"]) / config.routing_file,
                                            config.default_routing),
                      quota_path=directory / shared_file_name(run, model, "quotas"),
                      work_path=directory / shared_file_name(run, model, "work"))
        # What the instance made at start (modules, schemas, the tokenizer) lives as long as it
        # does: frozen, a full collection no longer walks it while requests wait on the GIL
        # (measured: 37k objects, 7.2 ms a full collection before, on 2 vCPU under load).
        gc.freeze()
        return service

    def finalize(self) -> None:
        self.request_pool.shutdown(wait=True)  # every accepted request is answered first
        self.metrics.stop()
        self.shadow_pool.shutdown(wait=True)
        self.lane_pool.shutdown(wait=True)
        self.metrics.flush()  # what moved since the last flush, shadows included
        self.quota_buckets.close()
        self.work.close()

    # --- requests in, answers out ---------------------------------------------------------

    def execute(self, requests):
        # Admitted requests are answered through their response senders by a worker when their
        # buckets are back; returning None tells Triton so.
        # Blocking BLS calls on worker threads cost the stub less CPU than asyncio round
        # trips through an executor (measured: 1.9 -> 1.3 CPU ms per request on 2 vCPU).
        # A lone request served inline is the exception: its answer is execute's return
        # value, which Triton sends once the instance is free for the next request (sent
        # through the sender before execute returned, a client's next request could find the
        # instance still busy and wait for Triton's scheduler to look again: measured 500 ms
        # for 5% of one-at-a-time requests to a router of one instance).
        # Refusals are answered when the call ends: as its return value when every request of
        # the call is answered here (one message back to Triton for all of them, where a send
        # each is a round trip each), else through their senders.
        if self.regimes is not None:
            self._count_arrivals(len(requests))
        answered, handed = [], False
        for request in requests:
            sender = request.get_response_sender()
            try:
                accepted = self._accept(request)
            except Exception as err:  # a bug must cost one request its answer, not the instance
                answered.append((sender, self._internal_error(err)))
                continue
            if isinstance(accepted, self.pb.InferenceResponse):
                answered.append((sender, accepted))
                continue
            response = self._serve_inline(len(requests), accepted)
            if response is not None:
                return [response]  # the only request of the call
            self._hand_to_worker(sender, accepted)
            handed = True
        if not handed:
            return [response for _, response in answered]
        for sender, response in answered:
            self._answer(sender, response)
        return None

    def _serve_inline(self, batch_size: int, accepted: Accepted):
        """The response to `accepted`, served on this thread, when `inline.serves_inline` says
        so; None when a worker is to serve it."""
        if not serves_inline(batch_size, self.in_flight, len(accepted.prepared.chunks)):
            return None
        target = self._targets(accepted.prepared)[0]
        started = time.monotonic()
        if held_off(self.inline, target, self.inline_held_off, started):
            return None
        response = self._respond(accepted)
        now = time.monotonic()
        record_inline(self.inline, target, (now - started) * 1000.0, self.inline_held_off, self.inline_strikes, now)
        return response

    def _hand_to_worker(self, sender, accepted: Accepted) -> None:
        with self.in_flight_lock:
            self.in_flight += 1
        try:
            self.request_pool.submit(self._finish_on_worker, sender, accepted)
        except RuntimeError:  # the pool is shutting down with the model: serve it here
            self._finish_on_worker(sender, accepted)

    def _finish_on_worker(self, sender, accepted: Accepted) -> None:
        try:
            self._finish(sender, accepted)
        finally:
            with self.in_flight_lock:
                self.in_flight -= 1

    def _count_arrivals(self, count: int) -> None:
        """Feed the regime tracker; move the regime gauge by this instance's share when it switches."""
        before = self.regimes.regime
        after = self.regimes.observe(time.monotonic(), count)
        if after is not before:
            share = 1.0 / self.regimes.regimes.instances
            self.regime_gauge.increment(share if after is Regime.PEAK else -share)

    def _targets(self, prepared: PreparedRequest) -> list[str]:
        """The model each chunk goes to now: its bucket model, or in the light regime the
        express model for a bucket that lingers."""
        if self.regimes is None:
            return [chunk.model_name for chunk in prepared.chunks]
        regime, regimes = self.regimes.regime, self.regimes.regimes
        return [regimes.target(chunk.model_name, regime) for chunk in prepared.chunks]

    def _error(self, message: str, code) -> object:
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, code))

    def _answer(self, sender, response) -> None:
        try:
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as err:  # the client is gone or the server is stopping: nothing to tell
            self.logger.log_warn(f"embed router: could not send a response: {err}")

    def _internal_error(self, err: Exception):
        self.logger.log_error(f"embed router: {type(err).__name__}: {err}")
        return self._error(f"internal error in the router: {type(err).__name__}: {err}",
                           self.pb.TritonError.INTERNAL)

    def _finish(self, sender, accepted: Accepted) -> None:
        self._answer(sender, self._respond(accepted))

    def _respond(self, accepted: Accepted):
        """Serve an admitted request: its response, an error response for a bug."""
        try:
            response = self._serve_admitted(accepted)
        except Exception as err:
            response = self._internal_error(err)
        self.metrics.tenant_outcome(accepted.tenant, self._outcome(response))
        return response

    def _outcome(self, response) -> str:
        if not response.has_error():
            return "ok"
        return "rejected" if response.error().code() == self.pb.TritonError.UNAVAILABLE else "error"

    # --- checks, quota and admission --------------------------------------------------------

    def _tenant_of(self, params):
        keys = self.key_source.keys(time.monotonic(), on_error=self.logger.log_warn) if self.key_source else {}
        return resolve_tenant(params, self.auth, keys, time.time(), self.verified_tokens)

    def _accept(self, request):
        """Check, prepare and admit one request: an error response to send at once, or the
        `Accepted` request for a worker to serve."""
        invalid_arg = self.pb.TritonError.INVALID_ARG
        started = time.monotonic()
        try:
            options = parse_request_options(request.parameters(), self._tenant_of)
        except InvalidInput as err:
            return self._error(str(err), invalid_arg)
        except AuthError as err:
            # Triton has no UNAUTHENTICATED code: INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT),
            # not retryable, with a message starting "authentication failed: ".
            self.metrics.unauthenticated.increment(1)
            self.metrics.auth_failures[err.reason].increment(1)
            return self._error(str(err), invalid_arg)
        # The quota first: a tenant over it costs the server no tokenization and no queue slot.
        quota = admit(self.tenants, self.quota_buckets, options.tenant, started)
        if not quota.allowed:
            self.metrics.tenant_outcome(options.tenant, "over_quota")
            return self._error(quota.message(options.tenant), self.pb.TritonError.UNAVAILABLE)
        accepted = self._admit(request, options, started)
        if isinstance(accepted, self.pb.InferenceResponse):
            self.metrics.tenant_outcome(options.tenant, self._outcome(accepted))
        return accepted

    def _admit(self, request, options, started):
        waited = waited_ms(options.started_at_s, time.time())
        late = deadline_passed(self.admission, waited)
        if late is not None:  # its answer would be late whatever the router did: no tokenizing
            return self._error(late.message(), self.pb.TritonError.UNAVAILABLE)
        share = self.share_of_tier[self.tenants.tier_of(options.tenant).name]
        busy = self.work.refuses_any(self.admission, share, waited)
        if busy is not None:  # not even its smallest possible work fits: no tokenizing either
            return self._error(busy.message(), self.pb.TritonError.UNAVAILABLE)
        try:
            prepared = self.codec.prepare(self.pb, request, options)
        except InvalidInput as err:
            return self._error(str(err), self.pb.TritonError.INVALID_ARG)
        table = self.routing.current(on_error=self.logger.log_warn)
        pinned = prepared.options.version
        if pinned is not None and not self.pb.is_model_ready(prepared.chunks[0].model_name, str(pinned)):
            return self._not_served(pinned)
        version = pinned if pinned is not None else table.pick(self.draw())
        own_work = self.admission.work_by_bucket(prepared.rows_by_bucket()) if self.admission.max_work_ms else {}
        admission = self.work.admit(self.admission, own_work, share, waited)
        if not admission.admitted:
            return self._error(admission.message(), self.pb.TritonError.UNAVAILABLE)
        self.metrics.of_version(version)[2].increment(1)  # in flight from admission on
        return Accepted(prepared, version, pinned, table, own_work, started, waited, admission,
                        answer_deadline_s(self.admission, started, waited, prepared.chunks_by_bucket(),
                                          admission.work_ahead_ms))

    # --- serving an admitted request ----------------------------------------------------------

    def _not_served(self, version: int, model_name: str | None = None):
        """The client pinned a version this server does not serve (or no longer does)."""
        detail = f" ({model_name} v{version} is not loaded)" if model_name else ""
        return self._error(f"version {version} of '{self.model}' is not being served{detail}; pin a served version "
                           "or leave 'version' out", self.pb.TritonError.NOT_FOUND)

    def _bucket_error(self, model_name: str, version: int, error, pinned: bool):
        code = error.code()
        message = error.message()
        if not self.pb.is_model_ready(model_name, str(version)):
            if pinned:
                return self._not_served(version, model_name)
            # Routed to a version that is being loaded or unloaded: retry.
            code = self.pb.TritonError.UNAVAILABLE
        elif is_scheduler_rejection(message):
            # Rejected by the bucket's queue policy (full, or the request's deadline came): the
            # server is busy, not broken; retry once the work in flight has drained.
            code = self.pb.TritonError.UNAVAILABLE
            message = f"{message}; server busy, retry after {max(0.001, self.work.total_ms() / 1000.0):.3f} s"
        elif is_instance_crash(message):
            # The instance died under the request; the supervisor reloads it, the other
            # instances keep serving: a retry succeeds.
            code = self.pb.TritonError.UNAVAILABLE
            message = f"{message} The instance crashed while serving this request; retry."
        return self._error(f"bucket model {model_name} v{version}: {message}", code)

    def _exec(self, model_name: str, chunk, version: int, deadline_s: float | None = None, chunks_left: int = 1):
        """One chunk's blocking BLS call to `version` of `model_name` (its bucket model or the
        express model): the response. With a `deadline_s`, the time the chunk may queue there
        (`queue_wait_ms`, with `chunks_left` of its bucket still to run, itself included) goes
        as the request's timeout, and a chunk already too late to be answered by then is not
        sent: it gets the queue's own timeout rejection."""
        pb = self.pb
        wait_ms = queue_wait_ms(self.admission, chunk.chunk.bucket_len, time.monotonic(), deadline_s, chunks_left)
        if wait_ms is not None and wait_ms < 0.001:
            return pb.InferenceResponse(error=pb.TritonError(LATE_BEFORE_SENT, pb.TritonError.UNAVAILABLE))
        return pb.InferenceRequest(
            model_name=model_name,
            model_version=version,
            inputs=[pb.Tensor(name, tensor) for name, tensor in chunk.tensors.items()],
            requested_output_names=self.output_names,
            timeout=0 if wait_ms is None else int(wait_ms * 1000.0),
        ).exec()

    def _exec_to(self, targets: list[str], index: int, chunk, version: int, deadline_s: float | None = None,
                 chunks_left: int = 1):
        """Chunk `index` to its target; a chunk the express model cannot take because it does not
        serve `version` goes to its bucket model, and `targets` says so afterwards."""
        response = self._exec(targets[index], chunk, version, deadline_s, chunks_left)
        if (response.has_error() and targets[index] != chunk.model_name
                and not self.pb.is_model_ready(targets[index], str(version))):
            targets[index] = chunk.model_name  # the express model is not loaded (at this version)
            response = self._exec(chunk.model_name, chunk, version, deadline_s, chunks_left)
        return response

    def _run_chunks(self, prepared: PreparedRequest, version: int, targets: list[str] | None = None,
                    deadline_s: float | None = None):
        """Send every chunk to `version` of its model in `targets` (by default `_targets`: its
        bucket model, or the express model), each with the request's deadline (`_exec`).

        Returns ((model name, error) of the first failure, None, None), or (None, the
        reassembled outputs, the bucket's own output tensors by name when one chunk served the
        whole request: those go back to the client as they are, without a copy).
        """
        pb = self.pb
        names = self.output_names
        chunks = prepared.chunks
        targets = targets if targets is not None else self._targets(prepared)
        if len(chunks) == 1:  # most requests: no lanes to run
            response = self._exec_to(targets, 0, chunks[0], version, deadline_s)
            if response.has_error():
                return (targets[0], response.error()), None, None
            tensors = {name: pb.get_output_tensor_by_name(response, name) for name in names}
            arrays = {name: tensor.as_numpy() for name, tensor in tensors.items()}
            return None, self.codec.reassemble(prepared, [arrays]), tensors

        responses = [None] * len(chunks)

        def run_lane(lane):
            for done, index in enumerate(lane):
                responses[index] = self._exec_to(targets, index, chunks[index], version, deadline_s, len(lane) - done)
                if responses[index].has_error():
                    return

        first, *others = prepared.lanes()
        pending = [self.lane_pool.submit(run_lane, lane) for lane in others]
        run_lane(first)
        for lane in pending:
            lane.result()
        # A lane stops at its first failed chunk (later ones stay None); report that failure.
        for target, response in zip(targets, responses, strict=True):
            if response is not None and response.has_error():
                return (target, response.error()), None, None
        outputs = [{name: pb.get_output_tensor_by_name(r, name).as_numpy() for name in names} for r in responses]
        return None, self.codec.reassemble(prepared, outputs), {}

    def _serve_admitted(self, accepted: Accepted):
        prepared, version, pinned, started = accepted.prepared, accepted.version, accepted.pinned, accepted.started
        outcomes, latency, inflight = self.metrics.of_version(version)
        targets = self._targets(prepared)
        failure = None
        try:
            failure, outputs, served_tensors = self._run_chunks(prepared, version, targets, accepted.deadline_s)
        except BaseException:
            inflight.increment(-1)
            raise
        finally:
            router_ms = (time.monotonic() - started) * 1000.0
            if failure is not None and accepted.deadline_s is not None and is_scheduler_rejection(
                    failure[1].message()):
                # Turned away at its deadline: its answer would have been late, and the bound learns so.
                router_ms = max(router_ms, (accepted.deadline_s - started) * 1000.0)
            self.work.release(self.admission, accepted.own_work,
                              seen_latency_ms(self.admission, router_ms, accepted.waited_ms), accepted.admission)
        if failure is not None:
            inflight.increment(-1)
            model_name, error = failure
            response = self._bucket_error(model_name, version, error, pinned is not None)
            code = response.error().code()
            if code != self.pb.TritonError.NOT_FOUND:  # a retired pinned version is the client's mistake
                outcomes["rejected" if code == self.pb.TritonError.UNAVAILABLE else "error"].increment(1)
            return response
        # What the request moved, handed to the metrics in one step.
        moves = [(inflight, -1), (outcomes["ok"], 1)]
        buckets = self.metrics.buckets
        for chunk, target in zip(prepared.chunks, targets, strict=True):
            rows, real, padded = buckets[chunk.chunk.bucket_len]
            num_rows = len(chunk.chunk.row_indices)
            moves += ((rows, num_rows), (real, chunk.num_real_tokens), (padded, self.codec.padded(chunk)))
            if target != chunk.model_name:  # served by the express model: counted under its bucket all the same
                moves.append((self.metrics.express_rows(chunk.chunk.bucket_len), num_rows))
        if prepared.num_truncated:
            moves.append((self.metrics.truncated, prepared.num_truncated))
        self.metrics.add(moves, (latency, time.monotonic() - started))
        baseline = accepted.table.shadows(version, self.draw()) if pinned is None else None
        if baseline is not None and self.shadow_slots.acquire(blocking=False):
            # Repeat the request on the baseline after answering: the client never waits for it.
            self.shadow_pool.submit(self._shadow, prepared, outputs, baseline, version)
        num_rows = len(prepared.token_counts)
        tensors = [self._tensor(name, array, outputs, served_tensors)
                   for name, array in self.codec.answer(prepared, outputs)]
        tensors.append(self.pb.Tensor("VERSION", np.full((num_rows, 1), version, dtype=np.int32)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _tensor(self, name: str, array: np.ndarray, outputs: dict, served_tensors: dict):
        """The answer's tensor `name`: the bucket model's own when the answer is its output
        unchanged (no copy into a new tensor), else a new one."""
        served = served_tensors.get(name)
        if served is not None and outputs.get(name) is array:
            return served
        return self.pb.Tensor(name, array)

    def _shadow(self, prepared: PreparedRequest, served: dict, baseline: int, candidate: int) -> None:
        try:
            failure, reference, _ = self._run_chunks(prepared, baseline)
            if failure is not None:
                return  # the baseline was busy or is going away: no sample
            codec = self.codec
            for series, values in drift_rows(codec.drift, codec.compared(served), codec.compared(reference)).items():
                metric = self.metrics.shadow_histogram(series, baseline, candidate)
                for value in values:
                    metric.observe(float(value))
        except Exception as err:  # a shadow must never take the router down
            self.logger.log_warn(f"shadow request on version {baseline} failed: {err}")
        finally:
            self.shadow_slots.release()
