"""The tensor model router: request checks (one line naming the input each), the bucket of the
variable axis with each input's pad value, inputs that pass through, chunks of the bucket's max
batch, the fixed bucket of a model without a variable axis, reassembly of several outputs, and
the config parameters read back as written. No server, no graph."""

from __future__ import annotations

import json

import numpy as np
import pytest

from python_backends.common.errors import InvalidInput
from python_backends.common.regimes import LingerRegimes
from python_backends.embed.admission import AdmissionPolicy
from python_backends.embed.buckets import Chunk
from python_backends.embed.router import RequestOptions
from python_backends.embed.routing import RoutingTable
from python_backends.tensor.router import (
    FIXED_BUCKET,
    TensorRouter,
    TensorRouterConfig,
    TensorRouterParameters,
    TensorSpec,
    bucket_model_name,
    num_padded_positions,
    parse_tensor_router_config,
    type_name,
)

# An audio model: frames on axis 0 of features and frame_mask (bucketed), a speaker id that
# has no frames axis (passes through), and token ids with their own pad value.
FEATURES = TensorSpec("features", "TYPE_FP32", (-1, 3), pad_value=-1.5)
FRAME_MASK = TensorSpec("frame_mask", "TYPE_FP32", (-1,), pad_value=0)
SPEAKER = TensorSpec("speaker", "TYPE_INT64", (1,))
PHONES = TensorSpec("phones", "TYPE_INT32", (-1,), pad_value=7)
LOGITS = TensorSpec("logits", "TYPE_FP32", (4,))
FRAME_SCORES = TensorSpec("frame_scores", "TYPE_FP32", (-1,))


def audio_config(**overrides) -> TensorRouterConfig:
    fields = {"inputs": (FEATURES, FRAME_MASK, SPEAKER, PHONES), "outputs": (LOGITS, FRAME_SCORES),
              "variable_axis": 0, "bucket_lens": (16, 32, 64), "bucket_max_batch": {16: 4, 32: 2, 64: 1},
              "encoder_prefix": "audio_"}
    fields.update(overrides)
    return TensorRouterConfig(**fields)


def audio_request(num_rows: int = 3, num_frames: int = 10, **replace) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(num_rows * 100 + num_frames)
    tensors = {
        "features": rng.standard_normal((num_rows, num_frames, 3)).astype(np.float32),
        "frame_mask": np.ones((num_rows, num_frames), dtype=np.float32),
        "speaker": np.arange(num_rows, dtype=np.int64).reshape(-1, 1),
        "phones": rng.integers(0, 5, (num_rows, num_frames)).astype(np.int32),
    }
    tensors.update(replace)
    return {name: array for name, array in tensors.items() if array is not None}


def image_config(**overrides) -> TensorRouterConfig:
    fields = {"inputs": (TensorSpec("pixel_values", "TYPE_FP32", (3, 8, 8)),),
              "outputs": (TensorSpec("logits", "TYPE_FP32", (10,)),), "bucket_max_batch": {FIXED_BUCKET: 4},
              "encoder_prefix": "resnet_"}
    fields.update(overrides)
    return TensorRouterConfig(**fields)


# --- request checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        ({"phones": None}, "missing input 'phones'; this model takes 'features', 'frame_mask', 'speaker', 'phones'"),
        ({"pitch": np.zeros((3, 10), np.float32)},
         "unknown input 'pitch'; this model takes 'features', 'frame_mask', 'speaker', 'phones'"),
        ({"frame_mask": np.ones((3, 10), np.float64)}, "input 'frame_mask' has data type FP64; the model takes FP32"),
        ({"speaker": np.zeros((3, 1), np.int32)}, "input 'speaker' has data type INT32; the model takes INT64"),
        ({"features": np.zeros((3, 10), np.float32)},
         r"input 'features' has shape \[3, 10\]; the model takes \[-1, -1, 3\] \(rank 3\)"),
        ({"features": np.zeros((3, 10, 4), np.float32)},
         r"input 'features' has size 4 on axis 2; the model takes 3 there \(shape \[-1, -1, 3\]\)"),
        ({"speaker": np.zeros((3, 2), np.int64)},
         r"input 'speaker' has size 2 on axis 1; the model takes 1 there \(shape \[-1, 1\]\)"),
        ({"frame_mask": np.ones((2, 10), np.float32)},
         "inputs disagree on the row count: 'features' has 3 rows, 'frame_mask' 2"),
        ({"phones": np.zeros((3, 11), np.int32)},
         "inputs disagree on the length of axis 1: 'features' has 10, 'phones' 11"),
    ],
)
def test_a_bad_request_gets_one_line_naming_the_input(replace, message):
    with pytest.raises(InvalidInput, match=f"^{message}$"):
        TensorRouter(audio_config()).prepare(audio_request(**replace), RequestOptions())


