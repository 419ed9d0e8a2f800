"""The tensor model's bucket backend: its config, the graph checked against it at load, batches
stacked and split back, and real graphs run through the router's buckets: the audio model's
padded rows give the logits each row gets alone, the image classifier's fixed bucket gives what
the graph gives. The Triton adapter is loaded once on the fake `pb_utils`."""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import numpy as np
import onnxruntime as ort
import pytest

from python_backends.common.artifacts import ArtifactError, write_manifest
from python_backends.tensor.bucket import (
    GraphTensor,
    OnnxTensorModel,
    TensorBucketConfig,
    graph_mismatches,
    parse_tensor_bucket_config,
    split_outputs,
    stack_requests,
)
from python_backends.tensor.router import FIXED_BUCKET, TensorRouter, TensorRouterConfig, TensorSpec
from tests import user_models
from tests.fakes.pb_utils import FakeTriton, Request

NUM_FEATURES = user_models.AUDIO_NUM_FEATURES
AUDIO_INPUTS = (TensorSpec("features", "TYPE_FP32", (-1, NUM_FEATURES), pad_value=0.0),
                TensorSpec("frame_mask", "TYPE_FP32", (-1,), pad_value=0.0))
AUDIO_OUTPUTS = (TensorSpec("logits", "TYPE_FP32", (user_models.AUDIO_NUM_LABELS,)),)
AUDIO_ROUTER = TensorRouterConfig(inputs=AUDIO_INPUTS, outputs=AUDIO_OUTPUTS, variable_axis=0,
                                  bucket_lens=(16, 32, 64), bucket_max_batch={16: 4, 32: 4, 64: 2},
                                  encoder_prefix="audio_")
IMAGE_SHAPE = (3, user_models.IMAGE_SIZE, user_models.IMAGE_SIZE)
IMAGE_ROUTER = TensorRouterConfig(inputs=(TensorSpec("pixel_values", "TYPE_FP32", IMAGE_SHAPE),),
                                  outputs=(TensorSpec("logits", "TYPE_FP32", (len(user_models.IMAGE_LABELS),)),),
                                  bucket_max_batch={FIXED_BUCKET: 4}, encoder_prefix="image_")


