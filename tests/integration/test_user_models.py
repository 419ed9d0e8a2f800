"""The user's own models on a real tritonserver, from files to a canary rollout.

Four models the kit was not written around, built from installed packages (random weights,
real architectures): a sentence encoder exported as it comes out of Hugging Face (its graph
answers `last_hidden_state`: the backend pools by CLS, with a query prefix), a cross-encoder
scoring text pairs (a Hugging Face folder the kit exports), an image classifier with a fixed
input shape and a 1-D convolutional model over audio frames of any length (tensor models, the
audio one bucketed by its frame count at edges derived from its mix of clip lengths). Each is
added with `add-model`, profiled with `profile --model`, configured by `gen-config` and served;
answers match the same models run in PyTorch or ONNX Runtime, row by row; each is swept, and
the classifier and the two tensor models are rolled from version 1 to 2 under load
(docs/own-models.md's walkthrough, run as written by test_own_model_docs.py, sweeps the encoder
and rolls it out).
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
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.user_models import (
    AUDIO_NUM_FEATURES,
    CROSS_ENCODER_LABELS,
    audio_conv_onnx,
    cross_encoder_dir,
    image_classifier_onnx,
    minilm_tokenizer,
    raw_sentence_encoder_onnx,
)
from tools.server.admin_key import ADMIN_KEY_ENV
from tools.server.triton_server import ModelControlMode, ServerConfig, TritonServer, free_port

from .conftest import EXIT_TIMEOUT_S, LOG_DIR, REPO

pytestmark = pytest.mark.integration

ADMIN_KEY = secrets.token_urlsafe(32)
SPEC = '''# The user's spec: their models only.
profile = "cpu.json"

[hardware.cpu]
max_instances = 2
intra_op_threads = 1
ort_spinning = false

[tenants.auth]
mode = "off"
'''
QUERIES = ["how do I rotate a key", "Triton batches requests by length", "a", "what does the router do " * 6]
FRAMES_MIX = """name = "frames"
description = "audio clips by frame count"
rows_per_request = 1

[[lengths]]
min_tokens = 5
max_tokens = 16
weight = 0.6