def test_a_request_longer_than_the_largest_bucket_is_told_the_limit():
    with pytest.raises(InvalidInput, match=r"^input 'features' has size 65 on axis 1; the limit is 64$"):
        TensorRouter(audio_config()).prepare(audio_request(num_frames=65))


def test_a_request_without_rows_or_without_frames_is_refused():
    router = TensorRouter(audio_config())
    with pytest.raises(InvalidInput, match=r"^input 'features' has no rows; send at least one$"):
        router.prepare(audio_request(num_rows=0))
    with pytest.raises(InvalidInput, match=r"^input 'features' has size 0 on axis 1; send at least one position$"):
        router.prepare(audio_request(num_frames=0))


def test_type_names_are_the_clients_names():
    assert [type_name(np.dtype(t)) for t in (np.float32, np.int64, np.bool_, object, "U3")] == [
        "FP32", "INT64", "BOOL", "BYTES", "BYTES"]


# --- buckets, padding, chunks -----------------------------------------------------------------------


def test_a_request_is_padded_to_the_smallest_bucket_with_each_input_s_pad_value():
    sent = audio_request(num_rows=3, num_frames=10)
    options = RequestOptions(tenant="acme")
    prepared = TensorRouter(audio_config()).prepare(sent, options)
    assert prepared.options is options and prepared.num_truncated == 0
    (chunk,) = prepared.chunks
    assert chunk.chunk == Chunk(16, (0, 1, 2)) and chunk.model_name == "audio_16"
    tensors = chunk.tensors
    assert {name: array.shape for name, array in tensors.items()} == {
        "features": (3, 16, 3), "frame_mask": (3, 16), "speaker": (3, 1), "phones": (3, 16)}
    assert {name: array.dtype for name, array in tensors.items()} == {name: array.dtype for name, array in sent.items()}
    np.testing.assert_array_equal(tensors["features"][:, :10], sent["features"])
    assert (tensors["features"][:, 10:] == -1.5).all()
    np.testing.assert_array_equal(tensors["frame_mask"][:, :10], 1.0)
    assert (tensors["frame_mask"][:, 10:] == 0.0).all()
    np.testing.assert_array_equal(tensors["phones"][:, :10], sent["phones"])
    assert (tensors["phones"][:, 10:] == 7).all()
    # The speaker id has no frames axis: it passes through as sent.
    np.testing.assert_array_equal(tensors["speaker"], sent["speaker"])
    assert prepared.token_counts.tolist() == [10, 10, 10] and prepared.token_counts.dtype == np.int32
    assert chunk.num_real_tokens == 30 and num_padded_positions(chunk.chunk) == 48
    assert prepared.rows_by_bucket() == {16: 3}


@pytest.mark.parametrize(("num_frames", "bucket"), [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64)])
def test_a_request_goes_to_the_smallest_bucket_that_holds_it(num_frames, bucket):
    (chunk,) = TensorRouter(audio_config()).prepare(audio_request(num_rows=1, num_frames=num_frames)).chunks
    assert chunk.chunk.bucket_len == bucket and chunk.tensors["features"].shape == (1, bucket, 3)
    if num_frames == bucket:  # already the bucket's length: nothing padded
        assert (chunk.tensors["frame_mask"] == 1.0).all()


