"""The serving spec (`serving.toml`): the one declarative source of every config.pbtxt.

It says what is served and what it must deliver: models, versions, buckets, the p95 SLO,
expected and peak request rates, the request length mix, tenant tiers, and what each kind
of hardware can run in parallel. `python -m tools gen-config` combines it with a measured
latency profile (`profiles/<hardware>.json`) to write the model configs.

Two halves: `ServingFile` and its tables are the file's schema (pydantic: each key's type,
bounds, default and docstring, and the rules across keys), and the frozen dataclasses are the
resolved spec the tools use (absolute paths, tiers in priority order, defaults filled in).
`load_spec` reads the file; the rest is pure.
"""

from __future__ import annotations

import enum
import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    PrivateAttr,
    StrictBool,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from python_backends.common.quotas import TENANT_PATTERN, TenantPolicy
from python_backends.common.quotas import TierPolicy as TenantTier  # a tier of the spec is the policy's tier
from python_backends.common.regimes import express_model_name
from python_backends.common.tenant_auth import ANONYMOUS_TENANT, MAX_CLOCK_SKEW_S, AuthConfig, AuthMode
from python_backends.embed.buckets import validate_buckets
from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS, ModelKind
from python_backends.embed.pooling import Pooling
from python_backends.llm.scheduler import BatchingPolicy
from python_backends.tensor.router import FIXED_BUCKET, bucket_model_name, validate_axis_buckets
from tools.paths import DEFAULT_SPEC, REPO_ROOT
from tools.spec.buckets import DEFAULT_BUCKET_COUNT, DERIVED, derived_edges
from tools.spec.schema import ClosedTable, Table, describe, table_error
from tools.spec.workload import WorkloadError, load_workload

ENCODER_PRECISIONS = ("fp32", "int8")  # what build-models can make of an encoder version
LLM_BATCHING = tuple(policy.value for policy in BatchingPolicy)  # the LLM engine's batching policies


class SpecError(ValueError):
    """The serving spec is invalid; the message names the file and the field."""


