"""A model of the user's own Triton repository, served behind the kit's router on a real server.

The user's repository holds `user_scorer` (python backend, a hand-written config.pbtxt with
comments, a `parameters` entry its model.py reads, a warm-up). It is added with `add-model
--external` (which only reads it), profiled through the server with `profile --model`, given
the kit's batching fields by `gen-config` (everything else in the file stays byte for byte) and
served by `tools serve`, which serves the user's repository beside the kit's. Answers through
the router are the model's own; a request of the wrong shape gets a 400 naming the input; a
copy of version 1 as version 2 is rolled out with the real `rollout` command under load.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.user_models import (
    EXTERNAL_CONFIG,
    EXTERNAL_MODEL,
    EXTERNAL_NUM_FEATURES,
    external_repository,
    external_scores,
)
from tools.repository.external import HEADER_PREFIX, MANAGED_FIELDS, parse_config
from tools.server.admin_key import ADMIN_KEY_ENV
from tools.server.control import ServerControl
from tools.server.triton_server import free_port

from .conftest import LOG_DIR, REPO

pytestmark = pytest.mark.integration

ADMIN_KEY = secrets.token_urlsafe(32)
ROUTER = "scorer"
SPEC = '''# The user's spec: their own Triton model behind the kit's router.
profile = "cpu.json"

[hardware.cpu]
max_instances = 2
intra_op_threads = 1
ort_spinning = false

[tenants.auth]
mode = "off"
'''


def tools(*args: str, folder: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A tools command run in the user's folder, on its spec and repository."""
    where = ("--spec", "serving.toml", "--model-repository", "model_repository")
    done = subprocess.run([sys.executable, "-m", "tools", *args, *where], cwd=folder, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, ADMIN_KEY_ENV: ADMIN_KEY, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The user's folder: their repository, a spec, the kit's repository with the router; the
    model added, profiled and configured; `tools serve` serving both repositories."""
    folder = tmp_path_factory.mktemp("external-kit")
    user_repository = external_repository(folder)
    (folder / "serving.toml").write_text(SPEC)
    (folder / "model_repository").mkdir()
    before = digests(user_repository)
    added = tools("add-model", ROUTER, "--external", f"user-repository/{EXTERNAL_MODEL}", "--slo-ms", "200",
                  "--expected-rps", "20", "--peak-rps", "50", folder=folder)
    added_untouched = digests(user_repository) == before
    profiled = tools("profile", "--model", ROUTER, "--out", "cpu.json", "--time-per-point", "0.2",
                     "--overhead-requests", "20", folder=folder)
    generated = tools("gen-config", folder=folder)
    checked = tools("gen-config", "--check", folder=folder)
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = open(LOG_DIR / "tritonserver-external.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", "--spec", "serving.toml", "--model-repository", "model_repository",
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
         "--host", "127.0.0.1"],
        cwd=folder, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, ADMIN_KEY_ENV: ADMIN_KEY,
                                                             "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 180
        while not ServerControl(f"127.0.0.1:{http_port}", timeout_s=2).is_server_ready():
            assert server.poll() is None and time.monotonic() < deadline, (LOG_DIR / "tritonserver-external.log"
                                                                           ).read_text()[-3000:]
            time.sleep(0.5)
        yield {"folder": folder, "repository": user_repository, "added": added.stdout, "profiled": profiled.stdout,
               "added_untouched": added_untouched, "generated": generated.stdout, "checked": checked.stdout,
               "http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}",
               "metrics": f"127.0.0.1:{metrics_port}/metrics"}
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def score(kit, features: np.ndarray):
    client = httpclient.InferenceServerClient(kit["http"])
    tensor = httpclient.InferInput("FEATURES", list(features.shape), "FP32" if features.dtype == np.float32 else
                                   "FP64")
    tensor.set_data_from_numpy(features)
    try:
        return client.infer(ROUTER, [tensor])
    finally:
        client.close()


def test_add_model_reads_the_user_s_model_and_writes_none_of_its_files(kit):
    assert "FEATURES FP32 [16]" in kit["added"] and "SCORES FP32 [4]" in kit["added"]
    assert "backend 'python'" in kit["added"] and "chosen, check it:    tolerance = 0.001" in kit["added"]
    assert kit["added_untouched"]
    assert (kit["folder"] / "model_repository" / ROUTER / "1" / "model.py").is_file()
    assert not (kit["folder"] / "model_repository" / EXTERNAL_MODEL).exists()
    assert f"{EXTERNAL_MODEL}    c(b) ms  1:" in kit["profiled"]
    assert f"{ROUTER}: router overhead" in kit["profiled"]


def test_gen_config_writes_only_the_batching_fields_and_keeps_every_other_byte(kit):
    path = kit["repository"] / EXTERNAL_MODEL / "config.pbtxt"
    merged = path.read_text()
    assert f"wrote the batching fields of {path}" in kit["generated"]
    assert "3 files match" in kit["checked"]
    header = [line for line in merged.splitlines() if line.startswith(HEADER_PREFIX)]
    assert header and merged.startswith(header[0]) and "gen-config" in header[0]
    body = merged.splitlines()[len(header):]
    # Lines the merge took out of the user's text are its managed fields; lines it put in are
    # the derived managed fields, nothing else. (The values are the derivation's from the
    # measured curve, which `gen-config --check` re-derives: for this model, whose compute is
    # a fraction of a millisecond at any batch, they follow the noise of a short profile.)
    managed_lines = {"max_batch_size: 4", "instance_group [ { kind: KIND_CPU, count: 1 } ]"}
    removed, inserted = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=EXTERNAL_CONFIG.splitlines(), b=body,
                                                        autojunk=False).get_opcodes():
        removed += EXTERNAL_CONFIG.splitlines()[i1:i2] if tag in ("delete", "replace") else []
        inserted += body[j1:j2] if tag in ("insert", "replace") else []
    assert removed and set(removed) <= managed_lines, removed
    derived = parse_config("\n".join(inserted), "inserted")
    assert {field.name for field, _ in derived.ListFields()} <= set(MANAGED_FIELDS)
    # The user wrote no batcher and one instance; the derivation adds one and a lane each.
    assert derived.dynamic_batching.default_queue_policy.max_queue_size > 0
    assert [group.count for group in derived.instance_group] == [2]
    config, original = parse_config(merged, str(path)), parse_config(EXTERNAL_CONFIG, "the user's")
    assert config.max_batch_size >= 1 and config.parameters["scale"].string_value == "0.5"
    for message in (config, original):
        for name in MANAGED_FIELDS:
            message.ClearField(name)
    assert config == original  # every other field as the user wrote it


def test_answers_through_the_router_are_the_model_s_own(kit):
    features = np.random.default_rng(3).standard_normal((5, EXTERNAL_NUM_FEATURES)).astype(np.float32)
    result = score(kit, features)
    np.testing.assert_allclose(result.as_numpy("SCORES"), external_scores(features), rtol=1e-5, atol=1e-6)
    assert result.as_numpy("VERSION").reshape(-1).tolist() == [1] * 5
    stats = httpclient.InferenceServerClient(kit["http"]).get_inference_statistics(EXTERNAL_MODEL)
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] > 0  # served by the user's model


@pytest.mark.parametrize(("features", "message"), [
    (np.zeros((2, EXTERNAL_NUM_FEATURES - 1), np.float32), "input 'FEATURES'"),  # checked by Triton: the
    (np.zeros((2, EXTERNAL_NUM_FEATURES), np.float64), "input 'FEATURES'"),  # router declares the config's
])
def test_a_request_of_the_wrong_shape_or_type_gets_a_400_naming_the_input(kit, features, message):
    with pytest.raises(InferenceServerException) as info:
        score(kit, features)
    assert info.value.status() == "400", info.value
    assert message in str(info.value)
    assert score(kit, np.ones((1, EXTERNAL_NUM_FEATURES), np.float32)).as_numpy("SCORES").shape == (1, 4)


def test_the_router_is_swept_with_the_tensors_its_metadata_declares(kit):
    done = subprocess.run([sys.executable, "-m", "tools", "sweep", "--model", ROUTER, "--url", kit["grpc"], "--rates",
                           "8", "--duration", "3", "--warmup", "1", "--slo-ms", "200", "--spec", "serving.toml"],
                          cwd=kit["folder"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8 rps:" in done.stdout and "errors 0 " in done.stdout, done.stdout
    assert EXTERNAL_MODEL in done.stdout  # its statistics are read beside the router's


def test_a_copy_of_version_1_rolls_out_as_version_2_under_load(kit):
    folder, model_dir = kit["folder"], kit["repository"] / EXTERNAL_MODEL
    shutil.copytree(model_dir / "1", model_dir / "2")
    config_before = (model_dir / "config.pbtxt").read_text()
    tools("add-model", ROUTER, "--version", "2", "--external", f"user-repository/{EXTERNAL_MODEL}", folder=folder)
    answers: list[str] = []
    stop = threading.Event()

    def load():
        features = np.ones((1, EXTERNAL_NUM_FEATURES), np.float32)
        while not stop.is_set():
            try:
                answers.append(str(score(kit, features).as_numpy("VERSION")[0, 0]))
            except InferenceServerException as err:
                answers.append(f"error: {err}")
            time.sleep(0.05)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        time.sleep(1)
        done = subprocess.run(
            [sys.executable, "-m", "tools", "rollout", ROUTER, "--to", "2", "--steps", "50,100", "--step-seconds", "3",
             "--max-step-seconds", "60", "--min-requests", "10", "--min-shadow-samples", "5", "--shadow-rate", "0.5",
             "--drain-timeout", "60", "--url", kit["http"], "--metrics-url", kit["metrics"],
             "--spec", "serving.toml", "--model-repository", "model_repository", "--records", "rollouts"],
            cwd=folder, capture_output=True, text=True, timeout=300,
            env={**os.environ, ADMIN_KEY_ENV: ADMIN_KEY, "PYTHONPATH": str(REPO)})
    finally:
        stop.set()
        thread.join(timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "largest absolute difference vs v1 <= 0.001" in done.stdout  # a tensor model's drift gate
    errors = [a for a in answers if a.startswith("error")]
    assert not errors, errors[:3]
    assert answers[-1] == "2"
    state = json.loads((folder / "rollouts" / f"{ROUTER}.state.json").read_text())
    assert state["status"] == "promoted", state
    assert (model_dir / "config.pbtxt").read_text() == config_before  # the rollout loads versions, writes nothing
