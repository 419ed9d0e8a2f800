"""Read the server's metrics: snapshots of /metrics, the window between two, quantiles.

Triton exports counters (requests, rows, batches, queue and compute microseconds summed over
requests), gauges (pending requests, the LLM engine's sequences and KV blocks) and the kit's
histograms (end-to-end latency per encoder version, rows per formed batch, LLM time to first
token). A rate, a mean or a p95 only means something over a window: the difference of two
snapshots. `top`, `explain` and `autoscale` all read the server this way, and their tests
read recorded snapshots the same way (a recording is JSON lines of snapshots).

Everything here is pure except `fetch_text` and `take_snapshot`.
"""

from __future__ import annotations

import gzip
import json
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tools.planning.samples import Labels, SeriesKey, histogram_quantile, labels_of

Match = Mapping[str, "str | Container[str]"]  # label -> exact value, or a set of accepted values

# Triton's per-model counters and gauge (labels model, version), summed over requests.
SUCCESS = "nv_inference_request_success"
FAILURE = "nv_inference_request_failure"
ROWS = "nv_inference_count"
BATCHES = "nv_inference_exec_count"
QUEUE_US = "nv_inference_queue_duration_us"
COMPUTE_US = ("nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
              "nv_inference_compute_output_duration_us")
PENDING = "nv_inference_pending_request_count"
# The kit's own (see python_backends/embed.py, encoder.py, adapters/llm_model.py).
ROUTER_LATENCY = "embed_request_duration_seconds"
ROUTER_REQUESTS = "embed_requests_total"
TENANT_REQUESTS = "embed_tenant_requests_total"
BATCH_ROWS = "embed_bucket_batch_rows"
REAL_TOKENS = "embed_bucket_real_tokens_total"
PADDED_TOKENS = "embed_bucket_padded_tokens_total"
EXPRESS_ROWS = "embed_bucket_express_rows_total"  # rows of a bucket its express model served
LLM_TTFT = "llm_time_to_first_token_seconds"
LLM_RUNNING = "llm_running_sequences"
LLM_WAITING = "llm_waiting_sequences"
LLM_BLOCKS_USED = "llm_kv_blocks_used"
LLM_BLOCKS_TOTAL = "llm_kv_blocks_total"

# Families a recording keeps: what top, explain and autoscale read.
RECORDED_PREFIXES = ("nv_inference_", "nv_cpu_utilization", "nv_gpu_utilization", "embed_", "llm_")


@dataclass(frozen=True)
class Snapshot:
    """Every sample of one read of /metrics."""

    at_s: float  # when it was read, seconds (wall clock in recordings)
    series: Mapping[SeriesKey, float]  # (sample name, labels) -> value

    def to_json(self) -> dict:
        return {"at_s": self.at_s, "series": [[name, dict(labels), value]
                                              for (name, labels), value in sorted(self.series.items())]}

    @classmethod
    def from_json(cls, data: Mapping) -> Snapshot:
        try:
            series = {(str(name), labels_of(labels)): float(value) for name, labels, value in data["series"]}
            return cls(at_s=float(data["at_s"]), series=series)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a metrics snapshot: {err}") from None


def parse_exposition(text: str, keep: Callable[[str], bool] | None = None) -> dict[SeriesKey, float]:
    """Samples of a Prometheus text exposition (format 0.0.4), names exactly as exported;
    `keep(sample_name)` filters them. Parsed by `prometheus_client.parser`.

    A line that is not a sample raises ValueError naming the line: a page that does not parse
    is not the server's /metrics (a wrong URL, a proxy's error page), and skipping its lines
    would read as "no traffic", so `top` would show an idle server and a rollout would wait
    out its step and blame the canary. Every reader (top, explain, autoscale, the rollout
    gates, the LLM benchmark) fails loudly instead, with the line.

    Comment lines are dropped before parsing: with its `# TYPE ... counter` line the library
    renames a counter's samples to end in `_total` (OpenMetrics' convention), and the kit
    reads names as Triton exports them. The library is about four times slower than the
    regular expressions it replaced (4 to 7 ms against 1.3 to 1.8 ms for a 255-series page of
    a recording, on 2 busy cores); a live reader reads one page a second at most, and
    recordings are replayed from JSON, never re-parsed.
    """
    lines = text.splitlines()
    body = "\n".join("" if line.lstrip().startswith("#") else line for line in lines)
    try:
        families = list(text_string_to_metric_families(body))
    except ValueError:
        raise ValueError(_unreadable_line(lines)) from None
    series: dict[SeriesKey, float] = {}
    for family in families:
        for sample in family.samples:
            if keep is None or keep(sample.name):
                series[(sample.name, labels_of(sample.labels))] = float(sample.value)
    return series


