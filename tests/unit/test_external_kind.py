"""The `external` kind without a server: the spec's rules, what the kit reads from the user's
config.pbtxt, gen-config writing only the batching fields (and --check seeing drift of those
only), add-model --external, the router's named bucket, the probe's config, serving two
repositories and the rollout's plan."""

from __future__ import annotations

import hashlib
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.drift import DriftMeasure
from python_backends.embed.kinds import ModelKind
from python_backends.tensor.router import (
    FIXED_BUCKET,
    TensorRouter,
    TensorRouterConfig,
    TensorRouterParameters,
    TensorSpec,
    parse_tensor_router_config,
)
from tests.user_models import EXTERNAL_CONFIG, EXTERNAL_MODEL, external_repository
from tools.bench.profiler import MAX_PROBE_BATCH, probe_external_config, probe_knobs
from tools.cli import main
from tools.ops.rollout import RolloutError, make_plan, read_config
from tools.repository.configs import expected_files, external_files, plan_all
from tools.repository.external import HEADER_PREFIX, MANAGED_FIELDS, parse_config
from tools.repository.sources import SourceError, served_external
from tools.server.triton_server import ServerConfig, ServerError, TritonServer, build_command
from tools.spec.profile import Hardware, LatencyCurve, LatencyProfile, ModelProfile, Overhead, save_profile
from tools.spec.serving import SpecError, load_spec, parse_spec