def test_rows_are_cut_into_chunks_of_the_bucket_s_max_batch():
    sent = audio_request(num_rows=5, num_frames=20)
    prepared = TensorRouter(audio_config()).prepare(sent)
    assert prepared.chunk_plan == [Chunk(32, (0, 1)), Chunk(32, (2, 3)), Chunk(32, (4,))]
    assert [c.model_name for c in prepared.chunks] == ["audio_32"] * 3
    assert [c.num_real_tokens for c in prepared.chunks] == [40, 40, 20]
    assert prepared.lanes() == [[0, 1, 2]]  # one bucket: one lane, chunks one after another
    for chunk in prepared.chunks:
        rows = list(chunk.chunk.row_indices)
        np.testing.assert_array_equal(chunk.tensors["speaker"], sent["speaker"][rows])
        np.testing.assert_array_equal(chunk.tensors["features"][:, :20], sent["features"][rows])
        assert all(array.flags["C_CONTIGUOUS"] for array in chunk.tensors.values())


def test_a_model_without_a_variable_axis_has_one_fixed_bucket():
    config = image_config()
    assert config.bucket_lens == (FIXED_BUCKET,) and config.carriers == ()
    assert config.model_for(FIXED_BUCKET) == "resnet_fixed" == bucket_model_name("resnet_", FIXED_BUCKET)
    pixels = np.random.default_rng(0).standard_normal((6, 3, 8, 8)).astype(np.float32)
    prepared = TensorRouter(config).prepare({"pixel_values": pixels})
    assert prepared.chunk_plan == [Chunk(FIXED_BUCKET, (0, 1, 2, 3)), Chunk(FIXED_BUCKET, (4, 5))]
    assert [c.model_name for c in prepared.chunks] == ["resnet_fixed", "resnet_fixed"]
    np.testing.assert_array_equal(np.concatenate([c.tensors["pixel_values"] for c in prepared.chunks]), pixels)
    assert prepared.token_counts.tolist() == [1] * 6
    assert [c.num_real_tokens for c in prepared.chunks] == [4, 2]
    assert [num_padded_positions(c.chunk) for c in prepared.chunks] == [4, 2]
    with pytest.raises(InvalidInput, match=r"^input 'pixel_values' has size 7 on axis 2; the model takes 8 there"):
        TensorRouter(config).prepare({"pixel_values": np.zeros((1, 3, 7, 8), np.float32)})


def test_free_dims_besides_the_variable_axis_are_not_bucketed():
    # An image model batched as sent: height and width free, no variable axis declared.
    config = image_config(inputs=(TensorSpec("pixel_values", "TYPE_FP32", (3, -1, -1)),))
    (chunk,) = TensorRouter(config).prepare({"pixel_values": np.zeros((2, 3, 5, 9), np.float32)}).chunks
    assert chunk.tensors["pixel_values"].shape == (2, 3, 5, 9)


def test_bucket_dims_fix_the_variable_axis_of_the_inputs_that_carry_it():
    config = audio_config()
    assert [config.bucket_dims(spec, 32) for spec in config.inputs] == [(32, 3), (32,), (1,), (32,)]
    assert config.carriers == (FEATURES, FRAME_MASK, PHONES)
    assert image_config().bucket_dims(image_config().inputs[0], FIXED_BUCKET) == (3, 8, 8)


# --- reassembly -----------------------------------------------------------------------------------


def test_every_output_is_put_back_in_row_order():
    router = TensorRouter(audio_config())
    prepared = router.prepare(audio_request(num_rows=5, num_frames=20))
    answers = []
    for chunk in prepared.chunks:
        rows = np.asarray(chunk.chunk.row_indices, dtype=np.float32)
        answers.append({"logits": np.repeat(rows[:, None], 4, axis=1),
                        "frame_scores": np.repeat(rows[:, None], 32, axis=1) * 10})
    outputs = router.reassemble(prepared, answers)
    assert set(outputs) == {"logits", "frame_scores"}
    assert outputs["logits"].shape == (5, 4) and outputs["frame_scores"].shape == (5, 32)
    np.testing.assert_array_equal(outputs["logits"][:, 0], np.arange(5))
    np.testing.assert_array_equal(outputs["frame_scores"][:, 31], np.arange(5) * 10)


