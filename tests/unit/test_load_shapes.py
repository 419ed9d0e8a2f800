"""Load shapes: tables of stages, curves, and shape_at."""

import pytest

from loadtest.shapes import (
    SHAPE_DIR,
    LoadShape,
    Stage,
    compress,
    curve_stages,
    load_shape,
    parse_shape,
    scale_users,
    shape_at,
    stage_index,
)

RAMP = LoadShape(name="ramp", stages=(Stage(10, 2, 1.0), Stage(20, 4, 2.0), Stage(5, 0, 4.0)))


def test_shape_at_walks_the_stages_and_ends_after_the_last():
    assert shape_at(RAMP, 0) == (2, 1.0)
    assert shape_at(RAMP, 9.99) == (2, 1.0)
    assert shape_at(RAMP, 10) == (4, 2.0)
    assert shape_at(RAMP, 34.9) == (0, 4.0)
    assert shape_at(RAMP, 35) is None
    with pytest.raises(ValueError, match="run time"):
        shape_at(RAMP, -1)


def test_stage_index_and_bounds():
    assert RAMP.stage_bounds() == [(0, 10), (10, 30), (30, 35)]
    assert [stage_index(RAMP, t) for t in (-0.1, 0, 15, 30, 35)] == [None, 0, 1, 2, None]
    assert RAMP.duration_s == 35 and RAMP.peak_users == 4


def test_compress_keeps_proportions_and_speeds_up_spawning():
    short = compress(RAMP, 7)
    assert [s.duration_s for s in short.stages] == pytest.approx([2, 4, 1])
    assert [s.spawn_rate for s in short.stages] == pytest.approx([5, 10, 20])
    assert [s.users for s in short.stages] == [2, 4, 0]
    with pytest.raises(ValueError, match="duration"):
        compress(RAMP, 0)


def test_scale_users_rounds_but_keeps_a_stage_with_users_alive():
    half = scale_users(RAMP, 0.2)
    assert [s.users for s in half.stages] == [1, 1, 0]
    assert [s.users for s in scale_users(RAMP, 2).stages] == [4, 8, 0]
    with pytest.raises(ValueError, match="scale"):
        scale_users(RAMP, 0)


def test_curve_slices_the_period_evenly_with_at_least_one_user():
    stages = curve_stages(period_s=60, peak_users=10, levels=[0.0, 0.5, 1.0])
    assert [s.users for s in stages] == [1, 5, 10]
    assert all(s.duration_s == 20 for s in stages)
    assert stages[2].spawn_rate == pytest.approx(5 / 2)  # 5 more users within a tenth of 20 s


def test_the_shipped_shapes_parse():
    names = sorted(p.stem for p in SHAPE_DIR.glob("*.toml"))
    assert names == ["diurnal", "spike", "step"]
    step = load_shape("step")
    users = [s.users for s in step.stages]
    assert users == sorted(users) and len(set(users)) == len(users)  # a ramp: every step adds users
    spike = load_shape("spike")
    assert spike.stages[1].users >= 4 * spike.stages[0].users
    diurnal = load_shape("diurnal")
    assert len(diurnal.stages) == 24 and diurnal.peak_users == 32 and diurnal.duration_s == pytest.approx(240)


@pytest.mark.parametrize(("data", "message"), [
    ({}, "exactly one of"),
    ({"stages": [], "curve": {}}, "exactly one of"),
    ({"stages": []}, "at least one stage"),
    ({"stages": [{"users": 2}]}, r"stages\[0\].duration_s must be a number"),
    ({"stages": [{"users": 2, "duration_s": 0}]}, r"duration_s must be > 0"),
    ({"stages": [{"users": -1, "duration_s": 5}]}, r"users must be >= 0"),
    ({"stages": [{"users": 1.5, "duration_s": 5}]}, "whole number"),
    ({"stages": [{"users": 2, "duration_s": 5, "spawn_rate": "fast"}]}, "spawn_rate must be a number"),
    ({"stages": [{"users": 0, "duration_s": 5}]}, "every stage has 0 users"),
    ({"curve": {"period_s": 60, "peak_users": 4}}, "levels must be"),
    ({"curve": {"period_s": 60, "peak_users": 4, "levels": [0.5, 1.5]}}, r"in \[0, 1\], got 1.5"),
    ({"curve": {"period_s": 60, "peak_users": 0, "levels": [1]}}, "peak_users must be >= 1"),
])
def test_bad_shape_files_are_refused_with_the_reason(data, message):
    with pytest.raises(ValueError, match=message):
        parse_shape(data, "bad.toml")


def test_a_missing_shape_file_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.toml"):
        load_shape(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match=r"no-such-shape\.toml"):
        load_shape("no-such-shape")