[[lengths]]
min_tokens = 17
max_tokens = 64
weight = 0.4
"""
PASSAGES = ["keys rotate without a restart", "buckets keep short inputs fast", "unrelated words here",
            "the router tokenizes and picks the smallest bucket " * 4]


def tools(*args: str, folder: Path, timeout: float = 600,
          where: tuple[str, ...] = ("--spec", "serving.toml", "--model-repository", "model_repository"),
          ) -> subprocess.CompletedProcess:
    """A tools command run in the user's folder, on its spec and repository (`where`)."""
    done = subprocess.run([sys.executable, "-m", "tools", *args, *where], cwd=folder, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, ADMIN_KEY_ENV: ADMIN_KEY, "COLUMNS": "160",
                                                "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A folder as a user would have it: a spec, a repository, their models added, profiled,
    configured; and a server serving them."""
    folder = tmp_path_factory.mktemp("user-kit")
    models = folder / "models"
    encoder_onnx = raw_sentence_encoder_onnx(models)
    cross_dir = cross_encoder_dir(models)
    shutil.copy2(REPO / "loadtest/workloads/embed_mix.toml", folder / "workload.toml")
    (folder / "serving.toml").write_text(SPEC)
    (folder / "model_repository").mkdir()
    common = ("--workload", "workload.toml", "--slo-ms", "300", "--expected-rps", "8", "--peak-rps", "20")
    added = tools("add-model", "search", "--onnx", str(encoder_onnx), "--tokenizer", str(minilm_tokenizer()),
                  "--pooling", "cls", "--query-prefix", "query: ", "--buckets", "16,32,64", *common, folder=folder)
    assert "chosen, check it" in added.stdout
    tools("add-model", "rerank", "--hf-dir", str(cross_dir), "--buckets", "32,64", *common, folder=folder)
    (folder / "frames.toml").write_text(FRAMES_MIX)
    tensor_common = ("--slo-ms", "300", "--expected-rps", "8", "--peak-rps", "20", "--tolerance", "0.001")
    # Edges derived from the frames mix: two buckets pad its clips least at 16 and 64 frames.
    tools("add-model", "audio", "--onnx", str(audio_conv_onnx(models)), "--buckets", "derived", "--bucket-count", "2",
          "--workload", "frames.toml", *tensor_common, folder=folder)
    tools("add-model", "image", "--onnx", str(image_classifier_onnx(models)), *tensor_common, folder=folder)
    # The next release of three of them: version 2 of the same files, no traffic until a rollout moves it.
    tools("add-model", "rerank", "--version", "2", "--hf-dir", str(cross_dir), folder=folder)
    for name, graph in (("audio", "audio-conv.onnx"), ("image", "image-classifier.onnx")):
        shutil.copy2(models / graph, models / f"v2-{graph}")
        tools("add-model", name, "--version", "2", "--onnx", str(models / f"v2-{graph}"), folder=folder)
    tools("profile", "--model", "search", "--model", "rerank", "--model", "audio", "--model", "image",
          "--out", "cpu.json", "--time-per-point", "0.1",
          "--overhead-requests", "20", folder=folder)
    tools("gen-config", folder=folder)
    names = ("search", "search_16", "search_32", "search_64", "rerank", "rerank_32", "rerank_64", "audio", "audio_16",
             "audio_64", "image", "image_fixed")
    config = ServerConfig(model_repository=folder / "model_repository", http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1",
                          model_control_mode=ModelControlMode.EXPLICIT, load_models=names, admin_key=ADMIN_KEY,
                          exit_timeout_s=EXIT_TIMEOUT_S)
    server = TritonServer(config, log_path=LOG_DIR / "tritonserver-user-models.log")
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        yield {"folder": folder, "server": server, "encoder_dir": models / "sentence-encoder", "cross_dir": cross_dir,
               "models": models}
    finally:
        server.stop()


def infer(server: TritonServer, model: str, inputs: dict[str, list[str]], **parameters):
    client = httpclient.InferenceServerClient(server.http_url)
    tensors = []
    for name, rows in inputs.items():
        array = np.array([row.encode() for row in rows], dtype=object).reshape(-1, 1)
        tensors.append(httpclient.InferInput(name, list(array.shape), "BYTES"))
        tensors[-1].set_data_from_numpy(array)
    try:
        return client.infer(model, tensors, parameters=parameters or None)
    finally:
        client.close()


def torch_tokenizer():
    from transformers import BertTokenizerFast

    return BertTokenizerFast(tokenizer_file=str(minilm_tokenizer()))


def test_the_encoder_answers_what_pytorch_answers_with_its_pooling_and_prefix(kit):
    import torch
    from transformers import AutoModel

    served = infer(kit["server"], "search", {"TEXT": QUERIES}).as_numpy("EMBEDDING")
    as_documents = infer(kit["server"], "search", {"TEXT": QUERIES}, input_type="document").as_numpy("EMBEDDING")
    model = AutoModel.from_pretrained(str(kit["encoder_dir"])).eval()
    tokenizer = torch_tokenizer()
    for texts, got in (([f"query: {q}" for q in QUERIES], served), (QUERIES, as_documents)):
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            expected = model(**batch).last_hidden_state[:, 0].numpy()  # CLS pooling, not normalised
        cosines = np.sum(got * expected, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
        assert got.shape == (len(QUERIES), 128)
        assert cosines.min() >= 0.999, cosines
    assert not np.allclose(served, as_documents)  # the prefix is part of what a query means


def test_the_cross_encoder_scores_pairs_as_pytorch_does_and_names_the_label(kit):
    import torch
    from transformers import AutoModelForSequenceClassification

    result = infer(kit["server"], "rerank", {"TEXT": QUERIES, "TEXT_PAIR": PASSAGES})
    logits = result.as_numpy("LOGITS")
    model = AutoModelForSequenceClassification.from_pretrained(str(kit["cross_dir"])).eval()
    batch = torch_tokenizer()(QUERIES, PASSAGES, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-3)
    labels = [label.decode() for label in result.as_numpy("LABEL").reshape(-1)]
    assert labels == [CROSS_ENCODER_LABELS[i] for i in expected.argmax(axis=1)]


@pytest.mark.parametrize(("model", "inputs", "message"), [
    ("search", {"TEXT": ["a"], "TEXT_PAIR": ["b"]}, "expected 1 inputs but got 2 inputs for model 'search'"),
    ("rerank", {"TEXT": ["a", "b"], "TEXT_PAIR": ["c"]}, "input 'TEXT' batch size does not match other inputs"),
    ("rerank", {"TEXT": [" "]}, "TEXT row 0 is empty"),
])
def test_bad_input_gets_a_400_naming_the_input_and_the_server_stays_up(kit, model, inputs, message):
    with pytest.raises(InferenceServerException) as info:
        infer(kit["server"], model, inputs)
    assert info.value.status() == "400", info.value
    assert message in str(info.value)
    assert infer(kit["server"], "rerank", {"TEXT": ["q"], "TEXT_PAIR": ["p"]}).as_numpy("LOGITS").shape == (1, 2)


def infer_tensors(server: TritonServer, model: str, arrays: dict[str, np.ndarray]):
    from tritonclient.utils import np_to_triton_dtype

    client = httpclient.InferenceServerClient(server.http_url)
    tensors = []
    for name, array in arrays.items():
        tensors.append(httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
        tensors[-1].set_data_from_numpy(array)
    try:
        return client.infer(model, tensors)
    finally:
        client.close()


def onnx_run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def clip(frames: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"features": rng.standard_normal((1, frames, AUDIO_NUM_FEATURES)).astype(np.float32),
            "frame_mask": np.ones((1, frames), dtype=np.float32)}


def test_audio_of_any_length_is_bucketed_and_answers_what_it_answers_alone(kit):
    server = kit["server"]
    graph = kit["models"] / "audio-conv.onnx"
    for frames, seed in ((5, 1), (16, 2), (17, 3), (50, 4)):  # buckets 16, 16, 64, 64
        request = clip(frames, seed)
        request = {name: np.repeat(array, 3, axis=0) for name, array in request.items()}  # three rows
        served = infer_tensors(server, "audio", request)
        np.testing.assert_allclose(served.as_numpy("logits"), onnx_run(graph, request), atol=1e-4)
        assert served.as_numpy("VERSION").reshape(-1).tolist() == [1, 1, 1]
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("audio_16")
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] > 0  # the short clips went there


def test_a_fixed_shape_image_model_batches_as_it_is(kit):
    rng = np.random.default_rng(7)
    pixels = rng.standard_normal((5, 3, 64, 64)).astype(np.float32)
    served = infer_tensors(kit["server"], "image", {"pixel_values": pixels}).as_numpy("logits")
    np.testing.assert_allclose(served, onnx_run(kit["models"] / "image-classifier.onnx", {"pixel_values": pixels}),
                               atol=1e-4)


@pytest.mark.parametrize(("model", "arrays", "message"), [
    ("audio", {"features": np.zeros((1, 10, AUDIO_NUM_FEATURES + 1), np.float32),
               "frame_mask": np.ones((1, 10), np.float32)}, "input 'features'"),
    ("audio", {"features": np.zeros((1, 65, AUDIO_NUM_FEATURES), np.float32),
               "frame_mask": np.ones((1, 65), np.float32)}, "the limit is 64"),
    ("audio", {"features": np.zeros((1, 10, AUDIO_NUM_FEATURES), np.float32),
               "frame_mask": np.ones((1, 11), np.float32)}, "inputs disagree on the length of axis 1"),
    ("image", {"pixel_values": np.zeros((1, 3, 32, 32), np.float32)}, "pixel_values"),
])
def test_tensors_of_the_wrong_shape_get_a_400_naming_the_input(kit, model, arrays, message):
    with pytest.raises(InferenceServerException) as info:
        infer_tensors(kit["server"], model, arrays)
    assert info.value.status() == "400", info.value
    assert message in str(info.value)
    assert infer_tensors(kit["server"], "audio", clip(8, 0)).as_numpy("logits").shape == (1, 8)


def test_top_and_explain_name_the_users_models(kit):
    """`top` and `explain` read any model by name: its rate, its buckets and its knobs."""
    server, folder = kit["server"], kit["folder"]
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            infer_tensors(server, "audio", clip(30, 5))
            infer(server, "rerank", {"TEXT": ["q"], "TEXT_PAIR": ["a short passage"]})

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        metrics = f"http://127.0.0.1:{server.config.metrics_port}/metrics"
        top = tools("top", "--once", "--interval", "2", "--metrics-url", metrics, folder=folder, where=())
        explained = tools("explain", "audio", "--window", "4", "--metrics-url", metrics, "--http-url",
                          f"127.0.0.1:{server.config.http_port}", "--spec", "serving.toml", folder=folder, where=())
    finally:
        stop.set()
        thread.join(timeout=30)
    assert "audio_64" in top.stdout and "rerank" in top.stdout, top.stdout
    assert "audio" in explained.stdout and "audio_64" in explained.stdout, explained.stdout


def test_each_model_is_swept_by_what_its_metadata_declares(kit):
    """Texts, text pairs, tensors with a variable axis and fixed-shape tensors: sweep reads what
    a model takes from the server and sends it."""
    server, folder = kit["server"], kit["folder"]
    for model, extra in (("search", ()), ("rerank", ()), ("audio", ("--variable-len", "30")), ("image", ())):
        swept = tools("sweep", "--model", model, "--url", f"127.0.0.1:{server.config.grpc_port}", "--rates", "8",
                      "--duration", "3", "--warmup", "1", "--slo-ms", "300", *extra, folder=folder,
                      where=("--spec", "serving.toml"))
        assert "8 rps:" in swept.stdout and "errors 0 " in swept.stdout, swept.stdout


def test_the_classifier_and_the_tensor_models_roll_out_to_version_2_under_load(kit):
    """Three rollouts at once, each gated by its kind's drift measure (top-1 agreement and logit
    difference for the classifier, the declared tolerance for the tensor models)."""
    server, folder = kit["server"], kit["folder"]
    errors: list[str] = []
    versions: dict[str, list[int]] = {"rerank": [], "audio": [], "image": []}
    stop = threading.Event()
    pixels = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)

    def traffic():
        while not stop.is_set():
            for model, call in (("rerank", lambda: infer(server, "rerank", {"TEXT": ["q"], "TEXT_PAIR": ["p"]})),
                                ("audio", lambda: infer_tensors(server, "audio", clip(20, 1))),
                                ("image", lambda: infer_tensors(server, "image", {"pixel_values": pixels}))):
                try:
                    versions[model].append(int(call().as_numpy("VERSION").reshape(-1)[0]))
                except InferenceServerException as err:
                    errors.append(f"{model}: {err}")
            time.sleep(0.02)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    env = {**os.environ, ADMIN_KEY_ENV: ADMIN_KEY, "PYTHONPATH": str(REPO)}
    try:
        time.sleep(1)
        rollouts = {model: subprocess.Popen(
            [sys.executable, "-m", "tools", "rollout", model, "--to", "2", "--steps", "50,100", "--step-seconds", "3",
             "--max-step-seconds", "60", "--min-requests", "5", "--min-shadow-samples", "3", "--shadow-rate", "0.5",
             "--drain-timeout", "60", "--url", f"127.0.0.1:{server.config.http_port}",
             "--metrics-url", f"127.0.0.1:{server.config.metrics_port}/metrics", "--spec", "serving.toml",
             "--model-repository", "model_repository", "--records", "rollouts"],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for model in versions}
        outputs = {model: process.communicate(timeout=300)[0] for model, process in rollouts.items()}
    finally:
        stop.set()
        thread.join(timeout=60)
    for model, process in rollouts.items():
        assert process.returncode == 0, outputs[model]
        state = json.loads((folder / "rollouts" / f"{model}.state.json").read_text())
        assert state["status"] == "promoted", state
        assert versions[model][-1] == 2
    assert "top-1 agreement" in outputs["rerank"], outputs["rerank"]
    assert "largest absolute difference" in outputs["audio"], outputs["audio"]
    assert errors == [], errors[:3]
