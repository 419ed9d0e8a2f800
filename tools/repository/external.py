"""The kit's knobs in a config.pbtxt the user wrote: merge them in, leave every other field.

A model that already lives in the user's Triton repository (any backend) keeps its own
config; the kit manages only the fields that batching and concurrency are made of
(`MANAGED_FIELDS`). `merge_managed` takes the user's text and the config the kit derived and
returns the user's text with exactly those fields replaced where they stand (fields the user
did not write go at the end), and a header of `#|` lines saying what the kit wrote and why.
Everything else, comments and layout included, stays byte for byte: the top-level fields are
found by a small scanner of protobuf's text format (`_top_level_fields`), and the result is
parsed back and compared with the intended message, so a config the scanner misreads is
written whole in protobuf's text format instead of wrongly. `managed_drift` lists the managed
fields whose values differ, for `gen-config --check`; `loaded_versions` says which version
folders the config's own `version_policy` has Triton load. Pure: text in, text out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

MANAGED_FIELDS = ("max_batch_size", "dynamic_batching", "instance_group")
HEADER_PREFIX = "#|"  # the kit's header lines; a merge replaces those at the top of the file


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


def merged_config(user: mc.ModelConfig, derived: mc.ModelConfig) -> mc.ModelConfig:
    """The user's config with the MANAGED_FIELDS of `derived`."""
    config = mc.ModelConfig()
    config.CopyFrom(user)
    for field in MANAGED_FIELDS:
        config.ClearField(field)
    config.max_batch_size = derived.max_batch_size
    if derived.HasField("dynamic_batching"):
        config.dynamic_batching.CopyFrom(derived.dynamic_batching)
    config.instance_group.extend(derived.instance_group)
    return config


def merge_managed(user_text: str, derived: mc.ModelConfig, where: str,
                  header: tuple[str, ...] = ()) -> str:
    """The user's config with the kit's MANAGED_FIELDS from `derived`, every other field as the
    user wrote it; `header` lines go first as `#|` comments (replacing the last merge's)."""
    config = parse_config(user_text, where)
    if config.name and derived.name and config.name != derived.name:
        raise ExternalConfigError(f"{where}: the config names model {config.name!r}, not {derived.name!r}")
    want = merged_config(config, derived)
    top = "".join(f"{HEADER_PREFIX} {line}".rstrip() + "\n" for line in header)
    body = _without_header(user_text)
    spliced = _splice(body, derived)
    if spliced is None or parse_config(spliced, where) != want:
        spliced = text_format.MessageToString(want)  # a layout the scanner does not follow: the fields, whole
    return top + spliced


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


def loaded_versions(config: mc.ModelConfig, folders: Iterable[int]) -> set[int]:
    """The version folders Triton loads for this config at start: its `version_policy` (by
    default the latest one) applied to the numbered folders there are."""
    versions = sorted(set(folders))
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return set(versions)
    if which == "specific":
        return set(policy.specific.versions) & set(versions)
    count = policy.latest.num_versions if which == "latest" else 1
    return set(versions[-count:]) if count > 0 else set()


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


# --- keeping the user's text --------------------------------------------------------------------


def _without_header(text: str) -> str:
    """The text without the `#|` header a previous merge put on top."""
    lines = text.splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith(HEADER_PREFIX):
        start += 1
    return "".join(lines[start:])


@dataclass(frozen=True)
class _Field:
    """Where one top-level field of a text-format message is written."""

    name: str
    start: int  # offset of its name
    end: int  # offset just past its value (and a `,` or `;` after it)


_OPEN = {"{": "}", "<": ">", "[": "]"}
_SPACE = " \t\r\n\f\v"


def _skip_space(text: str, at: int) -> int:
    """Past whitespace and `#` comments."""
    while at < len(text):
        if text[at] in _SPACE:
            at += 1
        elif text[at] == "#":
            newline = text.find("\n", at)
            at = len(text) if newline < 0 else newline + 1
        else:
            break
    return at


def _skip_string(text: str, at: int) -> int:
    """Past the quoted string starting at `at` (escapes honoured)."""
    quote, at = text[at], at + 1
    while at < len(text) and text[at] != quote:
        at += 2 if text[at] == "\\" else 1
    if at >= len(text):
        raise ValueError("unterminated string")
    return at + 1


