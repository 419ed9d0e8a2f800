"""Load shapes as data: a table of stages read from a TOML file, and `shape_at(run_time)`.

A shape file holds either explicit stages

    [[stages]]
    duration_s = 30      # how long the stage lasts
    users = 4            # simulated users during it
    spawn_rate = 2       # users started (or stopped) per second on entering it; default: all at once

or a curve of relative load levels spread evenly over a period (a day compressed into minutes)

    [curve]
    period_s = 240       # the whole curve
    peak_users = 16      # users at level 1.0
    levels = [0.2, 0.15, ..., 0.3]   # one level per slice, in [0, 1]

Everything here is pure: Locust's `LoadTestShape.tick()` is a thin call to `shape_at`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

SHAPE_DIR = Path(__file__).resolve().parent / "shapes"


@dataclass(frozen=True)
class Stage:
    """One step of a load shape."""

    duration_s: float  # how long the stage lasts, > 0
    users: int  # simulated users during the stage, >= 0
    spawn_rate: float  # users per second started or stopped when the stage begins, > 0


@dataclass(frozen=True)
class LoadShape:
    """A sequence of stages; the run ends after the last one."""

    name: str  # short identifier, used in reports
    stages: tuple[Stage, ...]  # in order, at least one
    description: str = ""  # what the shape stands for

    @property
    def duration_s(self) -> float:
        return sum(stage.duration_s for stage in self.stages)

    @property
    def peak_users(self) -> int:
        return max(stage.users for stage in self.stages)

    def stage_bounds(self) -> list[tuple[float, float]]:
        """(start_s, end_s) of each stage, from the start of the run."""
        bounds, start_s = [], 0.0
        for stage in self.stages:
            bounds.append((start_s, start_s + stage.duration_s))
            start_s += stage.duration_s
        return bounds


def shape_at(shape: LoadShape, run_time_s: float) -> tuple[int, float] | None:
    """(users, spawn_rate) at `run_time_s` seconds into the run, or None once the shape is over."""
    if run_time_s < 0:
        raise ValueError(f"run time must be >= 0, got {run_time_s}")
    for (_, end_s), stage in zip(shape.stage_bounds(), shape.stages, strict=True):
        if run_time_s < end_s:
            return stage.users, stage.spawn_rate
    return None


def stage_index(shape: LoadShape, run_time_s: float) -> int | None:
    """Which stage `run_time_s` falls in (None before the start or after the end)."""
    if run_time_s < 0:
        return None
    for index, (_, end_s) in enumerate(shape.stage_bounds()):
        if run_time_s < end_s:
            return index
    return None


def compress(shape: LoadShape, duration_s: float) -> LoadShape:
    """The same shape played in `duration_s` seconds: every stage shortened in proportion.

    Spawn rates grow by the same factor so each stage still reaches its users in the same
    share of its time.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    factor = duration_s / shape.duration_s
    stages = tuple(replace(stage, duration_s=stage.duration_s * factor, spawn_rate=stage.spawn_rate / factor)
                   for stage in shape.stages)
    return replace(shape, stages=stages)


def scale_users(shape: LoadShape, factor: float) -> LoadShape:
    """The same shape with `factor` times the users (rounded, at least 1 where there were any)."""
    if factor <= 0:
        raise ValueError(f"user scale must be > 0, got {factor}")

    def scaled(users: int) -> int:
        return 0 if users == 0 else max(1, round(users * factor))

    stages = tuple(replace(stage, users=scaled(stage.users), spawn_rate=stage.spawn_rate * factor)
                   for stage in shape.stages)
    return replace(shape, stages=stages)


def curve_stages(period_s: float, peak_users: int, levels: list[float]) -> tuple[Stage, ...]:
    """Stages for a curve of relative levels: each slice gets round(level x peak) users (at
    least 1, so the service never sits idle), reached within a tenth of the slice."""
    slice_s = period_s / len(levels)
    stages = []
    for level in levels:
        users = max(1, round(level * peak_users))
        previous = stages[-1].users if stages else 0
        spawn_rate = max(abs(users - previous), 1) / (slice_s / 10)
        stages.append(Stage(duration_s=slice_s, users=users, spawn_rate=spawn_rate))
    return tuple(stages)


def _number(raw: dict, key: str, where: str, *, default: float | None = None, minimum: float = 0.0,
            allow_equal: bool = False) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key} must be a number, got {value!r}")
    if value < minimum or (value == minimum and not allow_equal):
        relation = ">=" if allow_equal else ">"
        raise ValueError(f"{where}.{key} must be {relation} {minimum:g}, got {value!r}")
    return float(value)


def parse_shape(data: dict, source: str = "shape") -> LoadShape:
    """A LoadShape from a shape file's contents; ValueError names what is wrong."""
    has_stages, has_curve = "stages" in data, "curve" in data
    if has_stages == has_curve:
        raise ValueError(f"{source}: needs exactly one of [[stages]] or [curve]")
    if has_stages:
        raw_stages = data["stages"]
        if not isinstance(raw_stages, list) or not raw_stages:
            raise ValueError(f"{source}: [[stages]] needs at least one stage")
        stages = []
        for index, raw in enumerate(raw_stages):
            where = f"{source}: stages[{index}]"
            users = _number(raw, "users", where, minimum=0, allow_equal=True)
            if users != int(users):
                raise ValueError(f"{where}.users must be a whole number, got {raw['users']!r}")
            duration_s = _number(raw, "duration_s", where)
            # Default: the whole change within the first second of the stage.
            spawn_rate = _number(raw, "spawn_rate", where, default=max(float(users), 1.0))
            stages.append(Stage(duration_s=duration_s, users=int(users), spawn_rate=spawn_rate))
        stages_tuple = tuple(stages)
    else:
        curve = data["curve"]
        where = f"{source}: curve"
        period_s = _number(curve, "period_s", where)
        peak_users = _number(curve, "peak_users", where, minimum=1, allow_equal=True)
        levels = curve.get("levels")
        if not isinstance(levels, list) or not levels:
            raise ValueError(f"{where}.levels must be a non-empty list of numbers in [0, 1]")
        for level in levels:
            if isinstance(level, bool) or not isinstance(level, int | float) or not 0 <= level <= 1:
                raise ValueError(f"{where}.levels must be numbers in [0, 1], got {level!r}")
        stages_tuple = curve_stages(period_s, math.floor(peak_users), [float(level) for level in levels])
    if all(stage.users == 0 for stage in stages_tuple):
        raise ValueError(f"{source}: every stage has 0 users")
    return LoadShape(name=str(data.get("name", Path(source).stem)), stages=stages_tuple,
                     description=str(data.get("description", "")))


def load_shape(path: str | Path) -> LoadShape:
    """Read a shape file; a bare name (`step`) means loadtest/shapes/step.toml."""
    path = Path(path)
    if not path.suffix and not path.exists():
        path = SHAPE_DIR / f"{path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"load shape {path}: {err}") from None
    return parse_shape(data, source=str(path))
