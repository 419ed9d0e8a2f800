"""docs/own-models.md as written: a user's ONNX encoder from `add-model` to a canary rollout.

The walkthrough runs in a scratch serving home (`KIT_HOME`: its own serving.toml,
model_repository/, profiles/ and rollouts/), with the user's files in `my-models/`: a raw
Hugging Face export of a sentence encoder (random weights, a real BERT) and its tokenizer.
`make serve` gets free ports through SERVE_ARGS and the commands that talk to it the same
ports. Answers are checked against the model run in PyTorch with the doc's pooling and prefix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.doc_examples import REPO, run_shown, setup_problem, shell, shown
from tests.user_models import (
    audio_conv_onnx,
    chat_llm_dir,
    cross_encoder_dir,
    external_repository,
    image_classifier_onnx,
    minilm_tokenizer,
    raw_sentence_encoder_onnx,
)
from tools.server.triton_server import free_port

pytestmark = pytest.mark.integration

DOC = "docs/own-models.md"  # `shown` takes it literally below, so the suite can tell which commands run
SPEC = '''# The serving home of the walkthrough: tenants and hardware, no model yet.
profile = "profiles/cpu.json"

[hardware.cpu]
max_instances = 2
intra_op_threads = 1
ort_spinning = false

[tenants.auth]
mode = "off"
'''
FRAMES = """name = "frames"
rows_per_request = 1

