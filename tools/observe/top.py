"""The rows of the live terminal view of every model (`python -m tools top`): rate, p95 against
its SLO, queue vs compute, batches, rejections per model; the router's versions; tenants;
padding per bucket; LLM engines; and the rich tables they are drawn in. Pure: a window of
/metrics in, rows and renderables out. The `top` command (`tools/cli/top.py`) reads the
server or a recording and draws them.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from tools.observe.metrics import (
    BATCH_ROWS,
    EXPRESS_ROWS,
    LLM_BLOCKS_TOTAL,
    LLM_BLOCKS_USED,
    LLM_RUNNING,
    LLM_TTFT,
    LLM_WAITING,
    PADDED_TOKENS,
    REAL_TOKENS,
    ROUTER_LATENCY,
    ROUTER_REQUESTS,
    TENANT_REQUESTS,
    Window,
    queue_stats,
)


@dataclass(frozen=True)
class ModelRow:
    """One model over a window (its versions summed)."""

    model: str
    rate_rps: float
    num_failed: float
    p95_ms: float | None  # end-to-end (router) or time to first token (LLM); None where not measured
    slo_ms: float | None
    queue_ms: float  # mean per request
    compute_ms: float  # mean per request: the batch it ran in
    mean_batch_rows: float
    p95_batch_rows: float | None  # from the formed-batch histogram (bucket models)
    pending: float
    rejected: float  # turned away by the router: server busy or over quota

    @property
    def over_slo(self) -> bool:
        return self.p95_ms is not None and self.slo_ms is not None and self.p95_ms > self.slo_ms


def natural_key(name: str) -> tuple:
    """encoder_16 before encoder_128: digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def model_rows(window: Window, slos: Mapping[str, float]) -> list[ModelRow]:
    """Rows for every model with traffic or pending work in the window (pure)."""
    by_model: dict[str, list] = {}
    for q in queue_stats(window):
        by_model.setdefault(q.model, []).append(q)
    rows = []
    for model, queues in sorted(by_model.items(), key=lambda item: natural_key(item[0])):
        requests = sum(q.num_requests for q in queues)
        batches = sum(q.num_batches for q in queues)
        if not requests and not any(q.pending for q in queues) and not any(q.num_failed for q in queues):
            continue
        p95 = window.quantile(0.95, ROUTER_LATENCY, model=model)
        if p95 is None:
            p95 = window.quantile(0.95, LLM_TTFT, model=model)
        # The router counts every answer per tenant: admission's "server busy" and quota refusals
        # never reach a version, so the tenant counter is the one that sees them.
        rejected = window.increase(TENANT_REQUESTS, model=model, outcome={"rejected", "over_quota"})

        def mean(attr: str, queues=queues, requests=requests) -> float:
            return sum(getattr(q, attr) * q.num_requests for q in queues) / requests if requests else 0.0

        rows.append(ModelRow(
            model=model, rate_rps=requests / window.duration_s, num_failed=sum(q.num_failed for q in queues),
            p95_ms=None if p95 is None else p95 * 1000.0, slo_ms=slos.get(model), queue_ms=mean("queue_ms"),
            compute_ms=mean("compute_ms"),
            mean_batch_rows=sum(q.num_rows for q in queues) / batches if batches else 0.0,
            p95_batch_rows=window.quantile(0.95, BATCH_ROWS, interpolate=False, model=model),
            pending=sum(q.pending for q in queues),
            rejected=rejected))
    return rows


def version_rows(window: Window) -> list[tuple[str, str, float, dict[str, float], float | None]]:
    """(router, version, share of its requests, outcomes, p95 ms) per router version (pure)."""
    out = []
    for router in sorted(window.label_values(ROUTER_REQUESTS, "model"), key=natural_key):
        by_version = window.increase_by("version", ROUTER_REQUESTS, model=router)
        total = sum(by_version.values())
        for version in sorted(by_version):
            outcomes = window.increase_by("outcome", ROUTER_REQUESTS, model=router, version=version)
            p95 = window.quantile(0.95, ROUTER_LATENCY, model=router, version=version)
            out.append((router, version, by_version[version] / total if total else 0.0, outcomes,
                        None if p95 is None else p95 * 1000.0))
    return out


