"""The router of a length-bucketed text model: validate a request, tokenize it, and plan which
bucket models serve it.

The service (`python_backends.embed.service`) unpacks tensors, calls `EmbedRouter.prepare`,
sends each `PreparedChunk` to its bucket model over BLS, and passes the outputs to
`buckets.reassemble`. What a row is depends on the model's kind (`kinds`): a text (with the
spec's query or document prefix), or for a pair classifier a text and its pair, tokenized
together with token type ids, the longer member truncated first. Free of Triton imports.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import numpy as np
from pydantic import PlainSerializer, PlainValidator, model_validator

from python_backends.common.errors import InvalidInput
from python_backends.common.params import AuthParameter, Flag, ModelParameters, PositiveInt, TenantsParameter
from python_backends.common.quotas import UNLIMITED, TenantPolicy, parse_tenant
from python_backends.common.regimes import LingerRegimes, RegimesParameter
from python_backends.common.request_start import request_start
from python_backends.common.tenant_auth import AUTH_OFF, AuthConfig
from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.admission import ADMIT_ALL, AdmissionPolicy
from python_backends.embed.buckets import Chunk, pad_rows, plan_chunks, truncate_tokens, validate_buckets
from python_backends.embed.inline import InlineParameter, InlinePolicy, check_inline
from python_backends.embed.kinds import ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS, ModelKind
from python_backends.embed.routing import RoutingTable, format_weights, parse_weights, pinned_version

INPUT_TYPES = ("query", "document")  # what a request's `input_type` parameter may say (which prefix)

# Custom metrics of the router (Prometheus counters, port 8002): name -> help text.
ROUTER_COUNTERS = {
    "embed_bucket_rows_total": "Rows the embed router sent to each length bucket",
    "embed_bucket_real_tokens_total": "Tokens carrying text sent to each bucket (padding excluded)",
    "embed_bucket_padded_tokens_total": "Token slots sent to each bucket, padding included (rows x bucket length)",
    "embed_truncated_rows_total": "Rows cut to the model's token limit",
    "embed_bucket_express_rows_total": "Rows of each length bucket that the express model served instead of the "
                                       "bucket model (the light regime); counted in embed_bucket_rows_total too",
}
# Per model: which path the router's instances send the lingering buckets' rows to (common.regimes).
LINGER_REGIME = ("embed_linger_regime", "Share of the router's instances in the peak regime: 0, the lingering "
                                        "buckets' rows go to the express model (light); 1, to their bucket models")
# Per encoder version (labels model, version): what the rollout gates read.
VERSION_COUNTER = ("embed_requests_total", "Routed requests by encoder version and outcome (ok, error, rejected)")
VERSION_LATENCY = ("embed_request_duration_seconds", "Time the router took to answer a request, by encoder version")
VERSION_INFLIGHT = ("embed_inflight_requests", "Requests the router is serving on each encoder version now")
# Per tenant (labels model, tenant, tier, outcome): who is served and who is turned away.
TENANT_COUNTER = ("embed_tenant_requests_total",
                  "Requests by tenant, tier and outcome (ok, error, rejected: server busy, over_quota, "
                  "unauthenticated)")
TENANT_OUTCOMES = ("ok", "error", "rejected", "over_quota", "unauthenticated")
# A request that failed authentication has no tenant the router can trust: it is counted
# under these labels, and by reason (labels model, reason) in the failure counter.
UNAUTHENTICATED_LABELS = {"tenant": "unknown", "tier": "none", "outcome": "unauthenticated"}
AUTH_FAILURE_COUNTER = ("embed_auth_failures_total",
                        "Requests refused before any model ran because their tenant credential failed, by reason")
# Histogram bucket edges: latency in seconds (fine around a 200 ms SLO), cosine near 1.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
# The per-bucket counters, in the order the adapter increments them: rows, real, padded.
BUCKET_COUNTERS = ("embed_bucket_rows_total", "embed_bucket_real_tokens_total", "embed_bucket_padded_tokens_total")


@dataclass(frozen=True)
class RouterConfig:
    """Settings of the `embed` router, read from its config.pbtxt `parameters` (`RouterParameters`)."""

    bucket_lens: tuple[int, ...]  # sequence lengths of the bucket models, ascending
    bucket_max_batch: Mapping[int, int]  # bucket length -> its model's max_batch_size (chunk limit)
    encoder_prefix: str = "encoder_"  # bucket model name = prefix + length, e.g. encoder_16
    max_text_bytes: int = 65536  # a row longer than this (UTF-8 bytes) is rejected before tokenizing
    default_routing: RoutingTable = field(default_factory=lambda: RoutingTable({1: 1.0}))  # split with no routing file
    routing_file: str = "routing.json"  # the live split, relative to the model's folder unless absolute
    tenants: TenantPolicy = UNLIMITED  # tiers and quotas of tenants (spec [tenants])
    admission: AdmissionPolicy = ADMIT_ALL  # how much work may be in flight (derived from the profile)
    auth: AuthConfig = AUTH_OFF  # how a request proves its tenant (spec [tenants.auth])
    max_concurrent_requests: int = 32  # requests one instance serves at once (its worker threads)
    kind: ModelKind = ModelKind.TEXT_ENCODER  # what a row is and what comes back
    token_types: bool = False  # send TOKEN_TYPE_IDS to the bucket models
    query_prefix: str = ""  # put before each text of a query (input_type "query", the default)
    document_prefix: str = ""  # put before each text of a document (input_type "document")
    labels: tuple[str, ...] = ()  # classifier label names by logit index; empty: no LABEL output
    pairs: bool = False  # rows may be text pairs (TEXT_PAIR)
    linger_regimes: LingerRegimes | None = None  # when the express model serves lingering buckets; None: never
    inline: InlinePolicy = field(default_factory=InlinePolicy)  # how long a call served on execute's thread may take

    @property
    def output(self) -> str:
        return self.kind.output

    @property
    def max_tokens(self) -> int:
        """Longest row the model takes; longer rows are truncated or rejected."""
        return self.bucket_lens[-1]

    def model_for(self, bucket_len: int) -> str:
        return f"{self.encoder_prefix}{bucket_len}"


BUCKET_LENS_REQUIRED = "parameter bucket_lens is required (e.g. '16,32,64')"
DEFAULT_ROUTING_FILE = "routing.json"


def _parse_bucket_lens(value: object) -> tuple[int, ...]:
    if not isinstance(value, str):
        return validate_buckets(list(value))
    if not value:
        raise ValueError(BUCKET_LENS_REQUIRED)
    try:
        return validate_buckets([int(part) for part in value.split(",")])
    except ValueError as err:
        raise ValueError(f"parameter bucket_lens={value!r}: {err}") from None


def _parse_bucket_max_batch(value: object) -> dict[int, int]:
    """`16:32,32:24,...` (bucket length: max batch), or the mapping itself; every limit >= 1."""
    if isinstance(value, Mapping):
        entries = [(int(bucket), int(limit)) for bucket, limit in value.items()]
    else:
        entries = []
        for part in filter(None, (p.strip() for p in str(value).split(","))):
            try:
                bucket, limit = (int(x) for x in part.split(":"))
            except ValueError:
                raise ValueError(f"bucket_max_batch entry {part!r} is not 'length:max_batch'") from None
            entries.append((bucket, limit))
    for bucket, limit in entries:
        if limit < 1:
            raise ValueError(f"bucket_max_batch for bucket {bucket} must be >= 1")
    return dict(entries)


def _parse_version_weights(value: object) -> RoutingTable:
    if isinstance(value, RoutingTable):
        return value
    raw = value if isinstance(value, str) else format_weights(value)
    try:
        return RoutingTable(parse_weights(raw) if isinstance(value, str) else dict(value))
    except ValueError as err:
        raise ValueError(f"parameter version_weights={raw!r}: {err}") from None


def _parse_admission(value: object) -> AdmissionPolicy:
    if isinstance(value, AdmissionPolicy):
        return value
    if not value:
        return ADMIT_ALL
    try:
        return AdmissionPolicy.from_json(str(value))
    except ValueError as err:
        raise ValueError(f"parameter admission: {err}") from None


BucketLens = Annotated[tuple[int, ...], PlainValidator(_parse_bucket_lens),
                       PlainSerializer(lambda lens: ",".join(str(b) for b in lens), return_type=str)]
BucketMaxBatch = Annotated[dict[int, int], PlainValidator(_parse_bucket_max_batch),
                           PlainSerializer(lambda limits: ",".join(f"{b}:{n}" for b, n in sorted(limits.items())),
                                           return_type=str)]
VersionWeights = Annotated[RoutingTable, PlainValidator(_parse_version_weights),
                           PlainSerializer(lambda table: format_weights(table.weights), return_type=str)]
AdmissionParameter = Annotated[AdmissionPolicy, PlainValidator(_parse_admission),
                               PlainSerializer(lambda policy: policy.to_json(), return_type=str)]
RoutingFile = Annotated[str, PlainValidator(lambda value: str(value) or DEFAULT_ROUTING_FILE)]


def _parse_kind(value: object) -> ModelKind:
    return value if isinstance(value, ModelKind) else ModelKind.parse(str(value))


def _parse_labels(value: object) -> tuple[str, ...]:
    """A JSON list of label names (names may hold commas), or the names themselves."""
    if isinstance(value, str):
        if not value:
            return ()
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"parameter labels is not a JSON list of names: {err}") from None
    if not isinstance(value, list | tuple) or not all(isinstance(name, str) for name in value):
        raise ValueError(f"parameter labels must be a list of names, got {value!r}")
    return tuple(value)


KindParameter = Annotated[ModelKind, PlainValidator(_parse_kind), PlainSerializer(str, return_type=str)]
LabelsParameter = Annotated[tuple[str, ...], PlainValidator(_parse_labels),
                            PlainSerializer(lambda names: json.dumps(list(names)), return_type=str)]


class RouterParameters(ModelParameters):
    """The `embed` router's config.pbtxt parameters (gen-config writes them through this class)."""

    required_help: ClassVar[Mapping[str, str]] = {"bucket_lens": BUCKET_LENS_REQUIRED}

    bucket_lens: BucketLens  # sequence lengths of the bucket models
    bucket_max_batch: BucketMaxBatch = {}  # bucket length -> its model's max_batch_size; one per bucket
    encoder_prefix: str = "encoder_"  # bucket model name = prefix + length
    max_text_bytes: PositiveInt = 65536  # a longer row (UTF-8 bytes) is rejected before tokenizing
    version_weights: VersionWeights = RoutingTable({1: 1.0})  # the split when there is no routing file
    routing_file: RoutingFile = DEFAULT_ROUTING_FILE  # the live split, relative to the model's folder
    tenants: TenantsParameter = UNLIMITED  # tiers and quotas of tenants
    admission: AdmissionParameter = ADMIT_ALL  # how much work may be in flight
    tenant_auth: AuthParameter = AUTH_OFF  # how a request proves its tenant
    max_concurrent_requests: PositiveInt = 32  # requests one instance serves at once
    kind: KindParameter = ModelKind.TEXT_ENCODER  # text-encoder or text-classifier
    token_types: Flag = False  # send TOKEN_TYPE_IDS to the bucket models
    query_prefix: str = ""  # put before each query text
    document_prefix: str = ""  # put before each document text
    labels: LabelsParameter = ()  # classifier label names by logit index
    pairs: Flag = False  # rows may be text pairs (TEXT_PAIR)
    linger_regimes: RegimesParameter = None  # JSON: when the express model serves the lingering buckets
    inline_max_ms: InlineParameter = InlinePolicy()  # JSON: each target's limit on a call served inline

    @model_validator(mode="after")
    def _every_bucket_covered(self) -> RouterParameters:
        missing = [b for b in self.bucket_lens if b not in self.bucket_max_batch]
        if missing:
            raise ValueError(f"parameter bucket_max_batch has no limit for buckets {missing}")
        no_cost = sorted(set(self.bucket_lens) - set(self.admission.row_cost_ms))
        if self.admission.max_work_ms > 0 and no_cost:
            raise ValueError(f"parameter admission has no row cost for buckets {no_cost}")
        buckets = [f"{self.encoder_prefix}{b}" for b in self.bucket_lens]
        check_regimes(self.linger_regimes, buckets)
        check_inline(self.inline_max_ms, buckets + ([self.linger_regimes.express] if self.linger_regimes else []))
        return self

    def router_config(self) -> RouterConfig:
        return RouterConfig(bucket_lens=self.bucket_lens, bucket_max_batch=self.bucket_max_batch,
                            encoder_prefix=self.encoder_prefix, max_text_bytes=self.max_text_bytes,
                            default_routing=self.version_weights, routing_file=self.routing_file,
                            tenants=self.tenants, admission=self.admission, auth=self.tenant_auth,
                            max_concurrent_requests=self.max_concurrent_requests, kind=self.kind,
                            token_types=self.token_types, query_prefix=self.query_prefix,
                            document_prefix=self.document_prefix, labels=self.labels, pairs=self.pairs,
                            linger_regimes=self.linger_regimes, inline=self.inline_max_ms)


