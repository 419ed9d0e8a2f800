"""Merging the kit's knobs into a config.pbtxt the user wrote: only the managed fields change."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tools.repository import external
from tools.repository.external import (
    HEADER_PREFIX,
    MANAGED_FIELDS,
    ExternalConfigError,
    loaded_versions,
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
    assert merged_text.startswith(f"{HEADER_PREFIX} Knobs by the kit.\n")
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


def test_the_user_s_text_stays_byte_for_byte_and_each_managed_field_is_written_where_it_stood():
    merged = merge_managed(USER_CONFIG, derived(), "c", header=("one", "two"))
    user_lines = USER_CONFIG.splitlines()
    kept = [line for line in user_lines if not line.startswith(("max_batch_size", "instance_group"))]
    lines = merged.splitlines()
    assert lines[:2] == [f"{HEADER_PREFIX} one", f"{HEADER_PREFIX} two"]
    body = lines[2:]
    at_batch = user_lines.index("max_batch_size: 8")
    assert body[:at_batch] == user_lines[:at_batch]  # comments and all, as written
    managed_text = text_format.MessageToString(mc.ModelConfig(
        max_batch_size=16, dynamic_batching=derived().dynamic_batching)).splitlines()
    assert body[at_batch:at_batch + len(managed_text)] == managed_text  # missing fields join the first one
    rest = body[at_batch + len(managed_text):]
    groups = text_format.MessageToString(mc.ModelConfig(instance_group=derived().instance_group)).splitlines()
    at_group = rest.index(groups[0])
    assert rest[at_group:at_group + len(groups)] == groups
    assert rest[:at_group] + rest[at_group + len(groups):] == kept[at_batch:]


def test_a_managed_field_sharing_its_line_is_rewritten_on_that_line():
    text = ('name: "resnet" max_batch_size: 2 # tuned by hand\n'
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    merged = merge_managed(text, mc.ModelConfig(name="resnet", max_batch_size=16), "c")
    assert merged == 'name: "resnet" max_batch_size: 16 # tuned by hand\ninput [ { name: "x" data_type: TYPE_FP32 ' \
                     'dims: [ 1 ] } ]\n'


def test_repeated_instance_groups_become_the_derived_ones_in_the_first_one_s_place():
    text = ('name: "resnet"\ninstance_group { kind: KIND_GPU count: 1 gpus: [0] }\n# second GPU\n'
            'instance_group { kind: KIND_GPU count: 1 gpus: [1] }\nmax_batch_size: 8\n')
    merged = merge_managed(text, derived(), "c")
    assert merged.startswith('name: "resnet"\ninstance_group {\n  count: 2\n  kind: KIND_CPU\n}\ndynamic_batching {')
    assert merged.endswith("}\n# second GPU\nmax_batch_size: 16\n")
    assert [(g.kind, g.count) for g in parse_config(merged, "c").instance_group] == [(mc.ModelInstanceGroup.KIND_CPU,
                                                                                      2)]


def test_a_new_header_replaces_the_last_merge_s():
    once = merge_managed(USER_CONFIG, derived(), "c", header=("from spec abc",))
    twice = merge_managed(once, derived(), "c", header=("from spec def", "and a second line"))
    assert twice == once.replace(f"{HEADER_PREFIX} from spec abc\n",
                                 f"{HEADER_PREFIX} from spec def\n{HEADER_PREFIX} and a second line\n")


def test_a_layout_the_scanner_cannot_follow_is_written_whole_and_still_right(monkeypatch):
    monkeypatch.setattr(external, "_top_level_fields", lambda text: (_ for _ in ()).throw(ValueError("odd")))
    merged = merge_managed(USER_CONFIG, derived(), "c", header=("h",))
    assert merged == f"{HEADER_PREFIX} h\n" + text_format.MessageToString(parse_config(merged, "c"))
    assert without_managed(parse_config(merged, "c")) == without_managed(parse_config(USER_CONFIG, "c"))


def test_strings_and_comments_holding_brackets_do_not_confuse_the_scanner():
    text = ('name: "resnet"\nparameters { key: "note" value { string_value: "max_batch_size: 9 } {" } }\n'
            "# instance_group [ { count: 9 } ]\nmax_batch_size: 8\n")
    merged = merge_managed(text, derived(), "c")
    assert '"max_batch_size: 9 } {"' in merged and "# instance_group [ { count: 9 } ]" in merged
    assert parse_config(merged, "c").max_batch_size == 16


@pytest.mark.parametrize(("policy", "folders", "loaded"), [
    ("", [1, 2, 3], {3}),
    ("version_policy { latest { num_versions: 2 } }", [1, 2, 3], {2, 3}),
    ("version_policy { all { } }", [1, 3], {1, 3}),
    ("version_policy { specific { versions: [1, 4] } }", [1, 2], {1}),
])
def test_the_versions_a_config_loads_follow_its_version_policy(policy, folders, loaded):
    assert loaded_versions(parse_config(f'name: "m"\n{policy}', "c"), folders) == loaded
