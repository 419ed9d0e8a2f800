"""Latency profiles: measured compute curves c(b) per bucket model and the router overhead o,
recorded per hardware in `profiles/<name>.json` by `python -m tools profile`; and, per model,
the batching knobs `python -m tools tune` measured to beat the derived ones on that hardware
(`TunedModel`, the file's `tuned` section), which gen-config applies over the derived knobs.

The file's schema is `ProfileFile` (pydantic); the dataclasses are what gen-config and the
planners use. `load_profile` and `save_profile` read and write files; the rest is pure."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, ValidationError, model_validator

from tools.spec.schema import ClosedTable, Table, describe, table_error


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


def curve_at_length(curves: Mapping[int, LatencyCurve], seq_len: int) -> LatencyCurve:
    """An estimate of c(b) at a sequence length that was not measured, from the curves measured
    at other lengths (`curves`: length -> curve), so that edges can be tried without profiling
    them. Between the two nearest measured lengths it is linear in length, for each batch size
    both measured; past the longest it scales the longest's times in proportion to length; it is
    never below the shortest's times (a shorter row is not assumed cheaper than the shortest
    measured). A measured length gives its own curve."""
    if not curves or min(curves) < 1 or seq_len < 1:
        raise ValueError(f"needs curves at lengths >= 1 and a length >= 1, got {sorted(curves)} and {seq_len}")
    if seq_len in curves:
        return curves[seq_len]
    lengths = sorted(curves)
    shortest = curves[lengths[0]].compute_ms
    if seq_len < lengths[0]:
        return curves[lengths[0]]
    if seq_len > lengths[-1]:
        longest = curves[lengths[-1]].compute_ms
        estimate = {b: ms * seq_len / lengths[-1] for b, ms in longest.items()}
    else:
        upper = next(length for length in lengths if length > seq_len)
        lower = max(length for length in lengths if length < seq_len)
        low, high = curves[lower].compute_ms, curves[upper].compute_ms
        weight = (seq_len - lower) / (upper - lower)
        estimate = {b: low[b] + weight * (high[b] - low[b]) for b in sorted(set(low) & set(high))}
    return LatencyCurve({b: max(ms, shortest.get(b, ms)) for b, ms in estimate.items()})


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


# The batching knobs of a bucket model that a search or a tuning sets (BatchingKnobs' names);
# the queue policy stays derived. A preferred_batch_size of 1 writes none: Triton then batches
# up to max_batch_size.
TUNABLE_KNOBS = ("max_batch_size", "preferred_batch_size", "max_queue_delay_us", "instance_count")


@dataclass(frozen=True)
class TunedModel:
    """A model's knobs chosen by `python -m tools tune`: gen-config writes them over the derived
    ones while the spec's SLO for the model is the one they were tuned for."""

    knobs: dict[str, dict[str, int]]  # bucket model -> {knob of TUNABLE_KNOBS: value}, only the knobs tuning changed
    tuned_at: str  # UTC timestamp of the tuning
    command: str  # how it was tuned, e.g. "python -m tools tune embed --budget-min 30"
    slo_p95_ms: float  # the model's SLO when it was tuned
    derived_goodput_rps: float  # the derived configuration's goodput, median of the rounds
    tuned_goodput_rps: float  # the tuned configuration's goodput, median of the rounds
    rounds: int  # rounds each of the two medians took


