"""Request inputs made from declared tensors: random, zeros, and perf_analyzer's --input-data JSON files."""

from __future__ import annotations

import base64
import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import serialize_byte_tensor

from tools.bench.inputs import (
    DEFAULT_INT_HIGH,
    MAX_RANDOM_TEXT,
    Fill,
    InputDataError,
    batch_inputs,
    load_input_data,
    make_inputs,
    numpy_dtype,
    parse_fill,
    row_shape,
    samples_from_json,
    wire_type,
)
from tools.repository.graph import TensorInfo, read_graph

# As read_graph gives them: the batch axis first.
FRAMES = TensorInfo("frames", mc.TYPE_FP32, (None, 80, None))  # audio frames of any length
IDS = TensorInfo("input_ids", mc.TYPE_INT64, (None, None))
IMAGE = TensorInfo("image", mc.TYPE_UINT8, (None, 3, 4, 4))
FLAGS = TensorInfo("flags", mc.TYPE_BOOL, (None, 2))
TEXT = TensorInfo("text", mc.TYPE_STRING, (None, 1))
HALF = TensorInfo("half", mc.TYPE_FP16, (None, 3))
BF16 = TensorInfo("bf16", mc.TYPE_BF16, (None, 2))


def write(tmp_path, document) -> object:
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(document))
    return path


# --- types and shapes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensor", "wire", "dtype"),
    [
        (FRAMES, "FP32", np.float32), (IDS, "INT64", np.int64), (IMAGE, "UINT8", np.uint8),
        (FLAGS, "BOOL", np.bool_), (TEXT, "BYTES", np.object_), (HALF, "FP16", np.float16),
        (BF16, "BF16", ml_dtypes.bfloat16),
    ],
)
def test_triton_types_map_to_numpy(tensor, wire, dtype):
    assert wire_type(tensor) == wire
    assert numpy_dtype(tensor) == np.dtype(dtype)


def test_row_shape_sizes_free_axes_by_index_in_the_declared_shape():
    assert row_shape(IMAGE) == (3, 4, 4)
    assert row_shape(FRAMES, axis_sizes={2: 300}) == (80, 300)
    assert row_shape(FRAMES, variable_len=120) == (80, 120)
    assert row_shape(FRAMES, axis_sizes={2: 300}, variable_len=120) == (80, 300)  # a named axis wins
    assert row_shape(IMAGE, axis_sizes={2: 99}) == (3, 4, 4)  # fixed axes keep their size


@pytest.mark.parametrize(
    ("tensor", "kwargs", "message"),
    [
        (FRAMES, {}, r"frames: axis 2 of \[\?, 80, \?\] is free: give its size \(axis_sizes or variable_len\)"),
        (FRAMES, {"axis_sizes": {2: 0}}, "frames: axis 2 must be given a size >= 1, got 0"),
        (FRAMES, {"variable_len": -3}, "frames: axis 2 must be given a size >= 1, got -3"),
        (FRAMES, {"axis_sizes": {0: 8, 2: 5}}, "axis 0 is the batch axis: its size is the batch size"),
        (TensorInfo("x", mc.TYPE_FP32, (1, 80)), {},
         r"x: shape \[1, 80\] has no free batch axis first \(tensors are given with the batch axis"),
        (TensorInfo("x", mc.TYPE_FP32, ()), {}, r"x: shape \[\] has no free batch axis first"),
    ],
)
def test_row_shape_errors(tensor, kwargs, message):
    with pytest.raises(InputDataError, match=message):
        row_shape(tensor, **kwargs)


def test_tensors_read_from_a_graph_make_inputs_it_accepts(tmp_path):
    x = helper.make_tensor_value_info("frames", TensorProto.FLOAT, ["batch", 80, "num_frames"])
    y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 80, "num_frames"])
    graph = helper.make_graph([helper.make_node("Relu", ["frames"], ["scores"])], "g", [x], [y])
    path = tmp_path / "audio.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    inputs = make_inputs(read_graph(path).inputs, 4, axis_sizes={2: 50})
    assert inputs["frames"].shape == (4, 80, 50) and inputs["frames"].dtype == np.float32


