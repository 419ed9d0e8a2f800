"""Merging the kit's knobs into a config.pbtxt the user wrote: only the managed fields change."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tools.repository.external import (
    MANAGED_FIELDS,
    ExternalConfigError,
    managed_drift,
    merge_managed,
    parse_config,
)

USER_CONFIG = """
# The user's own notes.
name: "resnet"
backend: "onnxruntime"
max_batch_size: 8
input [
  { name: "image", data_type: TYPE_FP32, dims: [3, 224, 224] }
]
output [
  { name: "logits", data_type: TYPE_FP32, dims: [1000] }
]
instance_group [ { kind: KIND_CPU, count: 4 } ]
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
optimization { execution_accelerators { cpu_execution_accelerator: [ { name: "openvino" } ] } }
model_warmup [ { name: "w", batch_size: 1, inputs { key: "image" value { data_type: TYPE_FP32, dims: [3, 224, 224],
  zero_data: true } } } ]
"""


def derived() -> mc.ModelConfig:
    config = mc.ModelConfig(name="resnet", max_batch_size=16)
    config.dynamic_batching.preferred_batch_size.extend([4, 8])
    config.dynamic_batching.max_queue_delay_microseconds = 2500
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=2)
    return config


def without_managed(config: mc.ModelConfig) -> mc.ModelConfig:
    copy = mc.ModelConfig()
    copy.CopyFrom(config)
    for field in MANAGED_FIELDS:
        copy.ClearField(field)
    return copy


def test_the_managed_fields_are_the_kit_s_and_every_other_field_the_user_s():
    merged_text = merge_managed(USER_CONFIG, derived(), "repo/resnet/config.pbtxt", header=("Knobs by the kit.",))
    assert merged_text.startswith("# Knobs by the kit.\n")
    merged = parse_config(merged_text, "merged")
    user = parse_config(USER_CONFIG, "user")
    assert without_managed(merged) == without_managed(user)  # backend, tensors, parameters, warm-up, ...
    assert merged.max_batch_size == 16
    assert list(merged.dynamic_batching.preferred_batch_size) == [4, 8]
    assert merged.dynamic_batching.max_queue_delay_microseconds == 2500
    assert [(g.kind, g.count) for g in merged.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 2)]


def test_merging_twice_changes_nothing_and_check_then_sees_no_drift():
    once = merge_managed(USER_CONFIG, derived(), "c")
    assert merge_managed(once, derived(), "c") == once
    assert managed_drift(once, derived(), "c") == []


def test_drift_names_each_managed_field_that_differs():
    drift = managed_drift(USER_CONFIG, derived(), "repo/resnet/config.pbtxt")
    assert drift == [
        "repo/resnet/config.pbtxt: max_batch_size: 8 -> 16",
        "repo/resnet/config.pbtxt: dynamic_batching: unset -> { preferred_batch_size: 4 preferred_batch_size: 8 "
        "max_queue_delay_microseconds: 2500 }",
        "repo/resnet/config.pbtxt: instance_group: [{ count: 4 kind: KIND_CPU }] -> [{ count: 2 kind: KIND_CPU }]",
    ]


def test_a_derived_config_without_dynamic_batching_removes_the_user_s():
    user = USER_CONFIG + "dynamic_batching { max_queue_delay_microseconds: 100 }\n"
    plain = mc.ModelConfig(name="resnet", max_batch_size=4)
    merged = parse_config(merge_managed(user, plain, "c"), "c")
    assert not merged.HasField("dynamic_batching") and not merged.instance_group


def test_a_config_that_does_not_parse_or_names_another_model_is_refused_naming_the_file():
    with pytest.raises(ExternalConfigError, match=r"repo/x/config.pbtxt: not a Triton model config: .*bogus_field"):
        merge_managed('name: "x"\nbogus_field: 3\n', derived(), "repo/x/config.pbtxt")
    with pytest.raises(ExternalConfigError, match=r"repo/x/config.pbtxt: the config names model 'other', not 'resnet'"):
        merge_managed('name: "other"\n', derived(), "repo/x/config.pbtxt")


def test_the_merged_text_is_protobuf_text_format():
    merged = merge_managed(USER_CONFIG, derived(), "c")
    assert merged == text_format.MessageToString(parse_config(merged, "c"))