@dataclass(frozen=True)
class HardwareLimits:
    """What one kind of hardware runs in parallel, by the profile's `hardware.kind`."""

    kind: str  # "cpu" or "gpu", matched against the profile
    instance_kind: str  # Triton instance_group kind: KIND_CPU or KIND_GPU
    max_instances: int  # bucket-model instances that add throughput on this hardware
    intra_op_threads: int  # ONNX Runtime threads per instance; 0 lets ONNX Runtime choose
    ort_spinning: bool  # let idle ONNX Runtime threads spin; off where bucket models share few cores
    compute_nice: int = 0  # nice value of the bucket models' processes: they yield the cores to the router

    def lanes(self, cpu_count: int) -> int:
        """Executions this hardware runs side by side at full speed.

        A GPU runs one batch's kernels at a time: one lane. On a CPU an instance with
        `intra_op_threads` threads occupies that many cores, so the cores hold
        `cpu_count // intra_op_threads` lanes; with 0 ONNX Runtime spreads every batch over
        all cores, which makes the whole CPU one lane.
        """
        if self.kind != "cpu" or self.intra_op_threads == 0:
            return 1
        return max(1, cpu_count // self.intra_op_threads)


DEFAULT_CPU_NICE = 10  # bucket models' nice value on CPU nodes (see HardwareTable.compute_nice)
DEFAULT_KEYS_FILE = "build/tenant_keys.json"  # relative to the spec; build/ is never committed


@dataclass(frozen=True)
class TenantAuthSpec:
    """How a request proves which tenant it is (spec `[tenants.auth]`)."""

    mode: AuthMode  # off: trust the `tenant` parameter; anonymous: no token = tenant `anonymous`; required
    keys_file: Path  # the keys that verify tenant tokens (absolute; the spec gives it relative to itself)
    anonymous_tier: str  # tier of the `anonymous` tenant in anonymous mode
    max_clock_skew_s: float = 30.0  # a token is still taken this long past its expiry
    issuer: str = ""  # the `iss` an identity provider's token must name; empty: not checked
    audience: str = ""  # the `aud` an identity provider's token must include; empty: not checked

    def config(self) -> AuthConfig:
        """The models' `tenant_auth` parameter. A keys file inside the kit is written relative to
        the kit's root (where the models resolve it), so a generated config holds no absolute
        path and serves from any checkout or copy of the model repository."""
        try:
            keys_file = str(self.keys_file.relative_to(REPO_ROOT))
        except ValueError:
            keys_file = str(self.keys_file)
        return AuthConfig(mode=self.mode, keys_file=keys_file, max_clock_skew_s=self.max_clock_skew_s,
                          issuer=self.issuer, audience=self.audience)


PACKAGE_SOURCE = "package:"  # a source named `package:<module>` is a folder a pip package ships


@dataclass(frozen=True)
class BucketedModelSpec:
    """A length-bucketed text model: a router model (named by the spec's table) that tokenizes
    and routes, and one bucket model per length running the user's graph. `kind` says what a row
    is and what comes back (`python_backends.embed.kinds`). An external model's one "bucket" is
    the model of the user's own Triton repository (`repository`, `external_model`)."""

    name: str  # the router model clients call
    versions: tuple[int, ...]  # model versions loaded at start (each bucket model serves them all)
    slo_p95_ms: float  # end-to-end p95 latency target of one request
    expected_rps: float  # requests per second in normal traffic
    peak_rps: float  # requests per second at peak
    workload: Path | None  # length mix of requests (loadtest workload TOML); None: a tensor model without buckets
    bucket_lens: tuple[int, ...]  # bucket lengths, ascending; (0,): a tensor model's one fixed-shape bucket
    encoder_prefix: str  # bucket model name = prefix + length
    max_request_rows: int  # rows one client request may carry (the router's max_batch_size)
    max_router_instances: int  # cap on router instances (one per host core is derived)
    max_text_bytes: int  # longest row accepted, in UTF-8 bytes
    queue_timeouts: bool = True  # bucket queue timeouts, and deadlines from the router (see serving.toml)
    bucket_count: int = 0  # buckets = "derived": the most buckets derived from the workload; 0: the spec lists them
    max_length: int | None = None  # text kinds: most tokens the model takes (caps derived edges); None: not declared
    precision: dict[int, str] = field(default_factory=dict)  # version -> "fp32" or "int8" (build recipe)
    traffic: dict[int, float] = field(default_factory=dict)  # version -> weight of unpinned traffic at start
    kind: ModelKind = ModelKind.TEXT_ENCODER  # what a row is and what comes back
    sources: dict[int, str] = field(default_factory=dict)  # version -> ONNX file, Hugging Face folder or package:
    root: Path = Path(".")  # the folder relative sources are in (the spec's)
    tokenizer: Path | None = None  # tokenizer.json; None: the source folder's
    onnx_inputs: dict[str, str] = field(default_factory=lambda: {INPUT_IDS: "input_ids",
                                                                   ATTENTION_MASK: "attention_mask"})
    onnx_output: str = ""  # the graph output read; empty: the graph's only output
    pooling: Pooling = Pooling.NONE  # how the graph's per-token output becomes one vector per row
    normalize: bool = False  # L2-normalise each answered row
    query_prefix: str = ""  # put before each text of a query (the default input_type)
    document_prefix: str = ""  # put before each text of a document (input_type = "document")
    labels: tuple[str, ...] = ()  # classifier label names by logit index; empty: no LABEL output
    pairs: bool = False  # classifier rows may be text pairs (TEXT_PAIR input)
    variable_axis: int | None = None  # tensor: the row axis bucketed like token length; None: one fixed bucket
    pad: dict[str, float] = field(default_factory=dict)  # tensor: input -> its padding value on that axis
    tolerance: float | None = None  # tensor, external: largest absolute output difference a rollout allows
    repository: Path | None = None  # external: the user's own Triton model repository (absolute)
    external_model: str = ""  # external: the model's folder in that repository (its Triton name)

    def precision_of(self, version: int) -> str:
        return self.precision.get(version, "fp32")

    def encoder_name(self, bucket_len: int) -> str:
        if self.kind is ModelKind.EXTERNAL:
            return self.external_model
        return bucket_model_name(self.encoder_prefix, bucket_len)

    @property
    def external_dir(self) -> Path:
        """The external model's folder in the user's repository (its config.pbtxt, its versions)."""
        if self.repository is None:
            raise ValueError(f"model {self.name!r} is a {self.kind.value} model, not an external one")
        return self.repository / self.external_model

    def bucket_repository(self, kit_repository: Path) -> Path:
        """The repository holding this model's bucket models: the user's for an external model,
        else the kit's."""
        return self.repository if self.repository is not None else kit_repository

    @property
    def bucket_names(self) -> tuple[str, ...]:
        return tuple(self.encoder_name(length) for length in self.bucket_lens)

    @property
    def express_name(self) -> str:
        """The name of the express model gen-config adds when a bucket lingers at peak
        (`python_backends.common.regimes`); "" for an external model, which has none (its
        backend is the user's). Reserved either way: no other model may take it."""
        return "" if self.kind is ModelKind.EXTERNAL else express_model_name(self.encoder_prefix)

    def bucket_models(self, repository: Path) -> tuple[str, ...]:
        """Every model serving this model's rows: the bucket models and, where gen-config wrote
        one into `repository` (the kit's), the express model."""
        express = self.express_name
        has_express = bool(express) and (repository / express / "config.pbtxt").is_file()
        return (*self.bucket_names, *((express,) if has_express else ()))

    @property
    def token_types(self) -> bool:
        """Whether the graph takes token type ids (a pair's members told apart)."""
        return TOKEN_TYPE_IDS in self.onnx_inputs

    def source_of(self, version: int) -> str:
        return self.sources[version]


@dataclass(frozen=True)
class LLMModelSpec:
    """A generative model served by the continuous-batching engine (decoupled, streaming)."""

    name: str  # the model clients call
    versions: tuple[int, ...]  # versions of the model folder to serve
    batching: str  # "continuous", or "static" / "static_retiring" (the baselines the benchmark compares against)
    kv_cache_mb: float  # memory the KV cache may use: the admission constraint
    block_size: int  # token slots per KV block
    max_num_seqs: int  # sequences decoding together at most
    max_num_batched_tokens: int  # tokens computed per engine step (prefill chunks + decodes)
    max_model_len: int  # context: prompt plus output tokens
    default_max_tokens: int  # output tokens when a request does not say
    ttft_p95_ms: float  # time-to-first-token target (p95)
    tpot_p95_ms: float  # time-per-output-token target (p95 over requests of their mean after the first)
    threads: int  # torch intra-op threads; 0: every core
    source: Path | None = None  # a Hugging Face folder or a .gguf file; None: the packaged SmolLM2 GGUF
    device: str = "auto"  # cpu, cuda, or auto (cuda where torch sees a GPU)
    dtype: str = "auto"  # float32, bfloat16, float16, or auto (bfloat16 on a GPU or a CPU with bfloat16 instructions)
    stream_hold_ms: float = 0.0  # longest a stream's token is held while requests wait (0: never)


@dataclass(frozen=True)
class ServingSpec:
    """The whole serving spec."""

    path: Path  # the file it was read from
    sha256: str  # digest of that file, recorded in generated configs
    profile: Path  # default latency profile for gen-config
    models: tuple[BucketedModelSpec, ...]  # length-bucketed text models
    tiers: tuple[TenantTier, ...]  # tenant tiers, highest priority first
    default_tier: str  # tier of requests that name no tenant tier
    hardware: dict[str, HardwareLimits]  # by hardware kind
    llm_models: tuple[LLMModelSpec, ...] = ()  # generative models
    tenant_members: dict[str, str] = field(default_factory=dict)  # tenant id -> tier name
    tenant_auth: TenantAuthSpec | None = None  # None: authentication off (the `tenant` parameter is trusted)

    def tier(self, name: str) -> TenantTier:
        return next(t for t in self.tiers if t.name == name)

    @property
    def external_repositories(self) -> tuple[Path, ...]:
        """The users' own Triton repositories its external models live in (each once, in spec
        order): a server serves them beside the kit's repository."""
        return tuple(dict.fromkeys(m.repository for m in self.models if m.repository is not None))

    @property
    def external_models(self) -> tuple[str, ...]:
        """The models of those repositories that the spec serves (behind their routers)."""
        return tuple(m.external_model for m in self.models if m.kind is ModelKind.EXTERNAL)

    def tenant_policy(self) -> TenantPolicy:
        """Tiers, members and quotas as the router and the LLM engine enforce them. In anonymous
        mode the `anonymous` tenant is a member of its tier, so it has a tier and a metric label."""
        members = dict(self.tenant_members)
        if self.tenant_auth is not None and self.tenant_auth.mode is AuthMode.ANONYMOUS:
            members[ANONYMOUS_TENANT] = self.tenant_auth.anonymous_tier
        return TenantPolicy(tiers={t.name: t for t in self.tiers}, default_tier=self.default_tier, members=members)

    def auth_config(self) -> AuthConfig:
        """The models' `tenant_auth` parameter (mode off when the spec turns authentication off)."""
        return self.tenant_auth.config() if self.tenant_auth is not None else AuthConfig()


# --- the file's schema ------------------------------------------------------------------------
# What a user writes, table by table, with its bounds and rules. `parse_spec` validates a whole
# file against `ServingFile` and resolves it into the dataclasses above (absolute paths, tiers in
# priority order, defaults that depend on other tables).


def _root(info: ValidationInfo) -> Path:
    """The folder that paths in the spec are relative to: the spec's own."""
    return Path((info.context or {}).get("root", "."))


def _versions(value: object, handler: ValidatorFunctionWrapHandler) -> tuple[int, ...]:
    """Model versions, in one message whatever is wrong with them."""
    try:
        versions = handler(value)
    except ValidationError:
        versions = ()
    if not versions or min(versions) < 1:
        raise ValueError("versions must be a non-empty list of integers >= 1")
    if len(set(versions)) != len(versions):
        raise ValueError(f"versions {list(versions)} repeat a version")
    return versions


Versions = Annotated[tuple[int, ...], WrapValidator(_versions)]
_LENGTHS = TypeAdapter(tuple[int, ...])


def _lengths_or_derived(value: object, handler: ValidatorFunctionWrapHandler) -> tuple[int, ...] | str:
    """Bucket lengths, or "derived"; a list's errors name the list's item (`buckets[1]`)."""
    if isinstance(value, str):
        if value != DERIVED:
            raise ValueError(f'buckets must be a list of lengths or "{DERIVED}", got {value!r}')
        return value
    return _LENGTHS.validate_python(value)


Buckets = Annotated[tuple[int, ...] | Literal["derived"], WrapValidator(_lengths_or_derived)]


def _member_value(key: str, choices: type[enum.Enum], value: object) -> object:
    """`value` when it is one of the enum's values; else the error naming the key and the choices."""
    values = [member.value for member in choices]
    if value not in values:
        raise ValueError(f"{key} must be one of {values}, got {value!r}")
    return value  # distinct, each >= 1


class TierTable(Table):
    """`[tenants.tiers.<name>]`: what every tenant of the tier gets."""

    priority: int = Field(gt=0)
    """Triton priority level of the router queue; 1 is served first. The tiers' priorities are 1..n."""
    requests_per_s: float = Field(0.0, ge=0)
    """Sustained embed requests per second per tenant; 0: no limit."""
    burst: float = Field(0.0, ge=0)
    """Embed requests a tenant may send at once after being idle; >= 1 when requests_per_s is set."""
    llm_tokens_per_s: float = Field(0.0, ge=0)
    """Generated tokens per second per tenant on the LLM; 0: no limit."""
    llm_token_burst: float = Field(0.0, ge=0)
    """Generated tokens a tenant may take at once; >= 1 when llm_tokens_per_s is set."""

    def policy(self, name: str) -> TenantTier:
        return TenantTier(name=name, priority=self.priority, requests_per_s=self.requests_per_s, burst=self.burst,
                          llm_tokens_per_s=self.llm_tokens_per_s, llm_token_burst=self.llm_token_burst)


class AuthTable(ClosedTable):
    """`[tenants.auth]`: how a request proves which tenant it is. Without the table tenants
    authenticate in anonymous mode: a bare `tenant` parameter is never trusted unless the spec
    says `mode = "off"`. Unknown keys are refused: a misspelt key in a security setting must not
    fall back to a default silently."""

    mode: AuthMode = AuthMode.ANONYMOUS
    """off: trust the `tenant` parameter; anonymous: a request without a token is the tenant
    `anonymous`; required: every request needs a valid token."""
    keys_file: str = DEFAULT_KEYS_FILE
    """The keys that verify tenant tokens, relative to the spec."""
    anonymous_tier: str | None = None
    """Tier of the `anonymous` tenant in anonymous mode; default: the lowest tier."""
    max_clock_skew_s: float = Field(30.0, ge=0, le=MAX_CLOCK_SKEW_S)
    """A token is still taken this long past its expiry (issuer clocks drift), within [0, 300]."""
    issuer: str = ""
    """With a JWKS keys file: the issuer (`iss`) an identity provider's token must name. Empty:
    not checked. The kit's own HS256 tokens are not checked (their keys sign for this kit only)."""
    audience: str = ""
    """With a JWKS keys file: the audience (`aud`) an identity provider's token must include, so a
    token the provider issued for another service is refused. Empty: not checked."""

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, value: object) -> object:
        return _member_value("mode", AuthMode, value)

    @field_validator("keys_file", mode="before")
    @classmethod
    def _a_path(cls, value: object) -> object:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"keys_file must be a path (relative to the spec), got {value!r}")
        return value

    @field_validator("max_clock_skew_s", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_CLOCK_SKEW_S:
            raise ValueError(f"max_clock_skew_s must be a number of seconds within [0, {MAX_CLOCK_SKEW_S:g}], "
                             f"got {value!r}")
        return value


class TenantsTable(Table):
    """`[tenants]`: tenant tiers, which tenant is in which, and how tenants authenticate."""

    tiers: dict[str, TierTable] = Field(default_factory=lambda: {"standard": TierTable(priority=1)})
    """Tiers by name, with priorities 1..n. Without the table: one unlimited tier, `standard`."""
    default_tier: str | None = None
    """Tier of requests that name no tenant tier; default: the lowest priority."""
    members: dict[str, str] = {}
    """Tenant id -> tier name. Tenants the spec does not name are in `default_tier`."""
    auth: AuthTable = Field(default_factory=AuthTable, validate_default=True)
    """How a request proves which tenant it is."""

    @field_validator("tiers")
    @classmethod
    def _priorities_in_order(cls, tiers: dict[str, TierTable]) -> dict[str, TierTable]:
        if not tiers:
            raise ValueError("needs at least one [tenants.tiers.<name>] table")
        for name, table in tiers.items():
            try:
                table.policy(name).verify()
            except ValueError as err:
                raise table_error(str(err), at=(name,)) from None
        priorities = sorted(t.priority for t in tiers.values())
        if priorities != list(range(1, len(tiers) + 1)):
            raise ValueError(f"tenant tier priorities must be 1..{len(tiers)} without gaps, got {priorities}")
        return tiers

    @field_validator("default_tier")
    @classmethod
    def _a_tier(cls, name: str | None, info: ValidationInfo) -> str | None:
        tiers = _tier_names(info)
        if name is not None and tiers is not None and name not in tiers:
            raise ValueError(f"default_tier {name!r} is not one of {tiers}")
        return name

    @field_validator("members")
    @classmethod
    def _members_in_tiers(cls, members: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        tiers = _tier_names(info)
        for tenant, tier in members.items():
            if not TENANT_PATTERN.match(tenant):
                raise table_error(f"tenant id {tenant!r} must be 1-64 letters, digits, '.', '_' or '-'")
            if tiers is not None and tier not in tiers:
                raise table_error(f"tenant {tenant!r} is in tier {tier!r}, which is not one of {tiers}")
        return members

    @field_validator("auth")
    @classmethod
    def _auth_tiers(cls, auth: AuthTable, info: ValidationInfo) -> AuthTable:
        if auth.mode is AuthMode.OFF:
            return auth
        tiers = _tier_names(info)
        if auth.anonymous_tier is not None and tiers is not None and auth.anonymous_tier not in tiers:
            raise table_error(f"anonymous_tier {auth.anonymous_tier!r} is not one of {tiers}")
        if ANONYMOUS_TENANT in info.data.get("members", {}):
            raise table_error(f"the tenant id {ANONYMOUS_TENANT!r} is reserved for requests without a token; "
                              "remove it from [tenants.members]")
        return auth

    def lowest_tier(self) -> str:
        return max(self.tiers, key=lambda name: self.tiers[name].priority)


def _tier_names(info: ValidationInfo) -> list[str] | None:
    """The tiers validated so far, highest priority first (None when they were invalid)."""
    tiers = info.data.get("tiers")
    return None if tiers is None else sorted(tiers, key=lambda name: tiers[name].priority)


class HardwareTable(Table):
    """`[hardware.<kind>]`: what one kind of hardware (the profile's `hardware.kind`) runs in parallel."""

    instance_kind: Literal["KIND_CPU", "KIND_GPU"] | None = None
    """Triton instance_group kind; default: KIND_GPU on `gpu`, KIND_CPU elsewhere."""
    max_instances: int = Field(gt=0)
    """Bucket-model instances that add throughput on this hardware."""
    intra_op_threads: int = Field(ge=0)
    """ONNX Runtime threads per instance; 0 lets ONNX Runtime choose."""
    ort_spinning: StrictBool | None = None
    """Let idle ONNX Runtime threads spin; default: on `gpu` only."""
    compute_nice: int | None = Field(default=None, ge=0, le=19)
    """Nice value of the bucket models' processes (0 to 19): when the cores are short, the front
    end and the router, which admit and refuse, run first, and the compute admission counts
    waits; default: 10 on `cpu`, 0 on `gpu`."""

    @field_validator("instance_kind", mode="before")
    @classmethod
    def _known_kind(cls, value: object) -> object:
        if value not in ("KIND_CPU", "KIND_GPU"):
            raise ValueError(f"instance_kind must be KIND_CPU or KIND_GPU, got {value!r}")
        return value

    def limits(self, kind: str) -> HardwareLimits:
        return HardwareLimits(
            kind=kind,
            instance_kind=self.instance_kind or ("KIND_GPU" if kind == "gpu" else "KIND_CPU"),
            max_instances=self.max_instances,
            intra_op_threads=self.intra_op_threads,
            ort_spinning=kind == "gpu" if self.ort_spinning is None else self.ort_spinning,
            compute_nice=(DEFAULT_CPU_NICE if kind == "cpu" else 0) if self.compute_nice is None else self.compute_nice,
        )


class TextInputsTable(ClosedTable):
    """`[models.<name>.inputs]`: the graph's names of the tensors the kit feeds it."""

    ids: str = "input_ids"
    """The token ids input."""
    mask: str = "attention_mask"
    """The attention mask input."""
    token_types: str = ""
    """The token type ids input (BERT-style pair models); empty: the graph takes none."""

    @model_validator(mode="after")
    def _distinct(self) -> TextInputsTable:
        names = self.mapping()
        if len(set(names.values())) != len(names):
            raise table_error(f"inputs name one graph input twice: {names}")
        return self

    def mapping(self) -> dict[str, str]:
        names = {INPUT_IDS: self.ids, ATTENTION_MASK: self.mask}
        if self.token_types:
            names[TOKEN_TYPE_IDS] = self.token_types
        return names


TEXT_KINDS = (ModelKind.TEXT_ENCODER, ModelKind.TEXT_CLASSIFIER)
BUILT_KINDS = (*TEXT_KINDS, ModelKind.TENSOR)  # kinds whose bucket models the kit builds from a source
KIND_KEYS = {  # keys that mean something for some kinds only
    "source": BUILT_KINDS,
    "buckets": BUILT_KINDS,
    "bucket_count": BUILT_KINDS,
    "workload": BUILT_KINDS,
    "encoder_prefix": BUILT_KINDS,
    "precision": BUILT_KINDS,
    "labels": (ModelKind.TEXT_CLASSIFIER,),
    "pairs": (ModelKind.TEXT_CLASSIFIER,),
    "normalize": (ModelKind.TEXT_ENCODER,),
    "query_prefix": (ModelKind.TEXT_ENCODER,),
    "document_prefix": (ModelKind.TEXT_ENCODER,),
    "tokenizer": TEXT_KINDS,
    "inputs": TEXT_KINDS,
    "pooling": (ModelKind.TEXT_ENCODER,),
    "output": TEXT_KINDS,
    "max_length": TEXT_KINDS,
    "max_text_bytes": TEXT_KINDS,
    "variable_axis": (ModelKind.TENSOR,),
    "pad": (ModelKind.TENSOR,),
    "tolerance": (ModelKind.TENSOR, ModelKind.EXTERNAL),
    "repository": (ModelKind.EXTERNAL,),
    "model": (ModelKind.EXTERNAL,),
}


class BucketedModelTable(Table):
    """`[models.<name>]`: a length-bucketed text model, a router model (named by the table) and
    one bucket model per length running the model's graph."""

    kind: ModelKind = ModelKind.TEXT_ENCODER
    """What the model is: "text-encoder" (text -> one vector per row), "text-classifier" (text or
    text pair -> logits per row, and label names), "tensor" (any ONNX graph with a dynamic batch
    axis: its own tensors in and out), or "external" (a model of your own Triton repository, on
    any backend the server has, behind a router of the kit)."""
    source: str | dict[int, str] | None = None
    """Where the model comes from, for every version or as a table of version = source: an ONNX
    file, a Hugging Face folder (config.json, safetensors, tokenizer.json) that build-models exports,
    or `package:<module>`, a folder a pip package ships. Relative to the spec. Every kind but
    external."""
    repository: Path | None = None
    """External models: your own Triton model repository, relative to the spec. The server serves
    it beside the kit's; gen-config writes only the batching fields of the model's config.pbtxt."""
    model: str | None = None
    """External models: the model's folder in `repository` (its Triton name); default: the table's
    name. It must differ from the table's name, which is the router clients call."""
    tokenizer: str | None = None
    """The tokenizer.json the router tokenizes with, relative to the spec; default: the source
    folder's (required for an ONNX file)."""
    inputs: TextInputsTable = Field(default_factory=TextInputsTable)
    """The graph's input names."""
    output: str = ""
    """The graph output the model answers with; default: the graph's only output."""
    pooling: Literal["none", "mean", "cls", "last"] = "none"
    """How a per-token output ([rows, tokens, width]) becomes one vector per row: "mean" over real
    tokens, "cls" (first token), "last" (last real token); "none": the graph pools already."""
    normalize: StrictBool = False
    """Scale each embedding to unit length (text-encoder)."""
    query_prefix: str = ""
    """Put before every text a request sends as a query (the default `input_type`), e.g. "query: "."""
    document_prefix: str = ""
    """Put before every text a request sends with `input_type` = "document", e.g. "passage: "."""
    labels: tuple[str, ...] = ()
    """Label names by logit index (text-classifier); the router answers a LABEL per row with them."""
    pairs: StrictBool = False
    """Rows may be text pairs, sent as TEXT and TEXT_PAIR (text-classifier: cross-encoder rerankers)."""
    max_length: int | None = Field(None, gt=1)
    """Most tokens the model takes (its position embeddings); the largest bucket must not exceed it."""
    variable_axis: int | None = Field(None, ge=0)
    """Tensor models: the axis of a row (0 = the first after the batch axis) whose length varies
    (frames, pixels of width): requests are bucketed by it as texts are by tokens. None: every
    input has a fixed shape and the model has one bucket model, `<prefix>fixed`."""
    pad: dict[str, float] = {}
    """Tensor models: input name -> the value that pads it along the variable axis (every input
    that has the axis needs one; the graph must ignore it, e.g. under a mask)."""
    tolerance: float | None = Field(None, gt=0)
    """Tensor and external models: the largest absolute output difference a new version may show
    against the old on the same inputs before a rollout rolls back (the output-drift gate)."""
    versions: Versions = (1,)
    """Model versions loaded at start; every bucket model serves each of them."""
    precision: dict[int, Literal["fp32", "int8"]] = {}
    """Encoder version -> what build-models makes of it: "fp32" (the default) or "int8"."""
    traffic: dict[int, float] = {}
    """Encoder version -> weight of unpinned traffic at start; default: all on the first version."""
    slo_p95_ms: float = Field(gt=0)
    """End-to-end p95 latency target of one request."""
    expected_rps: float = Field(gt=0)
    """Requests per second in normal traffic."""
    peak_rps: float = Field(gt=0)
    """Requests per second at peak (what one node must carry); >= expected_rps."""
    workload: Path | None = None
    """Length mix of requests (a loadtest workload TOML: tokens, or positions on a tensor model's
    variable axis), relative to the spec; not needed by a tensor model without a variable axis."""
    buckets: Buckets = ()
    """Bucket lengths (tokens, or positions on the variable axis), distinct; read in ascending
    order. Text buckets are >= 2 (room for the tokenizer's special tokens). Or "derived": the
    edges that pad the workload's rows least (fewest padded positions per row, at most
    `bucket_count` buckets), computed from the workload file whenever the spec is read: multiples
    of 8 up to the workload's longest length, capped by max_length (longer rows are truncated
    into the last bucket). Bucket models are named by their length, so after a change of the
    workload that moves an edge, run build-models and profile again. `python -m tools gen-config
    --explain` compares the edges with the derived ones."""
    bucket_count: int | None = Field(None, gt=0)
    """With buckets = "derived": the most buckets to derive; default 5, as many as the built-in
    embed model has. Fewer come back when the workload has fewer lengths to split."""
    encoder_prefix: str | None = None
    """Bucket model name = prefix + length; default: the model's name and `_`."""
    max_request_rows: int = Field(gt=0)
    """Rows one client request may carry (the router's max_batch_size)."""
    max_router_instances: int = Field(gt=0)
    """Cap on router instances (one per host core is derived)."""
    max_text_bytes: int | None = Field(None, gt=0)
    """Longest text row accepted, in UTF-8 bytes (text kinds)."""
    queue_timeouts: StrictBool = True
    """Bucket queues REJECT after S - o - c(max_batch) and take each admitted request's deadline
    from the router; false: no queue timeouts (the queue bound alone turns requests away)."""
    _derived: tuple[int, ...] = PrivateAttr(())  # buckets = "derived": the edges derived from the workload

    @property
    def bucket_lens(self) -> tuple[int, ...]:
        """The bucket lengths, ascending: those listed, or those derived; () for a tensor model
        without a variable axis."""
        return self._derived if self.buckets == DERIVED else tuple(sorted(self.buckets))

    @field_validator("workload")
    @classmethod
    def _workload_exists(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        if path is None:
            return None
        path = _root(info) / path
        if not path.is_file():
            raise ValueError(f"workload file {path} not found")
        return path

    @field_validator("repository")
    @classmethod
    def _repository_exists(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        if path is None:
            return None
        path = (_root(info) / path).resolve()
        if not path.is_dir():
            raise ValueError(f"repository {path} is not a folder (a Triton model repository, relative to the spec)")
        return path

    @field_validator("model")
    @classmethod
    def _a_folder_name(cls, name: str | None) -> str | None:
        if name is not None and (not name.strip() or "/" in name or name in (".", "..")):
            raise ValueError(f"model must name a folder of the repository, got {name!r}")
        return name

    @field_validator("kind", mode="before")
    @classmethod
    def _known_kind(cls, value: object) -> object:
        return _member_value("kind", ModelKind, value)

    @field_validator("source", mode="before")
    @classmethod
    def _sources(cls, value: object) -> object:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("source must name an ONNX file, a Hugging Face folder or package:<module>")
            return value
        if not isinstance(value, dict) or not value:
            raise ValueError("source must be a path, package:<module>, or a table of version = source")
        keyed = {}
        for key, item in value.items():
            try:
                version = int(key)
            except ValueError:
                raise ValueError(f"source: key {key!r} is not a version number") from None
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"source of version {version} must be a path or package:<module>, got {item!r}")
            keyed[version] = item
        return keyed

    @field_validator("precision", "traffic", mode="before")
    @classmethod
    def _keyed_by_version(cls, table: object, info: ValidationInfo) -> dict[int, object]:
        """TOML keys are strings: `{ 1 = "fp32" }` is keyed by "1"."""
        key_name = info.field_name
        if not isinstance(table, dict):
            raise ValueError(f"'{key_name}' must be a table of version = value")
        keyed = {}
        for key, value in table.items():
            try:
                version = int(key)
            except ValueError:
                raise ValueError(f"{key_name}: key {key!r} is not a version number") from None
            if key_name == "precision" and value not in ENCODER_PRECISIONS:
                raise ValueError(f"precision of version {version} must be one of {ENCODER_PRECISIONS}, got {value!r}")
            if key_name == "traffic" and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise ValueError(f"traffic weight of version {version} must be a number >= 0, got {value!r}")
            keyed[version] = value
        return keyed

    @model_validator(mode="after")
    def _consistent(self) -> BucketedModelTable:
        for key, kinds in KIND_KEYS.items():
            if key in self.model_fields_set and self.kind not in kinds:
                raise table_error(f"'{key}' applies to kind {' and '.join(repr(k.value) for k in kinds)} only; "
                                  f"this model is {self.kind.value!r}")
        if self.kind is ModelKind.EXTERNAL:
            if self.repository is None:
                raise table_error("missing 'repository': the Triton model repository the external model is in")
        elif self.source is None:
            raise table_error("missing 'source'")
        self._buckets_and_workload()
        if self.pairs and not self.inputs.token_types:
            raise table_error("pairs = true needs the graph's token type ids input ([inputs] token_types), so "
                              "the model can tell a pair's members apart")
        if self.max_length is not None and self.bucket_lens[-1] > self.max_length:
            raise table_error(f"the largest bucket ({self.bucket_lens[-1]}) is over max_length ({self.max_length}): "
                              "the model has no position for the tokens past it")
        if isinstance(self.source, dict):
            missing = [v for v in self.versions if v not in self.source]
            if missing:
                raise table_error(f"source names no model for version(s) {missing}")
        if self.peak_rps < self.expected_rps:
            raise table_error(f"peak_rps ({self.peak_rps}) must be >= expected_rps ({self.expected_rps})")
        for key in ("precision", "traffic"):
            for version in getattr(self, key):
                if version not in self.versions:
                    raise table_error(f"{key} names version {version}, which is not in versions "
                                      f"{list(self.versions)}")
        if self.traffic and sum(self.traffic.values()) <= 0:
            raise table_error("traffic needs a weight > 0 on at least one version")
        return self

    def _buckets_and_workload(self) -> None:
        """What each kind needs of buckets, workload and text limits."""
        bucketed = self.kind.is_text or self.variable_axis is not None
        for key in ("buckets", "workload") if bucketed else ():
            if key not in self.model_fields_set:
                raise table_error(f"missing '{key}'" + ("" if self.kind.is_text else
                                                        " (a tensor model with a variable_axis is bucketed by it)"))
        if not bucketed and self.buckets:
            raise table_error("buckets need a variable_axis: a tensor model without one has a single bucket model")
        if self.kind.is_text and self.max_text_bytes is None:
            raise table_error("missing 'max_text_bytes'")
        if self.bucket_count is not None and self.buckets != DERIVED:
            raise table_error(f'bucket_count applies to buckets = "{DERIVED}" only; the buckets listed are the '
                              "model's")
        if bucketed and self.buckets == DERIVED:
            self._derived = self._derive()
        if bucketed:
            try:
                (validate_buckets if self.kind.is_text else validate_axis_buckets)(self.bucket_lens)
            except ValueError as err:
                raise table_error(f"buckets: {err}") from None
        if not self.kind.is_text and self.tolerance is None:
            article = "an" if self.kind.value[0] in "aeiou" else "a"
            raise table_error(f"missing 'tolerance': {article} {self.kind.value} model's rollouts compare a new "
                              "version's outputs with the old's within it (the largest absolute difference allowed)")

    def _derive(self) -> tuple[int, ...]:
        """The edges of buckets = "derived", from the workload file (read here)."""
        assert self.workload is not None  # a bucketed model's workload is required before this
        try:
            workload = load_workload(self.workload)
        except WorkloadError as err:
            raise table_error(f'buckets = "{DERIVED}" derives the edges from the workload: {err}') from None
        return derived_edges(workload, self.bucket_count or DEFAULT_BUCKET_COUNT, self.max_length)

    def external_model(self, name: str) -> str:
        """An external model's folder in its repository (the table's name by default)."""
        return self.model if self.model is not None else name

    def resolve(self, name: str, root: Path) -> BucketedModelSpec:
        sources = (dict(self.source) if isinstance(self.source, dict)
                   else {version: self.source for version in self.versions} if self.source is not None else {})
        return BucketedModelSpec(
            name=name,
            kind=self.kind,
            sources={v: sources[v] for v in self.versions if v in sources},
            root=root,
            tokenizer=root / self.tokenizer if self.tokenizer else None,
            onnx_inputs=self.inputs.mapping(),
            onnx_output=self.output,
            pooling=Pooling(self.pooling),
            normalize=self.normalize,
            query_prefix=self.query_prefix,
            document_prefix=self.document_prefix,
            labels=self.labels,
            pairs=self.pairs,
            versions=self.versions,
            precision=dict(self.precision),
            # all traffic on the first version until a rollout moves it
            traffic={v: float(w) for v, w in self.traffic.items()} or {self.versions[0]: 100.0},
            slo_p95_ms=self.slo_p95_ms,
            expected_rps=self.expected_rps,
            peak_rps=self.peak_rps,
            workload=self.workload,
            bucket_lens=self.bucket_lens or (FIXED_BUCKET,),
            bucket_count=(self.bucket_count or DEFAULT_BUCKET_COUNT) if self.buckets == DERIVED else 0,
            max_length=self.max_length,
            variable_axis=self.variable_axis,
            pad=dict(self.pad),
            tolerance=self.tolerance,
            repository=self.repository,
            external_model=self.external_model(name) if self.kind is ModelKind.EXTERNAL else "",
            encoder_prefix=self.encoder_prefix if self.encoder_prefix is not None else f"{name}_",
            max_request_rows=self.max_request_rows,
            max_router_instances=self.max_router_instances,
            max_text_bytes=self.max_text_bytes or 0,
            queue_timeouts=self.queue_timeouts,
        )


class LLMModelTable(Table):
    """`[llm_models.<name>]`: a generative model on the continuous-batching engine (decoupled,
    streaming), named by the table."""

    versions: Versions = (1,)
    """Versions of the model folder to serve."""
    batching: Literal["continuous", "static", "static_retiring"] = "continuous"
    """The engine's batching policy: "continuous", or the baselines the benchmark compares against."""
    kv_cache_mb: float = Field(gt=0)
    """Memory the KV cache may use: the admission constraint."""
    block_size: int = Field(gt=0)
    """Token slots per KV block."""
    max_num_seqs: int = Field(gt=0)
    """Sequences decoding together at most."""
    max_num_batched_tokens: int = Field(gt=0)
    """Tokens computed per engine step (prefill chunks + decodes); >= max_num_seqs."""
    max_model_len: int = Field(gt=0)
    """Context: prompt plus output tokens."""
    default_max_tokens: int = Field(gt=0)
    """Output tokens when a request does not say; < max_model_len."""
    ttft_p95_ms: float = Field(gt=0)
    """Time-to-first-token target (p95)."""
    tpot_p95_ms: float = Field(gt=0)
    """Time-per-output-token target (p95 over requests of each one's mean after its first token)."""
    threads: int = Field(ge=0)
    """Torch intra-op threads; 0: every core."""
    source: str | None = None
    """The model: a Hugging Face folder or a .gguf file, relative to this file; none: the packaged
    SmolLM2-135M-Instruct GGUF (`add-model NAME --llm PATH` writes it)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs: auto is cuda where torch sees a GPU, else cpu."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights, activations and KV cache: auto is bfloat16 on a GPU and on a CPU that multiplies
    bfloat16 in hardware (AVX-512 BF16, AMX), float32 on other CPUs. Greedy output in bfloat16
    can change with the batch a request shares (a near tie between two tokens tips either
    way); float32 gives the same tokens alone and in any batch."""
    stream_hold_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """While requests wait for the engine, a stream's tokens are held and sent together, each at
    most this long after it was made (one response instead of several: less CPU per token, so
    the queue drains sooner); none: `tpot_p95_ms`; 0: every token is sent as it is made. The
    first and the last token are never held, and nothing is held while no request waits."""

    @field_validator("batching", mode="before")
    @classmethod
    def _known_policy(cls, value: object) -> object:
        if value not in LLM_BATCHING:
            raise ValueError(f"batching must be one of {', '.join(map(repr, LLM_BATCHING))}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> LLMModelTable:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise table_error(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                              f"({self.max_num_seqs}) so every running sequence decodes each step")
        if self.default_max_tokens >= self.max_model_len:
            raise table_error(f"default_max_tokens ({self.default_max_tokens}) must be < max_model_len "
                              f"({self.max_model_len})")
        return self

    def model(self, name: str, root: Path) -> LLMModelSpec:
        fields = self.model_dump()
        source = fields.pop("source")
        if fields["stream_hold_ms"] is None:
            fields["stream_hold_ms"] = self.tpot_p95_ms  # a held token waits no longer than a token may take
        return LLMModelSpec(name=name, source=(root / source) if source else None, **fields)


class ServingFile(Table):
    """The serving spec as written: `serving.toml`. Paths in it are relative to the file."""

    profile: Path = Path("profiles/cpu.json")
    """Latency profile gen-config uses by default (one per hardware)."""
    tenants: TenantsTable = Field(default_factory=TenantsTable)
    """Tenant tiers, members and authentication."""
    hardware: dict[str, HardwareTable] = {}
    """What each kind of hardware runs in parallel, by the profile's hardware kind; at least one."""
    models: dict[str, BucketedModelTable] = {}
    """Length-bucketed text models (encoders, classifiers) by router model name."""
    llm_models: dict[str, LLMModelTable] = {}
    """Generative models by model name."""

    @model_validator(mode="after")
    def _complete(self) -> ServingFile:
        if not self.hardware:
            raise table_error("needs at least one [hardware.<kind>] table")
        for name in self.llm_models:
            if name in self.models:
                raise table_error(f"model name {name!r} is used twice")
        owners: dict[str, str] = {name: name for name in [*self.models, *self.llm_models]}
        for name, table in self.models.items():
            if table.kind is ModelKind.EXTERNAL:
                self._external_found(name, table)
            prefix = table.encoder_prefix if table.encoder_prefix is not None else f"{name}_"
            for length in table.bucket_lens or (FIXED_BUCKET,):
                bucket = (table.external_model(name) if table.kind is ModelKind.EXTERNAL
                          else bucket_model_name(prefix, length))
                if bucket in owners and table.kind is ModelKind.EXTERNAL:
                    raise table_error(f"external model {bucket!r} is also a model of {owners[bucket]!r} (Triton "
                                      "serves one model per name)", at=("models", name))
                if bucket in owners:
                    raise table_error(f"[models.{name}]: bucket model {bucket!r} is also a model of "
                                      f"{owners[bucket]!r}; give the model another encoder_prefix")
                owners[bucket] = name
            express = express_model_name(prefix) if table.kind is not ModelKind.EXTERNAL else ""
            if express in owners:
                raise table_error(f"[models.{name}]: its express model {express!r} (the bucket models' twin without "
                                  f"a linger) is also a model of {owners[express]!r}; give the model another "
                                  "encoder_prefix")
            if express:
                owners[express] = name
        return self

    @staticmethod
    def _external_found(name: str, table: BucketedModelTable) -> None:
        """The external model's folder and config.pbtxt are there, under a name that is not its
        router's (Triton serves one model per name, whatever the repository)."""
        model = table.external_model(name)
        if model == name:
            raise table_error(f"the router {name!r} and the external model it calls cannot share a name (Triton "
                              f"serves one model per name): name this table differently and keep model = "
                              f"{model!r}", at=("models", name))
        folder = table.repository / model
        if not folder.is_dir():
            raise table_error(f"model {model!r}: no folder {folder} in the repository", at=("models", name))
        if not (folder / "config.pbtxt").is_file():
            raise table_error(f"model {model!r}: {folder / 'config.pbtxt'} not found; the kit reads the model's "
                              "tensors from it and writes its batching fields there", at=("models", name))

    def spec(self, path: Path, sha256: str) -> ServingSpec:
        """The spec this file says, its paths resolved against `path`'s folder."""
        tenants, root = self.tenants, path.parent
        auth = tenants.auth
        return ServingSpec(
            path=path,
            sha256=sha256,
            profile=root / self.profile,
            models=tuple(table.resolve(name, root) for name, table in self.models.items()),
            tiers=tuple(sorted((t.policy(name) for name, t in tenants.tiers.items()), key=lambda t: t.priority)),
            default_tier=tenants.default_tier or tenants.lowest_tier(),
            hardware={kind: table.limits(kind) for kind, table in self.hardware.items()},
            llm_models=tuple(table.model(name, root) for name, table in self.llm_models.items()),
            tenant_members=dict(tenants.members),
            tenant_auth=None if auth.mode is AuthMode.OFF else TenantAuthSpec(
                mode=auth.mode, keys_file=(root / auth.keys_file).resolve(),
                anonymous_tier=auth.anonymous_tier or tenants.lowest_tier(),
                max_clock_skew_s=float(auth.max_clock_skew_s), issuer=auth.issuer, audience=auth.audience),
        )


def parse_spec(data: dict, path: Path) -> ServingSpec:
    """The spec in `data` (a parsed `serving.toml` read from `path`); SpecError names every
    problem with the file, the table and the key."""
    try:
        table = ServingFile.model_validate(data, context={"root": path.parent})
    except ValidationError as err:
        raise SpecError(describe(err, str(path))) from None
    return table.spec(path, hashlib.sha256(path.read_bytes()).hexdigest())


def load_spec(path: str | Path = DEFAULT_SPEC) -> ServingSpec:
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError(f"serving spec {path} not found")
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None
    return parse_spec(data, path)
