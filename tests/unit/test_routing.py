"""Version routing of the `embed` router: the routing table, its file, and the live source, no server."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import pytest

from python_backends.common.errors import InvalidInput
from python_backends.embed import routing
from python_backends.embed.routing import (
    RoutingSource,
    RoutingTable,
    format_weights,
    parse_weights,
    pinned_version,
    read_routing_table,
    write_routing_table,
)

NUM_DRAWS = 1000
DRAWS = [(i + 0.5) / NUM_DRAWS for i in range(NUM_DRAWS)]  # an even grid over [0, 1)
ROLLOUT = RoutingTable({1: 90, 2: 10}, candidate=2, baseline=1, shadow_rate=0.25, generation=3)


# --- the table --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [{1: 1}, {1: 90, 2: 10}, {1: 50, 2: 50}, {1: 1, 2: 1, 3: 2}, {3: 0.2, 1: 0.7, 2: 0.1}, {1: 0, 2: 3, 3: 1}],
)
def test_pick_gives_each_version_its_share_of_the_draws(weights):
    table = RoutingTable(weights)
    counts = Counter(table.pick(draw) for draw in DRAWS)
    total = sum(weights.values())
    for version, weight in weights.items():
        assert counts[version] / NUM_DRAWS == pytest.approx(weight / total, abs=1 / NUM_DRAWS)
        assert table.share(version) == pytest.approx(weight / total)


def test_pick_splits_the_range_in_version_order_and_covers_its_ends():
    table = RoutingTable({2: 10, 1: 90})
    assert table.pick(0.0) == 1
    assert table.pick(0.8999) == 1
    assert table.pick(0.9001) == 2
    assert table.pick(math.nextafter(1.0, 0.0)) == 2
    assert RoutingTable({1: 1, 2: 1}).pick(0.5) == 2  # each version takes a half-open [low, high) slice


def test_pick_lands_the_top_of_the_range_on_a_version_with_traffic():
    # Ten edges of 0.1 sum to 0.9999999999999999: the largest draw falls past the last edge.
    table = RoutingTable({**{v: 1 for v in range(1, 11)}, 11: 0})
    assert table.pick(math.nextafter(1.0, 0.0)) == 10


def test_zero_weight_versions_are_never_picked():
    table = RoutingTable({1: 0, 2: 5, 3: 0})
    assert {table.pick(draw) for draw in [0.0, *DRAWS, math.nextafter(1.0, 0.0)]} == {2}
    assert table.versions == (2,)
    assert table.share(1) == 0.0 and table.share(2) == 1.0
    # Zero weight at the top of the range: the draws near 1 still go to a version with traffic.
    assert RoutingTable({1: 3, 2: 0}).pick(math.nextafter(1.0, 0.0)) == 1


def test_versions_are_ascending_and_unknown_versions_have_no_share():
    table = RoutingTable({3: 1, 1: 2, 2: 0})
    assert table.versions == (1, 3)
    assert table.share(9) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": {}}, "at least one version"),
        ({"weights": {0: 1}}, "version 0 must be an integer >= 1"),
        ({"weights": {"1": 1}}, "version '1' must be an integer >= 1"),
        ({"weights": {1: -1}}, "weight of version 1 must be a finite number >= 0, got -1"),
        ({"weights": {1: 1, 2: math.nan}}, "weight of version 2 must be a finite number >= 0, got nan"),
        ({"weights": {1: 0, 2: 0}}, "at least one version needs a weight > 0"),
        ({"weights": {1: 1}, "shadow_rate": 1.5}, r"shadow_rate must be within \[0, 1\], got 1.5"),
        ({"weights": {1: 1}, "shadow_rate": -0.1}, r"shadow_rate must be within \[0, 1\]"),
        ({"weights": {1: 1}, "shadow_rate": math.nan}, r"shadow_rate must be within \[0, 1\]"),
        ({"weights": {1: 1, 2: 1}, "candidate": 2, "shadow_rate": 0.1}, "needs both a candidate and a baseline"),
        ({"weights": {1: 1, 2: 1}, "baseline": 1, "shadow_rate": 0.1}, "needs both a candidate and a baseline"),
        ({"weights": {1: 1, 2: 1}, "candidate": 2, "baseline": 2}, r"the same version \(2\)"),
    ],
)
def test_table_validation_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingTable(**kwargs)


def test_shadows_only_the_candidates_requests_under_the_rate():
    assert ROLLOUT.shadows(2, 0.0) == 1
    assert ROLLOUT.shadows(2, 0.2499) == 1
    assert ROLLOUT.shadows(2, 0.25) is None
    assert ROLLOUT.shadows(2, 0.9) is None
    assert {ROLLOUT.shadows(1, draw) for draw in DRAWS} == {None}  # the baseline is never repeated
    shadowed = sum(ROLLOUT.shadows(2, draw) is not None for draw in DRAWS)
    assert shadowed / NUM_DRAWS == pytest.approx(0.25, abs=1 / NUM_DRAWS)


def test_no_shadowing_outside_a_rollout_or_at_rate_zero():
    assert {RoutingTable({1: 1, 2: 1}).shadows(v, 0.0) for v in (1, 2)} == {None}
    quiet = RoutingTable({1: 90, 2: 10}, candidate=2, baseline=1, shadow_rate=0.0)
    assert quiet.shadows(2, 0.0) is None


def test_json_round_trip():
    data = json.loads(json.dumps(ROLLOUT.to_json()))
    assert data == {"weights": {"1": 90, "2": 10}, "candidate": 2, "baseline": 1, "shadow_rate": 0.25,
                    "generation": 3}
    assert RoutingTable.from_json(data) == ROLLOUT
    plain = RoutingTable({2: 0.5, 1: 1.5})
    assert list(plain.to_json()["weights"]) == ["1", "2"]
    assert RoutingTable.from_json(json.loads(json.dumps(plain.to_json()))) == plain


def test_from_json_fills_defaults():
    table = RoutingTable.from_json({"weights": {"1": 1}})
    assert table == RoutingTable({1: 1.0})
    assert (table.candidate, table.baseline, table.shadow_rate, table.generation) == (None, None, 0.0, 0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([{"1": 1}], "a routing table is a JSON object"),
        ("1:100", "a routing table is a JSON object"),
        ({}, "'weights' must be an object"),
        ({"weights": [[1, 100]]}, "'weights' must be an object"),
        ({"weights": {"one": 1}}, "'weights' must map version numbers to numbers"),
        ({"weights": {"1": "heavy"}}, "'weights' must map version numbers to numbers"),
        ({"weights": {"1": None}}, "'weights' must map version numbers to numbers"),
        ({"weights": {"1": 1}, "candidate": "2", "baseline": 1}, "'candidate' must be a version number or null"),
        ({"weights": {"1": 1}, "candidate": True, "baseline": 1}, "'candidate' must be a version number or null"),
        ({"weights": {"1": 1}, "candidate": 2, "baseline": 1.0}, "'baseline' must be a version number or null"),
        ({"weights": {"1": 0}}, "at least one version needs a weight > 0"),
        ({"weights": {"0": 1}}, "version 0 must be an integer >= 1"),
        ({"weights": {"1": 1}, "shadow_rate": 2}, "shadow_rate must be within"),
        ({"weights": {"1": 1}, "shadow_rate": "often"}, "must be numbers"),
        ({"weights": {"1": 1}, "generation": "next"}, "must be numbers"),
    ],
)
def test_from_json_errors(data, message):
    with pytest.raises(ValueError, match=message):
        RoutingTable.from_json(data)


@pytest.mark.parametrize("field", ["shadow_rate", "generation"])
def test_from_json_refuses_a_null_number_with_a_value_error(field):
    with pytest.raises(ValueError, match=field):
        RoutingTable.from_json({"weights": {"1": 1}, field: None})


# --- weights as text and pinned versions ---------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "weights"),
    [
        ("1:100", {1: 100.0}),
        ("1:90,2:10", {1: 90.0, 2: 10.0}),
        (" 2 : 0.5 , 1:1.5 ,", {1: 1.5, 2: 0.5}),
        ("", {}),
    ],
)
def test_parse_weights(raw, weights):
    assert parse_weights(raw) == weights


@pytest.mark.parametrize("raw", ["1=90", "1:90:10", "one:90", "1:lots", "1:90;2:10"])
def test_parse_weights_errors_name_the_entry(raw):
    with pytest.raises(ValueError, match="is not 'version:weight'"):
        parse_weights(raw)


def test_format_weights_is_sorted_compact_and_parses_back():
    weights = {2: 10.0, 1: 90.0, 3: 0.5}
    assert format_weights(weights) == "1:90,2:10,3:0.5"
    assert parse_weights(format_weights(weights)) == weights


@pytest.mark.parametrize(
    ("params", "version"),
    [({}, None), ({"version": None}, None), ({"version": ""}, None), ({"version": 2}, 2), ({"version": "2"}, 2),
     ({"version": " 3 "}, 3), ({"version": 2.0}, 2), ({"tenant": "a", "version": 1}, 1)],
)
def test_pinned_version(params, version):
    assert pinned_version(params) == version


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("latest", "must be a version number"),
        ("2.0", "must be a version number"),
        (True, "must be a version number"),
        (False, "must be a version number"),
        ([2], "must be a version number"),
        (0, "must be an integer >= 1, got 0"),
        (-1, "must be an integer >= 1"),
        ("0", "must be an integer >= 1"),
        (2.5, "must be an integer >= 1, got 2.5"),
        ("+2", "must be an integer >= 1"),
        ("02", "must be an integer >= 1"),
    ],
)
def test_pinned_version_errors_are_invalid_input(raw, message):
    with pytest.raises(InvalidInput, match=message):
        pinned_version({"version": raw})


# --- the routing file ---------------------------------------------------------------------------


def test_write_then_read_round_trips_and_leaves_no_staging_file(tmp_path):
    path = tmp_path / "embed" / "routing.json"  # the folder is made when missing
    write_routing_table(path, ROLLOUT)
    assert read_routing_table(path) == ROLLOUT
    first_inode = path.stat().st_ino
    moved = RoutingTable({1: 50, 2: 50}, candidate=2, baseline=1, shadow_rate=0.1, generation=4)
    write_routing_table(path, moved)
    assert read_routing_table(path) == moved
    # A replace, not a rewrite in place: a reader holding the old file never sees half a table.
    assert path.stat().st_ino != first_inode
    assert [p.name for p in path.parent.iterdir()] == ["routing.json"]


@pytest.mark.parametrize(
    ("text", "message"),
    [("{\"weights\": ", "not valid JSON"), ("{\"weights\": {\"1\": 0}}", "weight > 0"), ("[]", "JSON object")],
)
def test_read_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "routing.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        read_routing_table(path)
    assert str(info.value).startswith(f"{path}: ")


def test_read_of_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_routing_table(tmp_path / "routing.json")


# --- the live source ----------------------------------------------------------------------------

DEFAULT = RoutingTable({1: 100})
CANARY = RoutingTable({1: 95, 2: 5}, candidate=2, baseline=1, shadow_rate=0.5, generation=1)
HALF = RoutingTable({1: 50, 2: 50}, candidate=2, baseline=1, shadow_rate=0.5, generation=2)
INTERVAL_S = 0.25


class FakeClock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def replace_text(path: Path, text: str) -> None:
    """Put `text` at `path` through a new file, as the rollout tool does.

    Rewriting in place could keep both the inode and (within one kernel clock tick) the
    mtime, and the source would rightly take the file as unchanged.
    """
    staging = path.with_name("staging")
    staging.write_text(text)
    os.replace(staging, path)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def path(tmp_path):
    return tmp_path / "routing.json"


@pytest.fixture
def source(path, clock):
    return RoutingSource(path=path, default=DEFAULT, check_interval_s=INTERVAL_S, clock=clock)


def test_source_without_a_file_serves_the_default(source):
    errors = []
    assert source.current(on_error=errors.append) == DEFAULT
    assert errors == []


def test_source_reads_an_existing_file_on_first_use(source, path):
    write_routing_table(path, CANARY)
    assert source.current() == CANARY


def test_source_picks_up_a_rewritten_file_after_the_interval_but_not_before(source, path, clock):
    write_routing_table(path, CANARY)
    assert source.current() == CANARY
    write_routing_table(path, HALF)
    clock.advance(0.1)
    assert source.current() == CANARY
    clock.advance(0.1)
    assert source.current() == CANARY  # 0.2 s since the last check
    clock.advance(0.1)
    assert source.current() == HALF
    write_routing_table(path, CANARY)
    assert source.current() == HALF  # the interval counts from the latest check
    clock.advance(INTERVAL_S)
    assert source.current() == CANARY


def test_source_picks_up_a_file_that_appears(source, path, clock):
    assert source.current() == DEFAULT
    write_routing_table(path, CANARY)
    assert source.current() == DEFAULT
    clock.advance(INTERVAL_S)
    assert source.current() == CANARY


def test_source_reads_an_unchanged_file_once(source, path, clock, monkeypatch):
    reads = []

    def counting_read(file: Path) -> RoutingTable:
        reads.append(file)
        return read_routing_table(file)

    monkeypatch.setattr(routing, "read_routing_table", counting_read)
    write_routing_table(path, CANARY)
    for _ in range(5):
        assert source.current() == CANARY
        clock.advance(INTERVAL_S)
    assert reads == [path]


def test_a_corrupt_file_keeps_the_last_good_table_and_is_reported_once(source, path, clock):
    errors = []
    write_routing_table(path, CANARY)
    assert source.current(on_error=errors.append) == CANARY
    replace_text(path, "{\"weights\": {\"1\": 9")
    clock.advance(INTERVAL_S)
    assert source.current(on_error=errors.append) == CANARY
    assert len(errors) == 1
    assert "routing file ignored, keeping the previous split" in errors[0] and "not valid JSON" in errors[0]
    clock.advance(INTERVAL_S)
    assert source.current(on_error=errors.append) == CANARY
    assert len(errors) == 1  # once per change of the file, not once per check
    replace_text(path, json.dumps({"weights": {"1": -1}}))
    clock.advance(INTERVAL_S)
    assert source.current(on_error=errors.append) == CANARY
    assert len(errors) == 2 and "weight of version 1 must be a finite number >= 0" in errors[1]
    write_routing_table(path, HALF)
    clock.advance(INTERVAL_S)
    assert source.current(on_error=errors.append) == HALF
    assert len(errors) == 2


def test_a_corrupt_file_at_start_serves_the_default(source, path):
    errors = []
    path.write_text("not json")
    assert source.current(on_error=errors.append) == DEFAULT
    assert len(errors) == 1
    assert source.current() == DEFAULT  # no on_error given: still no exception


def test_deleting_the_file_goes_back_to_the_default(source, path, clock):
    write_routing_table(path, CANARY)
    assert source.current() == CANARY
    path.unlink()
    assert source.current() == CANARY  # not looked at again within the interval
    clock.advance(INTERVAL_S)
    assert source.current() == DEFAULT
    write_routing_table(path, HALF)
    clock.advance(INTERVAL_S)
    assert source.current() == HALF


def test_a_wrongly_typed_field_keeps_the_last_good_table(source, path, clock):
    errors = []
    write_routing_table(path, CANARY)
    assert source.current(on_error=errors.append) == CANARY
    replace_text(path, json.dumps({"weights": {"1": 1}, "shadow_rate": None}))
    clock.advance(INTERVAL_S)
    assert source.current(on_error=errors.append) == CANARY
    assert len(errors) == 1
