"""The SLO verdict of a load run: p95 per model and per tenant against the serving spec, error rates.

Every call a Locust user makes is recorded as `Sample`s (one `latency` sample per request, and
for a streamed generation also its `ttft` and `tpot`). At the end of the run `judge` compares
them with the targets: an embedding model's end-to-end p95 against `slo_p95_ms`, an LLM's time
to first token p95 against `ttft_p95_ms`, and each model's and each tenant's share of failed
requests against the mix's `max_error_rate`. `stage_rows` and `knee` read a shaped run stage by
stage. Everything here is pure; the Locust glue only records and ships samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from loadtest.mix import LoadMix, ModelKind
from loadtest.shapes import LoadShape, stage_index
from tools.bench.loadgen import MIN_P95_SAMPLES, percentile

# A line of fewer than MIN_P95_SAMPLES successful requests is judged on its median: a 15 s run
# of three users failed on one tenant line of 7 requests (one 374 ms answer beside six under
# 60 ms). A slow tenant still fails on its median; one slow answer does not.


class Metric(StrEnum):
    LATENCY = "latency"  # a whole request: sent to last response
    TTFT = "ttft"  # a stream: sent to first token
    TPOT = "tpot"  # a stream: mean time between tokens after the first


@dataclass(frozen=True)
class Sample:
    """One measurement of one call."""

    at_s: float  # wall-clock time the call was sent (time.time(): comparable across workers)
    model: str  # the mix's model name (an LLM called over HTTP still counts as that model)
    tenant: str  # "" when the request named no tenant
    metric: Metric
    value_ms: float  # the measured time
    error: str = ""  # "" when the call succeeded, else what went wrong (rejected, failed, timeout)

    def to_row(self) -> list:
        """A compact form for shipping from Locust workers to the master."""
        return [self.at_s, self.model, self.tenant, self.metric.value, self.value_ms, self.error]

    @classmethod
    def from_row(cls, row: Sequence) -> Sample:
        at_s, model, tenant, metric, value_ms, error = row
        return cls(float(at_s), str(model), str(tenant), Metric(metric), float(value_ms), str(error))


@dataclass(frozen=True)
class Target:
    """What one model must deliver."""

    model: str
    metric: Metric  # the metric the SLO is on
    p95_ms: float  # the p95 bound


@dataclass(frozen=True)
class Check:
    """One line of the verdict: a model, or one tenant's requests to it."""

    model: str
    tenant: str | None  # None: every request to the model
    metric: Metric  # the SLO's metric
    requests: int  # requests sent
    errors: int  # requests that failed
    p95_ms: float | None  # p95 of the SLO metric over successful requests (None: none succeeded)
    target_ms: float
    max_error_rate: float  # the share of failed requests allowed
    reasons: tuple[str, ...]  # why it failed; empty when it passed
    judged_on: str = "p95"  # "median" when too few requests succeeded for a p95 (MIN_P95_SAMPLES)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def passed(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Verdict:
    checks: tuple[Check, ...]  # models first, then their tenants
    error_kinds: dict[str, int]  # failed requests by kind, over the whole run

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "checks": [{**asdict(check), "error_rate": round(check.error_rate, 5), "passed": check.passed,
                        "tenant": check.tenant} for check in self.checks],
            "error_kinds": dict(self.error_kinds),
        }


def targets_for(mix: LoadMix, embed_slos: Mapping[str, float], llm_ttft_slos: Mapping[str, float]) -> dict[str, Target]:
    """The target of each model in the mix: the mix's own `slo_p95_ms`, else the serving spec's
    (`embed_slos`: model -> slo_p95_ms, `llm_ttft_slos`: model -> ttft_p95_ms)."""
    targets = {}
    for model in mix.models:
        metric = Metric.TTFT if model.kind is ModelKind.LLM else Metric.LATENCY
        if model.slo_p95_ms is not None:
            p95_ms = model.slo_p95_ms
        else:
            slos = llm_ttft_slos if model.kind is ModelKind.LLM else embed_slos
            if model.model not in slos:
                raise ValueError(f"model {model.model!r} has no SLO: the serving spec does not name it; "
                                 f"give it slo_p95_ms in the mix")
            p95_ms = slos[model.model]
        targets[model.model] = Target(model=model.model, metric=metric, p95_ms=float(p95_ms))
    return targets