def test_reassembly_refuses_a_missing_output_or_answer():
    router = TensorRouter(audio_config())
    prepared = router.prepare(audio_request(num_rows=5, num_frames=20))
    logits_only = [{"logits": np.zeros((len(c.chunk.row_indices), 4), np.float32)} for c in prepared.chunks]
    with pytest.raises(ValueError, match=r"bucket model audio_32 returned no output \['frame_scores'\]"):
        router.reassemble(prepared, logits_only)
    with pytest.raises(ValueError, match="3 chunks but 2 answers"):
        router.reassemble(prepared, logits_only[:2])


# --- config and parameters ---------------------------------------------------------------------------


def audio_parameters(**overrides) -> dict[str, str]:
    parameters = {
        "inputs": json.dumps([{"name": "features", "data_type": "TYPE_FP32", "dims": [-1, 3], "pad": -1.5},
                              {"name": "frame_mask", "data_type": "TYPE_FP32", "dims": [-1], "pad": 0},
                              {"name": "speaker", "data_type": "TYPE_INT64", "dims": [1]},
                              {"name": "phones", "data_type": "INT32", "dims": [-1], "pad": 7}]),
        "outputs": json.dumps([{"name": "logits", "data_type": "TYPE_FP32", "dims": [4]},
                               {"name": "frame_scores", "data_type": "TYPE_FP32", "dims": [-1]}]),
        "variable_axis": "0",
        "bucket_lens": "16,32,64",
        "bucket_max_batch": "16:4,32:2,64:1",
        "encoder_prefix": "audio_",
    }
    parameters.update(overrides)
    return {key: value for key, value in parameters.items() if value is not None}


def test_parameters_read_into_the_router_config():
    assert parse_tensor_router_config("audio", audio_parameters()) == audio_config()


def test_parameters_round_trip_through_config_text():
    written = TensorRouterParameters(
        inputs=audio_config().inputs, outputs=audio_config().outputs, variable_axis=0, bucket_lens=(16, 32, 64),
        bucket_max_batch={16: 4, 32: 2, 64: 1}, encoder_prefix="audio_",
        version_weights=RoutingTable({1: 0.9, 2: 0.1}),
        admission=AdmissionPolicy(row_cost_ms={16: 1.0, 32: 2.0, 64: 4.0}, lanes=2, max_work_ms=400.0),
        max_concurrent_requests=8)
    text = written.to_parameters()
    assert all(isinstance(value, str) for value in text.values())
    assert json.loads(text["inputs"])[0] == {"name": "features", "data_type": "TYPE_FP32", "dims": [-1, 3], "pad": -1.5}
    assert "pad" not in json.loads(text["inputs"])[2] and "pad" not in json.loads(text["outputs"])[0]
    assert text["bucket_lens"] == "16,32,64" and text["variable_axis"] == "0"
    read = TensorRouterParameters.from_parameters("audio", text)
    assert read == written
    assert read.router_config() == audio_config(default_routing=RoutingTable({1: 0.9, 2: 0.1}),
                                                admission=written.admission, max_concurrent_requests=8)


