"""Model file checksums: the manifest the build writes and the check each model runs before loading."""

from __future__ import annotations

import json

import pytest

from python_backends.common.artifacts import (
    MANIFEST,
    ArtifactError,
    file_sha256,
    find_mismatches,
    make_manifest,
    parse_manifest,
    verify_artifacts,
    write_manifest,
)

A, B = "a" * 64, "b" * 64


@pytest.fixture
def built(tmp_path):
    folder = tmp_path / "encoder_16" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"\x08\x07onnx graph bytes" * 1000)
    (folder / "tokenizer.json").write_text('{"vocab": {}}')
    write_manifest(folder, ["model.onnx", "tokenizer.json"])
    return folder


def test_the_manifest_records_the_sha256_of_each_file(built):
    manifest = json.loads((built / MANIFEST).read_text())
    assert manifest == make_manifest(built, ["tokenizer.json", "model.onnx"])
    assert manifest["algorithm"] == "sha256"
    assert manifest["files"]["model.onnx"] == file_sha256(built / "model.onnx")
    assert len(manifest["files"]["tokenizer.json"]) == 64


def test_untouched_files_verify(built):
    verify_artifacts(built, "encoder_16", required=["model.onnx"])


def test_a_changed_byte_is_refused_naming_the_model_version_and_file(built):
    data = bytearray((built / "model.onnx").read_bytes())
    data[100] ^= 0x01
    (built / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as error:
        verify_artifacts(built, "encoder_16", required=["model.onnx"])
    message = str(error.value)
    assert message.startswith("model 'encoder_16' version 1: refusing to load: model.onnx does not match its "
                              "checksum in MANIFEST.json")
    assert "tokenizer.json" not in message  # only the file that changed is named
    assert "build-models --force" in message


def test_a_missing_listed_file_and_an_unlisted_required_one_are_refused(built):
    (built / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"tokenizer.json is listed in MANIFEST.json but missing"):
        verify_artifacts(built, "encoder_16", required=["model.onnx"])
    write_manifest(built, ["model.onnx"])
    with pytest.raises(ArtifactError, match=r"config.json is needed but MANIFEST.json does not list it"):
        verify_artifacts(built, "encoder_16", required=["model.onnx", "config.json"])


def test_a_folder_without_a_manifest_cannot_be_verified(built):
    (built / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=r"no MANIFEST.json beside the model files.*build-models"):
        verify_artifacts(built, "encoder_16", required=["model.onnx"])


@pytest.mark.parametrize("raw, message", [
    ("not json", "not valid JSON"),
    ('{"algorithm": "md5", "files": {}}', "must be"),
    ('{"algorithm": "sha256", "files": []}', "must be"),
    ('["sha256"]', "must be"),
    ('{"algorithm": "sha256", "files": {"model.onnx": "abc"}}', "no valid sha256 for model.onnx"),
    ('{"algorithm": "sha256", "files": {"model.onnx": "' + "A" * 64 + '"}}', "no valid sha256"),
    ('{"algorithm": "sha256", "files": {"../other/model.onnx": "' + A + '"}}', "not a file of this folder"),
])
def test_a_malformed_manifest_is_refused(raw, message):
    with pytest.raises(ArtifactError, match=message):
        parse_manifest(raw, "model 'x' version 1")


def test_mismatches_are_listed_in_file_order_one_sentence_each():
    problems = find_mismatches({"b.bin": B, "a.bin": A, "c.bin": A}, {"a.bin": A, "b.bin": A, "c.bin": None},
                               required=["a.bin", "z.bin"])
    assert problems == ["z.bin is needed but MANIFEST.json does not list it",
                        "b.bin does not match its checksum in MANIFEST.json (sha256 bbbbbbbbbbbb... expected, "
                        "aaaaaaaaaaaa... found)",
                        "c.bin is listed in MANIFEST.json but missing"]
    assert find_mismatches({"a.bin": A}, {"a.bin": A}, required=["a.bin"]) == []