def _skip_value(text: str, at: int) -> int:
    """Past one value: a message or list (brackets balanced, strings and comments skipped), one
    or more adjacent strings, or a scalar token."""
    if text[at] in _OPEN:
        closing = [_OPEN[text[at]]]
        at += 1
        while closing:
            at = _skip_space(text, at)
            if at >= len(text):
                raise ValueError("unbalanced brackets")
            char = text[at]
            if char in "\"'":
                at = _skip_string(text, at)
            elif char in _OPEN:
                closing.append(_OPEN[char])
                at += 1
            elif char == closing[-1]:
                closing.pop()
                at += 1
            elif char in "}>]":
                raise ValueError(f"unexpected {char!r}")
            else:
                at += 1
        return at
    if text[at] in "\"'":
        while at < len(text) and text[at] in "\"'":
            at = _skip_space(text, _skip_string(text, at))
        return at
    start = at
    while at < len(text) and text[at] not in _SPACE + ",;#{}[]<>\"'":
        at += 1
    if at == start:
        raise ValueError(f"no value at offset {at}")
    return at


def _top_level_fields(text: str) -> list[_Field]:
    """Every top-level field of a text-format message, in order; ValueError where the text is
    not laid out as this scanner expects."""
    fields = []
    at = _skip_space(text, 0)
    while at < len(text):
        start = at
        while at < len(text) and (text[at].isalnum() or text[at] == "_"):
            at += 1
        if at == start:
            raise ValueError(f"no field name at offset {at}")
        name = text[start:at]
        at = _skip_space(text, at)
        if at < len(text) and text[at] == ":":
            at = _skip_space(text, at + 1)
        if at >= len(text):
            raise ValueError(f"field {name} has no value")
        at = _skip_value(text, at)
        after = _skip_space(text, at)
        end = after + 1 if after < len(text) and text[after] in ",;" else at
        fields.append(_Field(name, start, end))
        at = _skip_space(text, end)
    return fields


def _line_span(text: str, field: _Field) -> tuple[int, int] | None:
    """The whole lines a field fills (from its line's start to past its last line's newline),
    when nothing but blanks and a trailing comment shares them; None otherwise."""
    line_start = text.rfind("\n", 0, field.start) + 1
    if text[line_start:field.start].strip():
        return None
    line_end = text.find("\n", field.end)
    line_end = len(text) if line_end < 0 else line_end + 1
    rest = text[field.end:line_end].strip()
    if rest and not rest.startswith("#"):
        return None
    return line_start, line_end


def _render(derived: mc.ModelConfig, field: str, one_line: bool) -> str:
    """The derived value of one managed field in text format ('' when it has none)."""
    only = mc.ModelConfig()
    if field == "max_batch_size":
        only.max_batch_size = derived.max_batch_size
        return f"max_batch_size: {derived.max_batch_size}" + ("" if one_line else "\n")
    if field == "dynamic_batching":
        if not derived.HasField("dynamic_batching"):
            return ""
        only.dynamic_batching.CopyFrom(derived.dynamic_batching)
    else:
        only.instance_group.extend(derived.instance_group)
    return text_format.MessageToString(only, as_one_line=one_line)


def _splice(text: str, derived: mc.ModelConfig) -> str | None:
    """`text` with each managed field replaced where it first stands (later repeats removed);
    those it lacks go after the first managed field that fills its own lines (beside the other
    batching fields), else at the end. None when the scanner cannot follow the text."""
    try:
        fields = _top_level_fields(text)
    except ValueError:
        return None
    present = {field.name for field in fields}
    missing = "".join(_render(derived, name, one_line=False) for name in MANAGED_FIELDS if name not in present)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), in text order
    done: set[str] = set()
    for field in fields:
        if field.name not in MANAGED_FIELDS:
            continue
        lines = _line_span(text, field)
        first = field.name not in done
        done.add(field.name)
        if lines is None:
            edits.append((field.start, field.end, _render(derived, field.name, one_line=True) if first else ""))
            continue
        replacement = _render(derived, field.name, one_line=False) if first else ""
        if first and missing:
            replacement, missing = replacement + missing, ""
        edits.append((*lines, replacement))
    out, at = [], 0
    for start, end, replacement in edits:
        out += [text[at:start], replacement]
        at = end
    out.append(text[at:])
    result = "".join(out)
    if missing:
        result = (result if not result or result.endswith("\n") else result + "\n") + missing
    return result
