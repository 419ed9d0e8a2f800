"""The serving spec (`serving.toml`): the one declarative source of every config.pbtxt.

It says what is served and what it must deliver: models, versions, buckets, the p95 SLO,
expected and peak request rates, the request length mix, tenant tiers, and what each kind
of hardware can run in parallel. `python -m tools gen-config` combines it with a measured
latency profile (`profiles/<hardware>.json`) to write the model configs.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from python_backends.common.quotas import TENANT_PATTERN, TenantPolicy
from python_backends.common.quotas import TierPolicy as TenantTier  # a tier of the spec is the policy's tier
from python_backends.common.tenant_auth import ANONYMOUS_TENANT, MAX_CLOCK_SKEW_S, AuthConfig, AuthMode
from python_backends.embed.buckets import validate_buckets
from python_backends.llm.scheduler import BatchingPolicy
from tools.paths import DEFAULT_SPEC, REPO_ROOT

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


DEFAULT_KEYS_FILE = "build/tenant_keys.json"  # relative to the spec; build/ is never committed


@dataclass(frozen=True)
class TenantAuthSpec:
    """How a request proves which tenant it is (spec `[tenants.auth]`)."""

    mode: AuthMode  # off: trust the `tenant` parameter; anonymous: no token = tenant `anonymous`; required
    keys_file: Path  # the keys that verify tenant tokens (absolute; the spec gives it relative to itself)
    anonymous_tier: str  # tier of the `anonymous` tenant in anonymous mode
    max_clock_skew_s: float = 30.0  # a token is still taken this long past its expiry

    def config(self) -> AuthConfig:
        """The models' `tenant_auth` parameter. A keys file inside the kit is written relative to
        the kit's root (where the models resolve it), so a generated config holds no absolute
        path and serves from any checkout or copy of the model repository."""
        try:
            keys_file = str(self.keys_file.relative_to(REPO_ROOT))
        except ValueError:
            keys_file = str(self.keys_file)
        return AuthConfig(mode=self.mode, keys_file=keys_file, max_clock_skew_s=self.max_clock_skew_s)


@dataclass(frozen=True)
class EmbedModelSpec:
    """The length-bucketed embedding service: a router model and one encoder per bucket."""

    name: str  # the router model clients call
    versions: tuple[int, ...]  # encoder versions loaded at start (each bucket model serves them all)
    slo_p95_ms: float  # end-to-end p95 latency target of one request
    expected_rps: float  # requests per second in normal traffic
    peak_rps: float  # requests per second at peak
    workload: Path  # length mix of requests (loadtest workload TOML)
    bucket_lens: tuple[int, ...]  # bucket sequence lengths, ascending
    encoder_prefix: str  # bucket model name = prefix + length
    max_request_rows: int  # rows one client request may carry (the router's max_batch_size)
    max_router_instances: int  # cap on router instances (one per host core is derived)
    max_text_bytes: int  # longest row accepted, in UTF-8 bytes
    queue_timeouts: bool = False  # write default_timeout_microseconds on bucket models (see serving.toml)
    precision: dict[int, str] = field(default_factory=dict)  # encoder version -> "fp32" or "int8" (build recipe)
    traffic: dict[int, float] = field(default_factory=dict)  # encoder version -> weight of unpinned traffic at start

    def precision_of(self, version: int) -> str:
        return self.precision.get(version, "fp32")

    def encoder_name(self, bucket_len: int) -> str:
        return f"{self.encoder_prefix}{bucket_len}"


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
    threads: int  # torch intra-op threads; 0: every core


@dataclass(frozen=True)
class ServingSpec:
    """The whole serving spec."""

    path: Path  # the file it was read from
    sha256: str  # digest of that file, recorded in generated configs
    profile: Path  # default latency profile for gen-config
    models: tuple[EmbedModelSpec, ...]  # served models
    tiers: tuple[TenantTier, ...]  # tenant tiers, highest priority first
    default_tier: str  # tier of requests that name no tenant tier
    hardware: dict[str, HardwareLimits]  # by hardware kind
    llm_models: tuple[LLMModelSpec, ...] = ()  # generative models
    tenant_members: dict[str, str] = field(default_factory=dict)  # tenant id -> tier name
    tenant_auth: TenantAuthSpec | None = None  # None: authentication off (the `tenant` parameter is trusted)

    def tier(self, name: str) -> TenantTier:
        return next(t for t in self.tiers if t.name == name)

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


def _positive(table: dict, key: str, where: str, kind=float, allow_zero: bool = False):
    if key not in table:
        raise SpecError(f"{where}: missing '{key}'")
    try:
        value = kind(table[key])
    except (TypeError, ValueError):
        raise SpecError(f"{where}: '{key}' must be a number, got {table[key]!r}") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise SpecError(f"{where}: '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _boolean(table: dict, key: str, where: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def _tier(name: str, raw: dict, where: str) -> TenantTier:
    def quota(key: str) -> float:
        return float(_positive({key: raw.get(key, 0)}, key, where, allow_zero=True))

    tier = TenantTier(name=name, priority=int(_positive(raw, "priority", where, int)),
                      requests_per_s=quota("requests_per_s"), burst=quota("burst"),
                      llm_tokens_per_s=quota("llm_tokens_per_s"), llm_token_burst=quota("llm_token_burst"))
    try:
        tier.verify()
    except ValueError as err:
        raise SpecError(f"{where}: {err}") from None
    return tier


def parse_spec(data: dict, path: Path) -> ServingSpec:
    root = path.parent
    where = str(path)
    tiers_raw = data.get("tenants", {}).get("tiers", {"standard": {"priority": 1}})
    tiers = tuple(sorted((_tier(name, t, f"{where} [tenants.tiers.{name}]") for name, t in tiers_raw.items()),
                         key=lambda tier: tier.priority))
    if sorted(t.priority for t in tiers) != list(range(1, len(tiers) + 1)):
        raise SpecError(f"{where}: tenant tier priorities must be 1..{len(tiers)} without gaps, "
                        f"got {[t.priority for t in tiers]}")
    default_tier = data.get("tenants", {}).get("default_tier", tiers[-1].name)
    if default_tier not in {t.name for t in tiers}:
        raise SpecError(f"{where}: default_tier {default_tier!r} is not one of {[t.name for t in tiers]}")
    members = data.get("tenants", {}).get("members", {})
    for tenant, tier in members.items():
        if not TENANT_PATTERN.match(tenant):
            raise SpecError(f"{where} [tenants.members]: tenant id {tenant!r} must be 1-64 letters, digits, "
                            "'.', '_' or '-'")
        if tier not in {t.name for t in tiers}:
            raise SpecError(f"{where} [tenants.members]: tenant {tenant!r} is in tier {tier!r}, which is not "
                            f"one of {[t.name for t in tiers]}")

    tenant_auth = parse_tenant_auth(data.get("tenants", {}).get("auth", {}), tiers, members, root,
                                    f"{where} [tenants.auth]")

    hardware = {}
    for kind, raw in data.get("hardware", {}).items():
        at = f"{where} [hardware.{kind}]"
        instance_kind = raw.get("instance_kind", "KIND_GPU" if kind == "gpu" else "KIND_CPU")
        if instance_kind not in ("KIND_CPU", "KIND_GPU"):
            raise SpecError(f"{at}: instance_kind must be KIND_CPU or KIND_GPU, got {instance_kind!r}")
        hardware[kind] = HardwareLimits(
            kind=kind,
            instance_kind=instance_kind,
            max_instances=int(_positive(raw, "max_instances", at, int)),
            intra_op_threads=int(_positive(raw, "intra_op_threads", at, int, allow_zero=True)),
            ort_spinning=_boolean(raw, "ort_spinning", at, default=kind == "gpu"),
        )
    if not hardware:
        raise SpecError(f"{where}: needs at least one [hardware.<kind>] table")

    models = []
    for name, raw in data.get("models", {}).items():
        at = f"{where} [models.{name}]"
        try:
            buckets = validate_buckets([int(b) for b in raw.get("buckets", [])])
        except (TypeError, ValueError) as err:
            raise SpecError(f"{at}: buckets: {err}") from None
        expected = _positive(raw, "expected_rps", at)
        peak = _positive(raw, "peak_rps", at)
        if peak < expected:
            raise SpecError(f"{at}: peak_rps ({peak}) must be >= expected_rps ({expected})")
        workload = root / raw.get("workload", "")
        if not workload.is_file():
            raise SpecError(f"{at}: workload file {workload} not found")
        versions = tuple(int(v) for v in raw.get("versions", [1]))
        if not versions or min(versions) < 1:
            raise SpecError(f"{at}: versions must be a non-empty list of integers >= 1")
        precision, traffic = _version_tables(raw, versions, at)
        models.append(EmbedModelSpec(
            name=name,
            versions=versions,
            precision=precision,
            traffic=traffic,
            slo_p95_ms=_positive(raw, "slo_p95_ms", at),
            expected_rps=expected,
            peak_rps=peak,
            workload=workload,
            bucket_lens=buckets,
            encoder_prefix=str(raw.get("encoder_prefix", "encoder_")),
            max_request_rows=int(_positive(raw, "max_request_rows", at, int)),
            max_router_instances=int(_positive(raw, "max_router_instances", at, int)),
            max_text_bytes=int(_positive(raw, "max_text_bytes", at, int)),
            queue_timeouts=_boolean(raw, "queue_timeouts", at, default=False),
        ))
    if not models:
        raise SpecError(f"{where}: needs at least one [models.<name>] table")
    llm_models = tuple(parse_llm_model(name, raw, f"{where} [llm_models.{name}]")
                       for name, raw in data.get("llm_models", {}).items())
    taken = {m.name for m in models}
    for llm in llm_models:
        if llm.name in taken:
            raise SpecError(f"{where}: model name {llm.name!r} is used twice")
    return ServingSpec(
        path=path,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        profile=root / data.get("profile", "profiles/cpu.json"),
        models=tuple(models),
        tiers=tiers,
        default_tier=default_tier,
        hardware=hardware,
        llm_models=llm_models,
        tenant_members=dict(members),
        tenant_auth=tenant_auth,
    )


AUTH_KEYS = ("mode", "keys_file", "anonymous_tier", "max_clock_skew_s")


def parse_tenant_auth(raw: object, tiers: tuple[TenantTier, ...], members: dict, root: Path,
                      at: str) -> TenantAuthSpec | None:
    """`[tenants.auth]`. Without the table tenants authenticate in anonymous mode: a bare
    `tenant` parameter is never trusted unless the spec says `mode = "off"`."""
    if not isinstance(raw, dict):
        raise SpecError(f"{at}: must be a table")
    unknown = sorted(set(raw) - set(AUTH_KEYS))
    if unknown:  # a misspelt key in a security setting must not fall back to a default silently
        raise SpecError(f"{at}: unknown key(s) {unknown}; the keys are {list(AUTH_KEYS)}")
    modes = [m.value for m in AuthMode]
    mode_name = raw.get("mode", AuthMode.ANONYMOUS.value)
    if mode_name not in modes:
        raise SpecError(f"{at}: mode must be one of {modes}, got {mode_name!r}")
    mode = AuthMode(mode_name)
    if mode is AuthMode.OFF:
        return None
    keys_file = raw.get("keys_file", DEFAULT_KEYS_FILE)
    if not isinstance(keys_file, str) or not keys_file.strip():
        raise SpecError(f"{at}: keys_file must be a path (relative to the spec), got {keys_file!r}")
    lowest = max(tiers, key=lambda tier: tier.priority).name
    anonymous_tier = raw.get("anonymous_tier", lowest)
    if anonymous_tier not in {t.name for t in tiers}:
        raise SpecError(f"{at}: anonymous_tier {anonymous_tier!r} is not one of {[t.name for t in tiers]}")
    if ANONYMOUS_TENANT in members:
        raise SpecError(f"{at}: the tenant id {ANONYMOUS_TENANT!r} is reserved for requests without a token; "
                        "remove it from [tenants.members]")
    skew = raw.get("max_clock_skew_s", 30.0)
    if isinstance(skew, bool) or not isinstance(skew, int | float) or not 0 <= skew <= MAX_CLOCK_SKEW_S:
        raise SpecError(f"{at}: max_clock_skew_s must be a number of seconds within [0, {MAX_CLOCK_SKEW_S:g}], "
                        f"got {skew!r}")
    return TenantAuthSpec(mode=mode, keys_file=(root / keys_file).resolve(), anonymous_tier=anonymous_tier,
                          max_clock_skew_s=float(skew))


def _version_tables(raw: dict, versions: tuple[int, ...], at: str) -> tuple[dict[int, str], dict[int, float]]:
    """`precision` and `traffic` tables keyed by version; both may only name served versions."""
    if len(set(versions)) != len(versions):
        raise SpecError(f"{at}: versions {list(versions)} repeat a version")
    tables = {}
    for key in ("precision", "traffic"):
        table = raw.get(key, {})
        if not isinstance(table, dict):
            raise SpecError(f"{at}: '{key}' must be a table of version = value")
        parsed = {}
        for version_key, value in table.items():
            try:
                version = int(version_key)
            except ValueError:
                raise SpecError(f"{at}: {key}: key {version_key!r} is not a version number") from None
            if version not in versions:
                raise SpecError(f"{at}: {key} names version {version}, which is not in versions {list(versions)}")
            parsed[version] = value
        tables[key] = parsed
    for version, value in tables["precision"].items():
        if value not in ENCODER_PRECISIONS:
            raise SpecError(f"{at}: precision of version {version} must be one of {ENCODER_PRECISIONS}, got {value!r}")
    traffic = {}
    for version, value in tables["traffic"].items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise SpecError(f"{at}: traffic weight of version {version} must be a number >= 0, got {value!r}")
        traffic[version] = float(value)
    if not traffic:
        traffic = {versions[0]: 100.0}  # all traffic on the first version until a rollout moves it
    if sum(traffic.values()) <= 0:
        raise SpecError(f"{at}: traffic needs a weight > 0 on at least one version")
    return tables["precision"], traffic


def parse_llm_model(name: str, raw: dict, at: str) -> LLMModelSpec:
    versions = tuple(int(v) for v in raw.get("versions", [1]))
    if not versions or min(versions) < 1:
        raise SpecError(f"{at}: versions must be a non-empty list of integers >= 1")
    batching = str(raw.get("batching", "continuous"))
    if batching not in LLM_BATCHING:
        raise SpecError(f"{at}: batching must be one of {', '.join(map(repr, LLM_BATCHING))}, got {batching!r}")
    llm = LLMModelSpec(
        name=name,
        versions=versions,
        batching=batching,
        kv_cache_mb=_positive(raw, "kv_cache_mb", at),
        block_size=int(_positive(raw, "block_size", at, int)),
        max_num_seqs=int(_positive(raw, "max_num_seqs", at, int)),
        max_num_batched_tokens=int(_positive(raw, "max_num_batched_tokens", at, int)),
        max_model_len=int(_positive(raw, "max_model_len", at, int)),
        default_max_tokens=int(_positive(raw, "default_max_tokens", at, int)),
        ttft_p95_ms=_positive(raw, "ttft_p95_ms", at),
        threads=int(_positive(raw, "threads", at, int, allow_zero=True)),
    )
    if llm.max_num_batched_tokens < llm.max_num_seqs:
        raise SpecError(f"{at}: max_num_batched_tokens ({llm.max_num_batched_tokens}) must be >= max_num_seqs "
                        f"({llm.max_num_seqs}) so every running sequence decodes each step")
    if llm.default_max_tokens >= llm.max_model_len:
        raise SpecError(f"{at}: default_max_tokens ({llm.default_max_tokens}) must be < max_model_len "
                        f"({llm.max_model_len})")
    return llm


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