def test_fixed_parameters_round_trip():
    written = TensorRouterParameters(inputs=image_config().inputs, outputs=image_config().outputs,
                                     bucket_max_batch={FIXED_BUCKET: 4}, encoder_prefix="resnet_")
    text = written.to_parameters()
    assert "variable_axis" not in text and "bucket_lens" not in text and text["bucket_max_batch"] == "0:4"
    read = TensorRouterParameters.from_parameters("resnet", text)
    assert read == written and read.router_config() == image_config()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"inputs": None}, "parameter inputs is required: a JSON list of"),
        ({"outputs": None}, "parameter outputs is required"),
        ({"inputs": "[{"}, "parameter inputs is not JSON"),
        ({"inputs": '{"name": "x"}'}, "parameter inputs must be a JSON list of tensors"),
        ({"inputs": "[3]"}, "parameter inputs entry 0 is not an object"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_FP32"}]'}, "parameter inputs entry 0 has no dims"),
        ({"outputs": '[{"name": "y", "data_type": "TYPE_FP32", "dims": [2], "pad": 0}]'},
         r"parameter outputs entry 0 has unknown keys \['pad'\]; the keys are name, data_type, dims"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_FP32", "dims": 3}]'},
         "parameter inputs entry 0: name must be a string and dims a list"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_STRING", "dims": [-1], "pad": 0}]'},
         "parameter inputs entry 0: data type 'TYPE_STRING' is not one of BOOL, UINT8"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_FP32", "dims": [0], "pad": 0}]'},
         r"tensor 'x': dims must be sizes >= 1 or -1 \(free\), got \[0\]"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_INT64", "dims": [-1], "pad": 0.5}]'},
         r"tensor 'x': pad 0\.5 does not fit INT64"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_UINT8", "dims": [-1], "pad": -1}]'},
         "tensor 'x': pad -1 does not fit UINT8"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}]'},
         "input 'x' carries variable axis 0 but declares no pad value"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}]'},
         r"no input has a free dim \(-1\) at variable axis 0: x \[3\]"),
        ({"inputs": '[{"name": "x", "data_type": "TYPE_FP32", "dims": [-1], "pad": 0}, '
                    '{"name": "x", "data_type": "TYPE_FP32", "dims": [-1], "pad": 0}]'},
         r"inputs names must be distinct, got \['x', 'x'\]"),
        ({"outputs": "[]"}, "a tensor model needs at least one of its outputs"),
        ({"variable_axis": "frames"}, "parameter variable_axis='frames' is not an integer"),
        ({"variable_axis": "-2"}, "parameter variable_axis=-2 must be >= 0, or -1 for none"),
        ({"variable_axis": "-1"}, "parameter bucket_lens=16,32,64 needs a variable_axis"),
        ({"bucket_lens": "16,x"}, "parameter bucket_lens='16,x' is not a comma list of lengths"),
        ({"bucket_lens": ""}, "at least one bucket length is required with a variable axis"),
        ({"bucket_lens": "0,16"}, "bucket lengths must be integers >= 1, got 0"),
        ({"bucket_lens": "16,16"}, "bucket lengths must be distinct"),
        ({"bucket_max_batch": "16:4,32:2"}, r"bucket_max_batch has no limit for buckets \[64\]$"),
        ({"variable_axis": None, "bucket_lens": None},
         r"bucket_max_batch has no limit for buckets \[0\] \(a model without a variable axis has the one bucket 0"),
        ({"admission": AdmissionPolicy(row_cost_ms={16: 1.0}, lanes=1, max_work_ms=400.0).to_json()},
         r"parameter admission has no row cost for buckets \[32, 64\]"),
    ],
)
def test_bad_parameters_name_the_model_and_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_tensor_router_config("audio", audio_parameters(**overrides))
    assert str(info.value).startswith("model 'audio': ")


def test_config_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match=r"bucket lengths \[16\] need a variable axis"):
        image_config(bucket_lens=(16,))
    with pytest.raises(ValueError, match="variable axis must be an index >= 0"):
        audio_config(variable_axis=-1)
    with pytest.raises(ValueError, match="a tensor model needs at least one of its inputs"):
        audio_config(inputs=())
    with pytest.raises(ValueError, match="a tensor needs a name"):
        TensorSpec("", "TYPE_FP32", (1,))
    assert TensorSpec("m", "BOOL", (-1,), pad_value=0).dtype == np.bool_
    with pytest.raises(ValueError, match=r"pad 0\.0 does not fit BOOL"):
        TensorSpec("m", "BOOL", (-1,), pad_value=0.0)


AUDIO_REGIMES = LingerRegimes(up_rps=40.0, down_rps=20.0, hold_s=30.0, instances=2, express="audio_express",
                              peak_us={"audio_16": 30000})


def test_linger_regimes_are_read_and_checked_against_the_buckets():
    read = parse_tensor_router_config("audio", audio_parameters(linger_regimes=AUDIO_REGIMES.to_json()))
    assert read == audio_config(linger_regimes=AUDIO_REGIMES)
    assert parse_tensor_router_config("audio", audio_parameters()).linger_regimes is None
    with pytest.raises(ValueError, match=r"names \['resnet_16'\], which are not bucket models of this router"):
        audio_config(linger_regimes=LingerRegimes(**{**AUDIO_REGIMES.__dict__, "peak_us": {"resnet_16": 1}}))
    with pytest.raises(ValueError, match="the external model 'classifier' has no express model"):
        image_config(fixed_model="classifier", linger_regimes=LingerRegimes(
            **{**AUDIO_REGIMES.__dict__, "peak_us": {"classifier": 1000}}))