SPEC_HEAD = '''# The user's spec.
profile = "cpu.json"

[hardware.cpu]
max_instances = 2
intra_op_threads = 1
ort_spinning = false

[tenants.auth]
mode = "off"
'''
TABLE = '''
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
FAKE_DIST = type("Dist", (), {"binary": Path("/t/bin/tritonserver")})()


@pytest.fixture
def user(tmp_path):
    """A user's folder: their Triton repository, a spec serving its model, the kit's (empty)
    repository and a profile with the model's curve."""
    external_repository(tmp_path)
    (tmp_path / "serving.toml").write_text(SPEC_HEAD + TABLE)
    (tmp_path / "model_repository").mkdir()
    hardware = Hardware(name="cpu", kind="cpu", description="test cores", cpu_count=2,
                        details={"intra_op_threads": 1})
    save_profile(LatencyProfile(path=None, sha256="", hardware=hardware, measured_at="2026-01-01T00:00:00Z",
                                models={EXTERNAL_MODEL: ModelProfile(seq_len=0, curve=LatencyCurve(CURVE))},
                                overhead={"scorer": Overhead(p50_ms=1.0, p95_ms=2.0, cpu_ms=0.5)}),
                 tmp_path / "cpu.json")
    return tmp_path


def config_path(user: Path) -> Path:
    return user / "user-repository" / EXTERNAL_MODEL / "config.pbtxt"


def spec_of(user: Path, table: str = TABLE):
    (user / "serving.toml").write_text(SPEC_HEAD + table)
    return load_spec(user / "serving.toml")


def spec_error(user: Path, table: str) -> str:
    with pytest.raises(SpecError) as info:
        spec_of(user, table)
    return str(info.value)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- the spec -----------------------------------------------------------------------------------


def test_an_external_table_is_a_router_in_front_of_the_user_s_model(user):
    spec = spec_of(user)
    (model,) = spec.models
    assert model.kind is ModelKind.EXTERNAL and model.kind.drift is DriftMeasure.ABS_DIFF
    assert model.repository == user / "user-repository" and model.external_model == EXTERNAL_MODEL
    assert model.external_dir == user / "user-repository" / EXTERNAL_MODEL
    assert model.bucket_lens == (FIXED_BUCKET,) and model.bucket_names == (EXTERNAL_MODEL,)
    assert model.bucket_repository(user / "model_repository") == user / "user-repository"
    assert model.tolerance == 0.001 and model.traffic == {1: 100.0} and not model.kind.is_text
    assert spec.external_repositories == (user / "user-repository",) and spec.external_models == (EXTERNAL_MODEL,)


@pytest.mark.parametrize("line", ['buckets = [8, 16]', 'workload = "serving.toml"', 'source = "model.onnx"',
                                  'tokenizer = "tokenizer.json"', 'encoder_prefix = "s_"',
                                  'precision = { 1 = "fp32" }'])
def test_keys_of_the_models_the_kit_builds_are_refused(user, line):
    error = spec_error(user, TABLE + line + "\n")
    key = line.split(" ")[0]
    assert f"[models.scorer]: '{key}' applies to kind" in error and "this model is 'external'" in error, error


@pytest.mark.parametrize(("table", "message"), [
    (TABLE.replace('repository = "user-repository"\n', ""), "[models.scorer]: missing 'repository'"),
    (TABLE.replace('"user-repository"', '"nowhere"'), "repository {user}/nowhere is not a folder"),
    (TABLE.replace('model = "user_scorer"', 'model = "ranker"'),
     "[models.scorer]: model 'ranker': no folder {user}/user-repository/ranker in the repository"),
    (TABLE.replace("[models.scorer]", "[models.user_scorer]").replace('model = "user_scorer"\n', ""),
     "[models.user_scorer]: the router 'user_scorer' and the external model it calls cannot share a name"),
    (TABLE.replace("tolerance = 0.001\n", ""), "[models.scorer]: missing 'tolerance': an external model's rollouts"),
    (TABLE + TABLE.replace("[models.scorer]", "[models.scorer2]"),
     "[models.scorer2]: external model 'user_scorer' is also a model of 'scorer'"),
])
def test_each_missing_or_clashing_piece_is_named(user, table, message):
    assert message.format(user=user) in spec_error(user, table)


def test_a_model_folder_without_a_config_is_named(user):
    config_path(user).unlink()
    assert f"{config_path(user)} not found; the kit reads the model's tensors from it" in spec_error(user, TABLE)


def test_the_repository_keys_are_for_external_models_only(user):
    tensor = ('[models.image]\nkind = "tensor"\nsource = "m.onnx"\ntolerance = 0.1\nslo_p95_ms = 100\n'
              'expected_rps = 1\npeak_rps = 1\nmax_request_rows = 1\nmax_router_instances = 1\n'
              'repository = "user-repository"\n')
    assert "[models.image]: 'repository' applies to kind 'external' only; this model is 'tensor'" in \
        spec_error(user, tensor)
    assert "[models.image]: missing 'source'" in spec_error(user, tensor.replace('source = "m.onnx"\n', "").replace(
        'repository = "user-repository"\n', ""))


# --- the user's config ---------------------------------------------------------------------------


def test_the_kit_reads_the_tensors_backend_and_versions_from_the_user_s_config(user):
    external = served_external(spec_of(user).models[0])
    assert external.backend == "python" and external.folders == (1,) and external.text == EXTERNAL_CONFIG
    assert external.tensors.inputs == (TensorSpec("FEATURES", "TYPE_FP32", (16,)),)
    assert external.tensors.outputs == (TensorSpec("SCORES", "TYPE_FP32", (4,)),)


@pytest.mark.parametrize(("old", "new", "message"), [
    ("max_batch_size: 4", "max_batch_size: 0", "max_batch_size is 0: the model has no batch axis"),
    ('backend: "python"', 'backend: "python"\nbogus_field: 1', "not a Triton model config"),
    ('name: "user_scorer"', 'name: "other"', "name 'other' is not its folder's name 'user_scorer'"),
    ("data_type: TYPE_FP32\n    dims: [ 16 ]", "data_type: TYPE_STRING\n    dims: [ 16 ]",
     "input 'FEATURES' of {path}: data type 'TYPE_STRING' is not one of"),
    ("dims: [ 16 ]", "dims: [ -1 ]", "input 'FEATURES' of {path} has dims [-1]; the kit serves an external model"),
    ("dims: [ 16 ]", "dims: [ 16 ]\n    allow_ragged_batch: true", "input 'FEATURES' of {path} is a ragged or shape"),
    ('output [\n  {\n    name: "SCORES"\n    data_type: TYPE_FP32\n    dims: [ 4 ]\n  }\n]\n', "",
     "{path} declares no output"),
])
def test_a_config_the_kit_cannot_front_is_refused_naming_the_file_and_field(user, old, new, message):
    path = config_path(user)
    assert old in EXTERNAL_CONFIG
    path.write_text(EXTERNAL_CONFIG.replace(old, new, 1))
    with pytest.raises(SourceError) as info:
        served_external(spec_of(user).models[0])
    assert str(info.value).startswith("[models.scorer]: ")
    assert message.format(path=path) in str(info.value)


def test_a_spec_version_without_its_folder_is_named(user):
    with pytest.raises(SourceError, match=r"version\(s\) \[2\] of 'user_scorer' have no folder"):
        served_external(spec_of(user, TABLE + "versions = [1, 2]\n").models[0])


# --- gen-config ----------------------------------------------------------------------------------


def gen_config(user: Path, *args: str) -> int:
    return main(["gen-config", *args, "--spec", str(user / "serving.toml"), "--profile", str(user / "cpu.json"),
                 "--model-repository", str(user / "model_repository")])


def test_gen_config_writes_the_batching_fields_into_the_user_s_config_and_nothing_else(user, capsys):
    others = {name: digest for name, digest in digests(user / "user-repository").items() if name.endswith(".py")}
    assert gen_config(user) == 0
    out = capsys.readouterr().out
    assert f"wrote the batching fields of {config_path(user)}" in out and "wrote scorer/config.pbtxt" in out
    merged = config_path(user).read_text()
    header = [line for line in merged.splitlines() if line.startswith(HEADER_PREFIX)]
    assert "max_batch_size, dynamic_batching, instance_group" in header[0]
    assert any(line.startswith(f"{HEADER_PREFIX} max_batch_size: ") and "o + 2·c(b)" in line for line in header)
    user_config, config = parse_config(EXTERNAL_CONFIG, "user"), parse_config(merged, "merged")
    for field in MANAGED_FIELDS:
        config.ClearField(field)
        user_config.ClearField(field)
    assert config == user_config  # backend, tensors, parameters, warm-up: the user's
    merged_config = parse_config(merged, "merged")
    assert merged_config.max_batch_size > 4 and merged_config.dynamic_batching.default_queue_policy.max_queue_size
    assert [(g.kind, g.count) for g in merged_config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 2)]
    assert dict(merged_config.parameters) == dict(parse_config(EXTERNAL_CONFIG, "c").parameters)  # none added
    assert "# model.py multiplies every score by this." in merged  # the user's comments kept
    assert {n: d for n, d in digests(user / "user-repository").items() if n.endswith(".py")} == others
    assert sorted(p.name for p in (user / "model_repository").iterdir()) == ["scorer"]  # no copy of the model
    router = parse_config((user / "model_repository" / "scorer" / "config.pbtxt").read_text(), "router")
    parameters = {key: value.string_value for key, value in router.parameters.items()}
    layout = parse_tensor_router_config("scorer", parameters)
    assert layout.model_for(FIXED_BUCKET) == EXTERNAL_MODEL
    assert layout.bucket_max_batch[FIXED_BUCKET] == merged_config.max_batch_size
    assert [t.name for t in router.input] == ["FEATURES"] and [t.name for t in router.output] == ["SCORES", "VERSION"]


def test_check_sees_drift_of_the_managed_fields_only(user, capsys):
    assert gen_config(user) == 0
    assert gen_config(user, "--check") == 0
    path = config_path(user)
    # The user edits their own fields: not the kit's business.
    path.write_text(path.read_text().replace('string_value: "0.5"', 'string_value: "0.25"') + "# a note\n")
    assert gen_config(user, "--check") == 0
    assert "files match" in capsys.readouterr().out
    text = path.read_text()
    size = parse_config(text, "c").max_batch_size
    path.write_text(text.replace(f"max_batch_size: {size}", "max_batch_size: 3"))
    assert gen_config(user, "--check") == 1
    assert f"{path}: max_batch_size: 3 -> {size}" in capsys.readouterr().err
    assert gen_config(user) == 0  # rewrites the managed fields, keeps the user's edit
    assert 'string_value: "0.25"' in path.read_text() and path.read_text().endswith("# a note\n")
    assert gen_config(user, "--check") == 0


def test_the_external_config_is_not_among_the_kit_s_files(user):
    spec = spec_of(user)
    from tools.spec.profile import load_profile

    plan = plan_all(spec, load_profile(user / "cpu.json"))
    assert [m.name for m in plan] == ["scorer", EXTERNAL_MODEL]  # no express model: the backend is the user's
    assert "linger_regimes: none: the external model user_scorer gets no express model" in plan[0].config_text()
    files = expected_files(plan, user / "model_repository")
    assert all(path.is_relative_to(user / "model_repository") for path in files)
    assert list(external_files(plan)) == [config_path(user)]


def test_a_version_policy_that_would_not_load_a_served_version_is_named(user, capsys):
    shutil.copytree(config_path(user).parent / "1", config_path(user).parent / "2")
    spec_of(user, TABLE + "versions = [1, 2]\n")
    assert gen_config(user) == 2  # the default policy loads only the latest, 2
    err = capsys.readouterr().err
    assert f"{config_path(user)}: version_policy loads version(s) [2] of the folders [1, 2], not [1]" in err
    assert "version_policy: { specific: { versions: [1, 2] } }" in err
    config_path(user).write_text(EXTERNAL_CONFIG + "version_policy: { specific: { versions: [1, 2] } }\n")
    assert gen_config(user) == 0


# --- add-model --external ------------------------------------------------------------------------


def add(user: Path, *args: str) -> int:
    return main(["add-model", *args, "--spec", str(user / "serving.toml"), "--model-repository",
                 str(user / "model_repository")])


def test_add_model_external_writes_the_table_and_the_router_folder_only(user, capsys):
    (user / "serving.toml").write_text(SPEC_HEAD)
    before = digests(user / "user-repository")
    assert add(user, "scorer", "--external", str(user / "user-repository" / EXTERNAL_MODEL), "--slo-ms", "80") == 0
    out = capsys.readouterr().out
    assert "backend 'python', max_batch_size 4" in out
    assert "inputs FEATURES FP32 [16]; outputs SCORES FP32 [4]" in out
    assert "chosen, check it:    tolerance = 0.001" in out and "chosen, check it:    peak_rps = 50" in out
    assert "slo_p95_ms" not in out.split("chosen")[1]  # given, so not chosen
    table = tomllib.loads((user / "serving.toml").read_text())["models"]["scorer"]
    assert table["kind"] == "external" and table["repository"] == "user-repository" and table["model"] == EXTERNAL_MODEL
    assert table["slo_p95_ms"] == 80 and "buckets" not in table and "workload" not in table
    assert digests(user / "user-repository") == before
    assert [str(p.relative_to(user / "model_repository")) for p in (user / "model_repository").rglob("*")
            if p.is_file()] == ["scorer/1/model.py"]
    assert "tensor_router_model" in (user / "model_repository" / "scorer" / "1" / "model.py").read_text()
    load_spec(user / "serving.toml")


@pytest.mark.parametrize(("name", "extra", "message"), [
    ("scorer", ("--buckets", "8,16"), "--buckets do(es) not apply to an external model"),
    ("user_scorer", (), "the router 'user_scorer' and the external model it calls cannot share a name"),
    ("scorer", ("--pooling", "mean"), "--pooling do(es) not apply"),
])
def test_add_model_external_refusals_leave_everything_as_it_was(user, capsys, name, extra, message):
    (user / "serving.toml").write_text(SPEC_HEAD)
    assert add(user, name, "--external", str(user / "user-repository" / EXTERNAL_MODEL), *extra) == 2
    assert message in capsys.readouterr().err
    assert (user / "serving.toml").read_text() == SPEC_HEAD and not list((user / "model_repository").iterdir())


def test_add_model_external_needs_the_model_s_folder_and_config(user, capsys):
    (user / "serving.toml").write_text(SPEC_HEAD)
    assert add(user, "scorer", "--external", str(user / "user-repository" / "nope")) == 2
    assert "is not a folder: --external takes REPOSITORY/MODEL" in capsys.readouterr().err
    config_path(user).unlink()
    assert add(user, "scorer", "--external", str(config_path(user).parent)) == 2
    assert "config.pbtxt not found" in capsys.readouterr().err


def test_add_model_external_version_needs_the_folder_the_user_made(user, capsys):
    model_dir = config_path(user).parent
    assert add(user, "scorer", "--version", "2", "--external", str(model_dir)) == 2
    assert f"{model_dir / '2'} not found: make the version's folder" in capsys.readouterr().err
    shutil.copytree(model_dir / "1", model_dir / "2")
    assert add(user, "scorer", "--version", "2", "--external", str(model_dir)) == 0
    assert "python -m tools rollout scorer --to 2" in capsys.readouterr().out
    model = load_spec(user / "serving.toml").models[0]
    assert model.versions == (1, 2) and model.traffic == {1: 100.0}


# --- the router, the probe, the server, the rollout --------------------------------------------


def router_config(**changes) -> TensorRouterConfig:
    return TensorRouterConfig(inputs=(TensorSpec("FEATURES", "TYPE_FP32", (16,)),),
                              outputs=(TensorSpec("SCORES", "TYPE_FP32", (4,)),),
                              bucket_max_batch={FIXED_BUCKET: 3}, encoder_prefix="scorer_", **changes)


def test_the_router_s_single_bucket_may_be_a_named_model():
    assert router_config().model_for(FIXED_BUCKET) == "scorer_fixed"
    config = router_config(fixed_model=EXTERNAL_MODEL)
    prepared = TensorRouter(config).prepare({"FEATURES": np.zeros((5, 16), np.float32)})
    assert [(c.model_name, len(c.chunk.row_indices)) for c in prepared.chunks] == [(EXTERNAL_MODEL, 3),
                                                                                    (EXTERNAL_MODEL, 2)]
    parameters = TensorRouterParameters(inputs=config.inputs, outputs=config.outputs, bucket_max_batch={0: 3},
                                        fixed_model=EXTERNAL_MODEL).to_parameters()
    assert parse_tensor_router_config("scorer", parameters).model_for(FIXED_BUCKET) == EXTERNAL_MODEL
    with pytest.raises(ValueError, match="fixed_model 'user_scorer' names the one bucket of a model without"):
        TensorRouterConfig(inputs=(TensorSpec("x", "TYPE_FP32", (-1,), 0.0),), outputs=config.outputs,
                           variable_axis=0, bucket_lens=(8,), bucket_max_batch={8: 1}, fixed_model=EXTERNAL_MODEL)


def test_the_probe_loads_the_user_s_config_with_the_probing_fields(user):
    spec = spec_of(user)
    external = served_external(spec.models[0])
    config = probe_external_config(external, EXTERNAL_MODEL, probe_knobs(EXTERNAL_MODEL, MAX_PROBE_BATCH),
                                   spec.hardware["cpu"], 1)
    user_config = parse_config(EXTERNAL_CONFIG, "c")
    assert config.max_batch_size == MAX_PROBE_BATCH and list(config.version_policy.specific.versions) == [1]
    assert [(g.kind, g.count) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 1)]
    assert config.parameters == user_config.parameters and config.model_warmup == user_config.model_warmup
    assert config.backend == "python" and config.input == user_config.input


def test_the_server_serves_the_user_s_repositories_beside_the_kit_s(tmp_path):
    config = ServerConfig(model_repository=Path("/kit/models"), extra_repositories=(Path("/users/a"), Path("/b")))
    command = build_command(config, FAKE_DIST, Path("/backends"))
    assert [part for part in command if part.startswith("--model-repository=")] == [
        "--model-repository=/kit/models", "--model-repository=/users/a", "--model-repository=/b"]
    (tmp_path / "kit").mkdir()
    server = TritonServer(ServerConfig(model_repository=tmp_path / "kit", extra_repositories=(tmp_path / "gone",)),
                          dist=FAKE_DIST)
    with pytest.raises(ServerError, match=f"model repository {tmp_path / 'gone'} does not exist"):
        server.start()


def test_serve_refuses_a_spec_it_cannot_read(tmp_path, capsys):
    assert main(["serve", "--model-control-mode", "none", "--spec", str(tmp_path / "nope.toml"),
                 "--model-repository", str(tmp_path)]) == 2
    assert f"serving spec {tmp_path / 'nope.toml'} not found" in capsys.readouterr().err


def test_a_rollout_plans_on_the_user_s_model_and_its_version_folders(user):
    spec_of(user, TABLE + "versions = [1, 2]\n")
    with pytest.raises(RolloutError, match=f"version 2 has no model folder in {user / 'user-repository'}: "
                                           "user_scorer/2"):
        make_plan(user / "serving.toml", "scorer", user / "model_repository", 2)
    shutil.copytree(config_path(user).parent / "1", config_path(user).parent / "2")
    plan = make_plan(user / "serving.toml", "scorer", user / "model_repository", 2)
    assert plan.encoders == (EXTERNAL_MODEL,) and plan.gates.drift is DriftMeasure.ABS_DIFF
    assert plan.gates.tolerance == 0.001 and plan.baseline == 1
    config_path(user).write_text(EXTERNAL_CONFIG.replace('name: "user_scorer"\n', ""))
    assert read_config(user / "user-repository", EXTERNAL_MODEL).name == EXTERNAL_MODEL  # the folder's name


def test_a_spec_with_external_models_only_has_nothing_to_build(user, capsys):
    before = digests(user / "user-repository")
    assert main(["build-models", "--spec", str(user / "serving.toml"), "--model-repository",
                 str(user / "model_repository")]) == 0
    assert digests(user / "user-repository") == before
    assert "model files ready" in capsys.readouterr().out


def test_parse_spec_resolves_the_repository_against_the_spec_s_folder(user):
    data = tomllib.loads(SPEC_HEAD + TABLE)
    spec = parse_spec(data, user / "serving.toml")
    assert spec.models[0].repository == (user / "user-repository").resolve()


def test_on_a_gpu_the_instances_are_gpu_instances_and_no_backend_parameter_is_written(user):
    from tools.spec.profile import load_profile

    (user / "serving.toml").write_text(SPEC_HEAD.replace("[hardware.cpu]", "[hardware.gpu]").replace(
        "intra_op_threads = 1", "intra_op_threads = 0") + TABLE)
    hardware = Hardware(name="h100", kind="gpu", description="a GPU", cpu_count=16, gpu="NVIDIA H100",
                        details={"intra_op_threads": 0})
    save_profile(LatencyProfile(path=None, sha256="", hardware=hardware, measured_at="2026-01-01T00:00:00Z",
                                models={EXTERNAL_MODEL: ModelProfile(seq_len=0, curve=LatencyCurve(CURVE))},
                                overhead={"scorer": Overhead(p50_ms=1.0, p95_ms=2.0)}), user / "h100.json")
    plan = plan_all(load_spec(user / "serving.toml"), load_profile(user / "h100.json"))
    merged = parse_config(external_files(plan)[config_path(user)], "merged")
    assert [g.kind for g in merged.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
    assert list(merged.parameters) == ["scale"]
