"""The goodput benchmark of an external model without a server: its baselines are the user's
config with only the batcher changed, every setup serves a copy of the user's folder with a
fresh config.pbtxt, its requests are the config's declared tensors, and its report has no
ceiling."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.tensor.router import FIXED_BUCKET
from tests.user_models import EXTERNAL_MODEL, EXTERNAL_NUM_FEATURES, external_repository
from tools.bench.goodput import (
    EXTERNAL_CEILING_NOTE,
    external_baseline,
    model_plan,
    padded_only_plan,
    plot_goodput,
    routed_requests,
    short_request_indices,
    tensor_router_of,
    unbatched_plan,
)
from tools.bench.harness import build_user_repository, copy_user_model, without_tenant_quotas
from tools.bench.payloads import TensorPayload, find_model, model_payload
from tools.repository.configs import GeneratedModel
from tools.repository.external import parse_config
from tools.spec.profile import Hardware, LatencyCurve, LatencyProfile, ModelProfile, Overhead, save_profile
from tools.spec.serving import load_spec

SPEC = '''# The user's spec.
profile = "cpu.json"

[hardware.cpu]
max_instances = 2
intra_op_threads = 1
ort_spinning = false

[tenants.auth]
mode = "off"

[models.scorer]
kind = "external"
repository = "user-repository"
model = "user_scorer"
tolerance = 0.001
slo_p95_ms = 100
expected_rps = 20
peak_rps = 50
max_request_rows = 64
max_router_instances = 2
'''
CURVE = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.2, 32: 8.0, 64: 15.5}


@pytest.fixture
def user(tmp_path):
    """The user's repository, a spec serving its model and a profile with the model's curve."""
    external_repository(tmp_path)
    (tmp_path / "serving.toml").write_text(SPEC)
    hardware = Hardware(name="cpu", kind="cpu", description="test cores", cpu_count=2,
                        details={"intra_op_threads": 1})
    profile = LatencyProfile(path=None, sha256="", hardware=hardware, measured_at="2026-01-01T00:00:00Z",
                             models={EXTERNAL_MODEL: ModelProfile(seq_len=0, curve=LatencyCurve(CURVE))},
                             overhead={"scorer": Overhead(p50_ms=1.0, p95_ms=2.0, cpu_ms=0.5)})
    save_profile(profile, tmp_path / "cpu.json")
    spec = load_spec(tmp_path / "serving.toml")
    return spec, profile, find_model(spec, "scorer"), tmp_path


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("batching", [False, True])
def test_an_external_baseline_keeps_the_user_s_batch_size_and_instances_and_only_sets_the_batcher(batching):
    user = mc.ModelConfig(name="m", max_batch_size=8)
    user.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=3)
    user.dynamic_batching.max_queue_delay_microseconds = 500  # the user's own batcher is replaced too
    config = external_baseline(user, "m", batching)
    assert (config.name, config.max_batch_size, list(config.instance_group)) == ("m", 8, list(user.instance_group))
    assert config.HasField("dynamic_batching") == batching
    if batching:  # Triton's defaults: nothing set
        assert config.dynamic_batching == type(config.dynamic_batching)()


@pytest.mark.parametrize("batching", [False, True])
def test_an_external_model_s_baselines_are_its_own_config_through_the_router(user, batching):
    spec, profile, model, _ = user
    padded = {m.name: m for m in padded_only_plan(spec, profile, model, batching=batching)}
    assert set(padded) == {"scorer", EXTERNAL_MODEL}
    router = padded["scorer"].config
    assert "admission" not in router.parameters and not router.dynamic_batching.HasField("default_queue_policy")
    parsed = tensor_router_of(list(padded.values()), model)
    assert parsed.fixed_model == EXTERNAL_MODEL and parsed.bucket_max_batch == {FIXED_BUCKET: 4}
    bucket = padded[EXTERNAL_MODEL]
    assert bucket.user_config is not None and bucket.versions == ()  # the kit builds none of its files
    served = parse_config(bucket.config_text(), "baseline")
    assert served.max_batch_size == 4 and served.HasField("dynamic_batching") == batching
    assert served.parameters["scale"].string_value == "0.5" and served.model_warmup[0].batch_size == 1
    assert [(g.kind, g.count) for g in served.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 1)]


def test_the_kit_s_setup_merges_the_derived_fields_into_the_user_s_config(user):
    spec, profile, model, _ = user
    plan = {m.name: m for m in without_tenant_quotas(model_plan(spec, profile, model), model.name)}
    served = parse_config(plan[EXTERNAL_MODEL].config_text(), "slo_bucketed")
    assert served.max_batch_size == plan[EXTERNAL_MODEL].config.max_batch_size > 4
    assert served.dynamic_batching == plan[EXTERNAL_MODEL].config.dynamic_batching
    assert served.parameters["scale"].string_value == "0.5"


def test_a_copy_of_the_user_s_folder_links_its_files_and_writes_a_fresh_config(user, tmp_path):
    *_, folder = user
    source = folder / "user-repository" / EXTERNAL_MODEL
    (source / "1" / "__pycache__").mkdir()
    (source / "1" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"stale")
    before = digests(source)
    target = tmp_path / "copy" / EXTERNAL_MODEL
    copy_user_model(source, target, "name: \"user_scorer\"\n")
    assert digests(source) == before  # the user's folder is only read
    assert (target / "config.pbtxt").read_text() == "name: \"user_scorer\"\n"
    assert (target / "config.pbtxt").stat().st_ino != (source / "config.pbtxt").stat().st_ino
    assert (target / "1" / "model.py").stat().st_ino == (source / "1" / "model.py").stat().st_ino
    assert not (target / "1" / "__pycache__").exists()


def test_a_plan_without_an_external_model_needs_no_user_repository():
    router = mc.ModelConfig(name="embed")
    assert build_user_repository("no_batching", [GeneratedModel("embed", router, (), "embed_model", (1,))]) == ()


def test_an_external_model_s_requests_are_its_config_s_tensors(user):
    *_, model, _ = user
    payload = model_payload(model, None, 40)
    assert isinstance(payload, TensorPayload) and payload.lengths == ()
    request = payload.requests[0]
    assert set(request) == {"FEATURES"}
    assert request["FEATURES"].shape == (1, EXTERNAL_NUM_FEATURES) and request["FEATURES"].dtype == np.float32


def test_a_report_without_a_ceiling_is_plotted(tmp_path):
    report = {"setups": {"no_batching": {"goodput_rps": 10.0}, "slo_bucketed": {"goodput_rps": 40.0}},
              "ceiling_rps": None, "ceiling_note": EXTERNAL_CEILING_NOTE, "rounds": 1, "workload": None,
              "model": "scorer", "slo_ms": 100, "hardware": {"description": "test cores"}}
    plot_goodput(report, tmp_path / "goodput.png")
    assert (tmp_path / "goodput.png").stat().st_size > 1000


def test_an_external_models_requests_go_straight_to_the_users_model_and_its_copy_does_not_linger(user):
    spec, profile, model, _ = user
    plan = model_plan(spec, profile, model)
    payload = model_payload(model, None, 4)
    routed = routed_requests(payload, plan, model)
    assert len(routed) == len(payload.requests)
    assert {r.bucket_lens for r in routed} == {(FIXED_BUCKET,)}  # one bucket: every request is a short one
    assert short_request_indices([r.bucket_lens for r in routed]) == list(range(len(routed)))
    assert {call.model_name for r in routed for call in r.calls} == {EXTERNAL_MODEL}
    unbatched = {m.name: m for m in unbatched_plan(plan, model)}
    config = unbatched[EXTERNAL_MODEL]
    assert config.config.dynamic_batching.max_queue_delay_microseconds == 0
    assert not config.config.dynamic_batching.preferred_batch_size
    served = parse_config(config.config_text(), "config.pbtxt")  # the user's config with the managed fields
    assert served.dynamic_batching.max_queue_delay_microseconds == 0
    assert not served.dynamic_batching.preferred_batch_size
    assert served.max_batch_size == plan[1].config.max_batch_size
