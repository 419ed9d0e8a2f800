"""Load mixes: which models a load run calls, over which protocol, for which tenants, how fast.

A mix file (TOML, in loadtest/mixes/) names the models with their share of simulated users,
the protocol split, the workload each draws its requests from (a length mix for an embedding
model, a chat workload for an LLM), the tenants requests are sent as, and how many requests
per second each simulated user sends. Pure parsing and drawing; the Locust glue is in
`triton_users.py`.
"""

from __future__ import annotations

import random
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

MIX_DIR = Path(__file__).resolve().parent / "mixes"
T = TypeVar("T")


class ModelKind(StrEnum):
    EMBED = "embed"  # TEXT rows in, EMBEDDING out; one response
    LLM = "llm"  # a chat in, streamed tokens out


class Protocol(StrEnum):
    GRPC = "grpc"
    HTTP = "http"


@dataclass(frozen=True)
class ModelMix:
    """One model of the mix."""

    model: str  # served model name
    kind: ModelKind  # how to call it
    weight: float  # share of simulated users, > 0 (normalised over the mix)
    protocols: tuple[tuple[Protocol, float], ...]  # share of this model's users per protocol
    workload: Path  # length mix (embed) or chat workload (llm)
    http_model: str  # model called over HTTP: LLM streaming is gRPC-only, HTTP goes to the non-decoupled twin
    max_tokens_cap: int | None = None  # llm: cap on each request's drawn output budget
    slo_p95_ms: float | None = None  # overrides the serving spec's target for this model


@dataclass(frozen=True)
class TenantMix:
    name: str  # sent as the `tenant` request parameter
    weight: float  # share of requests, > 0
    max_error_rate: float | None = None  # this tenant's allowance of failed requests; None: the mix's


@dataclass(frozen=True)
class LoadMix:
    """A whole mix."""

    name: str
    models: tuple[ModelMix, ...]  # at least one
    tenants: tuple[TenantMix, ...]  # empty: requests carry no tenant (the default tier)
    user_rps: float  # requests per second each simulated user sends (Locust constant_throughput)
    request_timeout_s: float  # a request slower than this is cut off and counted as an error
    max_error_rate: float  # the verdict fails a model or tenant with a higher share of failed requests
    description: str = ""

    def tenant_error_rates(self) -> dict[str, float]:
        """Tenants with their own allowance of failed requests."""
        return {t.name: t.max_error_rate for t in self.tenants if t.max_error_rate is not None}

    def user_weights(self) -> dict[tuple[ModelKind, Protocol], float]:
        """Share of simulated users per (kind, protocol): one Locust user class each."""
        total = sum(model.weight for model in self.models)
        weights: dict[tuple[ModelKind, Protocol], float] = {}
        for model in self.models:
            for protocol, share in model.protocols:
                key = (model.kind, protocol)
                weights[key] = weights.get(key, 0.0) + model.weight / total * share
        return weights

    def models_for(self, kind: ModelKind, protocol: Protocol) -> list[tuple[ModelMix, float]]:
        """The models a user of (kind, protocol) calls, with their relative weights."""
        return [(model, model.weight * share) for model in self.models if model.kind is kind
                for p, share in model.protocols if p is protocol]


def draw_weighted(items: Sequence[tuple[T, float]], rng: random.Random) -> T:
    """One item, with probability proportional to its weight."""
    if not items:
        raise ValueError("nothing to draw from")
    return rng.choices([item for item, _ in items], [weight for _, weight in items])[0]


def draw_tenant(mix: LoadMix, rng: random.Random) -> str | None:
    """The tenant of the next request, or None when the mix names none."""
    if not mix.tenants:
        return None
    return draw_weighted([(tenant.name, tenant.weight) for tenant in mix.tenants], rng)


def _positive(raw: dict, key: str, where: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{where}.{key} must be a number > 0, got {value!r}")
    return float(value)


def _protocols(raw, where: str) -> tuple[tuple[Protocol, float], ...]:
    if raw is None:
        return ((Protocol.GRPC, 1.0),)
    if isinstance(raw, str):
        raw = {raw: 1.0}
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where}.protocols must be a protocol name or a table of shares, got {raw!r}")
    shares = []
    for name, share in raw.items():
        try:
            protocol = Protocol(name)
        except ValueError:
            raise ValueError(f"{where}.protocols: unknown protocol {name!r} (use grpc or http)") from None
        if isinstance(share, bool) or not isinstance(share, int | float) or share <= 0:
            raise ValueError(f"{where}.protocols.{name} must be a share > 0, got {share!r}")
        shares.append((protocol, float(share)))
    total = sum(share for _, share in shares)
    return tuple((protocol, share / total) for protocol, share in shares)


def _error_rate(raw: dict, where: str, default: float | None) -> float | None:
    value = raw.get("max_error_rate", default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"{where}: max_error_rate must be in [0, 1), got {value!r}")
    return float(value)


def parse_mix(data: dict, source: str = "mix", base_dir: Path | None = None) -> LoadMix:
    """A LoadMix from a mix file's contents; workload paths are relative to `base_dir`."""
    base_dir = base_dir or MIX_DIR
    raw_models = data.get("models")
    if not isinstance(raw_models, list) or not raw_models:
        raise ValueError(f"{source}: needs at least one [[models]] table")
    models = []
    for index, raw in enumerate(raw_models):
        where = f"{source}: models[{index}]"
        name = raw.get("model")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.model must be a model name")
        try:
            kind = ModelKind(raw.get("kind", name))  # `embed` and `llm` need no kind
        except ValueError:
            raise ValueError(f"{where}.kind must be one of {[k.value for k in ModelKind]}, "
                             f"got {raw.get('kind', name)!r}") from None
        workload = raw.get("workload")
        if not isinstance(workload, str):
            raise ValueError(f"{where}.workload must name a workload file")
        workload_path = (base_dir / workload).resolve()
        if not workload_path.is_file():
            raise ValueError(f"{where}.workload: {workload_path} does not exist")
        cap = raw.get("max_tokens_cap")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"{where}.max_tokens_cap must be an integer >= 1, got {cap!r}")
        models.append(ModelMix(
            model=name, kind=kind, weight=_positive(raw, "weight", where, default=1.0),
            protocols=_protocols(raw.get("protocols"), where), workload=workload_path,
            http_model=str(raw.get("http_model", f"{name}_infer" if kind is ModelKind.LLM else name)),
            max_tokens_cap=cap,
            slo_p95_ms=_positive(raw, "slo_p95_ms", where) if "slo_p95_ms" in raw else None,
        ))
    tenants = []
    for index, raw in enumerate(data.get("tenants", [])):
        where = f"{source}: tenants[{index}]"
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a tenant name")
        tenants.append(TenantMix(name=name, weight=_positive(raw, "weight", where, default=1.0),
                                 max_error_rate=_error_rate(raw, where, None)))
    max_error_rate = _error_rate(data, source, 0.01)
    return LoadMix(
        name=str(data.get("name", Path(source).stem)), models=tuple(models), tenants=tuple(tenants),
        user_rps=_positive(data, "user_rps", source, default=2.0),
        request_timeout_s=_positive(data, "request_timeout_s", source, default=30.0),
        max_error_rate=max_error_rate, description=str(data.get("description", "")),
    )


def load_mix(path: str | Path) -> LoadMix:
    """Read a mix file; a bare name (`embed`) means loadtest/mixes/embed.toml."""
    path = Path(path)
    if not path.suffix and not path.exists():
        path = MIX_DIR / f"{path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"load mix {path}: {err}") from None
    return parse_mix(data, source=str(path), base_dir=path.resolve().parent)
