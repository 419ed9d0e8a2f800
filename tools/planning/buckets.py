"""Bucket edges as a planning choice: edges derived from a workload's length distribution, by
padded tokens or by measured compute, and the figures that compare them with a model's edges.

The exact optimisation (`optimal_edges`, by dynamic programming) and the padded-token figures
live in `tools.spec.buckets`, because the serving spec resolves `buckets = "derived"` with them
when it is read. This module adds what needs a latency profile or a model's spec:

- `compute_row_cost` / `compute_edges`: the objective by expected compute, a row's compute at
  its bucket estimated from the measured curves (`curve_at_length` interpolates the lengths
  that were not profiled), so a search can try edges no bucket model was built for;
- `edge_sets`: the derived edges for each bucket count;
- `search_edge_sets`: the edges a search tries besides a model's own;
- `compare_edges` / `explain_line`: a model's edges against the derived ones for its workload
  (padded tokens per row, share of rows per bucket), the line `gen-config --explain` prints.

Pure: the callers read the workloads and profiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tools.spec.buckets import EDGE_ALIGN, bucket_shares, last_edge, optimal_edges, padded_length
from tools.spec.profile import LatencyCurve, curve_at_length
from tools.spec.serving import BucketedModelSpec
from tools.spec.workload import Workload

POWERS_OF_TWO_FROM = 16  # the reference edges of a derived model: powers of two from 16 (add-model's default)


def compute_row_cost(curves: Mapping[int, LatencyCurve], batch_size: int = 1) -> Callable[[int], float]:
    """A row's compute at a bucket edge, ms: c(b) / b of the curve at that length (measured, or
    estimated by `curve_at_length`), at `batch_size` rows per execution or the largest batch
    measured at that length when fewer were. Batch 1 weighs what a row costs at light load; the
    batch sizes that form at peak weigh throughput."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    def cost(edge: int) -> float:
        curve = curve_at_length(curves, edge)
        batch = min(batch_size, curve.max_measured)
        return curve.at(batch) / batch

    return cost


def compute_edges(probabilities: Mapping[int, float], max_buckets: int, last: int,
                  curves: Mapping[int, LatencyCurve], batch_size: int = 1,
                  align: int = EDGE_ALIGN) -> tuple[int, ...]:
    """At most `max_buckets` edges ending at `last` with the least expected compute per row
    (`compute_row_cost`) instead of the fewest padded tokens: they differ where compute is not
    proportional to length (attention's quadratic part, a fixed cost below some length)."""
    return optimal_edges(probabilities, max_buckets, last, align, compute_row_cost(curves, batch_size))


def edge_sets(workload: Workload, bucket_counts: Iterable[int], max_length: int | None = None,
              align: int = EDGE_ALIGN) -> dict[int, tuple[int, ...]]:
    """Bucket count -> the derived edges (fewest padded tokens) with at most that many buckets:
    the edge candidates a search measures. Counts that give the same edges appear once, under
    the smallest."""
    probabilities = workload.length_probabilities()
    last = last_edge(workload.longest, align, max_length)
    sets: dict[int, tuple[int, ...]] = {}
    for count in sorted(set(bucket_counts)):
        edges = optimal_edges(probabilities, count, last, align)
        if edges not in sets.values():
            sets[count] = edges
    return sets


MAX_SEARCH_EDGE_SETS = 4  # edge sets a search measures besides the model's own: one joint point each


