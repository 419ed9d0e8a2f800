"""A user's Hugging Face folder: what `inspect_hf_dir` reads from it, the one line each broken
folder gets, and `export_hf`'s graphs, checked here against the same model run in PyTorch
(pooled in the graph, or pooled afterwards as the server pools a raw export)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from python_backends.embed.pooling import Pooling, l2_normalise, pool
from tests.user_models import CROSS_ENCODER_LABELS, cross_encoder_dir, minilm_tokenizer, sentence_encoder_dir
from tools.repository import hf_export
from tools.repository.graph import read_graph
from tools.repository.hf_export import HfExportError, describe_config, export_hf, inspect_hf_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    return {"encoder": sentence_encoder_dir(folder), "classifier": cross_encoder_dir(folder), "folder": folder}


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """A tiny RoBERTa: one token type (no token_type_ids), positions offset past the padding id."""
    from transformers import RobertaConfig, RobertaModel

    folder = tmp_path_factory.mktemp("roberta") / "roberta"
    config = RobertaConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        RobertaModel(config).eval().save_pretrained(str(folder))
    shutil.copyfile(minilm_tokenizer(), folder / "tokenizer.json")
    return folder


def run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def batch(vocab_size=30522, token_types=True):
    """Two lengths: a full row, one padded on the right, one padded on the left."""
    rng = np.random.default_rng(5)
    ids = rng.integers(1000, vocab_size, (3, 20)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, :11] = 0
    ids[mask == 0] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        feeds["token_type_ids"] = np.zeros_like(ids)
    return feeds


def cosines(a, b):
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# --- inspect ---------------------------------------------------------------------------------


def test_an_encoder_folder_is_described_from_its_config(models):
    model = inspect_hf_dir(models["encoder"])
    assert model.model_type == "bert" and model.architectures == ("BertModel",)
    assert model.kind == "text-encoder"
    assert (model.num_labels, model.labels) == (0, ())
    assert model.uses_token_types  # BERT's two token types, as MiniLM has
    assert (model.max_length, model.hidden_size) == (512, 128)
    assert model.tokenizer == models["encoder"] / "tokenizer.json"
    assert model.weights == models["encoder"] / "model.safetensors"


def test_a_classifier_folder_gives_its_label_names_in_id_order(models):
    model = inspect_hf_dir(models["classifier"])
    assert model.kind == "text-classifier" and model.architectures == ("BertForSequenceClassification",)
    assert (model.num_labels, model.labels) == (2, CROSS_ENCODER_LABELS)
    assert model.uses_token_types


def test_roberta_positions_past_the_padding_id_are_not_input_length(roberta_dir):
    model = inspect_hf_dir(roberta_dir)
    assert model.model_type == "roberta"
    assert model.max_length == 66 - 2  # pad_token_id 1: positions 0 and 1 are never a token's
    assert not model.uses_token_types


def config_of(**fields):
    return {"model_type": "bert", "hidden_size": 8, "max_position_embeddings": 32, **fields}


def describe(config):
    return describe_config(Path("/m"), config, Path("/m/tokenizer.json"), Path("/m/model.safetensors"))


def test_default_label_names_are_no_label_names():
    model = describe(config_of(architectures=["BertForSequenceClassification"],
                               id2label={"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}))
    assert (model.kind, model.num_labels, model.labels) == ("text-classifier", 3, ())


def test_other_configs_name_the_width_differently_and_may_lack_token_types():
    model = describe({"model_type": "distilbert", "dim": 48, "architectures": ["DistilBertModel"]})
    assert (model.hidden_size, model.uses_token_types, model.max_length) == (48, False, None)
    assert describe(config_of(architectures=["BertForMaskedLM"])).kind == "text-encoder"


@pytest.mark.parametrize(("config", "message"), [
    (config_of(architectures=["LlamaForCausalLM"]), r"/m/config.json: LlamaForCausalLM generates text, it is not "
                                                    r"an encoder; serve it as an LLM instead"),
    (config_of(architectures=["GPT2LMHeadModel"]), r"GPT2LMHeadModel generates text.*serve it as an LLM"),
    (config_of(is_decoder=True), r"bert decoder generates text"),
    ({"hidden_size": 8}, r"/m/config.json: no model_type"),
    ({"model_type": "bert"}, r"/m/config.json: no hidden_size"),
    (config_of(architectures=["BertForSequenceClassification"], id2label={"0": "a", "2": "b"}),
     r"/m/config.json: id2label has ids \[0, 2\], not 0..1"),
    (config_of(architectures=["BertForSequenceClassification"], id2label={"x": "a"}),
     r"/m/config.json: id2label is not a map of label ids to names"),
])
def test_a_config_the_kit_does_not_export_is_named(config, message):
    with pytest.raises(HfExportError, match=message):
        describe(config)


def broken_copy(source, target, remove=(), write=None):
    shutil.copytree(source, target)
    for name in remove:
        (target / name).unlink()
    for name, content in (write or {}).items():
        (target / name).write_bytes(content)
    return target


def test_each_broken_folder_gets_one_line_naming_the_file(models, tmp_path):
    encoder = models["encoder"]
    cases = [
        (tmp_path / "nowhere", r"nowhere: not a directory"),
        (encoder / "config.json", r"config.json: not a directory"),
        (broken_copy(encoder, tmp_path / "a", remove=["config.json"]), r"/a: no config.json"),
        (broken_copy(encoder, tmp_path / "b", write={"config.json": b"{not json"}), r"/b/config.json: not JSON"),
        (broken_copy(encoder, tmp_path / "c", write={"config.json": b"[1, 2]"}), r"/c/config.json: not a JSON object"),
        (broken_copy(encoder, tmp_path / "d", remove=["tokenizer.json"]),
         r"/d: no tokenizer.json; the kit needs the fast tokenizer file"),
        (broken_copy(encoder, tmp_path / "e", remove=["model.safetensors"], write={"pytorch_model.bin": b"x"}),
         r"/e: no model.safetensors \(pytorch_model.bin is not read\); convert the weights with "
         r"model.save_pretrained\(folder, safe_serialization=True\)"),
        (broken_copy(encoder, tmp_path / "f", remove=["model.safetensors"]),
         r"/f: no model.safetensors \(no weights file\)"),
    ]
    for folder, message in cases:
        with pytest.raises(HfExportError, match=message) as caught:
            inspect_hf_dir(folder)
        assert "\n" not in str(caught.value)


def test_sharded_safetensors_are_found_by_their_index(models, tmp_path):
    folder = broken_copy(models["encoder"], tmp_path / "sharded", remove=["model.safetensors"],
                         write={"model.safetensors.index.json": b'{"weight_map": {}}'})
    assert inspect_hf_dir(folder).weights == folder / "model.safetensors.index.json"


# --- export ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(models):
    """The encoder's hidden states and the classifier's logits in PyTorch, on `batch()`."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    feeds = {name: torch.from_numpy(array) for name, array in batch().items()}
    encoder = AutoModel.from_pretrained(str(models["encoder"]), attn_implementation="eager").eval()
    classifier = AutoModelForSequenceClassification.from_pretrained(str(models["classifier"])).eval()
    with torch.no_grad():
        return {"hidden": encoder(**feeds).last_hidden_state.numpy(), "logits": classifier(**feeds).logits.numpy()}


