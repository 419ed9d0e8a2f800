"""The search runner's parts that need no server: the plan a point is measured with, the rows
of one bucket, where a rate search starts, the served knobs read back, resuming and the report."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tools.bench.harness import without_tenant_quotas
from tools.bench.payloads import find_model, model_texts
from tools.bench.search import (
    QUICK,
    Budget,
    ResumeError,
    SearchOptions,
    bucket_spaces,
    check_resumable,
    derived_config,
    knobs_served,
    load_report,
    measured_digest,
    models_beside,
    new_report,
    payload_by_bucket,
    plan_with,
    serving_one_version,
    with_edges,
    write_points,
)
from tools.planning.search import JOINT, KnobSet, Point
from tools.repository.configs import plan_embed_model
from tools.spec.profile import TunedModel, load_profile
from tools.spec.serving import load_spec
from tools.spec.workload import load_workload

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec():
    return load_spec(REPO / "serving.toml")


@pytest.fixture(scope="module")
def embed(spec):
    return find_model(spec, "embed")


@pytest.fixture(scope="module")
def profile():
    return load_profile(REPO / "profiles" / "cpu.json")


def test_a_point_is_planned_as_gen_config_would_write_it(spec, embed, profile):
    config = {"encoder_16": KnobSet(8, 4, 5000, 3)}
    measured = {g.name: g for g in plan_with(spec, embed, profile, config)}
    entry = TunedModel(knobs={"encoder_16": config["encoder_16"].as_dict()}, tuned_at="", command="a measured point",
                       slo_p95_ms=embed.slo_p95_ms, derived_goodput_rps=0.0, tuned_goodput_rps=0.0, rounds=1)
    written = without_tenant_quotas(plan_embed_model(embed, spec, replace(profile, tuned={"embed": entry})), "embed")
    for generated in written:
        served = measured[generated.name]
        if generated.knobs is None:  # the router: as written
            assert served.config == generated.config
            continue
        # The bucket models serve only the version the traffic goes to; the rest is as written.
        assert list(served.config.version_policy.specific.versions) == [1] and served.versions == (1,)
        assert served.config.dynamic_batching == generated.config.dynamic_batching
        assert served.config.instance_group == generated.config.instance_group
        assert served.knobs == generated.knobs
    assert KnobSet.of(measured["encoder_16"].knobs) == config["encoder_16"]


def test_a_measured_point_ignores_an_earlier_tuned_entry(spec, embed, profile):
    entry = TunedModel(knobs={"encoder_32": {"instance_count": 1}}, tuned_at="", command="tune",
                       slo_p95_ms=embed.slo_p95_ms, derived_goodput_rps=1.0, tuned_goodput_rps=2.0, rounds=3)
    tuned = replace(profile, tuned={"embed": entry})
    assert derived_config(spec, embed, tuned) == derived_config(spec, embed, profile)
    assert derived_config(spec, embed, profile)["encoder_32"].instance_count == 2
    plan = {g.name: g for g in plan_with(spec, embed, tuned, {})}
    assert plan["encoder_32"].knobs.instance_count == 2


def test_serving_one_version_leaves_the_router_and_single_versions_alone(spec, embed, profile):
    plan = plan_embed_model(embed, spec, profile)
    one = {g.name: g for g in serving_one_version(plan, 2)}
    assert list(one["encoder_64"].config.version_policy.specific.versions) == [2]
    assert one["embed"] is next(g for g in plan if g.name == "embed")
    assert list(next(g for g in plan if g.name == "encoder_64").config.version_policy.specific.versions) == [1, 2]


def test_the_served_knobs_are_read_back_from_tritons_json():
    served = {"max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": [8], "max_queue_delay_microseconds":
                                                        "20000"}, "instance_group": [{"count": 2}, {"count": 1}]}
    # Triton fills in max_batch_size as the preferred size when the config names none.
    assert knobs_served(served) == KnobSet(8, 1, 20000, 3)
    assert knobs_served({"max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": [4]},
                         "instance_group": [{"count": 2}]}) == KnobSet(8, 4, 0, 2)
    # A point that prefers its max_batch_size is served as one that names no preferred size.
    assert knobs_served({"max_batch_size": 2, "dynamic_batching": {"preferred_batch_size": [2]},
                         "instance_group": [{"count": 2}]}) == KnobSet(2, 2, 0, 2).as_served()
    assert KnobSet(8, 4, 0, 2).as_served() == KnobSet(8, 4, 0, 2)


def test_the_rows_of_one_bucket_are_those_the_router_sends_there(spec, embed, profile):
    workload = load_workload(REPO / "loadtest" / "workloads" / "embed_mix.toml")
    payload = model_texts(embed, workload, 200)
    plan = plan_embed_model(embed, spec, profile)
    by_bucket = payload_by_bucket(payload, plan, embed, REPO / "model_repository")
    assert sum(len(p.texts) for p in by_bucket.values()) == 200
    assert set(by_bucket) <= {f"encoder_{b}" for b in embed.bucket_lens}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(REPO / "model_repository" / "embed" / "1" / "tokenizer.json"))
    tokenizer.no_padding()
    for text in by_bucket["encoder_32"].texts:
        assert 16 < len(tokenizer.encode(text).ids) <= 32
    shares = {space.model_name: space.share for space in bucket_spaces(spec, embed, profile)}
    assert len(by_bucket["encoder_16"].texts) / 200 == pytest.approx(shares["encoder_16"], abs=0.1)


def test_a_report_resumes_only_the_same_run_and_says_why_not(spec, embed, profile, tmp_path):
    report = new_report("search", spec, embed, profile, QUICK, {"top_k": 1}, "python -m tools search embed")
    assert report["profile_sha256"] == measured_digest(profile)
    check_resumable(report, report, tmp_path / "s.json")
    other = new_report("search", spec, embed, profile, SearchOptions(), {}, "")
    with pytest.raises(ResumeError, match=r"a run with other options .* pass --restart"):
        check_resumable(other, report, tmp_path / "s.json")
    with pytest.raises(ResumeError, match="a run on other profile measurements"):
        check_resumable({**report, "profile_sha256": "x"}, report, tmp_path / "s.json")
    # Tuning rewrites the profile's tuned section, which a resumed search does not care about.
    entry = TunedModel(knobs={"encoder_16": {"instance_count": 1}}, tuned_at="", command="", slo_p95_ms=200,
                       derived_goodput_rps=1, tuned_goodput_rps=2, rounds=1)
    assert measured_digest(replace(profile, tuned={"embed": entry})) == measured_digest(profile)


def test_every_point_is_written_with_a_plot_and_read_back(spec, embed, profile, tmp_path):
    out = tmp_path / "search.json"
    assert load_report(out) is None
    report = new_report("search", spec, embed, profile, QUICK, {}, "python -m tools search embed")
    points = [Point("bucket", "encoder_16", {"encoder_16": KnobSet(8, 1, 0, 2)}, 120.0, 15.0,
                    ({"offered_rps": 60.0, "passed": True},)),
              Point("joint", JOINT, {"encoder_16": KnobSet(8, 1, 0, 2)}, 40.0, 20.0)]
    write_points(report, points, points[1], out)
    written = load_report(out)
    assert [Point.from_dict(p) for p in written["points"]] == points
    assert written["best"] == points[1].to_dict() and written["measure_s"] == 35.0
    assert out.with_suffix(".png").stat().st_size > 1000
    out.write_text("{")
    with pytest.raises(ResumeError, match="not a search report"):
        load_report(out)


def test_the_budget_starts_no_point_it_expects_to_overrun():
    started = time.monotonic()
    budget = Budget(started, 100.0)
    assert budget.affords(started, [])
    points = [Point("joint", JOINT, {}, 1.0, 30.0)]
    assert budget.affords(started + 60.0, points) and not budget.affords(started + 75.0, points)
    assert not budget.affords(started + 30.0, points, share=0.5)
    assert json.loads(json.dumps(QUICK.as_dict())) == QUICK.as_dict()


FRAMES_MIX = """name = "frames"
rows_per_request = 2