def tenant_rows(window: Window) -> list[tuple[str, str, dict[str, float]]]:
    """(tenant, tier, outcomes) with any traffic in the window (pure)."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for (name, labels), _ in window.end.series.items():
        if name != TENANT_REQUESTS:
            continue
        label = dict(labels)
        key = (label.get("tenant", ""), label.get("tier", ""))
        rows.setdefault(key, {})
    for tenant, tier in rows:
        rows[(tenant, tier)] = window.increase_by("outcome", TENANT_REQUESTS, tenant=tenant, tier=tier)
    return [(tenant, tier, outcomes) for (tenant, tier), outcomes in sorted(rows.items()) if sum(outcomes.values())]


def padding_rows(window: Window) -> list[tuple[str, str, float, float | None, float]]:
    """(router, bucket, rows/s, padded / real tokens, share of the rows the express model
    served) per bucket with traffic (pure)."""
    out = []
    for router in sorted(window.label_values(REAL_TOKENS, "model")):
        real = window.increase_by("bucket", REAL_TOKENS, model=router)
        padded = window.increase_by("bucket", PADDED_TOKENS, model=router)
        rows = window.increase_by("bucket", "embed_bucket_rows_total", model=router)
        express = window.increase_by("bucket", EXPRESS_ROWS, model=router)
        for bucket in sorted(real, key=natural_key):
            if rows.get(bucket):
                out.append((router, bucket, rows[bucket] / window.duration_s,
                            padded.get(bucket, 0.0) / real[bucket] if real[bucket] else None,
                            express.get(bucket, 0.0) / rows[bucket]))
    return out


def llm_rows(window: Window) -> list[tuple[str, float, float, float, float]]:
    """(model, running, waiting, KV blocks used, KV blocks total) now (pure)."""
    return [(model, window.gauge(LLM_RUNNING, model=model), window.gauge(LLM_WAITING, model=model),
             window.gauge(LLM_BLOCKS_USED, model=model), window.gauge(LLM_BLOCKS_TOTAL, model=model))
            for model in sorted(window.label_values(LLM_BLOCKS_TOTAL, "model"))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(window: Window, slos: Mapping[str, float]):
    """The rich renderable for one window."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    models = Table(title=f"models, last {window.duration_s:.0f} s", title_justify="left", expand=False)
    for column in ("model", "req/s", "failed", "rejected", "p95 ms", "SLO ms", "queue ms", "compute ms",
                   "batch rows", "batch p95", "pending"):
        models.add_column(column, justify="left" if column == "model" else "right")
    for row in model_rows(window, slos):
        p95 = Text(_ms(row.p95_ms), style="bold red" if row.over_slo else "")
        models.add_row(row.model, f"{row.rate_rps:.1f}", f"{row.num_failed:.0f}", f"{row.rejected:.0f}", p95,
                       _ms(row.slo_ms), _ms(row.queue_ms), _ms(row.compute_ms),
                       f"{row.mean_batch_rows:.1f}" if row.mean_batch_rows else "-", _ms(row.p95_batch_rows),
                       f"{row.pending:.0f}")
    parts = [models]
    versions = version_rows(window)
    if versions:
        table = Table(title="router versions", title_justify="left")
        for column in ("router", "version", "share", "ok", "rejected", "error", "p95 ms"):
            table.add_column(column, justify="left" if column in ("router", "version") else "right")
        for router, version, share, outcomes, p95 in versions:
            table.add_row(router, version, f"{share:.0%}", f"{outcomes.get('ok', 0):.0f}",
                          f"{outcomes.get('rejected', 0):.0f}", f"{outcomes.get('error', 0):.0f}", _ms(p95))
        parts.append(table)
    tenants = tenant_rows(window)
    if tenants:
        table = Table(title="tenants", title_justify="left")
        for column in ("tenant", "tier", "ok", "rejected", "over quota", "error", "unauthenticated"):
            table.add_column(column, justify="left" if column in ("tenant", "tier") else "right")
        for tenant, tier, outcomes in tenants:
            table.add_row(tenant, tier, *(f"{outcomes.get(k, 0):.0f}" for k in ("ok", "rejected", "over_quota",
                                                                                "error", "unauthenticated")))
        parts.append(table)
    padding = padding_rows(window)
    if padding:
        table = Table(title="buckets", title_justify="left")
        for column in ("router", "bucket", "rows/s", "padding waste", "express"):
            table.add_column(column, justify="left" if column == "router" else "right")
        for router, bucket, rate, waste, express in padding:
            table.add_row(router, bucket, f"{rate:.1f}", "-" if waste is None else f"{waste:.2f}x", f"{express:.0%}")
        parts.append(table)
    engines = llm_rows(window)
    if engines:
        table = Table(title="llm engines", title_justify="left")
        for column in ("model", "running", "waiting", "KV blocks used", "KV blocks"):
            table.add_column(column, justify="left" if column == "model" else "right")
        for model, running, waiting, used, total in engines:
            table.add_row(model, f"{running:.0f}", f"{waiting:.0f}", f"{used:.0f}", f"{total:.0f}")
        parts.append(table)
    return Group(*parts)