[[lengths]]
min_tokens = 5
max_tokens = 64
weight = 1.0
"""


def home(folder: Path) -> Path:
    """A serving home as a user starts one: the spec, the workloads it names, their models."""
    folder.mkdir(parents=True)
    (folder / "serving.toml").write_text(SPEC)
    shutil.copytree(REPO / "loadtest" / "workloads", folder / "loadtest" / "workloads")
    (folder / "model_repository").mkdir()
    models = folder / "my-models"
    encoder = raw_sentence_encoder_onnx(models)
    encoder.rename(models / "encoder.onnx")
    shutil.copy2(models / "encoder.onnx", models / "encoder-v2.onnx")  # the next release: the same graph
    shutil.copy2(minilm_tokenizer(), models / "tokenizer.json")
    return folder


def run(command: str, folder: Path, ports: dict[str, int] | None = None, timeout_s: float = 600) -> str:
    """A command the doc shows (taken with `shown`), run in the serving home as its own."""
    done = run_shown(command, folder, ports, timeout_s=timeout_s, KIT_HOME=str(folder))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_walkthrough_runs_as_written(tmp_path):
    if (problem := setup_problem()) is not None:
        pytest.fail(problem)
    folder = home(tmp_path / "serving-home")
    added = run(shown("docs/own-models.md", "python -m tools add-model search --onnx my-models/encoder.onnx "
                      "--tokenizer my-models/tokenizer.json --pooling cls --query-prefix \"query: \" --buckets "
                      "16,32,64 --slo-ms 150 --peak-rps 40"), folder)
    assert "added search (text-encoder)" in added and "chosen, check it" in added
    spec = tomllib.loads((folder / "serving.toml").read_text())
    assert spec["models"]["search"] == shown_table(), "the table the doc shows is what add-model writes"
    run(shown("docs/own-models.md", "python -m tools profile --model search"), folder)
    assert "search_64" in json.loads((folder / "profiles" / "cpu.json").read_text())["models"]
    run(shown("docs/own-models.md", "python -m tools gen-config"), folder)

    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    serve_args = (f"--http-port={ports['http']} --grpc-port={ports['grpc']} --metrics-port={ports['metrics']} "
                  f"--host=127.0.0.1 --log-file={tmp_path / 'server.log'}")
    argv, env = shell(shown("docs/own-models.md", "make serve"), SERVE_ARGS=serve_args, KIT_HOME=str(folder))
    process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        banner = wait_for_banner(process)
        assert "models   search, search_16, search_32, search_64" in banner, banner
        answer = json.loads(run(shown("docs/own-models.md", "curl -s -X POST localhost:8000/v2/models/search/infer "
                                      "-H 'Content-Type: application/json' -d '{\"inputs\": [{\"name\": \"TEXT\", "
                                      "\"shape\": [1, 1], \"datatype\": \"BYTES\", \"data\": [\"how do I rotate a "
                                      "key\"]}]}'"), folder, ports))
        served = np.array(next(o for o in answer["outputs"] if o["name"] == "EMBEDDING")["data"], dtype=np.float32)
        expected = pytorch_cls(folder / "my-models", "query: how do I rotate a key")
        assert float(served @ expected / (np.linalg.norm(served) * np.linalg.norm(expected))) >= 0.999

        swept = run(shown("docs/own-models.md", "python -m tools sweep --model search --url localhost:8001 --rates "
                          "5,10 --duration 3 --slo-ms 150"), folder, ports)
        assert "10 rps:" in swept and swept.count("errors 0 ") == 2, swept

        run(shown("docs/own-models.md", "python -m tools add-model search --version 2 --onnx "
                  "my-models/encoder-v2.onnx"), folder)
        run(shown("docs/own-models.md", "python -m tools gen-config"), folder)
        with Traffic(ports["http"]) as traffic:
            rolled = run(shown("docs/own-models.md", "python -m tools rollout search --to 2 --steps 50,100 "
                               "--step-seconds 3 --url localhost:8000 --metrics-url localhost:8002/metrics"),
                         folder, ports)
        assert "mean cosine" in rolled, rolled
        assert json.loads((folder / "rollouts" / "search.state.json").read_text())["status"] == "promoted"
        assert traffic.errors == [] and traffic.versions[-1] == 2
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_the_other_kinds_are_added_as_shown(tmp_path):
    folder = home(tmp_path / "serving-home")
    models = folder / "my-models"
    cross_encoder_dir(models)
    audio_conv_onnx(models).rename(models / "audio.onnx")
    image_classifier_onnx(models).rename(models / "image.onnx")
    (models / "frames.toml").write_text(FRAMES)
    run(shown("docs/own-models.md", "python -m tools add-model rerank --hf-dir my-models/cross-encoder --buckets "
              "32,64,128"), folder)
    run(shown("docs/own-models.md", "python -m tools add-model audio --onnx my-models/audio.onnx --buckets 16,64 "
              "--workload my-models/frames.toml --pad features=0 --pad frame_mask=0 --tolerance 0.001"), folder)
    run(shown("docs/own-models.md", "python -m tools add-model image --onnx my-models/image.onnx --tolerance 0.001"),
        folder)
    chat_llm_dir(models)
    run(shown("docs/own-models.md", "python -m tools add-model chat --llm my-models/chat-llm"), folder)
    external_repository(folder).rename(folder / "my-triton-repo")
    before = {path: path.read_bytes() for path in (folder / "my-triton-repo").rglob("*") if path.is_file()}
    run(shown("docs/own-models.md", "python -m tools add-model scorer --external my-triton-repo/user_scorer "
              "--tolerance 0.001"), folder)
    after = {path: path.read_bytes() for path in (folder / "my-triton-repo").rglob("*") if path.is_file()}
    assert after == before  # add-model only reads the user's repository
    tables = tomllib.loads((folder / "serving.toml").read_text())["models"]
    assert (tables["rerank"]["kind"], tables["rerank"]["pairs"]) == ("text-classifier", True)
    assert tables["audio"]["pad"] == {"features": 0.0, "frame_mask": 0.0}
    assert tables["image"]["kind"] == "tensor" and "buckets" not in tables["image"]
    assert tables["scorer"] == {**tables["scorer"], "kind": "external", "model": "user_scorer"}
    assert tomllib.loads((folder / "serving.toml").read_text())["llm_models"]["chat"]["source"] == "my-models/chat-llm"
    assert (folder / "model_repository" / "chat" / "1" / "model.safetensors").is_file()
    assert sorted(p.name for p in (folder / "model_repository").iterdir()) == [
        "audio", "audio_16", "audio_64", "chat", "chat_infer", "image", "image_fixed", "rerank", "rerank_128",
        "rerank_32", "rerank_64", "scorer"]


def shown_table() -> dict:
    """The [models.search] table docs/own-models.md shows."""
    text = (REPO / DOC).read_text()
    start = text.index("```toml\n[models.search]")
    block = text[start + len("```toml\n"):text.index("```", start + 7)]
    return tomllib.loads(block)["models"]["search"]


def wait_for_banner(process: subprocess.Popen) -> str:
    output = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        output.append(line)
        if "Ctrl-C stops the server" in line:
            return "".join(output)
    pytest.fail("make serve did not become ready:\n" + "".join(output))


def pytorch_cls(models: Path, text: str) -> np.ndarray:
    """The encoder's embedding of `text` in PyTorch: the first token's hidden state."""
    import torch
    from transformers import AutoModel, BertTokenizerFast

    model = AutoModel.from_pretrained(str(models / "sentence-encoder")).eval()
    batch = BertTokenizerFast(tokenizer_file=str(models / "tokenizer.json"))([text], return_tensors="pt")
    with torch.no_grad():
        return model(**batch).last_hidden_state[0, 0].numpy()


class Traffic:
    """A client sending one query every 50 ms while a rollout runs, keeping every answer."""

    def __init__(self, http_port: int):
        self.url = f"localhost:{http_port}"
        self.versions: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = httpclient.InferenceServerClient(self.url)
        while not self.stop.is_set():
            tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[b"steady traffic during the rollout"]], dtype=object))
            try:
                self.versions.append(int(client.infer("search", [tensor]).as_numpy("VERSION")[0, 0]))
            except InferenceServerException as err:
                self.errors.append(str(err))
            time.sleep(0.05)
        client.close()

    def __enter__(self) -> Traffic:
        self.thread.start()
        time.sleep(1)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
