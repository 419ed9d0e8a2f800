"""Bucket edges the profile did not measure are planned from curves estimated at their lengths."""

import dataclasses

import pytest

from tools.repository.configs import bucket_curves, plan_embed_model
from tools.spec.profile import ProfileError, curve_at_length, load_profile
from tools.spec.serving import load_spec


@pytest.fixture(scope="module")
def spec():
    return load_spec()


@pytest.fixture(scope="module")
def profile(spec):
    return load_profile(spec.profile)


def embed(spec, **changes):
    model = next(m for m in spec.models if m.name == "embed")
    return dataclasses.replace(model, **changes)


def test_measured_buckets_keep_their_curves_and_new_lengths_are_estimated(spec, profile):
    model = embed(spec, bucket_lens=(8, 16, 216, 256))
    curves, estimated = bucket_curves(model, profile)
    assert curves[16] == profile.curve("encoder_16") and curves[256] == profile.curve("encoder_256")
    measured = profile.curves_by_length(f"encoder_{n}" for n in (16, 32, 64, 128, 256))
    assert curves[216].compute_ms == curve_at_length(measured, 216).compute_ms
    assert sorted(estimated) == [8, 216]
    text, nearest = estimated[216]
    assert "estimated from the lengths the profile measured (16, 32, 64, 128, 256)" in text
    assert nearest == "encoder_256" and estimated[8][1] == "encoder_16"


def test_plan_of_unprofiled_edges_says_so_and_names_the_files_to_run(spec, profile):
    plan = {m.name: m for m in plan_embed_model(embed(spec, bucket_lens=(8, 16, 216, 256)), spec, profile)}
    assert any(line.startswith("ESTIMATED: c(b) of encoder_216") for line in plan["encoder_216"].header)
    assert plan["encoder_216"].files_from == "encoder_256"
    assert plan["encoder_16"].files_from == "" and not any("ESTIMATED" in line for line in plan["encoder_16"].header)
    assert plan["encoder_216"].knobs.max_batch_size >= 1


def test_a_model_the_profile_never_measured_still_asks_for_a_profile(spec, profile):
    with pytest.raises(ProfileError, match="no curve for model 'other_16'"):
        bucket_curves(embed(spec, encoder_prefix="other_", bucket_lens=(16,)), profile)


def test_a_mix_re_derives_the_edges_of_a_model_whose_spec_derives_them(spec):
    from tools.bench.goodput import for_mix
    from tools.spec.workload import WORKLOAD_DIR

    model = embed(spec)
    assert model.bucket_count == 5 and model.bucket_lens == (16, 32, 64, 128, 256)
    bimodal = for_mix(model, WORKLOAD_DIR / "embed_bimodal.toml")
    assert bimodal.bucket_lens == (8, 16, 216, 232, 256) and bimodal.workload.name == "embed_bimodal.toml"
    listed = for_mix(dataclasses.replace(model, bucket_count=0), WORKLOAD_DIR / "embed_bimodal.toml")
    assert listed.bucket_lens == (16, 32, 64, 128, 256)


def test_light_load_waits_out_the_routers_peak_regime(spec, profile):
    from python_backends.common.regimes import REGIMES_PARAMETER, LingerRegimes
    from tools.bench.goodput import regime_settle_s

    model = embed(spec)
    plan = plan_embed_model(model, spec, profile)
    router = next(generated for generated in plan if generated.name == "embed")
    regimes = LingerRegimes.from_json(router.config.parameters[REGIMES_PARAMETER].string_value)
    assert regime_settle_s(plan, model) == regimes.window_s + regimes.hold_s + 1.0
    del router.config.parameters[REGIMES_PARAMETER]
    assert regime_settle_s(plan, model) == 0.0