def allowed_errors(requests: Sequence[Sample], error_rates: Mapping[str, float], default_error_rate: float) -> float:
    """How many of `requests` may fail: each is allowed its tenant's error rate."""
    return sum(error_rates.get(s.tenant, default_error_rate) for s in requests)


def _check(model: str, tenant: str | None, samples: Sequence[Sample], target: Target,
           error_rates: Mapping[str, float], default_error_rate: float) -> Check:
    requests = [s for s in samples if s.metric is Metric.LATENCY]
    errors = sum(1 for s in requests if s.error)
    allowed = allowed_errors(requests, error_rates, default_error_rate)
    max_error_rate = allowed / len(requests) if requests else default_error_rate
    measured = [s.value_ms for s in samples if s.metric is target.metric and not s.error]
    p95_ms = percentile(measured, 95) if measured else None
    judged_on = "median" if 0 < len(measured) < MIN_P95_SAMPLES else "p95"
    reasons = []
    if not requests:
        reasons.append("no requests were sent")
    elif p95_ms is None:
        reasons.append("no request succeeded")
    elif judged_on == "median":
        if (median_ms := percentile(measured, 50)) > target.p95_ms:
            reasons.append(f"median {target.metric} {median_ms:.0f} ms > {target.p95_ms:.0f} ms ({len(measured)} "
                           f"requests: too few for a p95, which needs {MIN_P95_SAMPLES})")
    elif p95_ms > target.p95_ms:
        reasons.append(f"p95 {target.metric} {p95_ms:.0f} ms > {target.p95_ms:.0f} ms")
    if requests and errors > allowed + 1e-9:
        reasons.append(f"error rate {errors / len(requests):.2%} > {max_error_rate:.2%}")
    return Check(model=model, tenant=tenant, metric=target.metric, requests=len(requests), errors=errors,
                 p95_ms=p95_ms, target_ms=target.p95_ms, max_error_rate=max_error_rate, reasons=tuple(reasons),
                 judged_on=judged_on)


def judge(samples: Iterable[Sample], targets: Mapping[str, Target], max_error_rate: float,
          tenant_error_rates: Mapping[str, float] | None = None) -> Verdict:
    """Every model in `targets` and every tenant that called it, against its target.

    A model of the mix that got no requests fails (the run did not test it). A line with fewer
    than MIN_P95_SAMPLES successful requests is judged on their median. p95 is over the
    requests that succeeded; the failed ones count against the error rate instead, which is
    `max_error_rate` unless `tenant_error_rates` gives the tenant its own (a bulk tier that is
    shed first under load); a model's line allows each of its requests its tenant's rate.
    """
    rates = dict(tenant_error_rates or {})
    by_model: dict[str, list[Sample]] = {name: [] for name in targets}
    for sample in samples:
        if sample.model in by_model:
            by_model[sample.model].append(sample)
    checks = []
    error_kinds: Counter[str] = Counter()
    for name, target in targets.items():
        model_samples = by_model[name]
        checks.append(_check(name, None, model_samples, target, rates, max_error_rate))
        by_tenant: dict[str, list[Sample]] = {}
        for sample in model_samples:
            by_tenant.setdefault(sample.tenant, []).append(sample)
            if sample.metric is Metric.LATENCY and sample.error:
                error_kinds[sample.error] += 1
        if set(by_tenant) != {""}:
            for tenant in sorted(by_tenant):
                checks.append(_check(name, tenant, by_tenant[tenant], target, rates, max_error_rate))
    return Verdict(checks=tuple(checks), error_kinds=dict(error_kinds))


@dataclass(frozen=True)
class StageRow:
    """What one stage of a shaped run measured."""

    index: int  # stage number, from 0
    users: int  # the shape's users in this stage
    throughput_rps: float  # successful requests per second, all models
    errors: int  # failed requests
    p95_ms: dict[str, float | None]  # model -> p95 of its SLO metric (None: nothing succeeded)
    within_slo: bool  # every model met its target in this stage, errors within the limit


