"""Bucket encoder config validation and batch splitting, no server."""

import numpy as np
import pytest

from python_backends.embed.encoder import (
    EncoderConfig,
    batch_rows_buckets,
    parse_encoder_config,
    pick_providers,
    split_rows,
)


def config(**overrides):
    base = {
        "name": "encoder_32",
        "max_batch_size": 16,
        "input": [{"name": "INPUT_IDS", "dims": ["32"]}, {"name": "ATTENTION_MASK", "dims": ["32"]}],
        "output": [{"name": "EMBEDDING", "dims": ["384"]}],
        "parameters": {"intra_op_threads": {"string_value": "2"}},
    }
    base.update(overrides)
    return base


def test_parse_encoder_config():
    parsed = parse_encoder_config(config())
    assert parsed == EncoderConfig(model_name="encoder_32", seq_len=32, max_batch_size=16, intra_op_threads=2)


FREE = {"free_length": {"string_value": "1"}}


def test_the_express_model_takes_any_length():
    free = [{"name": "INPUT_IDS", "dims": ["-1"]}, {"name": "ATTENTION_MASK", "dims": ["-1"]}]
    parsed = parse_encoder_config(config(name="encoder_express", input=free, parameters=FREE))
    assert parsed == EncoderConfig(model_name="encoder_express", seq_len=None, max_batch_size=16)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"input": [{"name": "INPUT_IDS", "dims": ["32"]}]}, "no input ATTENTION_MASK"),
        ({"parameters": FREE}, r"with free_length, INPUT_IDS dims must be \[-1\] \(any length\), got \[32\]"),
        ({"input": [{"name": "INPUT_IDS", "dims": ["-1"]}, {"name": "ATTENTION_MASK", "dims": ["32"]}],
          "parameters": FREE}, "differ"),
        ({"input": [{"name": "INPUT_IDS", "dims": ["-1"]}, {"name": "ATTENTION_MASK", "dims": ["-1"]}]},
         "one fixed length"),
        ({"input": [{"name": "INPUT_IDS", "dims": ["32"]}, {"name": "ATTENTION_MASK", "dims": ["16"]}]},
         "differ"),
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
        ({"output": []}, "exactly one output"),
        ({"input": [{"name": "INPUT_IDS", "dims": ["32"]}, {"name": "ATTENTION_MASK", "dims": ["32"]},
                    {"name": "PIXELS", "dims": ["32"]}]}, r"onnx_inputs names no graph input for \['PIXELS'\]"),
        ({"parameters": {"pooling": {"string_value": "max"}}}, "parameter pooling: unknown pooling 'max'"),
        ({"parameters": {"intra_op_threads": {"string_value": "two"}}}, "intra_op_threads='two' is not an integer"),
        ({"parameters": {"intra_op_threads": {"string_value": "-1"}}}, "intra_op_threads=-1 must be >= 0"),
        ({"parameters": {"allow_spinning": {"string_value": "yes"}}}, "allow_spinning must be 0 or 1"),
    ],
)
def test_parse_encoder_config_errors_name_the_model(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_encoder_config(config(**overrides))
    assert "encoder_32" in str(info.value)


def test_pick_providers_keeps_order_and_falls_back_to_cpu():
    wanted = ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert pick_providers(wanted, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert pick_providers(wanted, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == list(wanted)
    assert pick_providers(("TensorrtExecutionProvider",), ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_split_rows():
    stacked = np.arange(6).reshape(6, 1)
    parts = split_rows(stacked, [1, 3, 2])
    assert [p.ravel().tolist() for p in parts] == [[0], [1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="batch has 6 rows but requests sum to 5"):
        split_rows(stacked, [2, 3])


def test_batch_rows_buckets_are_powers_of_two_then_the_batch_limit():
    assert batch_rows_buckets(22) == [1, 2, 4, 8, 16, 22]
    assert batch_rows_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_rows_buckets(1) == [1]


def test_batch_rows_buckets_rejects_a_limit_below_one():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        batch_rows_buckets(0)
