"""Metric samples as plain data, and the one histogram quantile every reader of them uses.

A parsed /metrics page is a mapping (sample name, labels) -> value; `tools.observe.metrics`
reads pages into that shape, and the planners (rollout gates, autoscale, capacity) take it,
already parsed, so that no I/O and no parsing happen in planning. Pure: no I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
SeriesKey = tuple[str, Labels]  # (sample name, labels), names exactly as exported


def labels_of(labels: Mapping[str, str]) -> Labels:
    """The key form of a label mapping: sorted (name, value) pairs."""
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]], interpolate: bool = True) -> float | None:
    """The q-quantile of a histogram given as (upper bound, cumulative count) pairs, by linear
    interpolation inside the bucket the rank falls in (Prometheus' `histogram_quantile`), or
    that bucket's upper bound when `interpolate` is False (for whole-number observations such
    as batch sizes, whose buckets end on the values themselves). None when the histogram is
    empty; the highest finite bound when the rank is in +Inf."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            if not interpolate:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
