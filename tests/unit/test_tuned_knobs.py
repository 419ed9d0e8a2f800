"""A profile's tuned knobs: the `tuned` section's schema and round trip, and gen-config writing
them over the derived knobs with the reason in the config header."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from python_backends.embed.router import parse_router_config
from tools.planning.derivation import BatchingKnobs
from tools.planning.search import KnobSet, apply_tuned, with_config
from tools.repository.configs import plan_embed_model
from tools.spec.profile import (
    LatencyCurve,
    ProfileError,
    TunedModel,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
    tuned_after_profiling,
)
from tools.spec.serving import load_spec

REPO = Path(__file__).resolve().parents[2]
PROFILE = json.loads((REPO / "tests" / "data" / "small_profile.json").read_text())
ENTRY = {"tuned_at": "2026-11-27T10:00:00Z", "command": "python -m tools tune embed --budget-min 30",
         "slo_p95_ms": 200, "goodput_rps": {"derived": 120.0, "tuned": 136.0}, "rounds": 3,
         "knobs": {"encoder_16": {"max_queue_delay_us": 20000, "instance_count": 3}}}
TUNED = TunedModel(knobs={"encoder_16": {"max_queue_delay_us": 20000, "instance_count": 3}},
                   tuned_at="2026-11-27T10:00:00Z", command="python -m tools tune embed --budget-min 30",
                   slo_p95_ms=200, derived_goodput_rps=120.0, tuned_goodput_rps=136.0, rounds=3)


def with_entry(entry: dict) -> dict:
    data = copy.deepcopy(PROFILE)
    data["tuned"] = {"embed": entry}
    return data


def test_the_tuned_section_round_trips_through_the_file(tmp_path):
    profile = profile_from_dict(with_entry(ENTRY))
    assert profile.tuned == {"embed": TUNED}
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path).tuned == {"embed": TUNED}
    assert json.loads(path.read_text())["tuned"]["embed"] == {**ENTRY, "slo_p95_ms": 200}


def test_a_profile_without_tuned_knobs_writes_no_section():
    profile = profile_from_dict(copy.deepcopy(PROFILE))
    assert profile.tuned == {} and "tuned" not in profile_to_dict(profile)


def test_the_committed_profile_has_no_tuned_entry():
    assert load_profile(REPO / "profiles" / "cpu.json").tuned == {}


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e["knobs"]["encoder_16"].update(max_batch=4),
     "p.json [tuned.embed.knobs.encoder_16]: unknown key(s) ['max_batch']; the keys are ['max_batch_size', "
     "'preferred_batch_size', 'max_queue_delay_us', 'instance_count']"),
    (lambda e: e["knobs"].update(encoder_32={}),
     "p.json [tuned.embed.knobs.encoder_32]: names no knob; the knobs are ['max_batch_size', 'preferred_batch_size', "
     "'max_queue_delay_us', 'instance_count']"),
    (lambda e: e["knobs"]["encoder_16"].update(instance_count=0),
     "p.json [tuned.embed.knobs.encoder_16]: 'instance_count' must be >= 1, got 0"),
    (lambda e: e.pop("slo_p95_ms"), "p.json [tuned.embed]: missing 'slo_p95_ms'"),
    (lambda e: e["goodput_rps"].update(tuned=-1), "p.json [tuned.embed.goodput_rps]: 'tuned' must be >= 0, got -1"),
])
def test_tuned_section_errors_name_the_table_and_the_key(change, message):
    entry = copy.deepcopy(ENTRY)
    change(entry)
    with pytest.raises(ProfileError) as info:
        profile_from_dict(with_entry(entry), Path("p.json"))
    assert str(info.value).splitlines()[1:] == [message]


DERIVED = BatchingKnobs(model_name="encoder_16", max_batch_size=22, preferred_batch_size=4, max_queue_delay_us=60000,
                        default_timeout_us=0, max_queue_size=91, instance_count=2,
                        reasons={"max_batch_size": "o + 2c", "preferred_batch_size": "knee",
                                 "max_queue_delay_microseconds": "min(budget, fill) = 60.0 ms",
                                 "instance_count": "one per lane"})
CURVE = LatencyCurve({1: 4.0, 2: 5.0, 4: 7.0, 8: 11.0, 16: 20.0, 32: 39.0})
BUCKETS = {"encoder_16", "encoder_32"}


def test_tuned_knobs_replace_the_derived_ones_and_say_so():
    knobs, lines = apply_tuned(DERIVED, TUNED, "embed", 200, CURVE, BUCKETS)
    assert (knobs.max_queue_delay_us, knobs.instance_count, knobs.max_batch_size) == (20000, 3, 22)
    assert knobs.reasons["max_queue_delay_microseconds"] == \
        "tuned: 20000 instead of the derived 60000: min(budget, fill) = 60.0 ms"
    assert knobs.reasons["max_batch_size"] == "o + 2c"  # not tuned: derived, as it was
    assert lines == ("tuned by `python -m tools tune embed --budget-min 30` on 2026-11-27: "
                     "max_queue_delay_microseconds 60000 -> 20000, instance_count 2 -> 3; the model's goodput "
                     "120.0 -> 136.0 req/s (medians of 3 rounds); derived values in the reasons above",)


def test_a_bucket_the_tuning_left_alone_says_it_kept_the_derived_knobs():
    other = replace(DERIVED, model_name="encoder_32")
    knobs, (line,) = apply_tuned(other, TUNED, "embed", 200, CURVE, BUCKETS)
    assert knobs == other and "the derived knobs kept" in line
    assert apply_tuned(DERIVED, None, "embed", 200, CURVE, BUCKETS) == (DERIVED, ())


def test_a_larger_tuned_batch_gets_a_queue_that_holds_it():
    tuned = replace(TUNED, knobs={"encoder_16": {"max_batch_size": 32}})
    small = replace(DERIVED, max_queue_size=6)
    assert apply_tuned(small, tuned, "embed", 200, CURVE, BUCKETS)[0].max_queue_size == 32


def test_tuned_knobs_for_another_slo_are_not_applied_and_warn():
    knobs, lines = apply_tuned(DERIVED, TUNED, "embed", 150, CURVE, BUCKETS)
    assert lines == () and knobs.max_queue_delay_us == 60000
    assert "were for SLO 200 ms, the spec's is 150 ms" in knobs.warnings[-1]


@pytest.mark.parametrize(("knobs", "message"), [
    ({"encoder_512": {"instance_count": 1}}, "name ['encoder_512'], which embed does not serve"),
    ({"encoder_16": {"preferred_batch_size": 32}}, "preferred_batch_size 32 is above max_batch_size 22"),
    ({"encoder_16": {"max_batch_size": 64, "preferred_batch_size": 64}}, "the largest batch measured (32)"),
])
def test_tuned_knobs_the_spec_or_profile_cannot_take_are_an_error(knobs, message):
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        apply_tuned(DERIVED, replace(TUNED, knobs=knobs), "embed", 200, CURVE, BUCKETS)


def test_gen_config_writes_the_tuned_knobs_into_the_buckets_the_router_and_the_header():
    spec = load_spec(REPO / "serving.toml")
    (model,) = spec.models
    profile = load_profile(REPO / "profiles" / "cpu.json")
    derived = {g.name: g for g in plan_embed_model(model, spec, profile)}
    entry = TunedModel(knobs={"encoder_32": {"max_batch_size": 8, "preferred_batch_size": 4}},
                       tuned_at="2026-11-27T10:00:00Z", command="python -m tools tune embed",
                       slo_p95_ms=model.slo_p95_ms, derived_goodput_rps=50.0, tuned_goodput_rps=56.0, rounds=3)
    plan = {g.name: g for g in plan_embed_model(model, spec, replace(profile, tuned={"embed": entry}))}
    encoder = plan["encoder_32"].config
    assert encoder.max_batch_size == 8 and list(encoder.dynamic_batching.preferred_batch_size) == [4]
    assert plan["encoder_16"].config == derived["encoder_16"].config  # the other buckets stay derived
    router = parse_router_config("embed", {k: v.string_value for k, v in plan["embed"].config.parameters.items()})
    assert router.bucket_max_batch[32] == 8  # the router chunks by the tuned batch
    assert router.admission.row_cost_ms[32] == pytest.approx(profile.curve("encoder_32").at(4) / 4, abs=1e-3)
    header = plan["encoder_32"].config_text()
    was = derived["encoder_32"].knobs
    assert (was.max_batch_size, was.preferred_batch_size) != (8, 4)
    assert f"# tuned by `python -m tools tune embed` on 2026-11-27: max_batch_size {was.max_batch_size} -> 8, " \
           f"preferred_batch_size {was.preferred_batch_size} -> 4; the model's goodput 50.0 -> 56.0 req/s (medians " \
           "of 3 rounds)" in header
    assert f"# max_batch_size: tuned: 8 instead of the derived {was.max_batch_size}: " \
           f"{was.reasons['max_batch_size']}" in header


def test_a_search_point_is_planned_through_the_same_tuned_entry():
    config = {"encoder_16": KnobSet(8, 1, 0, 2)}
    tuned = with_config({"other": TUNED}, "embed", 200, config, "a measured point")
    assert tuned["other"] == TUNED
    assert tuned["embed"].knobs == {"encoder_16": {"max_batch_size": 8, "preferred_batch_size": 1,
                                                   "max_queue_delay_us": 0, "instance_count": 2}}
    assert "embed" not in with_config({"embed": TUNED}, "embed", 200, {}, "the derived point")


def test_a_re_profile_drops_the_tuned_knobs_of_the_models_it_measured_again():
    other = replace(TUNED, command="python -m tools tune search")
    kept, dropped = tuned_after_profiling({"embed": TUNED, "search": other}, {"embed"})
    assert kept == {"search": other} and dropped == ["embed"]
    assert tuned_after_profiling({"embed": TUNED}, {"embed", "search"}) == ({}, ["embed"])
