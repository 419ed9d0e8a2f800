"""The `embed` router's custom metrics, buffered: increments summed in the process, handed to
Triton by a flusher thread every half second (see `python_backends.common.metric_buffer`).

`RouterMetrics` takes the Triton API (`pb_utils`, or a fake of it in the unit tests) as a
parameter and imports nothing of Triton's. Its I/O is the flusher thread's calls into Triton's
metric objects; the series are made on first use, from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from python_backends.common.drift import SHADOW_HISTOGRAMS
from python_backends.common.metric_buffer import DeltaBuffer, ObservationBuffer
from python_backends.common.quotas import TenantPolicy
from python_backends.common.tenant_auth import AuthFailure
from python_backends.embed.router import (
    AUTH_FAILURE_COUNTER,
    BUCKET_COUNTERS,
    LATENCY_BUCKETS_S,
    LINGER_REGIME,
    ROUTER_COUNTERS,
    TENANT_COUNTER,
    UNAUTHENTICATED_LABELS,
    VERSION_COUNTER,
    VERSION_INFLIGHT,
    VERSION_LATENCY,
)

VERSION_OUTCOMES = ("ok", "error", "rejected")


class BufferedCounter:
    """A counter or gauge whose increments go to the instance's `DeltaBuffer`, not to Triton
    one call at a time."""

    __slots__ = ("metric", "sink")

    def __init__(self, metric, sink):
        self.metric = metric
        self.sink = sink

    def increment(self, amount):
        self.sink(self.metric, amount)


class RouterMetrics:
    """Every series the router moves, for one model instance."""

    def __init__(self, pb, model: str, bucket_lens: Iterable[int], tenants: TenantPolicy):
        self.model = model
        self.tenants = tenants
        self.logger = pb.Logger
        # A MetricFamily must outlive its Metrics: keep the families on the instance.
        family = pb.MetricFamily
        self.families = {name: family(name=name, description=text, kind=family.COUNTER)
                         for name, text in ROUTER_COUNTERS.items()}
        for (name, text), kind in ((VERSION_COUNTER, family.COUNTER), (TENANT_COUNTER, family.COUNTER),
                                   (VERSION_INFLIGHT, family.GAUGE), (VERSION_LATENCY, family.HISTOGRAM),
                                   (AUTH_FAILURE_COUNTER, family.COUNTER), (LINGER_REGIME, family.GAUGE),
                                   *(((name, text), family.HISTOGRAM) for name, text, _ in SHADOW_HISTOGRAMS.values())):
            self.families[name] = family(name=name, description=text, kind=kind)
        # Counter and gauge increments are summed here and handed to Triton by a flusher
        # thread every half second: one call per moved series instead of several per request.
        # Latency observations wait for the same flush: it replays them off the request's path.
        self.lock = threading.Lock()
        self.create_lock = threading.Lock()  # series made on first use, from any thread
        self.deltas = DeltaBuffer()
        self.observations = ObservationBuffer()
        self.stopping = threading.Event()
        self.flusher = threading.Thread(target=self._flush_loop, name="metric-flush", daemon=True)
        self.truncated = self._buffered(self.families["embed_truncated_rows_total"].Metric(labels={"model": model}))
        self.buckets = {
            length: tuple(self._buffered(self.families[name].Metric(labels={"model": model, "bucket": str(length)}))
                          for name in BUCKET_COUNTERS)
            for length in bucket_lens
        }
        self.versions = {}
        self.shadows = {}
        self.express = {}
        self.tenant_series = {}
        self.unauthenticated = self._buffered(self.families[TENANT_COUNTER[0]].Metric(
            labels={"model": model, **UNAUTHENTICATED_LABELS}))
        self.auth_failures = {
            reason: self._buffered(self.families[AUTH_FAILURE_COUNTER[0]].Metric(
                labels={"model": model, "reason": reason.value}))
            for reason in AuthFailure
        }

    def start(self) -> None:
        self.flusher.start()

    def stop(self) -> None:
        """Stop the flusher (a no-op when it never started)."""
        self.stopping.set()
        if self.flusher.is_alive():
            self.flusher.join()

    def _buffered(self, metric):
        return BufferedCounter(metric, self._add_delta)

    def _add_delta(self, metric, amount):
        with self.lock:
            self.deltas.add(metric, amount)

    def observe(self, metric, value):
        with self.lock:
            self.observations.add(metric, value)

    def add(self, moves, observation=None) -> None:
        """Several increments (`(BufferedCounter, amount)` pairs) and at most one latency
        observation (`(histogram, value)`) under one taking of the lock: what one answered
        request moves (nine lock round trips a request before, two now)."""
        with self.lock:
            for counter, amount in moves:
                self.deltas.add(counter.metric, amount)
            if observation is not None:
                self.observations.add(*observation)

    def flush(self):
        with self.lock:
            now = time.monotonic()
            moved = self.deltas.drain(now) if self.deltas.due(now) or self.stopping.is_set() else []
            observed, dropped = self.observations.drain()
        for metric, amount in moved:
            metric.increment(amount)
        for metric, value in observed:
            metric.observe(value)
        if dropped:
            self.logger.log_warn(f"{dropped} latency observations dropped: the metrics flush fell behind")

    def _flush_loop(self):
        while not self.stopping.wait(self.deltas.interval_s):
            try:
                self.flush()
            except Exception as err:  # a metrics hiccup must not stop the flusher (or serving)
                self.logger.log_warn(f"flushing router metrics failed: {err}")

    def tenant_outcome(self, tenant: str, outcome: str) -> None:
        label = self.tenants.metric_label(tenant)
        key = (label, outcome)
        metric = self.tenant_series.get(key)  # made once; only the making needs the lock
        if metric is None:
            with self.create_lock:
                if key not in self.tenant_series:
                    tier = self.tenants.tier_of(tenant).name if label != "other" else self.tenants.default_tier
                    self.tenant_series[key] = self._buffered(self.families[TENANT_COUNTER[0]].Metric(
                        labels={"model": self.model, "tenant": label, "tier": tier, "outcome": outcome}))
                metric = self.tenant_series[key]
        metric.increment(1)

    def of_version(self, version: int):
        """Outcome counters, latency histogram and in-flight gauge of one encoder version."""
        series = self.versions.get(version)  # made once; only the making needs the lock
        if series is not None:
            return series
        with self.create_lock:
            if version not in self.versions:
                labels = {"model": self.model, "version": str(version)}
                outcomes = {outcome: self._buffered(self.families[VERSION_COUNTER[0]].Metric(
                    labels={**labels, "outcome": outcome})) for outcome in VERSION_OUTCOMES}
                # The in-flight gauge is buffered like the counters (a rollout draining a version
                # allows for the flush interval); latencies are replayed one by one at the flush.
                latency = self.families[VERSION_LATENCY[0]].Metric(labels=labels, buckets=list(LATENCY_BUCKETS_S))
                inflight = self._buffered(self.families[VERSION_INFLIGHT[0]].Metric(labels=labels))
                self.versions[version] = (outcomes, latency, inflight)
            return self.versions[version]

    def express_rows(self, bucket_len: int):
        """The counter of bucket `bucket_len`'s rows the express model served (made on first use)."""
        with self.create_lock:
            if bucket_len not in self.express:
                self.express[bucket_len] = self._buffered(self.families["embed_bucket_express_rows_total"].Metric(
                    labels={"model": self.model, "bucket": str(bucket_len)}))
            return self.express[bucket_len]

    def linger_regime(self):
        """The model's regime gauge (`LINGER_REGIME`): each instance moves it by its own share."""
        return self._buffered(self.families[LINGER_REGIME[0]].Metric(labels={"model": self.model}))

    def shadow_histogram(self, series: str, baseline: int, candidate: int):
        """The histogram of one drift series (`common.drift.SHADOW_HISTOGRAMS`) of shadowed rows."""
        key = (series, baseline, candidate)
        with self.create_lock:
            if key not in self.shadows:
                name, _, edges = SHADOW_HISTOGRAMS[series]
                labels = {"model": self.model, "baseline": str(baseline), "candidate": str(candidate)}
                self.shadows[key] = self.families[name].Metric(labels=labels, buckets=list(edges))
            return self.shadows[key]