[[lengths]]
min_tokens = 5
max_tokens = 80
weight = 1.0
"""


@pytest.fixture(scope="module")
def tensors(tmp_path_factory):
    """The repo's spec with the suite's audio model (bucketed by frames, 16 and 64) and image
    model (fixed shape); their profile borrows embed's curves (the plan needs a curve per bucket)."""
    import tomllib

    from tests import user_models
    from tools.spec.serving import parse_spec

    folder = tmp_path_factory.mktemp("tensor-models")
    audio, image = user_models.audio_conv_onnx(folder), user_models.image_classifier_onnx(folder)
    (folder / "frames.toml").write_text(FRAMES_MIX)
    data = tomllib.loads((REPO / "serving.toml").read_text())
    common = {"kind": "tensor", "tolerance": 0.001, "slo_p95_ms": 200, "expected_rps": 10, "peak_rps": 20,
              "max_request_rows": 16, "max_router_instances": 2}
    data["models"]["audio"] = {**common, "source": str(audio), "variable_axis": 0,
                               "pad": {"features": 0.0, "frame_mask": 0.0}, "buckets": [16, 64],
                               "workload": str(folder / "frames.toml")}
    data["models"]["image"] = {**common, "source": str(image)}
    spec = parse_spec(data, REPO / "serving.toml")
    profile = load_profile(spec.profile)
    borrowed = {"audio_16": "encoder_16", "audio_64": "encoder_64", "image_fixed": "encoder_32"}
    profile = replace(
        profile, models={**profile.models, **{name: profile.models[source] for name, source in borrowed.items()}},
        overhead={**profile.overhead, "audio": profile.overhead["embed"], "image": profile.overhead["embed"]})
    return spec, profile