@dataclass(frozen=True)
class LatencyProfile:
    path: Path | None  # file it was read from (None before saving)
    sha256: str  # digest of that file, recorded in generated configs
    hardware: Hardware  # where it was measured
    measured_at: str  # UTC timestamp
    models: dict[str, ModelProfile]  # bucket model name -> curve
    overhead: dict[str, Overhead]  # router model name -> overhead
    tuned: dict[str, TunedModel] = field(default_factory=dict)  # model name -> its tuned knobs, if tuned

    def curve(self, model: str) -> LatencyCurve:
        if model not in self.models:
            raise ProfileError(f"profile {self.path} has no curve for model '{model}'; "
                               f"run `python -m tools profile` (it has {sorted(self.models)})")
        return self.models[model].curve

    def curves_by_length(self, models: Iterable[str]) -> dict[int, LatencyCurve]:
        """Sequence length -> curve of those of `models` (bucket model names) this profile
        measured at a length (a fixed-shape bucket, length 0, is left out): what
        `curve_at_length` estimates other lengths from."""
        return {self.models[name].seq_len: self.models[name].curve for name in models
                if name in self.models and self.models[name].seq_len > 0}

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
        **({"tuned": {name: tuned_to_dict(t) for name, t in sorted(profile.tuned.items())}} if profile.tuned else {}),
    }


def tuned_after_profiling(tuned: Mapping[str, TunedModel], measured: set[str]) -> tuple[dict[str, TunedModel],
                                                                                         list[str]]:
    """The tuned entries a re-profile keeps, and the models whose entries it drops: those it
    measured again (their knobs were tuned on the old curves); the others keep theirs."""
    kept = {name: entry for name, entry in tuned.items() if name not in measured}
    return kept, sorted(set(tuned) - set(kept))


def tuned_to_dict(tuned: TunedModel) -> dict:
    """A model's `tuned` entry as the profile file holds it."""
    return {
        "tuned_at": tuned.tuned_at,
        "command": tuned.command,
        "slo_p95_ms": tuned.slo_p95_ms,
        "goodput_rps": {"derived": round(tuned.derived_goodput_rps, 2), "tuned": round(tuned.tuned_goodput_rps, 2)},
        "rounds": tuned.rounds,
        "knobs": {bucket: {knob: values[knob] for knob in TUNABLE_KNOBS if knob in values}
                  for bucket, values in sorted(tuned.knobs.items())},
    }


# --- the file's schema ------------------------------------------------------------------------
# `profiles/<name>.json` as `python -m tools profile` writes it; `profile_from_dict` validates a
# whole file and builds the dataclasses above from it.


class HardwareTable(Table):
    """`hardware`: the machine the profile was measured on. Keys beyond these (versions,
    memory, platform, the threads measured with) are kept as the hardware's details."""

    model_config = ConfigDict(extra="allow")

    name: str
    """Profile name, e.g. "cpu", "h100"."""
    kind: str
    """"cpu" or "gpu": selects the serving spec's [hardware.<kind>] limits."""
    description: str = ""
    """CPU model or GPU name, as read off the machine."""
    cpu_count: int = Field(0, ge=0)
    """Logical CPUs."""
    gpu: str | None = None
    """GPU name; null on CPU-only machines."""

    def hardware(self) -> Hardware:
        return Hardware(name=self.name, kind=self.kind, description=self.description, cpu_count=self.cpu_count,
                        gpu=self.gpu, details=dict(self.model_extra or {}))


class OverheadTable(Table):
    """`overhead_ms.<router>`: router-path time outside the bucket model's compute, ms."""

    p50: float = Field(ge=0)
    """Median."""
    p95: float = Field(ge=0)
    """95th percentile: what the derivation uses, since the SLO is a p95."""
    cpu: float | None = Field(None, ge=0)
    """Server CPU per request outside the bucket model; absent: not measured."""


def _curve(compute_ms: dict[int, float]) -> dict[int, float]:
    try:
        LatencyCurve(compute_ms)
    except ValueError as err:
        raise ValueError(f"compute_ms: {err}") from None
    return compute_ms


class ModelTable(Table):
    """`models.<bucket model>`: one bucket model's measured curve."""

    seq_len: int = Field(ge=0)
    """Bucket length the model was measured at (0: a tensor model's one fixed-shape bucket)."""
    compute_ms: Annotated[dict[int, float], AfterValidator(_curve)]
    """Batch size -> mean compute time of one execution, ms; batch size 1 included."""
    executions: dict[int, int] = {}
    """Batch size -> executions measured."""