# --- random and zeros -------------------------------------------------------------------------


def test_random_inputs_have_the_declared_types_and_shapes_and_repeat_with_the_seed():
    tensors = [FRAMES, IDS, IMAGE, FLAGS, TEXT, HALF, BF16]
    batch = make_inputs(tensors, 5, axis_sizes={2: 7}, variable_len=16, high={"input_ids": 30522})
    assert {name: (a.shape, a.dtype) for name, a in batch.items()} == {
        "frames": ((5, 80, 7), np.float32), "input_ids": ((5, 16), np.int64), "image": ((5, 3, 4, 4), np.uint8),
        "flags": ((5, 2), np.bool_), "text": ((5, 1), np.object_), "half": ((5, 3), np.float16),
        "bf16": ((5, 2), np.dtype(ml_dtypes.bfloat16)),
    }
    again = make_inputs(tensors, 5, axis_sizes={2: 7}, variable_len=16, high={"input_ids": 30522})
    assert all(np.array_equal(batch[name], again[name]) for name in batch)
    other = make_inputs(tensors, 5, axis_sizes={2: 7}, variable_len=16, high={"input_ids": 30522}, seed=1)
    assert not np.array_equal(batch["frames"], other["frames"])


def test_random_values_lie_where_each_type_says():
    rng = np.random.default_rng(7)
    batch = make_inputs([FRAMES, IDS, IMAGE, TEXT], 64, variable_len=128, high={"input_ids": 1000, "image": 256},
                        seed=rng)
    frames = batch["frames"]
    assert abs(frames.mean()) < 0.01 and 0.98 < frames.std() < 1.02  # standard normal
    ids = batch["input_ids"]
    assert ids.min() >= 0 and ids.max() < 1000 and ids.max() > 900  # [0, high)
    assert batch["image"].max() > 250
    texts = batch["text"].ravel()
    assert all(isinstance(t, bytes) and 1 <= len(t) <= MAX_RANDOM_TEXT and t.isalpha() and t.islower()
               for t in texts)
    assert len(set(texts)) > 60


def test_integers_default_to_zero_and_one():
    ids = make_inputs([IDS], 32, variable_len=32)["input_ids"]
    assert set(np.unique(ids)) == set(range(DEFAULT_INT_HIGH)) == {0, 1}


def test_zeros():
    batch = make_inputs([FRAMES, IDS, FLAGS, TEXT], 2, fill="zeros", variable_len=3)
    assert not batch["frames"].any() and not batch["input_ids"].any() and not batch["flags"].any()
    assert batch["text"].tolist() == [[b""], [b""]]
    assert batch["frames"].dtype == np.float32
    assert make_inputs([IDS], 1, fill=Fill.ZEROS, variable_len=2)["input_ids"].tolist() == [[0, 0]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"high": {"image": 257}}, r"image: high 257 is outside \[1, 256\] for TYPE_UINT8"),
        ({"high": {"image": 0}}, r"image: high 0 is outside \[1, 256\]"),
        ({"high": {"pixels": 5}}, r"high given for pixels, which the model does not take \(its inputs: image\)"),
    ],
)
def test_random_fill_errors(kwargs, message):
    with pytest.raises(InputDataError, match=message):
        make_inputs([IMAGE], 1, **kwargs)


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(InputDataError, match="batch size must be >= 1, got 0"):
        make_inputs([IMAGE], 0)


@pytest.mark.parametrize(("raw", "fill"), [("random", Fill.RANDOM), ("zeros", Fill.ZEROS), ("zero", Fill.ZEROS)])
def test_parse_fill(raw, fill):
    assert parse_fill(raw) is fill