def test_a_tensor_models_rows_go_to_the_bucket_of_their_frames(tensors):
    from tools.bench.payloads import model_payload

    spec, profile = tensors
    audio = find_model(spec, "audio")
    shares = {space.model_name: space.share for space in bucket_spaces(spec, audio, profile)}
    # Frames of 5..80 in one band; a request longer than the largest bucket is counted into it.
    assert shares == {"audio_16": pytest.approx(12 / 76), "audio_64": pytest.approx(64 / 76)}
    payload = model_payload(audio, load_workload(audio.workload), 100)
    by_bucket = payload_by_bucket(payload, plan_with(spec, audio, profile, {}), audio, REPO / "model_repository")
    assert set(by_bucket) == {"audio_16", "audio_64"}
    assert all(length <= 16 for length in by_bucket["audio_16"].lengths)
    assert all(16 < length <= 64 for length in by_bucket["audio_64"].lengths)
    assert sum(len(p.requests) for p in by_bucket.values()) == len(payload.requests)
    plan = {g.name: g for g in plan_with(spec, audio, profile, {"audio_64": KnobSet(4, 2, 10000, 1)})}
    assert KnobSet.of(plan["audio_64"].knobs) == KnobSet(4, 2, 10000, 1)


def test_a_fixed_shape_model_is_one_bucket_searched_with_the_full_mix(tensors):
    from tools.planning.search import StructuredSearch

    spec, profile = tensors
    image = find_model(spec, "image")
    (space,) = bucket_spaces(spec, image, profile)
    assert (space.model_name, space.share) == ("image_fixed", 1.0)
    proposal = StructuredSearch([space], points_per_bucket=2, top_k=1).next_point()
    assert (proposal.phase, proposal.bucket) == ("joint", JOINT)
    assert "image_fixed" in derived_config(spec, image, profile)


def test_an_external_model_is_reloaded_with_the_users_config_and_the_points_knobs(tmp_path):
    from tests.user_models import EXTERNAL_MODEL, external_repository
    from tools.bench.payloads import model_payload
    from tools.bench.search import served_config
    from tools.spec.profile import Hardware, LatencyCurve, LatencyProfile, ModelProfile, Overhead, save_profile

    external_repository(tmp_path)
    (tmp_path / "serving.toml").write_text('profile = "cpu.json"\n\n[hardware.cpu]\nmax_instances = 2\n'
                                           'intra_op_threads = 1\n\n[tenants.auth]\nmode = "off"\n\n'
                                           '[models.scorer]\nkind = "external"\nrepository = "user-repository"\n'
                                           'model = "user_scorer"\ntolerance = 0.001\nslo_p95_ms = 100\n'
                                           'expected_rps = 20\npeak_rps = 50\nmax_request_rows = 64\n'
                                           'max_router_instances = 2\n')
    hardware = Hardware(name="cpu", kind="cpu", description="test cores", cpu_count=2,
                        details={"intra_op_threads": 1})
    curve = LatencyCurve({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.2, 32: 8.0})
    save_profile(LatencyProfile(path=None, sha256="", hardware=hardware, measured_at="2026-01-01T00:00:00Z",
                                models={EXTERNAL_MODEL: ModelProfile(seq_len=0, curve=curve)},
                                overhead={"scorer": Overhead(p50_ms=1.0, p95_ms=2.0)}), tmp_path / "cpu.json")
    spec = load_spec(tmp_path / "serving.toml")
    scorer, profile = find_model(spec, "scorer"), load_profile(tmp_path / "cpu.json")
    (space,) = bucket_spaces(spec, scorer, profile)
    assert space.model_name == EXTERNAL_MODEL and space.share == 1.0
    plan = {g.name: g for g in plan_with(spec, scorer, profile, {EXTERNAL_MODEL: KnobSet(16, 8, 2000, 1)})}
    loaded = served_config(plan[EXTERNAL_MODEL])
    assert loaded.name == EXTERNAL_MODEL and loaded.backend == "python"  # the user's config, merged
    assert (loaded.max_batch_size, list(loaded.dynamic_batching.preferred_batch_size),
            loaded.dynamic_batching.max_queue_delay_microseconds, loaded.instance_group[0].count) == (16, [8], 2000, 1)
    payload = model_payload(scorer, None, 10)
    by_bucket = payload_by_bucket(payload, list(plan.values()), scorer, tmp_path)
    assert list(by_bucket) == [EXTERNAL_MODEL]


def test_the_models_only_other_edges_run_are_in_the_search_repository_once(spec, embed, profile):
    # Edges whose buckets do not linger have no express model; other edges may have one.
    own = [generated for generated in plan_with(spec, embed, profile, {}) if generated.name != "encoder_express"]
    others = [plan_with(spec, with_edges(embed, edges), profile, {}) for edges in ((24, 64, 128, 256),
                                                                                    (24, 48, 128, 256))]
    beside = models_beside(own, others)
    assert [generated.name for generated in beside] == ["encoder_24", "encoder_express", "encoder_48"]
    assert beside[1] is others[0][-1]  # the first plan's, once