@pytest.fixture(scope="module")
def raw_export(models):
    out = models["folder"] / "raw.onnx"
    return out, export_hf(models["encoder"], out)


def test_a_raw_export_gives_the_hidden_states_pytorch_gives(raw_export, reference):
    out, check = raw_export
    assert check.output_name == "last_hidden_state" and check.worst_cosine >= 0.9999
    graph = read_graph(out)
    assert [t.name for t in graph.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [(t.name, t.shape) for t in graph.outputs] == [("last_hidden_state", (None, None, 128))]
    assert all(t.shape == (None, None) for t in graph.inputs)
    hidden = run(out, batch())
    assert hidden.shape == reference["hidden"].shape
    assert cosines(hidden, reference["hidden"]).min() >= 0.9999


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", False), ("cls", False), ("last", True)])
def test_pooling_folded_into_the_graph_is_the_server_s_pooling(models, raw_export, pooling, normalize):
    out = models["folder"] / f"{pooling}.onnx"
    check = export_hf(models["encoder"], out, pooling=pooling, normalize=normalize)
    assert check.output_name == "embedding" and check.worst_cosine >= 0.9999
    assert [(t.name, t.shape) for t in read_graph(out).outputs] == [("embedding", (None, 128))]
    feeds = batch()
    embedding = run(out, feeds)
    # The raw graph pooled the way the server pools it (either padding side for `last`).
    served = pool(run(raw_export[0], feeds), feeds["attention_mask"], Pooling(pooling))
    if normalize:
        served = l2_normalise(served)
        np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, rtol=1e-5)
    assert cosines(embedding, served).min() >= 0.9999
    np.testing.assert_allclose(embedding, served, atol=1e-4)