def test_parse_fill_takes_anything_else_as_a_file(tmp_path):
    assert parse_fill(str(tmp_path / "s.json")) == tmp_path / "s.json"


# --- sample files -----------------------------------------------------------------------------


def test_flat_lists_are_rows_of_the_declared_shape(tmp_path):
    path = write(tmp_path, {"data": [
        {"image": list(range(48)), "flags": [True, False], "text": ["héllo"]},
        {"image": [255] * 48, "flags": [False, False], "text": [""]},
    ]})
    samples = load_input_data(path, [IMAGE, FLAGS, TEXT])
    assert len(samples) == 2
    assert samples[0]["image"].shape == (3, 4, 4) and samples[0]["image"].dtype == np.uint8
    assert samples[0]["image"][2, 3, 3] == 47  # row-major
    assert samples[0]["flags"].tolist() == [True, False]
    assert samples[0]["text"].tolist() == ["héllo".encode()] and samples[0]["text"].dtype == object
    assert samples[1]["text"].tolist() == [b""]


def test_content_with_a_shape_sizes_the_free_axes(tmp_path):
    path = write(tmp_path, {"data": [
        {"frames": {"content": [0.5] * 160, "shape": [80, 2]}},
        {"frames": {"content": [0.25] * 240, "shape": [80, 3]}},
    ]})
    samples = load_input_data(path, [FRAMES])
    assert [s["frames"].shape for s in samples] == [(80, 2), (80, 3)]
    assert samples[1]["frames"][79, 2] == 0.25


def test_one_free_axis_without_a_shape_is_what_the_element_count_makes_it(tmp_path):
    path = write(tmp_path, {"data": [{"input_ids": [101, 2023, 102]}, {"input_ids": [5]}]})
    assert [s["input_ids"].tolist() for s in load_input_data(path, [IDS])] == [[101, 2023, 102], [5]]
    path = write(tmp_path, {"data": [{"frames": [1.0] * 400}]})
    assert load_input_data(path, [FRAMES])[0]["frames"].shape == (80, 5)
    assert load_input_data(path, [FRAMES], axis_sizes={2: 5})[0]["frames"].shape == (80, 5)


def b64(data: bytes) -> dict:
    return {"b64": base64.b64encode(data).decode()}