def bucket_model_config(router: TensorRouterConfig, bucket: int, **overrides) -> dict:
    """A bucket model's config in Triton's JSON form, as gen-config would write it for `bucket`."""
    config = {
        "name": router.model_for(bucket),
        "max_batch_size": router.bucket_max_batch[bucket],
        "input": [{"name": spec.name, "data_type": spec.data_type,
                   "dims": [str(size) for size in router.bucket_dims(spec, bucket)]} for spec in router.inputs],
        "output": [{"name": spec.name, "data_type": spec.data_type, "dims": [str(size) for size in spec.dims]}
                   for spec in router.outputs],
        "parameters": {"intra_op_threads": {"string_value": "1"}, "allow_spinning": {"string_value": "0"}},
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tensor_graphs")
    return {"audio": user_models.audio_conv_onnx(folder), "image": user_models.image_classifier_onnx(folder)}


def audio_rows(num_rows: int, num_frames: int, seed: int) -> dict[str, np.ndarray]:
    features = np.random.default_rng(seed).standard_normal((num_rows, num_frames, NUM_FEATURES)).astype(np.float32)
    return {"features": features, "frame_mask": np.ones((num_rows, num_frames), dtype=np.float32)}


def alone(path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Each row run by itself, unpadded, straight through ONNX Runtime."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = feeds[next(iter(feeds))].shape[0]
    return np.concatenate([session.run(["logits"], {k: v[i:i + 1] for k, v in feeds.items()})[0] for i in range(rows)])


# --- config -----------------------------------------------------------------------------------------


def test_parse_bucket_config():
    parsed = parse_tensor_bucket_config(bucket_model_config(AUDIO_ROUTER, 32))
    assert parsed == TensorBucketConfig(
        model_name="audio_32", max_batch_size=4,
        inputs=(TensorSpec("features", "TYPE_FP32", (32, NUM_FEATURES)), TensorSpec("frame_mask", "TYPE_FP32", (32,))),
        outputs=AUDIO_OUTPUTS, intra_op_threads=1, allow_spinning=False)
    assert parsed.input_names == ("features", "frame_mask") and parsed.output_names == ("logits",)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1 so Triton can batch it"),
        ({"input": []}, "config has no inputs"),
        ({"output": []}, "config has no outputs"),
        ({"input": [{"name": "words", "data_type": "TYPE_STRING", "dims": ["4"]}]},
         "config input 'words': data type 'TYPE_STRING' is not one of"),
        ({"output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": ["0"]}]},
         r"config output 'logits': tensor 'logits': dims must be sizes >= 1 or -1"),
        ({"parameters": {"intra_op_threads": {"string_value": "two"}}}, "intra_op_threads='two' is not an integer"),
        ({"parameters": {"allow_spinning": {"string_value": "yes"}}}, "allow_spinning must be 0 or 1"),
    ],
)
def test_bad_bucket_configs_name_the_model(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_tensor_bucket_config(bucket_model_config(AUDIO_ROUTER, 16, **overrides))
    assert str(info.value).startswith("model 'audio_16': ")


def test_graph_mismatches_list_every_difference():
    config = parse_tensor_bucket_config(bucket_model_config(AUDIO_ROUTER, 16))
    fits = ([GraphTensor("features", "tensor(float)", ["batch", "frames", NUM_FEATURES]),
             GraphTensor("frame_mask", "tensor(float)", ["batch", "frames"])],
            [GraphTensor("logits", "tensor(float)", ["batch", 8]), GraphTensor("hidden", "tensor(float)", None)])
    assert graph_mismatches(config, *fits) == []
    assert graph_mismatches(config, [GraphTensor("features", "tensor(float)", None), fits[0][1]], fits[1]) == []
    problems = graph_mismatches(
        config,
        [GraphTensor("features", "tensor(double)", [4, 16, 39]), GraphTensor("lengths", "tensor(int64)", ["batch"])],
        [GraphTensor("logits", "tensor(float)", ["batch"])])
    assert problems == [
        "the graph has no input 'frame_mask'",
        "graph input 'lengths' is not in the config",
        "input 'features' is tensor(double) in the graph, FP32 in the config",
        "input 'features' has a fixed batch axis (4) in the graph",
        "input 'features' axis 2 is 39 in the graph, 40 in the config",
        "output 'logits' has rank 1 in the graph; the config's dims [8] make 2",
    ]
    free = parse_tensor_bucket_config(bucket_model_config(
        AUDIO_ROUTER, 16, output=[{"name": "logits", "data_type": "TYPE_FP32", "dims": ["-1"]}]))
    assert graph_mismatches(free, *fits) == ["output 'logits' axis 1 is 8 in the graph, free in the config"]
    assert graph_mismatches(config, fits[0], [GraphTensor("scores", "tensor(float)", ["batch", 8])]) == [
        "the graph has no output 'logits'"]


def test_a_batch_is_stacked_and_every_output_split_back():
    requests = [{"a": np.full((n, 2), n, np.float32), "b": np.full((n,), n, np.int64)} for n in (1, 3, 2)]
    stacked, sizes = stack_requests(("a", "b"), requests)
    assert sizes == [1, 3, 2] and stacked["a"].shape == (6, 2) and stacked["b"].tolist() == [1, 3, 3, 3, 2, 2]
    alone_stacked, alone_sizes = stack_requests(("a", "b"), requests[:1])
    assert alone_stacked["a"] is requests[0]["a"] and alone_sizes == [1]  # one request: no copy
    parts = split_outputs({"x": stacked["a"] * 2, "y": stacked["b"]}, sizes)
    assert [part["y"].tolist() for part in parts] == [[1], [3, 3, 3], [2, 2]]
    assert [part["x"].shape for part in parts] == [(1, 2), (3, 2), (2, 2)]
    with pytest.raises(ValueError, match="no requests to stack"):
        stack_requests(("a",), [])


# --- real graphs ------------------------------------------------------------------------------------


def test_the_audio_graph_gives_each_padded_row_the_logits_it_gets_alone(graphs):
    router = TensorRouter(AUDIO_ROUTER)
    buckets = {bucket: OnnxTensorModel(graphs["audio"], parse_tensor_bucket_config(bucket_model_config(
        AUDIO_ROUTER, bucket))) for bucket in AUDIO_ROUTER.bucket_lens}
    # Requests of 10 and 14 frames share bucket 16, 23 frames go to 32, 64 frames fill 64.
    sent = [audio_rows(3, 10, seed=1), audio_rows(6, 14, seed=2), audio_rows(2, 23, seed=3), audio_rows(1, 64, seed=4)]
    prepared = [router.prepare(tensors) for tensors in sent]
    assert [[c.chunk.bucket_len for c in p.chunks] for p in prepared] == [[16], [16, 16], [32], [64]]
    # Triton's dynamic batcher stacks requests of one bucket: the first request's chunk and the
    # second's two run in one batch of 16-frame rows.
    sixteen = [prepared[0].chunks[0], *prepared[1].chunks]
    answers = buckets[16].run_requests([chunk.tensors for chunk in sixteen])
    by_chunk = {id(chunk): answer for chunk, answer in zip(sixteen, answers, strict=True)}
    for request in prepared[2:]:
        (chunk,) = request.chunks
        (by_chunk[id(chunk)],) = buckets[chunk.chunk.bucket_len].run_requests([chunk.tensors])
    for tensors, request in zip(sent, prepared, strict=True):
        served = router.reassemble(request, [by_chunk[id(chunk)] for chunk in request.chunks])
        assert served["logits"].shape == (len(tensors["features"]), user_models.AUDIO_NUM_LABELS)
        np.testing.assert_allclose(served["logits"], alone(graphs["audio"], tensors), rtol=1e-5, atol=1e-5)
    # The padding was real: a 10-frame row went to the graph with 6 zero frames under a zero mask.
    assert prepared[0].chunks[0].tensors["frame_mask"][:, 10:].sum() == 0
    assert prepared[0].chunks[0].tensors["features"].shape == (3, 16, NUM_FEATURES)


def test_the_image_classifier_runs_in_its_fixed_bucket(graphs):
    router = TensorRouter(IMAGE_ROUTER)
    model = OnnxTensorModel(graphs["image"], parse_tensor_bucket_config(bucket_model_config(IMAGE_ROUTER, 0)))
    assert model.config.model_name == "image_fixed" and model.providers == ["CPUExecutionProvider"]
    pixels = np.random.default_rng(5).standard_normal((6, *IMAGE_SHAPE)).astype(np.float32)
    prepared = router.prepare({"pixel_values": pixels})
    assert [len(c.chunk.row_indices) for c in prepared.chunks] == [4, 2]
    answers = [model.run_requests([chunk.tensors])[0] for chunk in prepared.chunks]
    served = router.reassemble(prepared, answers)["logits"]
    session = ort.InferenceSession(str(graphs["image"]), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(served, session.run(["logits"], {"pixel_values": pixels})[0], rtol=1e-4, atol=1e-4)


def test_a_graph_that_does_not_fit_its_config_fails_the_load_in_one_line(graphs, tmp_path):
    wrong = parse_tensor_bucket_config(bucket_model_config(
        AUDIO_ROUTER, 16, input=[{"name": "feats", "data_type": "TYPE_FP32", "dims": ["16", "40"]},
                                 {"name": "frame_mask", "data_type": "TYPE_INT64", "dims": ["16"]}]))
    with pytest.raises(ValueError) as info:
        OnnxTensorModel(graphs["audio"], wrong)
    message = str(info.value)
    assert message.startswith(f"model 'audio_16': {graphs['audio']} does not fit the config: ")
    assert "the graph has no input 'feats'" in message and "graph input 'features' is not in the config" in message
    assert "input 'frame_mask' is tensor(float) in the graph, INT64 in the config" in message
    assert "\n" not in message
    with pytest.raises(FileNotFoundError, match=r"model 'audio_16': .*missing\.onnx not found"):
        OnnxTensorModel(tmp_path / "missing.onnx", wrong)


# --- the Triton adapter -----------------------------------------------------------------------------


@pytest.fixture
def adapter(monkeypatch):
    """The adapter module imported against a fresh fake `pb_utils`."""
    pb = FakeTriton()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "python_backends.adapters.tensor_bucket_model", raising=False)
    return pb, importlib.import_module("python_backends.adapters.tensor_bucket_model")


def install(graph, repository, name: str) -> dict[str, str]:
    version = repository / name / "1"
    version.mkdir(parents=True)
    shutil.copyfile(graph, version / "model.onnx")
    write_manifest(version, ["model.onnx"])
    return {"model_name": name, "model_version": "1", "model_repository": str(repository / name)}


def test_the_adapter_serves_a_batch_triton_formed(graphs, tmp_path, adapter):
    pb, module = adapter
    args = install(graphs["audio"], tmp_path, "audio_16")
    model = module.TritonPythonModel()
    model.initialize({**args, "model_config": json.dumps(bucket_model_config(AUDIO_ROUTER, 16))})
    router = TensorRouter(AUDIO_ROUTER)
    sent = [audio_rows(2, 9, seed=6), audio_rows(1, 16, seed=7)]
    chunks = [router.prepare(tensors).chunks[0] for tensors in sent]
    responses = model.execute([Request(chunk.tensors) for chunk in chunks])
    for tensors, response in zip(sent, responses, strict=True):
        assert not response.has_error()
        np.testing.assert_allclose(response.output("logits"), alone(graphs["audio"], tensors), rtol=1e-5, atol=1e-5)
    histogram = pb.metric("embed_bucket_batch_rows", model="audio_16", version="1")
    assert histogram.observations == [3.0] and histogram.buckets == [1.0, 2.0, 4.0]


def test_the_adapter_refuses_a_changed_graph(graphs, tmp_path, adapter):
    _, module = adapter
    args = install(graphs["audio"], tmp_path, "audio_16")
    (tmp_path / "audio_16" / "1" / "model.onnx").write_bytes(b"not the graph that was built")
    with pytest.raises(ArtifactError, match="model 'audio_16' version 1: refusing to load"):
        module.TritonPythonModel().initialize(
            {**args, "model_config": json.dumps(bucket_model_config(AUDIO_ROUTER, 16))})


def test_the_express_model_takes_every_bucket_s_padded_rows_with_the_axis_free(graphs):
    # As gen-config writes it: the inputs as the router declares them (the frames axis -1).
    free_inputs = [{"name": spec.name, "data_type": spec.data_type, "dims": [str(size) for size in spec.dims]}
                   for spec in AUDIO_ROUTER.inputs]
    express = parse_tensor_bucket_config(bucket_model_config(AUDIO_ROUTER, 16, name="audio_express",
                                                             input=free_inputs))
    assert express.inputs[0].dims == (-1, NUM_FEATURES)
    model = OnnxTensorModel(graphs["audio"], express)
    router = TensorRouter(AUDIO_ROUTER)
    for bucket in (16, 32):
        bucket_model = OnnxTensorModel(graphs["audio"], parse_tensor_bucket_config(bucket_model_config(AUDIO_ROUTER,
                                                                                                       bucket)))
        (chunk,) = router.prepare(audio_rows(2, bucket - 3, seed=bucket)).chunks
        np.testing.assert_allclose(model.run(chunk.tensors)["logits"], bucket_model.run(chunk.tensors)["logits"],
                                   rtol=1e-5, atol=1e-6)
