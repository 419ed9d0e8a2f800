"""What the schemas of the kit's files share: the pydantic base of a table, the error a rule
raises about a whole table, and the wording of pydantic's `ValidationError` as the kit's
messages, one line per problem naming the file, the table and the key:

    serving.toml [models.embed]: 'slo_p95_ms' must be > 0, got -5
    serving.toml [tenants.auth]: unknown key(s) ['mdoe']; the keys are [...]

Pure: the callers read the files and raise their own error type with `describe(...)`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

TABLE_ERROR = "table"  # the error type of a rule about a whole table (see `table_error`)


class Table(BaseModel):
    """A table of a user-written file. Each field's docstring is its description (the JSON
    schema's and the docs'); infinities and NaN are refused wherever a number is read. Keys the
    schema does not know are ignored, as the kit always has; `ClosedTable` refuses them."""

    model_config = ConfigDict(use_attribute_docstrings=True, allow_inf_nan=False, frozen=True)


class ClosedTable(Table):
    """A table whose unknown keys are an error: a misspelt key in it must not fall back to a
    default silently (a security setting, for example)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """All the unknown keys in one message, with the keys there are."""
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise table_error(f"unknown key(s) {unknown}; the keys are {list(cls.model_fields)}")
        return data


def table_error(message: str, at: tuple[str, ...] = ()) -> PydanticCustomError:
    """A rule's error about the table being validated (or its sub-table `at`), not about one of
    its keys: a `ValueError` raised in a field validator is reported under the field's table, this
    one under the table itself, e.g. `[tenants.members]: tenant 'acme' is in tier 'gold', ...`."""
    return PydanticCustomError(TABLE_ERROR, "{message}", {"message": message, "at": at})


def _split(loc: tuple[str | int, ...]) -> tuple[tuple[str | int, ...], str]:
    """(table, key) of an error location: the key is the last name with its list indices
    (`buckets[1]`), the table everything before it."""
    end = len(loc)
    while end > 0 and isinstance(loc[end - 1], int):
        end -= 1
    if end == 0:
        return (), "".join(f"[{i}]" for i in loc)
    return loc[:end - 1], str(loc[end - 1]) + "".join(f"[{i}]" for i in loc[end:])


def _table_name(loc: tuple[str | int, ...]) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_NUMBER_TYPES = {"int_type", "int_parsing", "float_type", "float_parsing", "int_parsing_size"}
_TABLE_TYPES = {"model_type", "dict_type", "model_attributes_type"}


def _message(error: Any) -> tuple[tuple[str | int, ...], str]:
    """The table an error is about and what to say about it."""
    kind, loc, value = error["type"], tuple(error["loc"]), error.get("input")
    ctx = error.get("ctx") or {}
    if kind == TABLE_ERROR:
        return loc + tuple(ctx.get("at", ())), str(ctx["message"])
    if kind in _TABLE_TYPES:
        return loc, f"must be a table, got {value!r}"
    if loc and loc[-1] == "[key]":  # a key of a table keyed by numbers: ('compute_ms', 'x', '[key]')
        table, key = _split(loc[:-2])
        what = "a number" if kind in _NUMBER_TYPES | {"int_from_float"} else "valid"
        return table, f"'{key}': key {loc[-2]!r} is not {what}"
    table, key = _split(loc)
    if kind == "value_error":  # a field validator's ValueError names the field itself
        return table, str(ctx["error"])
    if kind == "missing":
        return table, f"missing '{key}'"
    if kind in _NUMBER_TYPES:
        return table, f"'{key}' must be a number, got {value!r}"
    if kind == "int_from_float":
        return table, f"'{key}' must be a whole number, got {value!r}"
    if kind == "finite_number":
        return table, f"'{key}' must be a finite number, got {value!r}"
    if kind in _BOUNDS:
        (bound,) = ctx.values()
        return table, f"'{key}' must be {_BOUNDS[kind]} {bound:g}, got {value!r}"
    if kind in ("bool_type", "bool_parsing"):
        return table, f"'{key}' must be true or false, got {value!r}"
    if kind == "path_type":
        return table, f"'{key}' must be a path, got {value!r}"
    if kind == "string_type":
        return table, f"'{key}' must be a string, got {value!r}"
    if kind in ("list_type", "tuple_type", "iterable_type"):
        return table, f"'{key}' must be a list, got {value!r}"
    if kind in ("literal_error", "enum"):
        return table, f"'{key}' must be one of {ctx.get('expected')}, got {value!r}"
    return table, f"'{key}': {error['msg']}"


def describe(err: ValidationError, source: str) -> str:
    """Every problem in `err`, one line each: `<source> [<table>]: <message>` (without the
    brackets for the file's top level)."""
    lines = []
    for error in err.errors(include_url=False):
        table, message = _message(error)
        lines.append(f"{source} [{_table_name(table)}]: {message}" if table else f"{source}: {message}")
    return "\n".join(dict.fromkeys(lines))