def _unreadable_line(lines: list[str]) -> str:
    """The first line the parser refuses, found again one line at a time (only on the error path)."""
    for number, line in enumerate(lines, start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                list(text_string_to_metric_families(line))
            except ValueError as err:
                return f"unreadable metrics text at line {number}: {line.strip()[:80]!r} ({err})"
    return "unreadable metrics text"


def keep_recorded(name: str) -> bool:
    return name.startswith(RECORDED_PREFIXES)


def fetch_text(metrics_url: str, timeout_s: float = 5.0) -> str:
    """GET the metrics endpoint (e.g. http://localhost:8002/metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        return response.read().decode("utf-8")


def take_snapshot(metrics_url: str, keep: Callable[[str], bool] | None = keep_recorded,
                  clock: Callable[[], float] = time.time) -> Snapshot:
    return Snapshot(at_s=clock(), series=parse_exposition(fetch_text(metrics_url), keep))


def open_recording(path: str | Path, mode: str = "rt"):
    """A recording file, gzip-compressed when its name ends in .gz."""
    path = Path(path)
    return gzip.open(path, mode) if path.suffix == ".gz" else path.open(mode)


def snapshot_line(snapshot: Snapshot) -> str:
    return json.dumps(snapshot.to_json(), separators=(",", ":")) + "\n"


def read_recording(path: str | Path) -> list[Snapshot]:
    """Snapshots from a JSON-lines recording (.jsonl, or .jsonl.gz), oldest first."""
    snapshots = []
    with open_recording(path) as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                snapshots.append(Snapshot.from_json(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as err:
                raise ValueError(f"{path}:{number}: {err}") from None
    if len(snapshots) < 2:
        raise ValueError(f"{path}: a recording needs at least two snapshots, found {len(snapshots)}")
    return sorted(snapshots, key=lambda s: s.at_s)


def _matches(labels: Labels, match: Match) -> bool:
    values = dict(labels)
    for key, wanted in match.items():
        value = values.get(key)
        if value is None or (value != wanted if isinstance(wanted, str) else value not in wanted):
            return False
    return True


@dataclass(frozen=True)
class Window:
    """What happened between two snapshots."""

    start: Snapshot
    end: Snapshot

    def __post_init__(self) -> None:
        if self.end.at_s <= self.start.at_s:
            raise ValueError(f"a window needs a later end: {self.start.at_s} .. {self.end.at_s}")

    @property
    def duration_s(self) -> float:
        return self.end.at_s - self.start.at_s

    def _series(self, name: str, match: Match) -> Iterator[tuple[Labels, float]]:
        for (sample, labels), value in self.end.series.items():
            if sample == name and _matches(labels, match):
                yield labels, value

    def _increase(self, name: str, labels: Labels, value: float) -> float:
        before = self.start.series.get((name, labels), 0.0)
        return value if value < before else value - before  # a drop is a reset: the server or model restarted

    def increase(self, name: str, **match: str | Container[str]) -> float:
        """Sum over matching series of a counter's increase (resets handled as Prometheus does)."""
        return sum(self._increase(name, labels, value) for labels, value in self._series(name, match))

    def increase_by(self, label: str, name: str, **match: str | Container[str]) -> dict[str, float]:
        """A counter's increase per value of one label."""
        totals: dict[str, float] = defaultdict(float)
        for labels, value in self._series(name, match):
            totals[dict(labels).get(label, "")] += self._increase(name, labels, value)
        return dict(totals)

    def gauge(self, name: str, **match: str | Container[str]) -> float:
        """Sum over matching series of a gauge at the end of the window."""
        return sum(value for _, value in self._series(name, match))

    def label_values(self, name: str, label: str, **match: str | Container[str]) -> set[str]:
        return {dict(labels)[label] for labels, _ in self._series(name, match) if label in dict(labels)}

    def quantile(self, q: float, histogram: str, interpolate: bool = True,
                 **match: str | Container[str]) -> float | None:
        """The q-quantile of a histogram's observations in this window, over matching series."""
        counts: dict[float, float] = defaultdict(float)
        for labels, value in self._series(histogram + "_bucket", match):
            bound = float(dict(labels)["le"])
            counts[bound] += self._increase(histogram + "_bucket", labels, value)
        return histogram_quantile(q, counts.items(), interpolate)

    def mean(self, histogram: str, **match: str | Container[str]) -> float | None:
        count = self.increase(histogram + "_count", **match)
        return self.increase(histogram + "_sum", **match) / count if count > 0 else None


@dataclass(frozen=True)
class QueueStats:
    """One model version's queue and batches over a window, from Triton's counters."""

    model: str
    version: str
    duration_s: float  # window length
    num_requests: float  # requests that succeeded
    num_failed: float  # requests that failed (rejected by the queue policy included)
    num_rows: float  # rows inferred (a request may carry several)
    num_batches: float  # executions: batches Triton formed
    queue_ms: float  # mean time a request waited in the queue
    compute_ms: float  # mean compute time of the batch a request ran in
    pending: float  # requests queued or running at the end of the window

    @property
    def rate_rps(self) -> float:
        return self.num_requests / self.duration_s

    @property
    def mean_batch_rows(self) -> float:
        return self.num_rows / self.num_batches if self.num_batches else 0.0

    @property
    def busy_s(self) -> float:
        """Device time the batches took: every request carries its whole batch's compute time,
        so the sum over requests counts a batch once per request in it."""
        if not self.num_requests:
            return 0.0
        return self.compute_ms / 1000.0 * self.num_batches


def queue_stats(window: Window, models: Container[str] | None = None) -> list[QueueStats]:
    """Per (model, version) with traffic or pending work in the window, sorted by name."""
    keys = sorted({(dict(labels).get("model", ""), dict(labels).get("version", ""))
                   for (name, labels) in window.end.series if name == SUCCESS})
    out = []
    for model, version in keys:
        if models is not None and model not in models:
            continue
        match = {"model": model, "version": version}
        num_requests = window.increase(SUCCESS, **match)
        compute_us = sum(window.increase(name, **match) for name in COMPUTE_US)
        out.append(QueueStats(
            model=model, version=version, duration_s=window.duration_s, num_requests=num_requests,
            num_failed=window.increase(FAILURE, **match), num_rows=window.increase(ROWS, **match),
            num_batches=window.increase(BATCHES, **match),
            queue_ms=window.increase(QUEUE_US, **match) / num_requests / 1000.0 if num_requests else 0.0,
            compute_ms=compute_us / num_requests / 1000.0 if num_requests else 0.0,
            pending=window.gauge(PENDING, **match)))
    return out


def windows(snapshots: list[Snapshot], span_s: float) -> Iterator[Window]:
    """A sliding window of about `span_s` ending at each snapshot (from the first one that has
    that much history): what a live reader sees at that moment."""
    first = 0
    for end in range(1, len(snapshots)):
        while snapshots[end].at_s - snapshots[first + 1].at_s >= span_s and first + 1 < end:
            first += 1
        if snapshots[end].at_s - snapshots[first].at_s >= span_s * 0.999:
            yield Window(snapshots[first], snapshots[end])