class TunedKnobsTable(ClosedTable):
    """`tuned.<model>.knobs.<bucket model>`: the knobs tuning changed; the others stay derived."""

    max_batch_size: int | None = Field(None, ge=1)
    """Triton max_batch_size."""
    preferred_batch_size: int | None = Field(None, ge=1)
    """dynamic_batching.preferred_batch_size; 1 writes none (batches up to max_batch_size)."""
    max_queue_delay_us: int | None = Field(None, ge=0)
    """dynamic_batching.max_queue_delay_microseconds."""
    instance_count: int | None = Field(None, ge=1)
    """instance_group count."""

    @model_validator(mode="after")
    def _some(self) -> TunedKnobsTable:
        if not self.knob_values():
            raise table_error(f"names no knob; the knobs are {list(TUNABLE_KNOBS)}")
        return self

    def knob_values(self) -> dict[str, int]:
        return {knob: getattr(self, knob) for knob in TUNABLE_KNOBS if getattr(self, knob) is not None}


class TunedGoodputTable(ClosedTable):
    """`tuned.<model>.goodput_rps`: the two configurations' goodput, medians of the rounds."""

    derived: float = Field(ge=0)
    """The derived configuration's."""
    tuned: float = Field(ge=0)
    """The tuned configuration's."""


class TunedTable(ClosedTable):
    """`tuned.<model>`: the knobs `python -m tools tune` chose for a model, and what it measured."""

    tuned_at: str
    """UTC timestamp of the tuning."""
    command: str
    """How it was tuned."""
    slo_p95_ms: float = Field(gt=0)
    """The model's SLO when it was tuned: with another SLO in the spec, gen-config writes the derived knobs."""
    goodput_rps: TunedGoodputTable
    """Goodput of the derived and the tuned configuration."""
    rounds: int = Field(ge=1)
    """Rounds each median took."""
    knobs: dict[str, TunedKnobsTable]
    """Bucket model -> the knobs tuning changed."""

    def tuned(self) -> TunedModel:
        return TunedModel(knobs={bucket: table.knob_values() for bucket, table in self.knobs.items()},
                          tuned_at=self.tuned_at, command=self.command, slo_p95_ms=self.slo_p95_ms,
                          derived_goodput_rps=self.goodput_rps.derived, tuned_goodput_rps=self.goodput_rps.tuned,
                          rounds=self.rounds)


class ProfileFile(Table):
    """A latency profile as written by `python -m tools profile`."""

    hardware: HardwareTable
    """Where it was measured."""
    measured_at: str = ""
    """UTC timestamp."""
    overhead_ms: dict[str, OverheadTable]
    """Router model name -> overhead."""
    models: dict[str, ModelTable]
    """Bucket model name -> curve."""
    tuned: dict[str, TunedTable] = {}
    """Model name -> the knobs `python -m tools tune` chose (absent: none tuned)."""


def profile_from_dict(data: dict, path: Path | None = None, sha256: str = "") -> LatencyProfile:
    """The profile in `data` (a parsed profile JSON); ProfileError names every problem."""
    try:
        table = ProfileFile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(f"profile {path}: malformed\n{describe(err, str(path or 'profile'))}") from None
    return LatencyProfile(
        path=path, sha256=sha256, hardware=table.hardware.hardware(), measured_at=table.measured_at,
        models={name: ModelProfile(seq_len=m.seq_len, curve=LatencyCurve(m.compute_ms), reps=dict(m.executions))
                for name, m in table.models.items()},
        overhead={name: Overhead(p50_ms=o.p50, p95_ms=o.p95, cpu_ms=o.cpu) for name, o in table.overhead_ms.items()},
        tuned={name: t.tuned() for name, t in table.tuned.items()},
    )


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
