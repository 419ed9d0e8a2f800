"""The kit's knobs in a config.pbtxt the user wrote: merge them in, leave every other field.

A model that already lives in the user's Triton repository (any backend) keeps its own
config; the kit manages only the fields that batching and concurrency are made of
(`MANAGED_FIELDS`). `merge_managed` takes the user's text and the config the kit derived and
returns the user's config with exactly those fields replaced, written with protobuf's text
format (comments in the user's file are not kept: protobuf has no place for them, so the
result says where the fields came from in its own header); `managed_drift` lists the managed
fields whose values differ, for `gen-config --check`. Pure: text in, text out.
"""

from __future__ import annotations

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

MANAGED_FIELDS = ("max_batch_size", "dynamic_batching", "instance_group")


class ExternalConfigError(ValueError):
    """A user's config.pbtxt the kit cannot merge into; the message names the file."""


def parse_config(text: str, where: str) -> mc.ModelConfig:
    """The user's config as a message; ExternalConfigError naming `where` if it does not parse."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        raise ExternalConfigError(f"{where}: not a Triton model config: {error}") from error
    return config


def merge_managed(user_text: str, derived: mc.ModelConfig, where: str,
                  header: tuple[str, ...] = ()) -> str:
    """The user's config with the kit's MANAGED_FIELDS from `derived`, every other field as the
    user wrote it; `header` lines go first as comments."""
    config = parse_config(user_text, where)
    if config.name and derived.name and config.name != derived.name:
        raise ExternalConfigError(f"{where}: the config names model {config.name!r}, not {derived.name!r}")
    for field in MANAGED_FIELDS:
        config.ClearField(field)
    config.max_batch_size = derived.max_batch_size
    if derived.HasField("dynamic_batching"):
        config.dynamic_batching.CopyFrom(derived.dynamic_batching)
    config.instance_group.extend(derived.instance_group)
    body = text_format.MessageToString(config)
    return "".join(f"# {line}\n" for line in header) + body


def managed_drift(user_text: str, derived: mc.ModelConfig, where: str) -> list[str]:
    """The managed fields whose value in the user's config is not the derived one, each as
    `field: have -> want` in one line; empty when the config is as the kit would write it."""
    config = parse_config(user_text, where)
    drift = []
    for field in MANAGED_FIELDS:
        have = _field_text(config, field)
        want = _field_text(derived, field)
        if have != want:
            drift.append(f"{where}: {field}: {have or 'unset'} -> {want or 'unset'}")
    return drift


def _field_text(config: mc.ModelConfig, field: str) -> str:
    """A managed field's value on one line ('' when unset)."""
    if field == "max_batch_size":
        return str(config.max_batch_size)
    if field == "dynamic_batching":
        if not config.HasField("dynamic_batching"):
            return ""
        return "{ " + text_format.MessageToString(config.dynamic_batching, as_one_line=True) + " }"
    return "[" + ", ".join("{ " + text_format.MessageToString(group, as_one_line=True) + " }"
                           for group in config.instance_group) + "]" if config.instance_group else ""