def check_regimes(regimes: LingerRegimes | None, bucket_models: Sequence[str]) -> None:
    """The regimes name only this router's bucket models, and an express model that is none of them."""
    if regimes is None:
        return
    unknown = sorted(set(regimes.peak_us) - set(bucket_models))
    if unknown:
        raise ValueError(f"parameter linger_regimes names {unknown}, which are not bucket models of this router "
                         f"({', '.join(bucket_models)})")
    if regimes.express in bucket_models:
        raise ValueError(f"parameter linger_regimes: the express model {regimes.express!r} is a bucket model")


def parse_router_config(model_name: str, parameters: Mapping[str, str]) -> RouterConfig:
    """Build the router config from config.pbtxt string parameters; errors name the model."""
    return RouterParameters.from_parameters(model_name, parameters).router_config()


@dataclass(frozen=True)
class RequestOptions:
    """Per-request options carried as inference request parameters.

    `priority` is not here: it is Triton's own request field (KServe parameter
    `priority`), applied by the router's dynamic batcher before the backend sees it.
    """

    tenant: str = "default"  # who sent it; quotas and priorities key on this
    truncate: bool = True  # False: a row over the token limit is an error instead of cut
    version: int | None = None  # encoder version the request pins; None: the routing table decides
    input_type: str = "query"  # which of the model's prefixes its texts get: query or document
    started_at_s: float | None = None  # its X-Request-Start stamp (seconds since the epoch); None: none