def test_a_classifier_exports_its_logits(models, reference, tmp_path):
    out = tmp_path / "cross.onnx"
    check = export_hf(models["classifier"], out)
    assert check.output_name == "logits" and check.max_abs_diff <= 1e-3
    graph = read_graph(out)
    assert [t.name for t in graph.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [(t.name, t.shape) for t in graph.outputs] == [("logits", (None, 2))]
    np.testing.assert_allclose(run(out, batch()), reference["logits"], atol=1e-4)


def test_token_type_ids_are_an_input_only_when_the_model_uses_them(roberta_dir, tmp_path):
    out = tmp_path / "roberta.onnx"
    check = export_hf(roberta_dir, out, pooling="mean")
    assert check.worst_cosine >= 0.9999
    assert [t.name for t in read_graph(out).inputs] == ["input_ids", "attention_mask"]


def test_a_single_text_encoder_is_exported_without_token_types_and_sees_type_zero(models, tmp_path):
    """What build-models does for an encoder of single texts: no third input; the graph answers
    what the model answers with token type ids of zero."""
    out = tmp_path / "single.onnx"
    export_hf(models["encoder"], out, pooling="mean", token_types=False)
    assert [t.name for t in read_graph(out).inputs] == ["input_ids", "attention_mask"]
    feeds = batch()
    with_types = models["folder"] / "mean-types.onnx"
    export_hf(models["encoder"], with_types, pooling="mean")
    zeros = {**feeds, "token_type_ids": np.zeros_like(feeds["input_ids"])}
    np.testing.assert_allclose(run(out, {k: v for k, v in feeds.items() if k != "token_type_ids"}),
                               run(with_types, zeros), atol=1e-5)


def test_token_types_are_refused_for_a_model_with_one_type(roberta_dir, tmp_path):
    with pytest.raises(HfExportError, match="has one token type"):
        export_hf(roberta_dir, tmp_path / "x.onnx", pooling="mean", token_types=True)


@pytest.mark.parametrize(("which", "options", "message"), [
    ("encoder", {"pooling": "max"}, r"unknown pooling 'max'; one of: mean, cls, last, or None"),
    ("encoder", {"pooling": "none"}, r"unknown pooling 'none'"),
    ("encoder", {"normalize": True}, r"normalize needs a pooling"),
    ("classifier", {"pooling": "cls"}, r"BertForSequenceClassification\) outputs logits; pooling and normalize "
                                       r"apply to encoders only"),
])
def test_options_that_do_not_fit_the_model_are_refused(models, tmp_path, which, options, message):
    with pytest.raises(HfExportError, match=message):
        export_hf(models[which], tmp_path / "x.onnx", **options)
    assert list(tmp_path.iterdir()) == []


def test_weights_transformers_cannot_read_are_named(models, tmp_path):
    folder = broken_copy(models["encoder"], tmp_path / "bad", write={"model.safetensors": b"garbage" * 10})
    with pytest.raises(HfExportError, match=r"/bad: transformers cannot load the model: "):
        export_hf(folder, tmp_path / "x.onnx")
    config = json.loads((models["encoder"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "my-own"}))
    with pytest.raises(HfExportError, match=r"transformers cannot load the model: .*model type `my-own`"):
        export_hf(folder, tmp_path / "x.onnx")


@pytest.mark.parametrize(("which", "bound", "value", "message"), [
    ("encoder", "MIN_EXPORT_COSINE", 1.5, r"disagrees with PyTorch \(cosine 1.000000 < 1.5\); nothing written"),
    ("classifier", "MAX_LOGIT_DIFF", -1.0, r"disagrees with PyTorch \(largest logit difference .* > -1.0\)"),
])
def test_a_graph_that_fails_its_check_is_not_left_behind(models, tmp_path, monkeypatch, which, bound, value,
                                                         message):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the user's previous file")
    monkeypatch.setattr(hf_export, bound, value)
    with pytest.raises(HfExportError, match=message):
        export_hf(models[which], out)
    assert out.read_bytes() == b"the user's previous file"
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]  # no staging file left


def test_a_model_torch_onnx_cannot_export_is_named(models, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise torch.onnx.OnnxExporterError("Exporting the operator 'aten::frobnicate' to ONNX "
                                           "opset version 17 is not supported.\nPlease open a bug")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    with pytest.raises(HfExportError, match=r"sentence-encoder: torch.onnx cannot export the model: Exporting the "
                                            r"operator 'aten::frobnicate' to ONNX opset version 17 is not supported.$"):
        export_hf(models["encoder"], tmp_path / "x.onnx")
    assert list(tmp_path.iterdir()) == []
