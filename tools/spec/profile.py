"""Latency profiles: measured compute curves c(b) per bucket model and the router overhead o,
recorded per hardware in `profiles/<name>.json` by `python -m tools profile`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LatencyCurve:
    """Measured compute time per execution, by batch size."""

    compute_ms: Mapping[int, float]  # batch size -> mean compute time of one execution, ms

    def __post_init__(self) -> None:
        if not self.compute_ms:
            raise ValueError("a latency curve needs at least one measured batch size")
        for batch, ms in self.compute_ms.items():
            if batch < 1 or not ms > 0:
                raise ValueError(f"bad latency point: batch {batch}, {ms} ms")
        if 1 not in self.compute_ms:
            raise ValueError("a latency curve must include batch size 1")

    @property
    def sizes(self) -> list[int]:
        return sorted(self.compute_ms)

    @property
    def max_measured(self) -> int:
        return max(self.compute_ms)

    def at(self, batch: int) -> float:
        """c(b), linearly interpolated between measured sizes; no extrapolation."""
        if batch in self.compute_ms:
            return self.compute_ms[batch]
        sizes = self.sizes
        if batch < sizes[0] or batch > sizes[-1]:
            raise ValueError(f"batch {batch} is outside the measured range {sizes[0]}..{sizes[-1]}")
        upper = next(s for s in sizes if s > batch)
        lower = max(s for s in sizes if s < batch)
        weight = (batch - lower) / (upper - lower)
        return self.compute_ms[lower] + weight * (self.compute_ms[upper] - self.compute_ms[lower])

    def throughput_rps(self, batch: int) -> float:
        """Rows per second of one instance running batches of `batch` back to back."""
        return batch / self.at(batch) * 1000.0


class ProfileError(ValueError):
    """A profile file is missing, malformed, or lacks a model gen-config needs."""


@dataclass(frozen=True)
class Hardware:
    """The machine a profile was measured on."""

    name: str  # profile name, e.g. "cpu", "h100"
    kind: str  # "cpu" or "gpu": selects the spec's [hardware.<kind>] limits
    description: str  # CPU model or GPU name, as read off the machine
    cpu_count: int  # logical CPUs
    gpu: str | None = None  # GPU name, None on CPU-only machines
    details: dict = field(default_factory=dict)  # versions, memory, platform


@dataclass(frozen=True)
class ModelProfile:
    """One bucket model's measured curve."""

    seq_len: int  # bucket length the model was measured at
    curve: LatencyCurve  # compute ms per execution by batch size
    reps: dict[int, int] = field(default_factory=dict)  # batch size -> executions measured


@dataclass(frozen=True)
class Overhead:
    """Router-path time outside the bucket model's compute, from single-row requests."""

    p50_ms: float  # median
    p95_ms: float  # 95th percentile: what the derivation uses, since the SLO is a p95
    cpu_ms: float | None = None  # server CPU per request outside the bucket model (router, core); None: not measured


@dataclass(frozen=True)
class LatencyProfile:
    path: Path | None  # file it was read from (None before saving)
    sha256: str  # digest of that file, recorded in generated configs
    hardware: Hardware  # where it was measured
    measured_at: str  # UTC timestamp
    models: dict[str, ModelProfile]  # bucket model name -> curve
    overhead: dict[str, Overhead]  # router model name -> overhead

    def curve(self, model: str) -> LatencyCurve:
        if model not in self.models:
            raise ProfileError(f"profile {self.path} has no curve for model '{model}'; "
                               f"run `python -m tools profile` (it has {sorted(self.models)})")
        return self.models[model].curve

    def overhead_for(self, router: str) -> Overhead:
        if router not in self.overhead:
            raise ProfileError(f"profile {self.path} has no overhead for '{router}'; run `python -m tools profile`")
        return self.overhead[router]


def profile_to_dict(profile: LatencyProfile) -> dict:
    hw = profile.hardware
    return {
        "hardware": {"name": hw.name, "kind": hw.kind, "description": hw.description, "cpu_count": hw.cpu_count,
                     "gpu": hw.gpu, **hw.details},
        "measured_at": profile.measured_at,
        "overhead_ms": {name: {"p50": round(o.p50_ms, 3), "p95": round(o.p95_ms, 3),
                               **({"cpu": round(o.cpu_ms, 3)} if o.cpu_ms is not None else {})}
                        for name, o in sorted(profile.overhead.items())},
        "models": {
            name: {
                "seq_len": m.seq_len,
                "compute_ms": {str(b): round(ms, 3) for b, ms in sorted(m.curve.compute_ms.items())},
                "executions": {str(b): n for b, n in sorted(m.reps.items())},
            }
            for name, m in sorted(profile.models.items(), key=lambda item: item[1].seq_len)
        },
    }


def profile_from_dict(data: dict, path: Path | None = None, sha256: str = "") -> LatencyProfile:
    try:
        hw = data["hardware"]
        known = {"name", "kind", "description", "cpu_count", "gpu"}
        hardware = Hardware(
            name=hw["name"], kind=hw["kind"], description=hw.get("description", ""),
            cpu_count=int(hw.get("cpu_count", 0)), gpu=hw.get("gpu"),
            details={k: v for k, v in hw.items() if k not in known},
        )
        models = {
            name: ModelProfile(
                seq_len=int(m["seq_len"]),
                curve=LatencyCurve({int(b): float(ms) for b, ms in m["compute_ms"].items()}),
                reps={int(b): int(n) for b, n in m.get("executions", {}).items()},
            )
            for name, m in data["models"].items()
        }
        overhead = {name: Overhead(float(o["p50"]), float(o["p95"]), float(o["cpu"]) if "cpu" in o else None)
                    for name, o in data["overhead_ms"].items()}
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(f"profile {path}: malformed ({type(err).__name__}: {err})") from None
    return LatencyProfile(path=path, sha256=sha256, hardware=hardware, measured_at=data.get("measured_at", ""),
                          models=models, overhead=overhead)


def load_profile(path: str | Path) -> LatencyProfile:
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"latency profile {path} not found; measure one with `python -m tools profile`")
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ProfileError(f"profile {path}: not valid JSON: {err}") from None
    return profile_from_dict(data, path=path, sha256=hashlib.sha256(raw).hexdigest())


def save_profile(profile: LatencyProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")