def parse_request_options(parameters_json: str | None,
                          tenant_of: Callable[[Mapping[str, object]], str] = parse_tenant) -> RequestOptions:
    """Parse the request's parameters (Triton hands them over as a JSON object).

    `tenant_of` says who the request is from; with tenant authentication on it checks the
    token, and its `AuthError` passes through to the caller untouched.
    """
    if not parameters_json or parameters_json == "{}":  # most requests: no parameters at all
        return _options_without_parameters(tenant_of)
    params: object = {}
    if parameters_json:
        try:
            params = json.loads(parameters_json)
        except json.JSONDecodeError as err:
            raise InvalidInput(f"request parameters are not valid JSON: {err}") from None
    if not isinstance(params, dict):
        raise InvalidInput("request parameters must be a JSON object")

    try:
        tenant = tenant_of(params)
    except ValueError as err:
        raise InvalidInput(str(err)) from None

    truncate = params.get("truncate", True)
    if isinstance(truncate, str) and truncate.lower() in ("true", "false"):
        truncate = truncate.lower() == "true"
    if not isinstance(truncate, bool):
        raise InvalidInput(f"parameter 'truncate' must be true or false, got {truncate!r}")
    input_type = params.get("input_type", "query")
    if input_type not in INPUT_TYPES:
        raise InvalidInput(f"parameter 'input_type' must be one of {', '.join(INPUT_TYPES)}, got {input_type!r}")
    try:
        started_at_s = request_start(params)
    except ValueError as err:
        raise InvalidInput(str(err)) from None
    return RequestOptions(tenant=tenant, truncate=truncate, version=pinned_version(params), input_type=input_type,
                          started_at_s=started_at_s)


