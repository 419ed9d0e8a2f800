"""The wait before the router's clock starts: its Triton queue, read from the server's /metrics.

Admission steers by the latency it measures, from the moment an instance takes a request.
Before that the request waited in the router model's own Triton queue, longest exactly when
admission matters (the cores are short and the instances cannot keep up). Triton counts that
wait per model (`nv_inference_queue_duration_us`, summed over the requests it counts as
successful, `nv_inference_request_success`), so one router instance reads both counters from
the server's metrics endpoint every `PERIOD_S`, turns the increase into the mean wait of the
requests of that window, smooths it, and shares it with the other instances through the
admission table (`SharedWork.set_queue_wait`). Each answer's latency is then fed to the
adaptive bound with that wait added.

The endpoint is the one on the server's own command line (`metrics_url_of`: the stub's parent
is tritonserver); a server started without metrics leaves the probe off, and admission falls
back to the fixed margin for the wait it cannot see. The parsing is `prometheus_client`'s, on
the few lines of the two counters for this model.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

QUEUE_US = "nv_inference_queue_duration_us"
SUCCESS = "nv_inference_request_success"
PERIOD_S = 0.5  # how often the probe reads /metrics
SMOOTHING = 0.5  # weight of the newest window in the smoothed wait
DEFAULT_METRICS_PORT = 8002


def metrics_url_of(argv: Sequence[str]) -> str | None:
    """The metrics URL of a tritonserver started with `argv` (its command line); None when
    metrics are off. Flags as Triton takes them: `--flag=value` or `--flag value`."""
    values: dict[str, str] = {}
    for index, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, sep, value = arg.partition("=")
        if not sep:
            value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else ""
        values[name] = value
    if values.get("--allow-metrics", "true").lower() in ("false", "0", "no", "off"):
        return None
    port = values.get("--metrics-port") or str(DEFAULT_METRICS_PORT)
    address = values.get("--metrics-address") or "127.0.0.1"
    if address in ("0.0.0.0", "::", "[::]"):
        address = "127.0.0.1"
    return f"http://{address}:{port}/metrics"


@dataclass(frozen=True)
class QueueCounters:
    """The router model's queue counters at one read, summed over its versions."""

    queue_us: float
    requests: float


def queue_counters(text: str, model: str) -> QueueCounters:
    """The two counters of `model` in a /metrics page (Prometheus text format). ValueError when
    the page has neither (not the server's page, or the model is not loaded: Triton exports
    them from the load on, at 0), which must not read as "no wait"."""
    from prometheus_client.parser import text_string_to_metric_families

    label = f'model="{model}"'
    lines = [line for line in text.splitlines()
             if line.startswith((QUEUE_US + "{", SUCCESS + "{")) and label in line]
    if not lines:
        raise ValueError(f"no {QUEUE_US} or {SUCCESS} of model {model!r} in the page")
    totals = {QUEUE_US: 0.0, SUCCESS: 0.0}
    for family in text_string_to_metric_families("\n".join(lines)):
        for sample in family.samples:
            if sample.labels.get("model") == model and sample.name in totals:
                totals[sample.name] += float(sample.value)
    return QueueCounters(queue_us=totals[QUEUE_US], requests=totals[SUCCESS])


def window_wait_ms(before: QueueCounters, after: QueueCounters) -> float | None:
    """Mean queue wait (ms) of the requests between two reads; None when none finished (or
    the counters went back: the model was reloaded)."""
    requests = after.requests - before.requests
    queued = after.queue_us - before.queue_us
    if requests <= 0 or queued < 0:
        return None
    return queued / requests / 1000.0


def smoothed(previous: float | None, sample: float | None, weight: float = SMOOTHING) -> float | None:
    """Exponential smoothing; a window without requests keeps the last value."""
    if sample is None:
        return previous
    return sample if previous is None else previous + weight * (sample - previous)


class QueueWaitProbe:
    """A thread reading the router's queue wait every `PERIOD_S` and handing it to `publish(wait_ms, now)`."""

    def __init__(self, metrics_url: str, model: str, publish: Callable[[float, float], None],
                 fetch: Callable[[str], str] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[str], None] | None = None):
        self.metrics_url = metrics_url
        self.model = model
        self.publish = publish
        self.fetch = fetch or _fetch
        self.clock = clock
        self.on_error = on_error
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="queue-wait", daemon=True)
        self.last: QueueCounters | None = None
        self.wait_ms: float | None = None
        self.errors = 0

    def start(self) -> QueueWaitProbe:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def step(self) -> None:
        """One read: the window since the last one, smoothed, published."""
        try:
            counters = queue_counters(self.fetch(self.metrics_url), self.model)
        except (OSError, ValueError) as err:
            self.errors += 1
            if self.on_error is not None and self.errors in (1, 10, 100):
                self.on_error(f"queue wait probe: cannot read {self.metrics_url}: {err}")
            return
        if self.last is not None:
            self.wait_ms = smoothed(self.wait_ms, window_wait_ms(self.last, counters))
            if self.wait_ms is not None:
                self.publish(self.wait_ms, self.clock())
        self.last = counters

    def _run(self) -> None:
        while not self.stopping.wait(PERIOD_S):
            self.step()


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2.0) as response:
        return response.read().decode("utf-8")


def parent_argv(ppid: int) -> list[str]:
    """The command line of process `ppid` (the stub's parent: tritonserver); empty when unreadable."""
    import psutil

    try:
        return psutil.Process(ppid).cmdline()
    except (psutil.Error, OSError):
        return []