def test_b64_contents_are_little_endian_bytes(tmp_path):
    frames = np.arange(160, dtype="<f4")
    half = np.array([1.5, -2.0, 0.125], dtype="<f2")
    text = serialize_byte_tensor(np.array([b"query: what"], dtype=object)).item()
    bf16 = np.array([1.5, -3.0], dtype=ml_dtypes.bfloat16)
    path = write(tmp_path, {"data": [{
        "frames": {"content": b64(frames.tobytes()), "shape": [80, 2]},
        "half": b64(half.tobytes()),
        "text": b64(text),
        "bf16": b64(bf16.tobytes()),
    }]})
    [sample] = load_input_data(path, [FRAMES, HALF, TEXT, BF16])
    assert sample["frames"].shape == (80, 2) and sample["frames"].dtype == np.float32
    assert sample["frames"][79, 1] == 159.0
    assert sample["half"].tolist() == [1.5, -2.0, 0.125] and sample["half"].dtype == np.float16
    assert sample["text"].tolist() == [b"query: what"] and sample["text"].dtype == object
    assert sample["bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert sample["bf16"].astype(float).tolist() == [1.5, -3.0]


def test_other_top_level_keys_are_left_alone(tmp_path):
    path = write(tmp_path, {"data": [{"flags": [True, True]}], "validation_data": [{"out": [1]}]})
    assert load_input_data(path, [FLAGS])[0]["flags"].tolist() == [True, True]


@pytest.mark.parametrize(
    ("document", "tensors", "message"),
    [
        ({"rows": []}, [FLAGS], r'samples.json: needs a non-empty "data" list, as perf_analyzer\'s --input-data'),
        ({"data": []}, [FLAGS], r'samples.json: needs a non-empty "data" list'),
        ([1, 2], [FLAGS], r'samples.json: needs a non-empty "data" list'),
        ({"data": [[{"flags": [True, True]}]]}, [FLAGS],
         r"samples.json: data\[0\] is a list \(a sequence stream\); each entry must be one object of tensors"),
        ({"data": [{"flags": [True, True]}, {}]}, [FLAGS],
         r"samples.json: data\[1\]: no tensor flags \(the model's inputs: flags\)"),
        ({"data": [{"flags": [True, True], "mask": [1]}]}, [FLAGS],
         r"samples.json: data\[0\]: mask is not an input of the model \(its inputs: flags\)"),
        ({"data": [{"image": list(range(47))}]}, [IMAGE],
         r"samples.json: data\[0\]: image: has 47 elements; shape \[3, 4, 4\] takes 48"),
        ({"data": [{"image": {"content": list(range(48)), "shape": [3, 16]}}]}, [IMAGE],
         r"samples.json: data\[0\]: image: shape \[3, 16\] contradicts the declared \[3, 4, 4\]"),
        ({"data": [{"image": {"content": list(range(48)), "shape": [4, 4, 3]}}]}, [IMAGE],
         r"data\[0\]: image: shape \[4, 4, 3\] contradicts the declared \[3, 4, 4\]"),
        ({"data": [{"frames": {"content": [1.0] * 8, "shape": [80, "2"]}}]}, [FRAMES],
         r"data\[0\]: frames: shape \[80, '2'\] contradicts the declared \[80, \?\]"),
        ({"data": [{"frames": {"content": [1.0] * 160, "shape": [80, 3]}}]}, [FRAMES],
         r"data\[0\]: frames: has 160 elements; shape \[80, 3\] takes 240"),
        ({"data": [{"frames": [1.0] * 81}]}, [FRAMES],
         r"data\[0\]: frames: 81 elements do not fill the declared \[80, \?\]; give its \"shape\""),
        ({"data": [{"x": [1.0] * 6}]}, [TensorInfo("x", mc.TYPE_FP32, (None, None, None))],
         r"data\[0\]: x: 6 elements do not fill the declared \[\?, \?\]; give its \"shape\""),
        ({"data": [{"image": [1.5] * 48}]}, [IMAGE],
         r"data\[0\]: image: TYPE_UINT8 elements must be integers in a flat list, got 1.5"),
        ({"data": [{"image": [[0] * 16] * 3}]}, [IMAGE], r"image: TYPE_UINT8 elements must be integers in a flat list"),
        ({"data": [{"image": [256] * 48}]}, [IMAGE], r"image: 256 is outside TYPE_UINT8's range \[0, 255\]"),
        ({"data": [{"flags": [1, 0]}]}, [FLAGS], r"flags: TYPE_BOOL elements must be true or false in a flat list"),
        ({"data": [{"half": [1, "2", 3]}]}, [HALF],
         r"half: TYPE_FP16 elements must be numbers in a flat list, got '2'"),
        ({"data": [{"half": [True, 2.0, 3]}]}, [HALF], "half: TYPE_FP16 elements must be numbers"),
        ({"data": [{"text": [3]}]}, [TEXT], r"data\[0\]: text: TYPE_STRING elements must be strings, got 3"),
        ({"data": [{"half": "1,2,3"}]}, [HALF], r"half: content must be a flat list or \{\"b64\": ...\}, got str"),
        ({"data": [{"half": {"values": [1, 2, 3]}}]}, [HALF],
         r'half: give a list, \{"b64": ...\}, or \{"content": ..., "shape": \[...\]\}'),
        ({"data": [{"half": {"content": [1, 2, 3], "shape": [3], "dtype": "FP16"}}]}, [HALF], "half: give a list"),
        ({"data": [{"half": {"b64": "not base64!"}}]}, [HALF], r"half: b64 is not base64"),
        ({"data": [{"half": {"content": {"b64": 5}}}]}, [HALF], r'half: binary content must be \{"b64": "<base64'),
        ({"data": [{"half": {"b64": base64.b64encode(b"\x00" * 5).decode()}}]}, [HALF],
         r"half: b64 holds 5 bytes, not a whole number of TYPE_FP16 elements \(2 bytes each\)"),
        ({"data": [{"text": {"b64": base64.b64encode(b"\x09\x00\x00\x00abc").decode()}}]}, [TEXT],
         "text: b64 BYTES content must be elements each prefixed by a 4-byte length"),
    ],
)
def test_sample_file_errors_name_the_file_the_entry_and_the_tensor(tmp_path, document, tensors, message):
    with pytest.raises(InputDataError, match=message) as caught:
        load_input_data(write(tmp_path, document), tensors)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_a_file_that_is_missing_or_not_json(tmp_path):
    with pytest.raises(InputDataError, match=r"nothing.json: no such file"):
        load_input_data(tmp_path / "nothing.json", [FLAGS])
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [')
    with pytest.raises(InputDataError, match=r"bad.json: not a JSON file: Expecting value"):
        load_input_data(bad, [FLAGS])


def test_samples_from_a_parsed_document_name_their_source():
    with pytest.raises(InputDataError, match=r"the request: data\[0\]: no tensor flags"):
        samples_from_json({"data": [{}]}, [FLAGS], source="the request")


def test_a_free_axis_size_the_file_cannot_tell_comes_from_the_arguments():
    two_free = TensorInfo("x", mc.TYPE_FP32, (None, None, None))
    [sample] = samples_from_json({"data": [{"x": [1.0] * 6}]}, [two_free], axis_sizes={1: 2})
    assert sample["x"].shape == (2, 3)


# --- batches ----------------------------------------------------------------------------------


def test_batches_cycle_through_the_samples_in_order():
    samples = [{"x": np.full(2, i, dtype=np.int64), "t": np.array([f"{i}".encode()], dtype=object)} for i in range(3)]
    batch = batch_inputs(samples, 5)
    assert batch["x"].tolist() == [[0, 0], [1, 1], [2, 2], [0, 0], [1, 1]]
    assert batch["t"].tolist() == [[b"0"], [b"1"], [b"2"], [b"0"], [b"1"]]
    assert batch_inputs(samples, 2, start=2)["x"].tolist() == [[2, 2], [0, 0]]
    assert batch_inputs(samples, 1, start=7)["x"].tolist() == [[1, 1]]


def test_a_sample_file_fills_a_batch(tmp_path):
    path = write(tmp_path, {"data": [{"flags": [True, False]}, {"flags": [False, True]}]})
    assert make_inputs([FLAGS], 3, fill=path)["flags"].tolist() == [[True, False], [False, True], [True, False]]
    assert make_inputs([FLAGS], 1, fill=str(path))["flags"].tolist() == [[True, False]]


def test_samples_of_different_free_axis_lengths_cannot_share_a_batch(tmp_path):
    samples = load_input_data(write(tmp_path, {"data": [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]}), [IDS])
    assert batch_inputs(samples, 1, start=1)["input_ids"].tolist() == [[4, 5]]
    with pytest.raises(InputDataError, match=r"samples 0 and 1 give input_ids shapes \[3\] and \[2\]: samples of "
                                             r"different free-axis lengths cannot share a batch \(use batch size 1, "
                                             r"or samples of one length\)"):
        batch_inputs(samples, 2)


def test_batching_errors():
    with pytest.raises(InputDataError, match="no samples to batch"):
        batch_inputs([], 4)
    with pytest.raises(InputDataError, match="batch size must be >= 1, got 0"):
        batch_inputs([{"x": np.zeros(1)}], 0)
