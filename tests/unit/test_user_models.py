"""The suite's proof models (tests/user_models.py) are what they say: graphs with the inputs and
outputs the issue names and a free batch axis, the same answers as the PyTorch modules they were
exported from, an audio model that padding does not move, an external Triton model whose
model.py stands alone, and the same bytes every time they are built."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tokenizers import Tokenizer
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.buckets import pad_rows
from python_backends.embed.pooling import Pooling, pool
from tests import user_models
from tests.fakes.pb_utils import FakeTriton, Request
from tools.repository.external import merge_managed, parse_config
from tools.repository.graph import read_graph
from tools.repository.hf_export import inspect_hf_dir

BUILDERS = (user_models.raw_sentence_encoder_onnx, user_models.cross_encoder_onnx,
            user_models.image_classifier_onnx, user_models.audio_conv_onnx, user_models.external_repository)


def build_all(folder):
    return {builder.__name__: builder(folder) for builder in BUILDERS}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_models")
    return {**build_all(folder), "folder": folder}


def run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def signature(path):
    graph = read_graph(path)
    assert graph.batch_axis_is_free()
    graph.verify_batchable()
    return ([(t.name, t.type_name, t.shape) for t in graph.inputs],
            [(t.name, t.type_name, t.shape) for t in graph.outputs])


def test_building_twice_gives_the_same_bytes(built, tmp_path):
    again = build_all(tmp_path)
    assert set(again) == set(built) - {"folder"}

    def digests(root):
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    first = digests(built["folder"])
    assert first == digests(tmp_path)
    assert "sentence-encoder/model.safetensors" in first and "user-repository/user_scorer/1/model.py" in first


def test_builders_leave_torch_s_random_state_as_it_was(tmp_path):
    state = torch.random.get_rng_state()
    user_models.audio_conv_onnx(tmp_path)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_minilm_tokenizer_is_found():
    tokenizer = Tokenizer.from_file(str(user_models.minilm_tokenizer()))
    assert tokenizer.get_vocab_size() == 30522


# --- 1. the raw sentence encoder ---------------------------------------------------------------


def test_the_sentence_encoder_folder_is_a_hugging_face_model(built):
    folder = built["folder"] / "sentence-encoder"
    for name in ("config.json", "model.safetensors", *user_models.MINILM_TOKENIZER_FILES):
        assert (folder / name).is_file(), name
    model = inspect_hf_dir(folder)
    assert (model.kind, model.architectures, model.hidden_size) == ("text-encoder", ("BertModel",), 128)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 4


def test_the_raw_sentence_encoder_graph_leaves_pooling_to_the_server(built):
    inputs, outputs = signature(built["raw_sentence_encoder_onnx"])
    assert inputs == [("input_ids", "TYPE_INT64", (None, None)), ("attention_mask", "TYPE_INT64", (None, None)),
                      ("token_type_ids", "TYPE_INT64", (None, None))]
    assert outputs == [("last_hidden_state", "TYPE_FP32", (None, None, 128))]


def test_cls_pooled_raw_export_matches_pytorch_on_prefixed_queries(built):
    from transformers import AutoModel

    folder = built["folder"] / "sentence-encoder"
    tokenizer = TextTokenizer.from_file(folder / "tokenizer.json")
    texts = [f"query: {text}" for text in ("how do I reset my password?", "a",
                                          "which GPU serves the most requests per second at a 200 ms SLO?")]
    ids, mask = pad_rows(tokenizer.encode(texts), 32, tokenizer.pad_id)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    served = pool(run(built["raw_sentence_encoder_onnx"], feeds), mask, Pooling.CLS)
    encoder = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        reference = encoder(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state[:, 0].numpy()
    cosine = np.sum(served * reference, axis=1) / (np.linalg.norm(served, axis=1) * np.linalg.norm(reference, axis=1))
    assert cosine.min() >= 0.999


# --- 2. the cross-encoder ------------------------------------------------------------------------


def test_the_cross_encoder_scores_pairs_as_pytorch_does(built):
    from transformers import AutoModelForSequenceClassification

    inputs, outputs = signature(built["cross_encoder_onnx"])
    assert [name for name, _, _ in inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert outputs == [("logits", "TYPE_FP32", (None, 2))]
    folder = built["folder"] / "cross-encoder"
    assert inspect_hf_dir(folder).labels == user_models.CROSS_ENCODER_LABELS
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    pairs = [("how do I reset my password?", "Open settings, then choose 'reset password'."),
             ("capital of France", "Paris is the capital and largest city of France.")]
    encoded = tokenizer.encode_batch(pairs)
    feeds = {"input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
             "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
             "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64)}
    assert feeds["token_type_ids"].max() == 1  # the second member of each pair is told apart
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        reference = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    np.testing.assert_allclose(run(built["cross_encoder_onnx"], feeds), reference, atol=1e-4)


# --- 3. the image classifier ---------------------------------------------------------------------


def test_the_image_classifier_takes_fixed_size_images_in_batches_of_any_size(built):
    inputs, outputs = signature(built["image_classifier_onnx"])
    assert inputs == [("pixel_values", "TYPE_FP32", (None, 3, 64, 64))]
    assert outputs == [("logits", "TYPE_FP32", (None, len(user_models.IMAGE_LABELS)))]
    images = np.random.default_rng(3).standard_normal((3, 3, 64, 64)).astype(np.float32)
    with torch.no_grad():
        reference = user_models.image_classifier_module()(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(run(built["image_classifier_onnx"], {"pixel_values": images}), reference, atol=1e-4)
    assert run(built["image_classifier_onnx"], {"pixel_values": images[:1]}).shape == (1, 10)


# --- 4. the audio model --------------------------------------------------------------------------


def test_the_audio_model_takes_any_number_of_frames(built):
    inputs, outputs = signature(built["audio_conv_onnx"])
    assert inputs == [("features", "TYPE_FP32", (None, None, 40)), ("frame_mask", "TYPE_FP32", (None, None))]
    assert outputs == [("logits", "TYPE_FP32", (None, 8))]
    assert read_graph(built["audio_conv_onnx"]).input("features").free_axes == (1,)
    features = np.random.default_rng(4).standard_normal((2, 23, 40)).astype(np.float32)
    mask = np.ones((2, 23), dtype=np.float32)
    with torch.no_grad():
        reference = user_models.audio_conv_module()(torch.from_numpy(features), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(run(built["audio_conv_onnx"], {"features": features, "frame_mask": mask}),
                               reference, atol=1e-5)


def test_padding_frames_with_zeros_does_not_change_a_row_s_logits(built):
    rng = np.random.default_rng(6)
    short, long = (rng.standard_normal((1, frames, 40)).astype(np.float32) for frames in (9, 50))
    alone = run(built["audio_conv_onnx"], {"features": short, "frame_mask": np.ones((1, 9), np.float32)})
    # The short clip in a batch with a long one, padded with zero frames that its mask marks.
    features = np.concatenate([np.pad(short, ((0, 0), (0, 41), (0, 0))), long])
    mask = np.ones((2, 50), np.float32)
    mask[0, 9:] = 0
    together = run(built["audio_conv_onnx"], {"features": features, "frame_mask": mask})
    np.testing.assert_allclose(together[0], alone[0], atol=1e-5)
    # Without the mask the padding would move the row: the test can tell the difference.
    unmasked = run(built["audio_conv_onnx"], {"features": features, "frame_mask": np.ones((2, 50), np.float32)})
    assert np.abs(unmasked[0] - alone[0]).max() > 1e-3


# --- 5. the external repository ------------------------------------------------------------------


def test_the_external_config_is_the_user_s_own(built):
    path = built["external_repository"] / user_models.EXTERNAL_MODEL / "config.pbtxt"
    text = path.read_text()
    assert text.startswith("# ") and "# model.py multiplies" in text
    config = parse_config(text, str(path))
    assert (config.name, config.backend) == ("user_scorer", "python")
    assert [(t.name, list(t.dims)) for t in config.input] == [("FEATURES", [16])]
    assert [(t.name, list(t.dims)) for t in config.output] == [("SCORES", [4])]
    assert config.parameters["scale"].string_value == str(user_models.EXTERNAL_SCALE)
    assert [w.name for w in config.model_warmup] == ["zeros"]
    # The kit's knobs merged in, the user's fields stay.
    derived = mc.ModelConfig(name="user_scorer", max_batch_size=16)
    derived.dynamic_batching.max_queue_delay_microseconds = 500
    merged = parse_config(merge_managed(text, derived, str(path)), str(path))
    assert merged.max_batch_size == 16 and merged.dynamic_batching.max_queue_delay_microseconds == 500
    assert merged.parameters == config.parameters and merged.model_warmup == config.model_warmup


def test_the_external_model_py_imports_nothing_of_the_kit(built):
    source = (built["external_repository"] / user_models.EXTERNAL_MODEL / "1" / "model.py").read_text()
    nodes = list(ast.walk(ast.parse(source)))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom)}
    assert imported == {"json", "numpy", "triton_python_backend_utils"}


def test_the_external_model_computes_its_scores(built, monkeypatch):
    folder = built["external_repository"] / user_models.EXTERNAL_MODEL
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakeTriton())
    spec = importlib.util.spec_from_file_location("user_scorer_model", folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = parse_config((folder / "config.pbtxt").read_text(), "config.pbtxt")
    from google.protobuf import json_format

    model.initialize({"model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True))})
    features = np.random.default_rng(7).standard_normal((3, 16)).astype(np.float32)
    (response,) = model.execute([Request({"FEATURES": features})])
    scores = response.output("SCORES")
    assert scores.shape == (3, 4) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, user_models.external_scores(features), rtol=1e-6)
    assert np.abs(scores).max() <= user_models.EXTERNAL_SCALE  # tanh, scaled by the config's parameter