def stage_rows(samples: Iterable[Sample], shape: LoadShape, start_s: float, targets: Mapping[str, Target],
               max_error_rate: float, settle_s: float = 0.0,
               tenant_error_rates: Mapping[str, float] | None = None) -> list[StageRow]:
    """Per stage of `shape` (run started at wall-clock `start_s`): throughput, errors, p95 per model.

    Requests sent in the first `settle_s` seconds of a stage are left out: the users are still
    spawning and the queue is still filling.
    """
    bounds = shape.stage_bounds()
    buckets: list[list[Sample]] = [[] for _ in bounds]
    for sample in samples:
        index = stage_index(shape, sample.at_s - start_s)
        if index is not None and sample.at_s - start_s >= bounds[index][0] + settle_s:
            buckets[index].append(sample)
    rows = []
    for index, (stage, (begin_s, end_s), stage_samples) in enumerate(zip(shape.stages, bounds, buckets,
                                                                         strict=True)):
        requests = [s for s in stage_samples if s.metric is Metric.LATENCY]
        errors = sum(1 for s in requests if s.error)
        window_s = max(end_s - begin_s - settle_s, 1e-9)
        p95s: dict[str, float | None] = {}
        within = errors <= allowed_errors(requests, tenant_error_rates or {}, max_error_rate) + 1e-9
        for name, target in targets.items():
            measured = [s.value_ms for s in stage_samples
                        if s.model == name and s.metric is target.metric and not s.error]
            p95s[name] = percentile(measured, 95) if measured else None
            if p95s[name] is not None and p95s[name] > target.p95_ms:
                within = False
        rows.append(StageRow(index=index, users=stage.users, throughput_rps=(len(requests) - errors) / window_s,
                             errors=errors, p95_ms=p95s, within_slo=within and bool(requests)))
    return rows


def knee(rows: Sequence[StageRow]) -> StageRow | None:
    """The stage with the highest throughput among those that met every SLO: on a step ramp,
    the most load this deployment carries within its SLOs (None if no stage met them)."""
    passing = [row for row in rows if row.within_slo]
    return max(passing, key=lambda row: row.throughput_rps) if passing else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render_markdown(verdict: Verdict, info: Mapping[str, object], rows: Sequence[StageRow] = ()) -> str:
    """The short report written at the end of a run."""
    lines = [f"# Load run: {'PASS' if verdict.passed else 'FAIL'}", ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines += ["", "| model | tenant | requests | errors | allowed | p95 (ms) | target (ms) | verdict |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for check in verdict.checks:
        tenant = "all" if check.tenant is None else (check.tenant or "(none)")
        outcome = "pass" if check.passed else "FAIL: " + "; ".join(check.reasons)
        if check.passed and check.judged_on == "median":
            outcome = f"pass (on its median: too few requests for a p95, which needs {MIN_P95_SAMPLES})"
        lines.append(f"| {check.model} | {tenant} | {check.requests} | {check.errors} ({check.error_rate:.1%}) | "
                     f"{check.max_error_rate:.1%} | {_ms(check.p95_ms)} {check.metric} | {check.target_ms:.0f} | "
                     f"{outcome} |")
    if verdict.error_kinds:
        lines += ["", "Failed requests by kind: " + ", ".join(f"{kind} {count}" for kind, count
                                                               in sorted(verdict.error_kinds.items()))]
    if rows:
        models = list(rows[0].p95_ms)
        lines += ["", "| stage | users | ok req/s | errors | " + " | ".join(f"{m} p95 (ms)" for m in models)
                  + " | within SLO |", "|---:|---:|---:|---:|" + "---:|" * len(models) + "---|"]
        for row in rows:
            lines.append(f"| {row.index} | {row.users} | {row.throughput_rps:.1f} | {row.errors} | "
                         + " | ".join(_ms(row.p95_ms[m]) for m in models) + f" | {'yes' if row.within_slo else 'no'} |")
        best = knee(rows)
        if best is None:
            lines += ["", "Knee: no stage met every SLO."]
        elif best.index == rows[-1].index:
            lines += ["", f"Knee not reached: the last stage ({best.users} users, {best.throughput_rps:.1f} req/s) "
                          "still met every SLO; a larger shape (--shape-user-scale) finds it."]
        else:
            lines += ["", f"Knee: stage {best.index}, {best.users} users, {best.throughput_rps:.1f} req/s "
                          "within every SLO."]
    return "\n".join(lines) + "\n"
