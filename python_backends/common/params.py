"""The typed schema of the `parameters` a model's config.pbtxt carries, shared by both sides.

Triton hands a Python backend its config parameters as strings. Each model kind declares
them once as a `ModelParameters` subclass, one field per parameter, named as the parameter:
gen-config builds the values through it and writes `to_parameters()` (every value as its
config text), and the backend reads them back with `from_parameters(model, parameters)`, so
the writer and the reader cannot drift. A field accepts its config text or the typed value;
a bad one raises ValueError naming the model and the parameter, as `model 'embed': parameter
max_text_bytes='lots' is not an integer`.

The field types here are the ones several model kinds share: bounded integers, numbers, 0/1
flags, comma lists, and the tenant policy and tenant authentication JSON. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, PlainSerializer, PlainValidator, ValidationError, ValidationInfo

from python_backends.common.quotas import UNLIMITED, TenantPolicy
from python_backends.common.tenant_auth import AuthConfig, parse_auth_parameter


class ModelParameters(BaseModel):
    """A model kind's config parameters; subclasses declare one field per parameter."""

    model_config = ConfigDict(frozen=True, extra="ignore", arbitrary_types_allowed=True)

    # Put between "model 'NAME': " and the problem in every error message.
    error_context: ClassVar[str] = ""
    # What the error says when a required parameter is missing, by parameter.
    required_help: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_parameters(cls, model_name: str, parameters: Mapping[str, str]):
        """Read the parameters (strings, as in config.pbtxt); ValueError names the model and the parameter."""
        try:
            return cls.model_validate(dict(parameters), context={"model": model_name})
        except ValidationError as err:
            raise ValueError(cls._message(model_name, err.errors(include_url=False)[0])) from None

    def to_parameters(self) -> dict[str, str]:
        """The parameters given when this was built, as config text (`string_value`s)."""
        return self.model_dump(mode="json", exclude_unset=True)

    @classmethod
    def _message(cls, model_name: str, error: Mapping[str, Any]) -> str:
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "missing":
            problem = cls.required_help.get(where, f"parameter {where} is required")
        elif error["type"] == "value_error":
            problem = str(error["ctx"]["error"])
        else:
            problem = f"parameter {where}: {error['msg']}"
        prefix = f"model '{model_name}': "
        return problem if problem.startswith(prefix) else f"{prefix}{cls.error_context}{problem}"


def model_of(info: ValidationInfo) -> str:
    """The model whose parameters are being read (`?` when built in code)."""
    return (info.context or {}).get("model", "?")


def _integer(minimum: int):
    def parse(value: object, info: ValidationInfo) -> int:
        if isinstance(value, bool):
            raise ValueError(f"parameter {info.field_name}={value!r} is not an integer")
        try:
            number = value if isinstance(value, int) else int(str(value))
        except ValueError:
            raise ValueError(f"parameter {info.field_name}={value!r} is not an integer") from None
        if number < minimum:
            raise ValueError(f"parameter {info.field_name}={number} must be >= {minimum}")
        return number

    return Annotated[int, PlainValidator(parse), PlainSerializer(str, return_type=str)]


PositiveInt = _integer(1)  # an integer >= 1, written as its digits
CountInt = _integer(0)  # an integer >= 0 (0 often meaning "let the library choose")


def _number(allow_zero: bool):
    def parse(value: object, info: ValidationInfo) -> float:
        try:
            number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
                else float(str(value))
        except ValueError:
            raise ValueError(f"parameter {info.field_name}={value!r} is not a number") from None
        if not (number >= 0 if allow_zero else number > 0) or number == float("inf"):
            raise ValueError(f"parameter {info.field_name}={number:g} must be a finite number "
                             f"{'>= 0' if allow_zero else '> 0'}")
        return number

    return Annotated[float, PlainValidator(parse), PlainSerializer(lambda number: f"{number:g}", return_type=str)]


PositiveNumber = _number(allow_zero=False)  # a finite number > 0
NonNegativeNumber = _number(allow_zero=True)  # a finite number >= 0 (0 often meaning "off")


def _parse_flag(value: object, info: ValidationInfo) -> bool:
    if isinstance(value, bool):
        return value
    if value not in ("0", "1"):
        raise ValueError(f"parameter {info.field_name} must be 0 or 1, got {value!r}")
    return value == "1"


Flag = Annotated[bool, PlainValidator(_parse_flag), PlainSerializer(lambda flag: "1" if flag else "0", return_type=str)]


def _parse_names(value: object) -> tuple[str, ...]:
    parts = value.split(",") if isinstance(value, str) else value
    return tuple(part.strip() for part in parts if part.strip())


NameList = Annotated[tuple[str, ...], PlainValidator(_parse_names),
                     PlainSerializer(lambda names: ",".join(names), return_type=str)]


def _parse_name_map(value: object) -> dict[str, str]:
    """`KEY=value,KEY=value` (or the mapping itself); keys and values non-empty, keys distinct."""
    if isinstance(value, Mapping):
        return {str(key): str(name) for key, name in value.items()}
    mapping: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in str(value).split(","))):
        key, sep, name = part.partition("=")
        if not sep or not key.strip() or not name.strip():
            raise ValueError(f"entry {part!r} is not 'KEY=name'")
        if key.strip() in mapping:
            raise ValueError(f"entry {key.strip()!r} is given twice")
        mapping[key.strip()] = name.strip()
    return mapping


NameMap = Annotated[dict[str, str], PlainValidator(_parse_name_map),
                    PlainSerializer(lambda mapping: ",".join(f"{k}={v}" for k, v in mapping.items()), return_type=str)]


def _parse_tenants(value: object) -> TenantPolicy:
    if isinstance(value, TenantPolicy):
        return value
    if not value:
        return UNLIMITED
    try:
        return TenantPolicy.from_json(str(value))
    except ValueError as err:
        raise ValueError(f"parameter tenants: {err}") from None


# The spec's tenant tiers and quotas as JSON (`TenantPolicy.to_json`); empty: no quotas.
TenantsParameter = Annotated[TenantPolicy, PlainValidator(_parse_tenants),
                             PlainSerializer(lambda policy: policy.to_json(), return_type=str)]


def _parse_auth(value: object, info: ValidationInfo) -> AuthConfig:
    if isinstance(value, AuthConfig):
        return value
    return parse_auth_parameter(model_of(info), str(value))  # its errors name the model already


# How a request proves its tenant, as JSON (`AuthConfig.to_json`); empty: authentication off.
AuthParameter = Annotated[AuthConfig, PlainValidator(_parse_auth),
                          PlainSerializer(lambda auth: auth.to_json(), return_type=str)]
