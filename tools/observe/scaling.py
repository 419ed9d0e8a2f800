"""What a window of /metrics says to the planners: the autoscaler's `Signals` from a service's
window, decisions over a recording (`replay`), and the batches a bucket model really formed, for
capacity planning (`observed_batches`). The decisions themselves are `tools.planning`'s. Pure:
windows in, plain data out; no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from tools.observe.explain import QueueKnobs, ServiceWindow, Thresholds, split_lingering_share
from tools.observe.metrics import Snapshot, Window, queue_stats, windows
from tools.planning.autoscale import AutoscalePolicy, AutoscaleState, Decision, Signals, decide
from tools.planning.capacity import Observed


def signals_from(view: ServiceWindow, replicas: int, at_s: float) -> Signals:
    """What a service's window says to the autoscaler, as measured on `replicas` replicas."""
    total = sum(q.num_requests for q in view.queues)
    linger = (sum(view.knobs[q.model].max_queue_delay_ms * q.num_requests for q in view.queues if q.model in view.knobs)
              / total if total else 0.0)
    return Signals(at_s=at_s, replicas=replicas, queue_ms=view.queue_ms, linger_ms=linger,
                   compute_ms=view.compute_ms, pending=sum(q.pending for q in view.queues), p95_ms=view.p95_ms,
                   busy_share=view.busy_share,
                   fragmented=split_lingering_share(view) >= Thresholds().lingering_share,
                   num_served=view.num_served, num_busy=view.num_busy)


def default_pending_per_replica(knobs: Mapping[str, QueueKnobs]) -> float:
    """One preferred batch waiting per instance, summed over the bucket models: past that,
    a request queues behind a full batch instead of joining one."""
    return float(sum(k.instances * max(1, k.preferred_batch) for k in knobs.values())) or 1.0


def replay(snapshots: list[Snapshot], view_of: Callable[[Window, Window | None], ServiceWindow],
           policy: AutoscalePolicy, span_s: float, replicas: int = 1) -> Iterator[Decision]:
    """Decisions over a recording, one per sliding window (what a live loop would have said)."""
    state = AutoscaleState(desired=replicas)
    by_end: dict[float, Window] = {}
    for window in windows(snapshots, span_s):
        view = view_of(window, by_end.get(window.start.at_s))  # the window just before, to see p99 rise
        by_end[window.end.at_s] = window
        decision = decide(signals_from(view, replicas, window.end.at_s), state, policy)
        state = decision.state
        yield decision


def observed_batches(window: Window, model: str, preferred_batch: int | None = None) -> Observed:
    """What one bucket model's batches were over a window of /metrics, for `capacity`."""
    queues = queue_stats(window, {model})
    requests = sum(q.num_requests for q in queues)
    batches = sum(q.num_batches for q in queues)
    if not requests or not batches:
        raise ValueError(f"the recording shows no traffic at {model} in the {window.duration_s:.0f} s read")
    rows = sum(q.num_rows for q in queues)
    return Observed(model=model, requests_per_min=rows / window.duration_s * 60, mean_batch_rows=rows / batches,
                    batch_ms=sum(q.compute_ms * q.num_requests for q in queues) / requests,
                    preferred_batch=preferred_batch)
