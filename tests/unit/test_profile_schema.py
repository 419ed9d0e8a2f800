"""The latency profile's schema: every problem in a profile file is named with its table and key."""

import copy
import json
from pathlib import Path

import pytest

from tools.spec.profile import ProfileError, load_profile, profile_from_dict

REPO = Path(__file__).resolve().parents[2]
PROFILE = json.loads((REPO / "tests" / "data" / "small_profile.json").read_text())


def changed(change) -> dict:
    data = copy.deepcopy(PROFILE)
    change(data)
    return data


def first_model(data: dict) -> dict:
    return next(iter(data["models"].values()))


def error(data: dict) -> list[str]:
    with pytest.raises(ProfileError) as info:
        profile_from_dict(data, Path("p.json"))
    head, *lines = str(info.value).splitlines()
    assert head == "profile p.json: malformed"
    return lines


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("overhead_ms"), "p.json: missing 'overhead_ms'"),
    (lambda d: d["hardware"].pop("kind"), "p.json [hardware]: missing 'kind'"),
    (lambda d: d["hardware"].update(cpu_count=-2), "p.json [hardware]: 'cpu_count' must be >= 0, got -2"),
    (lambda d: d.update(models=[]), "p.json [models]: must be a table, got []"),
    (lambda d: first_model(d)["compute_ms"].pop("1"),
     "p.json [models.encoder_16]: compute_ms: a latency curve must include batch size 1"),
    (lambda d: first_model(d)["compute_ms"].update({"2": -3}),
     "p.json [models.encoder_16]: compute_ms: bad latency point: batch 2, -3.0 ms"),
    (lambda d: first_model(d)["compute_ms"].update({"two": 3}),
     "p.json [models.encoder_16]: 'compute_ms': key 'two' is not a number"),
    (lambda d: first_model(d).update(seq_len=-1), "p.json [models.encoder_16]: 'seq_len' must be >= 0, got -1"),
    (lambda d: d["overhead_ms"]["embed"].update(p95="slow"),
     "p.json [overhead_ms.embed]: 'p95' must be a number, got 'slow'"),
])
def test_profile_errors_name_the_table_and_the_key(change, message):
    assert error(changed(change)) == [message]


def test_the_hardware_keeps_keys_beyond_the_schema_as_details():
    profile = profile_from_dict(changed(lambda d: d["hardware"].update(memory_gb=8, intra_op_threads=1)))
    assert profile.hardware.details["memory_gb"] == 8 and profile.hardware.details["intra_op_threads"] == 1


def test_a_profile_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(ProfileError, match=f"profile {path}: not valid JSON"):
        load_profile(path)