def search_edge_sets(workload: Workload, own_edges: Sequence[int], curves: Mapping[int, LatencyCurve],
                     align: int = EDGE_ALIGN, limit: int = MAX_SEARCH_EDGE_SETS) -> list[tuple[int, ...]]:
    """The bucket edges a search tries besides the model's own, in this order: the fewest
    padded tokens per row with as many buckets as the model has; the least compute per row
    (`compute_edges` at the largest batch measured, what a row costs in the full batches of
    peak load) with as many; the fewest padded tokens with one bucket fewer, then one more;
    powers of two. All end where the model's own edges end (rows past it are truncated
    either way), at most `limit` of them, none equal to the model's own or to another."""
    if not own_edges:
        raise ValueError("the model has no bucket edges to compare with")
    own = tuple(sorted(own_edges))
    probabilities = workload.length_probabilities()
    last = last_edge(workload.longest, align, max_length=own[-1])
    count = len(own)
    peak_batch = max(curve.max_measured for curve in curves.values())
    candidates = [optimal_edges(probabilities, count, last, align),
                  compute_edges(probabilities, count, last, curves, peak_batch, align)]
    candidates += [optimal_edges(probabilities, n, last, align) for n in (count - 1, count + 1) if n >= 1]
    candidates.append(powers_of_two(last))
    found: list[tuple[int, ...]] = []
    for edges in candidates:
        if edges != own and edges not in found:
            found.append(edges)
    return found[:limit]


@dataclass(frozen=True)
class EdgeFigures:
    """One set of edges on one workload."""

    edges: tuple[int, ...]  # bucket lengths, ascending
    padded_per_row: float  # expected length a row is padded to (tokens, or positions on the variable axis)
    shares: dict[int, float]  # edge -> share of rows it receives


def edge_figures(probabilities: Mapping[int, float], edges: Sequence[int]) -> EdgeFigures:
    ordered = tuple(sorted(edges))
    return EdgeFigures(edges=ordered, padded_per_row=padded_length(probabilities, ordered),
                       shares=bucket_shares(probabilities, ordered))


@dataclass(frozen=True)
class EdgeComparison:
    """A model's edges against others for its workload."""

    model: str  # the router model's name
    unit: str  # what a length counts: "tokens" (text kinds) or "positions" (a tensor model's variable axis)
    workload: str  # the workload's name
    bucket_count: int  # buckets asked of the derivation
    derived: bool  # whether the model's own edges are the derived ones (buckets = "derived")
    own: EdgeFigures  # the model's edges
    other: EdgeFigures  # derived edges for a model that lists them; powers of two for a derived model


def powers_of_two(last: int, start: int = POWERS_OF_TWO_FROM) -> tuple[int, ...]:
    """Powers of two from `start` below `last`, then `last`."""
    edges, length = [], start
    while length < last:
        edges.append(length)
        length *= 2
    return (*edges, last)


def compare_edges(model: BucketedModelSpec, workload: Workload, align: int = EDGE_ALIGN) -> EdgeComparison:
    """The model's edges and the figures to weigh them by. A model that lists its edges is
    compared with the edges derived for its workload with as many buckets and the same largest
    one (rows past it are truncated either way); a derived model, with powers of two up to its
    largest edge."""
    probabilities = workload.length_probabilities()
    own = edge_figures(probabilities, model.bucket_lens)
    derived = model.bucket_count > 0
    if derived:
        other = edge_figures(probabilities, powers_of_two(own.edges[-1]))
        count = model.bucket_count
    else:
        count = len(own.edges)
        last = last_edge(workload.longest, align, max_length=own.edges[-1])
        other = edge_figures(probabilities, optimal_edges(probabilities, count, last, align))
    return EdgeComparison(model=model.name, unit="tokens" if model.kind.is_text else "positions",
                          workload=workload.name, bucket_count=count, derived=derived,
                          own=own, other=other)


def _percent(share: float) -> str:
    percent = 100 * share
    return f"{percent:.0f}" if percent >= 1 or percent == 0 else f"{percent:.1f}"


def _figures_text(figures: EdgeFigures, unit: str) -> str:
    return (f"{','.join(map(str, figures.edges))}: {figures.padded_per_row:.1f} padded {unit}/row, rows "
            f"{'/'.join(_percent(s) for s in figures.shares.values())}%")


def explain_line(comparison: EdgeComparison) -> str:
    """One line: the model's edges, then the others, each with its padded tokens per row and
    its share of rows per bucket."""
    derived = f"derived for {comparison.workload} ({comparison.bucket_count} buckets)"
    own, other = (_figures_text(figures, comparison.unit) for figures in (comparison.own, comparison.other))
    if comparison.derived:
        return f"{comparison.model}: edges {derived} {own}; powers of two {other}"
    return f"{comparison.model}: edges {own}; {derived} {other}"