def _options_without_parameters(tenant_of: Callable[[Mapping[str, object]], str]) -> RequestOptions:
    """The options of a request that sends no parameters: the defaults, for the tenant
    `tenant_of` makes of no parameters (its errors pass through as for any request)."""
    try:
        tenant = tenant_of({})
    except ValueError as err:
        raise InvalidInput(str(err)) from None
    return _default_options(tenant)


@functools.lru_cache(maxsize=64)  # tenant_of({}) names one tenant in practice
def _default_options(tenant: str) -> RequestOptions:
    """One shared (frozen) value per tenant, not a new one per request."""
    return RequestOptions(tenant=tenant)


def decode_rows(raw_rows: Sequence[bytes | str], max_text_bytes: int, tensor: str = "TEXT") -> list[str]:
    """Check and decode the rows of a BYTES input; the error names the input and the first offending row."""
    if len(raw_rows) == 0:
        raise InvalidInput(f"input '{tensor}' has no rows; send at least one string")
    texts: list[str] = []
    for index, raw in enumerate(raw_rows):
        data = raw if type(raw) is bytes else raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
        if len(data) > max_text_bytes:
            raise InvalidInput(
                f"{tensor} row {index} is {len(data)} bytes; the limit is {max_text_bytes} bytes per row"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidInput(f"{tensor} row {index} is not valid UTF-8 (byte {err.start})") from None
        if not text.strip():
            raise InvalidInput(f"{tensor} row {index} is empty; send at least one non-blank character")
        texts.append(text)
    return texts


# Triton's own texts for requests its scheduler turned away: the queue policy's timeout
# and a full queue. Over BLS they arrive as INTERNAL; the router restores UNAVAILABLE
# (HTTP 503), the retryable status a client gets when it calls a model directly.
SCHEDULER_REJECTIONS = ("Request timeout expired", "Exceeds maximum queue size")
# A chunk the router does not send: its deadline leaves it no time to queue (`admission.queue_wait_ms`).
# It reads as the queue's own timeout rejection, and is mapped and counted as one.
LATE_BEFORE_SENT = (f"{SCHEDULER_REJECTIONS[0]} before the request was sent: its answer would come after the "
                    "latency SLO")


def is_instance_crash(message: str) -> bool:
    """Whether a bucket model's error says the instance that took the request died (its stub
    process is gone). Retryable: another instance, or the reloaded one, serves the retry."""
    return "Stub process" in message and "is not healthy" in message


def is_scheduler_rejection(message: str) -> bool:
    """Whether a bucket model's error is a queue-policy rejection (retryable), not a failure."""
    return any(text in message for text in SCHEDULER_REJECTIONS)


@dataclass(frozen=True)
class PreparedChunk:
    """A chunk ready to send: the bucket model and its padded tensors."""

    chunk: Chunk  # which rows, which bucket
    model_name: str  # bucket model to call
    tensors: dict[str, np.ndarray]  # the bucket model's inputs by name, each int64 [rows, bucket_len]
    num_real_tokens: int  # tokens that carry text; the rest of rows * bucket_len is padding

    @property
    def input_ids(self) -> np.ndarray:
        return self.tensors[INPUT_IDS]

    @property
    def attention_mask(self) -> np.ndarray:
        return self.tensors[ATTENTION_MASK]


@dataclass(frozen=True)
class PreparedRequest:
    """A validated client request, split into bucket chunks."""

    options: RequestOptions
    token_counts: np.ndarray  # int32 [rows]: tokens used per row, special tokens included
    num_truncated: int  # rows cut to the token limit
    chunks: list[PreparedChunk] = field(default_factory=list)

    @property
    def chunk_plan(self) -> list[Chunk]:
        return [prepared.chunk for prepared in self.chunks]

    def rows_by_bucket(self) -> dict[int, int]:
        rows: dict[int, int] = {}
        for prepared in self.chunks:
            rows[prepared.chunk.bucket_len] = rows.get(prepared.chunk.bucket_len, 0) + len(prepared.chunk.row_indices)
        return rows

    def chunks_by_bucket(self) -> dict[int, int]:
        """How many chunks each bucket's lane runs, one after another."""
        return dict(Counter(prepared.chunk.bucket_len for prepared in self.chunks))

    def lanes(self) -> list[list[int]]:
        """Indices into `chunks`, one lane per bucket.

        Lanes run concurrently; the chunks inside a lane go one after another. Sent together,
        a request's own chunks would queue behind each other at the bucket model and could
        time out there waiting for their siblings rather than for other traffic.
        """
        lanes: dict[int, list[int]] = {}
        for index, prepared in enumerate(self.chunks):
            lanes.setdefault(prepared.chunk.bucket_len, []).append(index)
        return list(lanes.values())


class EmbedRouter:
    """Turns a client request into per-bucket chunks; holds no Triton state."""

    def __init__(self, config: RouterConfig, tokenizer: TextTokenizer):
        self.config = config
        self.tokenizer = tokenizer

    def prepare(self, raw_rows: Sequence[bytes | str], parameters_json: str | None,
                options: RequestOptions | None = None,
                raw_pairs: Sequence[bytes | str] | None = None) -> PreparedRequest:
        """Validate, tokenize and plan a request; `options` when the caller parsed the parameters
        already; `raw_pairs` the TEXT_PAIR rows of a pair classifier's request."""
        options = options if options is not None else parse_request_options(parameters_json)
        config = self.config
        texts = decode_rows(raw_rows, config.max_text_bytes)
        max_tokens = config.max_tokens
        if raw_pairs is not None:
            if not config.pairs:
                raise InvalidInput(f"this model takes single texts; it has no input TEXT_PAIR (kind {config.kind})")
            seconds = decode_rows(raw_pairs, config.max_text_bytes, "TEXT_PAIR")
            if len(seconds) != len(texts):
                raise InvalidInput(f"TEXT has {len(texts)} rows but TEXT_PAIR {len(seconds)}; send one pair per row")
            encoded, types, num_truncated = self._pairs(texts, seconds, max_tokens, options.truncate)
        else:
            prefix = config.document_prefix if options.input_type == "document" else config.query_prefix
            if prefix:
                texts = [prefix + text for text in texts]
            encoded, num_truncated = self._singles(texts, max_tokens, options.truncate)
            types = None
        lengths = [len(ids) for ids in encoded]
        prepared: list[PreparedChunk] = []
        for chunk in plan_chunks(lengths, config.bucket_lens, config.bucket_max_batch):
            rows = [encoded[i] for i in chunk.row_indices]
            input_ids, attention_mask = pad_rows(rows, chunk.bucket_len, self.tokenizer.pad_id)
            tensors = {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask}
            if config.token_types:
                tensors[TOKEN_TYPE_IDS] = (pad_rows([types[i] for i in chunk.row_indices], chunk.bucket_len, 0)[0]
                                           if types is not None else np.zeros_like(input_ids))
            prepared.append(PreparedChunk(
                chunk=chunk,
                model_name=config.model_for(chunk.bucket_len),
                tensors=tensors,
                num_real_tokens=sum(lengths[i] for i in chunk.row_indices),
            ))
        return PreparedRequest(
            options=options,
            token_counts=np.asarray(lengths, dtype=np.int32),
            num_truncated=num_truncated,
            chunks=prepared,
        )

    def _singles(self, texts: list[str], max_tokens: int, truncate: bool) -> tuple[list[list[int]], int]:
        encoded = self.tokenizer.encode(texts)
        num_truncated = 0
        for index, ids in enumerate(encoded):
            if len(ids) <= max_tokens:
                continue
            if not truncate:
                raise InvalidInput(
                    f"TEXT row {index} has {len(ids)} tokens; the limit is {max_tokens} and truncate=false"
                )
            encoded[index] = truncate_tokens(ids, max_tokens, self.tokenizer.layout.trailing)
            num_truncated += 1
        return encoded, num_truncated

    def _pairs(self, firsts: list[str], seconds: list[str], max_tokens: int,
               truncate: bool) -> tuple[list[list[int]], list[list[int]], int]:
        rows = self.tokenizer.encode_pairs(firsts, seconds, max_tokens if truncate else None)
        if not truncate:
            for index, (ids, _, _) in enumerate(rows):
                if len(ids) > max_tokens:
                    raise InvalidInput(f"pair row {index} has {len(ids)} tokens; the limit is {max_tokens} and "
                                       "truncate=false")
        return ([ids for ids, _, _ in rows], [types for _, types, _ in rows],
                sum(1 for _, _, cut in rows if cut))
