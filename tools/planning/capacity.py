"""How many GPUs (replicas) for N requests per minute at model latency X and batch size Y.

One replica runs `instances` batches side by side, each of Y rows in X ms, so it serves
T = instances x Y / X rows per second at most. Demand is R = N / 60 x rows per request.
Replicas = ceil(R / (T x u)), where u < 1 is the utilization to plan for: queues stay short
only with headroom (gen-config plans for 80% at peak; 70% is the default here). A batch
size is only usable if a request can wait for the batch in flight and then run in its own
within the SLO: o + 2 X <= S, the rule gen-config uses for max_batch_size.

`Observed` is what a recording showed one bucket model's batches to be
(`tools.observe.scaling.observed_batches` reads it); `observed_plans` plans at those batches.
The `capacity` command (`tools/cli/capacity.py`) reads profiles, specs and recordings and prints.
No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tools.spec.profile import LatencyCurve

DEFAULT_UTILIZATION = 0.7


@dataclass(frozen=True)
class Demand:
    """What must be served, and how hard to run the hardware."""

    requests_per_min: float  # N
    rows_per_request: float = 1.0  # rows one request carries
    utilization: float = DEFAULT_UTILIZATION  # u: busy share planned per replica, (0, 1]
    slo_p95_ms: float | None = None  # S: checks that the batch size can meet it
    overhead_ms: float = 0.0  # o: time outside the model (router, network)

    def __post_init__(self) -> None:
        if not self.requests_per_min > 0:
            raise ValueError(f"requests per minute must be > 0, got {self.requests_per_min}")
        if not self.rows_per_request > 0:
            raise ValueError(f"rows per request must be > 0, got {self.rows_per_request}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if self.slo_p95_ms is not None and not self.slo_p95_ms > 0:
            raise ValueError(f"the SLO must be > 0 ms, got {self.slo_p95_ms}")
        if self.overhead_ms < 0:
            raise ValueError(f"overhead must be >= 0 ms, got {self.overhead_ms}")

    @property
    def rows_per_s(self) -> float:
        return self.requests_per_min / 60.0 * self.rows_per_request


@dataclass(frozen=True)
class Plan:
    """The answer for one batch size, with every number that set it."""

    batch: float  # Y (a mean when it is what traffic formed)
    latency_ms: float  # X: one batch of Y rows
    instances: int  # batches one replica runs side by side
    rows_per_s_needed: float  # R
    rows_per_s_per_replica: float  # T
    replicas: int
    utilization_at_replicas: float  # R / (replicas x T)
    cost_per_million_usd: float | None = None

    def formula(self, demand: Demand) -> str:
        return (f"replicas = ceil(R / (T x u)) = ceil({self.rows_per_s_needed:,.1f} rows/s / "
                f"({self.instances} x {self.batch:g} rows / {self.latency_ms / 1000:.4f} s "
                f"x {demand.utilization:.2f})) "
                f"= ceil({self.rows_per_s_needed / (self.rows_per_s_per_replica * demand.utilization):.2f}) "
                f"= {self.replicas}")


def plan(demand: Demand, batch: float, latency_ms: float, instances: int = 1,
         gpu_hour_usd: float | None = None) -> Plan:
    """Replicas for the demand at one batch size (pure); ValueError when it cannot meet the SLO."""
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    if not latency_ms > 0:
        raise ValueError(f"batch latency must be > 0 ms, got {latency_ms}")
    if instances < 1:
        raise ValueError(f"instances per replica must be >= 1, got {instances}")
    if gpu_hour_usd is not None and gpu_hour_usd < 0:
        raise ValueError(f"GPU-hour cost must be >= 0, got {gpu_hour_usd}")
    if demand.slo_p95_ms is not None and demand.overhead_ms + 2 * latency_ms > demand.slo_p95_ms:
        raise ValueError(
            f"batch {batch} cannot meet the SLO: o + 2 x X = {demand.overhead_ms:.1f} + 2 x {latency_ms:.1f} = "
            f"{demand.overhead_ms + 2 * latency_ms:.1f} ms > {demand.slo_p95_ms:.0f} ms (a request may wait for "
            f"the batch in flight, then run in its own); choose a batch that runs in at most "
            f"{(demand.slo_p95_ms - demand.overhead_ms) / 2:.1f} ms")
    per_replica = instances * batch / (latency_ms / 1000.0)
    replicas = max(1, math.ceil(demand.rows_per_s / (per_replica * demand.utilization) - 1e-9))
    cost = None
    if gpu_hour_usd is not None:
        cost = replicas * gpu_hour_usd / (demand.requests_per_min * 60.0) * 1e6
    return Plan(batch=batch, latency_ms=latency_ms, instances=instances, rows_per_s_needed=demand.rows_per_s,
                rows_per_s_per_replica=per_replica, replicas=replicas,
                utilization_at_replicas=demand.rows_per_s / (replicas * per_replica), cost_per_million_usd=cost)


def candidates(demand: Demand, curve: LatencyCurve, instances: int = 1,
               gpu_hour_usd: float | None = None) -> list[Plan | str]:
    """A plan per measured batch size, or why that size is out (pure)."""
    out: list[Plan | str] = []
    for batch in curve.sizes:
        try:
            out.append(plan(demand, batch, curve.at(batch), instances, gpu_hour_usd))
        except ValueError as err:
            out.append(str(err))
    return out


def best(plans: Sequence[Plan | str]) -> Plan:
    """Fewest replicas; among those, the smallest batch (less waiting to fill it)."""
    usable = [p for p in plans if isinstance(p, Plan)]
    if not usable:
        raise ValueError("no measured batch size meets the SLO: " + "; ".join(str(p) for p in plans))
    return min(usable, key=lambda p: (p.replicas, p.batch))


@dataclass(frozen=True)
class Observed:
    """One bucket model's batches over a recorded window."""

    model: str
    requests_per_min: float  # requests (rows, for bucket models) it carried
    mean_batch_rows: float  # Y as formed
    batch_ms: float  # X: mean compute time of those batches, as measured (contention included)
    preferred_batch: int | None  # the served config's preferred size, if known


def observed_plans(observed: Observed, demand: Demand, instances: int, curve: LatencyCurve | None,
                   gpu_hour_usd: float | None = None) -> tuple[Plan, Plan | None]:
    """The plan at the batches traffic formed, and at the preferred size with the profile's
    c(b) when both are known (pure)."""
    as_formed = plan(demand, round(observed.mean_batch_rows, 2), observed.batch_ms, instances, gpu_hour_usd)
    preferred = None
    if curve is not None and observed.preferred_batch and observed.preferred_batch <= curve.max_measured:
        preferred = plan(demand, observed.preferred_batch, curve.at(observed.preferred_batch), instances,
                         gpu_hour_usd)
    return as_formed, preferred
