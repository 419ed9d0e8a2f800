"""build-models never overwrites a model file it did not make: `made_here` and `to_build`."""

from __future__ import annotations

import json
import os

from tools.repository.build import BUILD_INFO, link_from_built, made_here, to_build, write_build_info

SOURCE = {"recipe": "r1"}


def built(folder, content=b"graph made by the kit"):
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(content)
    write_build_info(folder, "model.onnx", SOURCE)
    (folder / "MANIFEST.json").write_text("{}")
    return folder


def plan(folders, force=False):
    said = []
    return to_build(tuple(folders), "model.onnx", lambda _: SOURCE, force, said.append), said


def test_a_file_the_build_installed_is_its_own_and_one_put_in_its_place_is_not(tmp_path):
    folder = built(tmp_path / "encoder_32" / "1")
    assert made_here(folder, "model.onnx") is True
    assert made_here(folder, "tokenizer.json") is None  # no such file
    (folder / "model.onnx").write_bytes(b"the user's own graph")
    assert made_here(folder, "model.onnx") is False
    bare = tmp_path / "encoder_64" / "1"
    bare.mkdir(parents=True)
    (bare / "model.onnx").write_bytes(b"a graph with no build record")
    assert made_here(bare, "model.onnx") is False


def test_a_touched_but_identical_file_is_still_the_build_s_and_its_record_is_refreshed(tmp_path):
    folder = built(tmp_path / "encoder_16" / "1")
    os.utime(folder / "model.onnx", ns=(1, 1))
    assert made_here(folder, "model.onnx") is True  # hashed: the same bytes
    assert json.loads((folder / BUILD_INFO).read_text())["mtime_ns"] == 1


def test_a_record_from_before_sizes_were_kept_is_checked_by_hash(tmp_path):
    folder = built(tmp_path / "encoder_16" / "1")
    info = json.loads((folder / BUILD_INFO).read_text())
    del info["size"], info["mtime_ns"]
    (folder / BUILD_INFO).write_text(json.dumps(info))
    assert made_here(folder, "model.onnx") is True
    assert "size" in json.loads((folder / BUILD_INFO).read_text())


def test_the_user_s_file_is_left_and_named_even_with_force_while_stale_and_missing_ones_build(tmp_path):
    mine = built(tmp_path / "encoder_16" / "1")
    users = built(tmp_path / "encoder_32" / "1")
    (users / "model.onnx").write_bytes(b"the user's own graph")
    stale = built(tmp_path / "encoder_64" / "1")
    info = json.loads((stale / BUILD_INFO).read_text())
    info["source"] = {"recipe": "r0"}
    (stale / BUILD_INFO).write_text(json.dumps(info))
    empty = tmp_path / "encoder_128" / "1"
    empty.mkdir(parents=True)

    folders, said = plan([mine, users, stale, empty])
    assert folders == [stale, empty]
    assert said == [f"      left as it is: {users}/model.onnx was not made by build-models (its BUILD_INFO.json "
                    "does not match it); delete it to have the packaged model built there"]
    forced, said = plan([mine, users, stale, empty], force=True)
    assert forced == [mine, stale, empty] and len(said) == 1
    assert (users / "model.onnx").read_bytes() == b"the user's own graph"


def test_a_folder_added_since_the_build_gets_the_built_graph_linked_not_rebuilt(tmp_path):
    # The express model's folder, written by gen-config after the bucket models were built.
    bucket = built(tmp_path / "encoder_16" / "1")
    express = tmp_path / "encoder_express" / "1"
    express.mkdir(parents=True)
    stale, _ = plan([bucket, express])
    said = []
    left = link_from_built({1: (bucket, express)}, {1: stale}, {1: SOURCE}, tmp_path, said.append)
    assert left == {}
    assert os.path.samefile(express / "model.onnx", bucket / "model.onnx")  # the same file, as between buckets
    assert made_here(express, "model.onnx") is True and plan([bucket, express])[0] == []
    assert said == ["      encoder_express/1/model.onnx: linked from encoder_16/1"]
    assert "model.onnx" in json.loads((express / "MANIFEST.json").read_text())["files"]


def test_with_no_built_graph_of_the_version_the_folder_is_left_to_the_build(tmp_path):
    stale_bucket = built(tmp_path / "encoder_16" / "1")
    info = json.loads((stale_bucket / BUILD_INFO).read_text())
    info["source"] = {"recipe": "r0"}
    (stale_bucket / BUILD_INFO).write_text(json.dumps(info))
    express = tmp_path / "encoder_express" / "1"
    express.mkdir(parents=True)
    folders, _ = plan([stale_bucket, express])
    assert link_from_built({1: (stale_bucket, express)}, {1: folders}, {1: SOURCE}, tmp_path, print) == {1: folders}
    assert not (express / "model.onnx").exists()
