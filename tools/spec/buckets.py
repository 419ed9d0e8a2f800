"""Bucket edges for a length distribution: where to cut K buckets so that rows carry the fewest
padded positions, and the figures that compare one set of edges with another.

A row of length n goes to the smallest edge e >= n and is padded to it; a row longer than the
last edge is truncated into the last bucket (`python_backends.embed.buckets`). For a length
distribution p (a workload's `length_probabilities`) and edges e_1 < ... < e_K, a row costs on
average

    sum_n p(n) * cost(edge(n))

With cost(e) = e that is the expected padded length per row, which `buckets = "derived"` in
the serving spec minimises; `tools.planning.buckets` passes the measured compute of a row
instead. `optimal_edges` finds the minimum exactly, by dynamic programming over the candidate
edges.

The serving spec resolves `buckets = "derived"` with this module when it is loaded, so it sits
in the spec layer (the planning layer above it cannot be imported from here). Pure.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tools.spec.workload import Workload

DERIVED = "derived"  # the spec's `buckets` value that asks for edges derived from the workload
DEFAULT_BUCKET_COUNT = 5  # buckets derived when the spec gives no bucket_count: as many as the built-in embed has
# Derived edges are multiples of 8 (but the last, which the model's max_length may cap): fp16
# GEMMs run on a GPU's tensor cores when their dimensions are multiples of 8, an AVX2 register
# holds 8 fp32 values, and a small change in a workload moves an edge by a whole step or not at
# all, so bucket model names change rarely. What the rounding costs, in padded tokens per row
# with 5 buckets (edges on any length -> on multiples of 8): embed_mix 44.80 -> 44.80; a long
# tail to 256 tokens 72.62 -> 72.64; a bimodal mix (70% of 4-12 tokens, 30% of 200-256)
# 77.94 -> 79.29, where the powers of two 16..256 give 88.0.
EDGE_ALIGN = 8
_TIE = 1e-12  # relative: costs this close are equal, and the fewer buckets win


def edge_of(length: int, edges: Sequence[int]) -> int:
    """The bucket a row of `length` goes to: the smallest edge >= length, else the last
    (the row is truncated into it). `edges` ascending."""
    return edges[min(bisect.bisect_left(edges, length), len(edges) - 1)]


def bucket_shares(probabilities: Mapping[int, float], edges: Sequence[int]) -> dict[int, float]:
    """Edge -> the share of rows that bucket receives (rows past the last edge are its too)."""
    shares = dict.fromkeys(edges, 0.0)
    for length, probability in probabilities.items():
        shares[edge_of(length, edges)] += probability
    return shares


def expected_cost(probabilities: Mapping[int, float], edges: Sequence[int],
                  row_cost: Callable[[int], float] = float) -> float:
    """sum_n p(n) * row_cost(edge(n)): what a row costs on average with these edges; with the
    default cost, the expected padded length per row."""
    return sum(share * row_cost(edge) for edge, share in bucket_shares(probabilities, edges).items())


def padded_length(probabilities: Mapping[int, float], edges: Sequence[int]) -> float:
    """Expected length a row is padded to (padded tokens per row), truncated rows included."""
    return expected_cost(probabilities, edges)


def last_edge(longest: int, align: int = EDGE_ALIGN, max_length: int | None = None) -> int:
    """The largest bucket: the longest length rounded up to a multiple of `align`, capped by
    the model's `max_length` (rows past it are truncated into it)."""
    if longest < 1 or align < 1:
        raise ValueError(f"needs longest >= 1 and align >= 1, got {longest} and {align}")
    edge = math.ceil(longest / align) * align
    return edge if max_length is None else min(edge, max_length)


def candidate_edges(probabilities: Mapping[int, float], last: int, align: int = EDGE_ALIGN) -> tuple[int, ...]:
    """Edges worth trying: each length's multiple of `align` (rounded up) below `last`, and
    `last`. Lowering an edge to the candidate at or above its rows keeps every row where it was
    and pads less, so for a cost that grows with the edge the best edges are among these; each
    of them receives rows."""
    below = {math.ceil(length / align) * align for length, p in probabilities.items() if p > 0}
    return (*sorted(edge for edge in below if edge < last), last)


def optimal_edges(probabilities: Mapping[int, float], max_buckets: int, last: int, align: int = EDGE_ALIGN,
                  row_cost: Callable[[int], float] = float) -> tuple[int, ...]:
    """At most `max_buckets` edges, ascending, ending at `last`, that minimise `expected_cost`:
    exact over `candidate_edges` (dynamic programming over (buckets used, last edge), O(K C^2)
    for C candidates). Ties go to fewer buckets, so every edge returned receives rows; fewer
    than `max_buckets` come back when fewer candidates exist or more would not lower the cost.
    """
    if max_buckets < 1:
        raise ValueError(f"needs at least one bucket, got {max_buckets}")
    if not probabilities or sum(probabilities.values()) <= 0:
        raise ValueError("needs a length distribution with some probability")
    candidates = candidate_edges(probabilities, last, align)
    num = len(candidates)
    mass = np.zeros(num)
    for length, probability in probabilities.items():
        mass[candidates.index(edge_of(length, candidates))] += probability
    below = np.concatenate(([0.0], np.cumsum(mass)))  # below[j + 1]: the rows of candidates 0..j
    cost = np.array([row_cost(edge) for edge in candidates], dtype=float)
    # best[k][j]: least cost of the rows up to candidate j with k + 1 edges, the last at j;
    # back[k][j]: the edge before it.
    best = [cost * below[1:]]
    back: list[np.ndarray] = [np.full(num, -1)]
    for k in range(1, min(max_buckets, num)):
        row, before = np.full(num, np.inf), np.full(num, -1)
        for j in range(k, num):
            previous = np.arange(k - 1, j)
            totals = best[k - 1][k - 1:j] + cost[j] * (below[j + 1] - below[previous + 1])
            pick = int(np.argmin(totals))
            row[j], before[j] = totals[pick], previous[pick]
        best.append(row)
        back.append(before)
    finals = [float(row[-1]) for row in best]
    least = min(finals)
    k = next(k for k, total in enumerate(finals) if total <= least + _TIE * max(1.0, abs(least)))
    edges, j = [], num - 1
    while j >= 0:
        edges.append(candidates[j])
        j, k = int(back[k][j]), k - 1
    return tuple(reversed(edges))


def derived_edges(workload: Workload, num_buckets: int = DEFAULT_BUCKET_COUNT, max_length: int | None = None,
                  align: int = EDGE_ALIGN) -> tuple[int, ...]:
    """The edges `buckets = "derived"` gives: at most `num_buckets`, the fewest padded tokens
    per row for the workload's lengths, the last at its longest length (rounded up to `align`,
    capped by `max_length`)."""
    return optimal_edges(workload.length_probabilities(), num_buckets,
                         last_edge(workload.longest, align, max_length), align)
