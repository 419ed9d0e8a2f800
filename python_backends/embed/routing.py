"""Version routing of the `embed` router: which encoder version serves a request.

A routing table gives each served version a weight; a request goes to a version drawn by
weight unless it pins one (request parameter `version`). During a canary rollout the table
also names the candidate and the baseline it is compared with: a sampled share of the
candidate's requests is repeated on the baseline (shadowed) so the two outputs can be
compared. The table lives in a small JSON file that the rollout tool rewrites atomically;
every router instance re-reads it when it changes, so the split moves without a restart.
Everything here is free of Triton imports.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from python_backends.common.errors import InvalidInput


@dataclass(frozen=True)
class RoutingTable:
    """The traffic split over versions, and the shadow comparison of a rollout."""

    weights: Mapping[int, float]  # version -> share of unpinned traffic (relative; need not sum to 1)
    candidate: int | None = None  # version under test in a rollout
    baseline: int | None = None  # version the candidate is compared with
    shadow_rate: float = 0.0  # share of the candidate's requests repeated on the baseline
    generation: int = 0  # increases with every change the rollout tool writes

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("a routing table needs at least one version")
        for version, weight in self.weights.items():
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise ValueError(f"version {version!r} must be an integer >= 1")
            if not (weight >= 0 and math.isfinite(weight)):  # also rejects NaN
                raise ValueError(f"weight of version {version} must be a finite number >= 0, got {weight}")
        if sum(self.weights.values()) <= 0:
            raise ValueError("at least one version needs a weight > 0")
        if not 0.0 <= self.shadow_rate <= 1.0:
            raise ValueError(f"shadow_rate must be within [0, 1], got {self.shadow_rate}")
        if self.shadow_rate > 0 and (self.candidate is None or self.baseline is None):
            raise ValueError("shadowing needs both a candidate and a baseline version")
        if self.candidate is not None and self.candidate == self.baseline:
            raise ValueError(f"candidate and baseline are the same version ({self.candidate})")

    @functools.cached_property
    def versions(self) -> tuple[int, ...]:
        """Versions that take unpinned traffic, ascending."""
        return tuple(sorted(v for v, w in self.weights.items() if w > 0))

    @functools.cached_property
    def _edges(self) -> tuple[tuple[float, int], ...]:
        """(upper end of its share of [0, 1), version) for each version that takes traffic, in
        order: worked out once per table, not per request."""
        total = sum(self.weights.values())
        edges, edge = [], 0.0
        for version in self.versions:
            edge += self.weights[version] / total
            edges.append((edge, version))
        return tuple(edges)

    def share(self, version: int) -> float:
        """Fraction of unpinned traffic that goes to `version`."""
        return self.weights.get(version, 0.0) / sum(self.weights.values())

    def pick(self, draw: float) -> int:
        """The version for a uniform draw in [0, 1): each version takes its share of the range."""
        for edge, version in self._edges:
            if draw < edge:
                return version
        return self.versions[-1]

    def shadows(self, version: int, draw: float) -> int | None:
        """The baseline to repeat a request on, when `version` is the candidate and the draw falls in the sample."""
        if version == self.candidate and draw < self.shadow_rate:
            return self.baseline
        return None

    def to_json(self) -> dict:
        return {
            "weights": {str(v): w for v, w in sorted(self.weights.items())},
            "candidate": self.candidate,
            "baseline": self.baseline,
            "shadow_rate": self.shadow_rate,
            "generation": self.generation,
        }

    @classmethod
    def from_json(cls, data: object) -> RoutingTable:
        if not isinstance(data, dict):
            raise ValueError("a routing table is a JSON object")
        raw = data.get("weights")
        if not isinstance(raw, dict):
            raise ValueError("'weights' must be an object {\"version\": weight}")
        try:
            weights = {int(v): float(w) for v, w in raw.items()}
        except (TypeError, ValueError):
            raise ValueError(f"'weights' must map version numbers to numbers, got {raw!r}") from None

        def optional_version(key: str) -> int | None:
            value = data.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"'{key}' must be a version number or null, got {value!r}")
            return value

        try:
            shadow_rate = float(data.get("shadow_rate", 0.0))
            generation = int(data.get("generation", 0))
        except (TypeError, ValueError):
            raise ValueError("'shadow_rate' and 'generation' must be numbers") from None
        return cls(
            weights=weights,
            candidate=optional_version("candidate"),
            baseline=optional_version("baseline"),
            shadow_rate=shadow_rate,
            generation=generation,
        )


def parse_weights(raw: str) -> dict[int, float]:
    """Parse `1:90,2:10` (version: weight)."""
    weights: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        try:
            version, weight = part.split(":")
            key, value = int(version), float(weight)
        except ValueError:
            raise ValueError(f"weight entry {part!r} is not 'version:weight'") from None
        if key in weights:
            raise ValueError(f"version {key} has two weights")
        weights[key] = value
    return weights


def format_weights(weights: Mapping[int, float]) -> str:
    return ",".join(f"{v}:{w:g}" for v, w in sorted(weights.items()))


def pinned_version(params: Mapping[str, object]) -> int | None:
    """The version a request pins with the parameter `version`, or None."""
    raw = params.get("version")
    if raw is None or raw == "":
        return None
    if isinstance(raw, bool):
        raise InvalidInput(f"parameter 'version' must be a version number, got {raw!r}")
    try:
        version = int(raw)
    except (TypeError, ValueError):
        raise InvalidInput(f"parameter 'version' must be a version number, got {raw!r}") from None
    if version < 1 or str(raw).strip() not in (str(version), f"{version}.0"):
        raise InvalidInput(f"parameter 'version' must be an integer >= 1, got {raw!r}")
    return version


def write_routing_table(path: Path, table: RoutingTable) -> None:
    """Replace the routing file atomically: readers see the old table or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(table.to_json(), indent=2) + "\n")
    os.replace(staging, path)


def read_routing_table(path: Path) -> RoutingTable:
    try:
        return RoutingTable.from_json(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


@dataclass
class RoutingSource:
    """The live routing table of one router instance: the file when there is one, else the default.

    The file is checked at most every `check_interval_s`; a file that fails to parse keeps
    the last good table and reports the error once per change of the file.
    """

    path: Path  # routing file the rollout tool writes
    default: RoutingTable  # table when the file does not exist (from the model config)
    check_interval_s: float = 0.25
    clock: object = time.monotonic
    _table: RoutingTable | None = field(default=None, init=False)
    _stamp: tuple[int, int] | None = field(default=None, init=False)
    _checked_at: float = field(default=float("-inf"), init=False)

    def current(self, on_error=None) -> RoutingTable:
        now = self.clock()
        if self._table is not None and now - self._checked_at < self.check_interval_s:
            return self._table
        self._checked_at = now
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._table, self._stamp = self.default, None
            return self._table
        stamp = (stat.st_mtime_ns, stat.st_ino)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._table = read_routing_table(self.path)
            except (OSError, ValueError) as err:
                if on_error is not None:
                    on_error(f"routing file ignored, keeping the previous split: {err}")
                if self._table is None:
                    self._table = self.default
        return self._table
