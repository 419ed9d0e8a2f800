"""`python -m tools add-model`: a user's ONNX file or Hugging Face folder becomes a spec table
and model folders, without touching anything else, or nothing at all when it cannot be served."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from python_backends.common.artifacts import MANIFEST, verify_artifacts
from tests.unit.test_gen_config import REPO
from tests.user_models import (
    audio_conv_onnx,
    chat_llm_dir,
    cross_encoder_dir,
    image_classifier_onnx,
    minilm_tokenizer,
    raw_sentence_encoder_onnx,
    sentence_encoder_dir,
)
from tools.cli import main
from tools.repository.add_model import (
    AddModelError,
    buckets_up_to,
    describe_hf,
    describe_onnx,
    spec_with_model,
    spec_with_version,
)

SPEC_HEAD = '''# A user's spec: only the tables add-model needs around a model.
[hardware.cpu]
max_instances = 2
intra_op_threads = 1   # one thread per instance

[tenants.auth]
mode = "off"
'''


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user-models")
    return {"raw": raw_sentence_encoder_onnx(folder), "encoder_dir": sentence_encoder_dir(folder),
            "cross_dir": cross_encoder_dir(folder), "image": image_classifier_onnx(folder),
            "audio": audio_conv_onnx(folder)}


@pytest.fixture
def kit(tmp_path):
    """A scratch spec (with a workload beside it) and an empty repository."""
    (tmp_path / "workload.toml").write_text((REPO / "loadtest/workloads/embed_mix.toml").read_text())
    spec = tmp_path / "serving.toml"
    spec.write_text(SPEC_HEAD)
    (tmp_path / "repo").mkdir()
    return tmp_path


def add(kit: Path, *args: str) -> int:
    return main(["add-model", *args, "--spec", str(kit / "serving.toml"), "--model-repository", str(kit / "repo"),
                 "--workload", str(kit / "workload.toml")])


def test_a_raw_onnx_encoder_reads_its_inputs_and_guesses_the_pooling(made):
    described = describe_onnx(made["raw"])
    assert described.table["kind"] == "text-encoder" and described.table["pooling"] == "mean"
    assert described.table["inputs"] == {"ids": "input_ids", "mask": "attention_mask",
                                         "token_types": "token_type_ids"}
    assert any(note.startswith("pooling = 'mean'") for note in described.guessed)
    assert describe_onnx(made["raw"], pooling="cls").table["pooling"] == "cls"


def test_a_hugging_face_cross_encoder_is_a_pair_classifier_with_its_labels(made):
    described = describe_hf(made["cross_dir"])
    assert described.table["kind"] == "text-classifier" and described.table["pairs"] is True
    assert described.table["labels"] == ["irrelevant", "relevant"]
    assert described.table["max_length"] == 512
    encoder = describe_hf(made["encoder_dir"], pooling="cls")
    assert (encoder.table["pooling"], encoder.table["normalize"]) == ("cls", True)


@pytest.mark.parametrize(("which", "options", "message"), [
    ("image", {"kind": "text-encoder"}, r"inputs \['pixel_values'\] are not a text model's .* --kind tensor"),
    ("raw", {"kind": "text-classifier"}, r"a text-classifier answers logits \[rows, labels\]; 'last_hidden_state' is "
                                         r"\[None, None, 128\]"),
    ("raw", {"output": "logits"}, "no output named 'logits'; the graph's outputs: last_hidden_state"),
])
def test_a_graph_add_model_cannot_serve_is_named(made, which, options, message):
    with pytest.raises(AddModelError, match=message):
        describe_onnx(made[which], **options)


def test_any_other_graph_is_a_tensor_model_bucketed_along_its_free_axis(made):
    image = describe_onnx(made["image"])
    assert image.table == {"kind": "tensor", "source": str(made["image"]), "tolerance": 0.001}
    assert image.guessed[0].startswith("kind = 'tensor': inputs ['pixel_values'] are not token ids and a mask")
    audio = describe_onnx(made["audio"], pad={"features": -1.0}, tolerance=0.01)
    assert audio.table["variable_axis"] == 0  # frames: the one free axis after the batch axis
    assert audio.table["pad"] == {"features": -1.0, "frame_mask": 0.0}
    assert audio.table["tolerance"] == 0.01
    assert any(note.startswith("pad = 0.0 for ['frame_mask']") for note in audio.guessed)


def test_a_tensor_model_gets_its_folders_and_no_tokenizer(kit, made, capsys):
    assert add(kit, "audio", "--onnx", str(made["audio"]), "--buckets", "16,64", "--tolerance", "0.01") == 0
    table = tomllib.loads((kit / "serving.toml").read_text())["models"]["audio"]
    assert (table["kind"], table["variable_axis"], table["buckets"]) == ("tensor", 0, [16, 64])
    assert "max_text_bytes" not in table
    assert "tensor_bucket_model" in (kit / "repo" / "audio_16" / "1" / "model.py").read_text()
    assert "tensor_router_model" in (kit / "repo" / "audio" / "1" / "model.py").read_text()
    assert not (kit / "repo" / "audio" / "1" / "tokenizer.json").exists()
    assert add(kit, "image", "--onnx", str(made["image"])) == 0
    assert (kit / "repo" / "image_fixed" / "1" / "model.onnx").is_file()
    assert "workload" not in tomllib.loads((kit / "serving.toml").read_text())["models"]["image"]


def test_derived_buckets_are_written_as_such_and_name_the_bucket_models(kit, made, capsys):
    assert add(kit, "audio", "--onnx", str(made["audio"]), "--buckets", "derived", "--bucket-count", "2",
               "--tolerance", "0.01") == 0
    table = tomllib.loads((kit / "serving.toml").read_text())["models"]["audio"]
    assert (table["buckets"], table["bucket_count"]) == ("derived", 2)
    # The workload (embed_mix) is read when the spec is: two buckets pad its rows least at 48 and 256.
    assert "bucket models audio_48, audio_256" in capsys.readouterr().out
    assert sorted(p.name for p in (kit / "repo").iterdir()) == ["audio", "audio_256", "audio_48"]
    assert (kit / "repo" / "audio_48" / "1" / "model.onnx").is_file()


def test_buckets_are_powers_of_two_up_to_the_model_length():
    assert buckets_up_to(512) == [16, 32, 64, 128, 256]
    assert buckets_up_to(100) == [16, 32, 64]
    assert buckets_up_to(None) == [16, 32, 64, 128, 256]
    assert buckets_up_to(8) == [8]


def test_the_table_goes_in_after_the_others_with_the_comments_kept():
    text = spec_with_model(SPEC_HEAD, "search", {"kind": "text-encoder", "inputs": {"ids": "input_ids"},
                                                  "buckets": [16, 32]}, " search: added")
    assert text.startswith(SPEC_HEAD)  # every comment and value above is as it was
    assert tomllib.loads(text)["models"]["search"] == {"kind": "text-encoder", "inputs": {"ids": "input_ids"},
                                                       "buckets": [16, 32]}
    with pytest.raises(AddModelError, match="a model named 'search' is in the spec already"):
        spec_with_model(text, "search", {}, "")
    versioned = tomllib.loads(spec_with_version(text.replace("[models.search]", "[models.search]\nsource = "
                                                             '"a.onnx"'), "search", 2, "b.onnx"))["models"]["search"]
    assert versioned["source"] == {"1": "a.onnx", "2": "b.onnx"} and versioned["versions"] == [1, 2]
    assert versioned["traffic"] == {"1": 100}  # the new version gets no traffic until a rollout
    with pytest.raises(AddModelError, match="no model 'rerank' to add version 2 to"):
        spec_with_version(text, "rerank", 2, "b.onnx")


def test_add_model_writes_the_spec_and_the_folders_of_that_model_only(kit, made, capsys):
    other = kit / "repo" / "someone_else" / "1"
    other.mkdir(parents=True)
    (other / "model.onnx").write_bytes(b"not ours")
    assert add(kit, "search", "--onnx", str(made["raw"]), "--tokenizer", str(minilm_tokenizer()),
               "--pooling", "cls", "--query-prefix", "query: ", "--buckets", "16,32") == 0
    out = capsys.readouterr().out
    assert "added search (text-encoder)" in out and "bucket models search_16, search_32" in out
    assert "read from the model: inputs = " in out and "chosen, check it:    slo_p95_ms = 200" in out
    assert "next: python -m tools profile --model search" in out
    table = tomllib.loads((kit / "serving.toml").read_text())["models"]["search"]
    assert (table["pooling"], table["query_prefix"], table["buckets"]) == ("cls", "query: ", [16, 32])
    assert Path(table["source"]) == made["raw"].resolve()
    for bucket in ("search_16", "search_32"):
        folder = kit / "repo" / bucket / "1"
        assert (folder / "model.onnx").stat().st_size == made["raw"].stat().st_size
        # A copy (the buckets share it), never a link to the user's file: editing that file in
        # place must not reach the served model without a build.
        assert (folder / "model.onnx").stat().st_ino != made["raw"].stat().st_ino
        verify_artifacts(folder, bucket, required=["model.onnx"])
    assert (kit / "repo" / "search_16" / "1" / "model.onnx").stat().st_ino == \
        (kit / "repo" / "search_32" / "1" / "model.onnx").stat().st_ino
    assert json.loads((kit / "repo" / "search" / "1" / MANIFEST).read_text())["files"].keys() == {"tokenizer.json"}
    assert sorted(p.name for p in (kit / "repo").iterdir()) == ["search", "search_16", "search_32", "someone_else"]
    assert (other / "model.onnx").read_bytes() == b"not ours"

    second = made["raw"].with_name("sentence-encoder-v2.onnx")
    shutil.copy2(made["raw"], second)
    assert add(kit, "search", "--version", "2", "--onnx", str(second)) == 0
    table = tomllib.loads((kit / "serving.toml").read_text())["models"]["search"]
    assert table["versions"] == [1, 2] and table["traffic"] == {"1": 100}
    assert (kit / "repo" / "search_16" / "2" / "model.onnx").is_file()


def test_a_hugging_face_folder_is_exported_into_its_folders(kit, made, capsys):
    assert add(kit, "rerank", "--hf-dir", str(made["cross_dir"]), "--buckets", "32") == 0
    out = capsys.readouterr().out
    assert "exported" in out and "cosine vs PyTorch" in out
    table = tomllib.loads((kit / "serving.toml").read_text())["models"]["rerank"]
    assert table["kind"] == "text-classifier" and table["pairs"] is True
    assert (kit / "repo" / "rerank_32" / "1" / "model.onnx").is_file()
    assert (kit / "repo" / "rerank" / "1" / "tokenizer.json").is_file()


@pytest.mark.parametrize(("args", "message"), [
    (["--onnx", "{image}", "--kind", "text-classifier"], "are not a text model's"),
    (["--onnx", "{audio}"], "needs --buckets (lengths on that axis) and --workload"),
    (["--onnx", "{audio}", "--pad", "frames=0", "--buckets", "16"],
     "--pad names inputs ['frames'] the graph does not have"),
    (["--onnx", "{raw}"], "tokenizer.json not found: name the model's tokenizer.json with --tokenizer"),
    (["--onnx", "{raw}", "--tokenizer", "{tokenizer}", "--pooling", "none"], "has one vector per token"),
    (["--onnx", "{missing}"], "does not exist"),
    (["--hf-dir", "{encoder_dir}", "--kind", "text-classifier"], "is a text-encoder, not a text-classifier"),
    (["--onnx", "{raw}", "--version", "2"], "the spec has no model 'search' to add version 2 to"),
    (["--onnx", "{audio}", "--buckets", "16", "--bucket-count", "2"],
     'bucket_count applies to buckets = "derived" only'),
])
def test_a_model_that_cannot_be_served_leaves_everything_as_it_was(kit, made, capsys, args, message):
    paths = {**{k: str(v) for k, v in made.items()}, "tokenizer": str(minilm_tokenizer()),
             "missing": str(kit / "missing.onnx")}
    before = (kit / "serving.toml").read_text()
    assert add(kit, "search", *(arg.format(**paths) for arg in args)) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error and error.count("\n") == 1
    assert (kit / "serving.toml").read_text() == before
    assert list((kit / "repo").iterdir()) == []


# --- generative models (--llm) ---------------------------------------------------------------


def add_llm(kit: Path, *args: str) -> int:
    return main(["add-model", *args, "--spec", str(kit / "serving.toml"), "--model-repository", str(kit / "repo")])


def test_an_llm_folder_becomes_a_spec_table_and_a_built_engine_model(kit, tmp_path_factory, capsys):
    from python_backends.llm.config import REQUIRED_FILES, EngineConfig
    from python_backends.llm.engine import LLMEngine
    from python_backends.llm.scheduler import SamplingParams

    source = chat_llm_dir(tmp_path_factory.mktemp("llm"))
    assert add_llm(kit, "chat", "--llm", str(source)) == 0
    out = capsys.readouterr().out
    assert "a qwen2 decoder: 2 layers, 2 KV heads of 16" in out and "chosen, check it:    kv_cache_mb" in out
    table = tomllib.loads((kit / "serving.toml").read_text())["llm_models"]["chat"]
    assert table["source"] == str(source) and table["max_model_len"] == 1024 and table["batching"] == "continuous"
    version = kit / "repo" / "chat" / "1"
    verify_artifacts(version, "chat", required=REQUIRED_FILES)  # every file the build wrote, checksummed
    assert "llm_infer_model" in (kit / "repo" / "chat_infer" / "1" / "model.py").read_text()
    llm = LLMEngine.from_dir(version, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=1024, device="cpu"))
    assert llm.tokenizer.stop_token_ids == (1,)
    prompt, _ = llm.prepare(build_chat("t5 t6 t7"))
    assert prompt == [3, 5, 6, 7, 1, 3]  # the model's own chat template
    llm.add("r", prompt, SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=()))
    seq = llm.scheduler.sequence("r")
    while llm.has_work:
        llm.step()
    assert len(seq.output_token_ids) == 4
    # Built once: a build of the spec finds it up to date.
    assert main(["build-models", "--spec", str(kit / "serving.toml"), "--model-repository", str(kit / "repo")]) == 0
    assert "LLM chat: 1 version folder(s) up to date" in capsys.readouterr().out


def build_chat(content: str):
    from python_backends.llm.engine import build_inputs

    return build_inputs(text_input=None, messages=json.dumps([{"role": "user", "content": content}]), max_tokens=4,
                        temperature=None, top_p=None, seed=None, stop=(), stream=True)


@pytest.mark.parametrize(("which", "options", "message"), [
    ("encoder_dir", [], "BertModel is not a decoder-only causal language model"),
    ("raw", [], "--llm takes a Hugging Face folder or a .gguf file"),
    ("encoder_dir", ["--slo-ms", "100"], "--slo-ms do(es) not apply to a generative model"),
])
def test_an_llm_add_model_cannot_serve_is_named_and_nothing_changes(kit, made, which, options, message, capsys):
    before = (kit / "serving.toml").read_text()
    assert add_llm(kit, "chat", "--llm", str(made[which]), *options) == 2
    assert message in capsys.readouterr().err
    assert (kit / "serving.toml").read_text() == before and not any((kit / "repo").iterdir())
