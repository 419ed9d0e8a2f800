"""Canary rollouts against the real tritonserver under steady background load.

The server serves a copy of the repository in explicit model-control mode. Two versions
made for the test stand in for bad releases: one that fails every real request (warm-up
still passes, as a real bug often would) and one too slow for the SLO. Each rollout runs
through the real CLI (`python -m tools rollout`), the good one, `status` and `abort` as
docs/operations.md shows them, in a folder holding the copy as `model_repository/` and the
records as `rollouts/`; the background clients record every answer, so the tests count
exactly what clients saw.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.artifacts import MANIFEST
from python_backends.embed.admission import ADMIT_ALL
from tests import doc_examples
from tests.doc_examples import shown
from tools.paths import DEFAULT_MODEL_REPOSITORY
from tools.server.admin_key import ADMIN_KEY_ENV, admin_headers
from tools.server.triton_server import ModelControlMode, ServerConfig, TritonServer, free_port
from tools.spec.serving import load_spec

from .conftest import EXIT_TIMEOUT_S, LOG_DIR, REPO

SPEC = load_spec()
EMBED = SPEC.models[0]
# The bucket models and the express model, which must load and unload the same versions.
ENCODERS = list(EMBED.bucket_models(DEFAULT_MODEL_REPOSITORY))
# The server's control endpoints are behind a key, as `serve` runs them; the tool gets it from the environment.
ADMIN_KEY = secrets.token_urlsafe(32)
ADMIN_ENV = {**os.environ, ADMIN_KEY_ENV: ADMIN_KEY}

BROKEN = '''import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.adapters.encoder_model import TritonPythonModel as Encoder


class TritonPythonModel(Encoder):
    """Made for the test: fails every request that carries text (warm-up sends none, so it loads)."""

    def execute(self, requests):
        masks = [pb_utils.get_input_tensor_by_name(r, "ATTENTION_MASK").as_numpy() for r in requests]
        if any(np.any(mask) for mask in masks):
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError("injected fault: broken release"))
                    for _ in requests]
        return super().execute(requests)
'''

SLOW = '''import time

from python_backends.adapters.encoder_model import TritonPythonModel as Encoder


class TritonPythonModel(Encoder):
    """Made for the test: right answers, but every batch takes 350 ms more (the SLO is 200 ms)."""

    def execute(self, requests):
        time.sleep(0.35)
        return super().execute(requests)
'''

FAST_STEPS = ["--steps", "10,50,100", "--step-seconds", "3", "--max-step-seconds", "60", "--min-requests", "10",
              "--min-shadow-samples", "5", "--shadow-rate", "0.5", "--drain-timeout", "60"]


def copy_repository(target: Path) -> Path:
    for name in ["embed", *ENCODERS]:
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / name, target / name, copy_function=os.link,
                        ignore=shutil.ignore_patterns("__pycache__", "routing.json"))
    for encoder in ENCODERS:
        for version, source in ((3, BROKEN), (4, SLOW)):
            folder = target / encoder / str(version)
            folder.mkdir()
            (folder / "model.py").write_text(source)
            for name in ("model.onnx", MANIFEST):  # the same graph, verified at load like any version
                os.link(target / encoder / "1" / name, folder / name)
    admit_everything(target / "embed" / "config.pbtxt")
    return target


def admit_everything(config_path: Path) -> None:
    """Turn the router's admission control off in the copy.

    These tests measure rollouts, not overload: their deliberately heavy requests (24 long
    rows pinned to v1, a version 350 ms slower) would otherwise make the router turn the
    background load away as late, which is right under overload (test_overload.py) but would
    hide what the rollout did. The file is a hard link to the real repository's: replace it.
    """
    config = text_format.Parse(config_path.read_text(), mc.ModelConfig())
    config.parameters["admission"].string_value = ADMIT_ALL.to_json()
    config.dynamic_batching.ClearField("default_queue_policy")
    config_path.unlink()
    config_path.write_text(text_format.MessageToString(config))


@pytest.fixture(scope="module")
def canary_server(tmp_path_factory):
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)
    # The folder the shown commands run in: the served copy and the records under the names
    # they have in the kit's root.
    folder = tmp_path_factory.mktemp("rollout")
    repository = copy_repository(folder / "model_repository")
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=("embed", *ENCODERS), admin_key=ADMIN_KEY,
                          exit_timeout_s=EXIT_TIMEOUT_S)
    server = TritonServer(config, log_path=LOG_DIR / "tritonserver-rollout.log")
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        yield server, repository, folder / "rollouts"
    finally:
        server.stop()


@dataclass
class Answer:
    ok: bool
    version: int | None  # the version the response names, or the pinned one
    error: str = ""


def embed_answer(client: httpclient.InferenceServerClient, texts: list[str], pin: int | None) -> Answer:
    """One embed request; the answer names the version that served it, or the error."""
    rows = np.array(texts, dtype=object).reshape(-1, 1)
    tensor = httpclient.InferInput("TEXT", list(rows.shape), "BYTES")
    tensor.set_data_from_numpy(rows)
    try:
        result = client.infer("embed", [tensor], parameters={"version": pin} if pin else None)
        return Answer(True, int(result.as_numpy("VERSION")[0, 0]))
    except Exception as err:  # every failure is an answer to count
        return Answer(False, pin, str(err))


@dataclass
class Load:
    """A client thread sending embed requests at a steady pace and keeping every answer."""

    url: str
    rate: float  # requests per second
    texts: list[str]
    pin: int | None = None
    until: threading.Event = field(default_factory=threading.Event)
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = httpclient.InferenceServerClient(self.url, network_timeout=120)
        next_at = time.monotonic()
        index = 0
        while not self.until.is_set():
            text = self.texts[index % len(self.texts)]
            index += 1
            self.answers.append(embed_answer(client, [text], self.pin))
            next_at += 1.0 / self.rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        client.close()

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.until.set()
        self.thread.join(timeout=120)


TEXTS = [f"steady background traffic, request about topic {i}" for i in range(50)]


def ports(server: TritonServer) -> dict[str, int]:
    return {"http": server.config.http_port, "metrics": server.config.metrics_port}


def run_shown(command: str, server: TritonServer, records: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """A command docs/operations.md shows, in the folder holding the repository and records,
    pointed at the canary server by its ports, with the admin key from the environment."""
    return doc_examples.run_shown(command, records.parent, ports(server), timeout_s=timeout_s,
                                  **{ADMIN_KEY_ENV: ADMIN_KEY})


def rollout(server: TritonServer, repository: Path, records: Path, *args: str) -> tuple[int, dict, str]:
    command = [sys.executable, "-m", "tools", "rollout", "embed", *args,
               "--url", f"127.0.0.1:{server.config.http_port}",
               "--metrics-url", f"127.0.0.1:{server.config.metrics_port}/metrics", "--model-repository",
               str(repository), "--records", str(records)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=ADMIN_ENV)
    return done.returncode, last_record(records), done.stdout + done.stderr


def last_record(records: Path) -> dict:
    state = json.loads((records / "embed.state.json").read_text())
    return json.loads((records.parent / state["record"]).read_text())  # relative to where the tool ran


def loaded(server: TritonServer, model: str) -> set[int]:
    client = httpclient.InferenceServerClient(server.http_url)
    index = client.get_model_repository_index(headers=admin_headers(ADMIN_KEY))
    client.close()
    return {int(entry["version"]) for entry in index if entry["name"] == model and entry.get("state") == "READY"}


def test_the_express_model_rolls_out_with_the_bucket_models(canary_server):
    server, _, _ = canary_server
    assert EMBED.express_name in ENCODERS  # the committed configs have one
    assert loaded(server, EMBED.express_name) == {1, 2}


def test_a_version_that_fails_requests_is_rolled_back_by_the_error_gate(canary_server):
    server, repository, records = canary_server
    with Load(server.http_url, rate=15, texts=TEXTS) as load:
        time.sleep(2)
        code, record, output = rollout(server, repository, records, "--to", "3", *FAST_STEPS)
    assert code == 1, output
    assert record["status"] == "rolled_back", output
    assert "errors gate failed" in record["reason"], record["reason"]
    assert len(record["steps"]) == 1 and record["steps"][0]["percent"] == 10  # pulled at the first step
    failed = [a for a in load.answers if not a.ok]
    assert failed, "the broken version should have failed some canary requests"
    assert all("injected fault" in a.error for a in failed), {a.error for a in failed}
    # Only the canary's share failed: the failures are at most the first step's 10% of the
    # requests sent while the rollout ran, plus the few in flight when the gate tripped.
    assert len(failed) <= 0.10 * len(load.answers) + 3, (len(failed), len(load.answers))
    for encoder in ENCODERS:
        assert loaded(server, encoder) == {1, 2}  # v3 unloaded again
    assert json.loads((repository / "embed" / "routing.json").read_text())["weights"] == {"1": 100.0}


def test_a_version_too_slow_for_the_slo_is_rolled_back_by_the_latency_gate(canary_server):
    server, repository, records = canary_server
    with Load(server.http_url, rate=15, texts=TEXTS) as load:
        time.sleep(2)
        code, record, output = rollout(server, repository, records, "--to", "4", *FAST_STEPS)
    assert code == 1, output
    assert record["status"] == "rolled_back"
    assert "latency gate failed" in record["reason"], record["reason"]
    latency = next(r for r in record["steps"][-1]["readings"] if r["gate"] == "latency")
    assert latency["value"] > latency["limit"] == EMBED.slo_p95_ms
    assert all(a.ok for a in load.answers), [a.error for a in load.answers if not a.ok][:3]
    for encoder in ENCODERS:
        assert loaded(server, encoder) == {1, 2}


def test_rollout_abort_rolls_back_a_running_rollout_and_status_reports_it(canary_server):
    server, repository, records = canary_server
    command = [sys.executable, "-m", "tools", "rollout", "embed", "--to", "4", "--steps", "10,100",
               "--min-requests", "100000", "--max-step-seconds", "300", "--url", f"127.0.0.1:{server.config.http_port}",
               "--metrics-url", f"127.0.0.1:{server.config.metrics_port}/metrics",
               "--model-repository", str(repository), "--records", str(records)]
    state_file = records / "embed.state.json"
    state_file.unlink(missing_ok=True)
    running = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=ADMIN_ENV)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if state_file.is_file() and json.loads(state_file.read_text())["status"].startswith("step"):
                break
            time.sleep(0.5)
        status = run_shown(shown("docs/operations.md", "python -m tools rollout status embed "
                                 "--model-repository model_repository --records rollouts"), server, records, 60)
        assert "rollout v1 -> v4: step 10%" in status.stdout and "(tool running)" in status.stdout, status.stdout
        assert "live split of embed: v1 90%, v4 10%" in status.stdout, status.stdout
        second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, env=ADMIN_ENV)
        assert second.returncode == 2 and "already running" in second.stderr
        aborted = run_shown(shown("docs/operations.md", "python -m tools rollout abort embed "
                                  "--model-repository model_repository --records rollouts"), server, records, 300)
        assert aborted.returncode == 0, aborted.stdout + aborted.stderr
        assert running.wait(timeout=120) == 1
    finally:
        running.kill()
    state = json.loads(state_file.read_text())
    assert state["status"] == "aborted" and "aborted by the operator" in state["reason"]
    for encoder in ENCODERS:
        assert loaded(server, encoder) == {1, 2}
    assert json.loads((repository / "embed" / "routing.json").read_text())["weights"] == {"1": 100.0}


def test_a_good_rollout_completes_with_no_failed_request_and_honours_pins(canary_server):
    server, _, records = canary_server
    long_text = " ".join(["batching long documents through the largest bucket"] * 30)
    state_file = records / "embed.state.json"
    old_answers: list[Answer] = []
    stop_old = threading.Event()

    def send_old_until_draining() -> None:
        # Requests pinned to the old version, back to back, until the tool starts draining it:
        # whatever is in flight then must finish before v1 is unloaded.
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        rows = [long_text] * 48  # long enough to be in flight when draining begins
        while not stop_old.is_set():
            try:
                if json.loads(state_file.read_text()).get("status") in ("draining", "promoted"):
                    break
            except (OSError, ValueError):
                pass
            old_answers.append(embed_answer(client, rows, pin=1))
        client.close()

    state_file.unlink(missing_ok=True)
    # Three senders, so that some v1 request is in flight at any moment, also the one when
    # draining starts (one sender alone may be between two requests then).
    old_threads = [threading.Thread(target=send_old_until_draining, daemon=True) for _ in range(3)]
    with Load(server.http_url, rate=15, texts=TEXTS) as load, \
            Load(server.http_url, rate=3, texts=TEXTS, pin=2) as pinned_new:
        time.sleep(2)
        for thread in old_threads:
            thread.start()
            time.sleep(0.3)
        # The shown rollout's steps: 10% -> 50% -> 100%, 3 s or more each (FAST_STEPS, with the
        # default step and drain limits).
        done = run_shown(shown("docs/operations.md", "python -m tools rollout embed --to 2 --steps 10,50,100 "
                               "--step-seconds 3 --min-requests 10 --min-shadow-samples 5 --shadow-rate 0.5 "
                               "--url localhost:8000 --metrics-url localhost:8002/metrics "
                               "--model-repository model_repository --records rollouts"),
                         server, records, timeout_s=600)
        stop_old.set()
        for thread in old_threads:
            thread.join(timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    record = last_record(records)
    assert record["status"] == "promoted"
    assert [s["percent"] for s in record["steps"]] == [10, 50, 100]
    assert all(s["verdict"] == "pass" for s in record["steps"])
    drift = next(r for r in record["steps"][0]["readings"] if r["gate"] == "drift")
    assert drift["value"] >= 0.98  # INT8 against FP32 on live traffic
    failed = [a.error for a in load.answers + pinned_new.answers + old_answers if not a.ok]
    assert failed == [], failed[:3]
    assert {a.version for a in load.answers} == {1, 2}
    assert pinned_new.answers and {a.version for a in pinned_new.answers} == {2}  # pins win over the split
    assert old_answers and {a.version for a in old_answers} == {1}
    # Unloading waited for the requests still in flight on v1.
    assert record["drain"]["version"] == 1 and not record["drain"]["timed_out"]
    assert record["drain"]["max_inflight_seen"] >= 1, record["drain"]
    for encoder in ENCODERS:
        assert loaded(server, encoder) == {2}
