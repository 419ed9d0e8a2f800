"""The `embed` model on a real tritonserver: correctness, bucketing, batching."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from python_backends.common.regimes import REGIMES_PARAMETER, LingerRegimes
from python_backends.common.request_start import stamp
from python_backends.embed.admission import AdmissionPolicy
from tests.integration.helpers import (
    BUCKETS,
    ROUTER_COUNTERS_LAG_S,
    as_tenant,
    cosines,
    grpc_embed,
    http_embed,
    model_counts,
    reference_embeddings,
    settled,
    text_with_tokens,
    token_count,
)
from tools.cli.serve import example_request

# Lengths that land in every bucket, on both sides of each edge, plus one beyond the limit.
LENGTHS = (5, 16, 17, 32, 33, 60, 100, 128, 129, 250, 256)


@pytest.fixture(scope="module")
def texts():
    return [text_with_tokens(n) for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(texts):
    return reference_embeddings(texts)


def test_http_embeddings_match_transformers_reference(http_client, texts, reference):
    embedding, tokens = http_embed(http_client, texts)
    assert embedding.shape == (len(texts), 384) and embedding.dtype == np.float32
    assert tokens.ravel().tolist() == [token_count(t) for t in texts]
    assert {b for b in BUCKETS if any(b // 2 < n <= b for n in tokens.ravel())} == set(BUCKETS)
    assert cosines(embedding, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-5)


def test_grpc_embeddings_match_transformers_reference(grpc_client, texts, reference):
    embedding, tokens = grpc_embed(grpc_client, texts)
    assert tokens.ravel().tolist() == [token_count(t) for t in texts]
    assert cosines(embedding, reference).min() >= 0.9999


def test_plain_json_over_http_matches_reference(triton, texts, reference):
    body = {"inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/embed/infer",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        outputs = {o["name"]: o for o in json.load(response)["outputs"]}
    embedding = np.array(outputs["EMBEDDING"]["data"], dtype=np.float32).reshape(outputs["EMBEDDING"]["shape"])
    assert outputs["TOKENS"]["datatype"] == "INT32"
    assert cosines(embedding, reference).min() >= 0.9999


def test_the_example_curl_request_printed_by_serve_works(triton):
    command = example_request(triton.config.http_port)
    result = subprocess.run(shlex.split(command.replace("\\\n", " ")), capture_output=True, text=True, timeout=60)
    outputs = {o["name"]: o for o in json.loads(result.stdout)["outputs"]}
    assert outputs["EMBEDDING"]["shape"] == [1, 384]
    assert outputs["TOKENS"]["data"][0] > 2


def test_long_input_is_truncated_to_256_tokens_by_default(http_client):
    text = text_with_tokens(600)
    assert token_count(text) > 256
    embedding, tokens = http_embed(http_client, [text])
    assert tokens.ravel().tolist() == [256]
    assert cosines(embedding, reference_embeddings([text]))[0] >= 0.9999


def test_truncate_false_rejects_long_input(http_client):
    with pytest.raises(httpclient.InferenceServerException) as info:
        http_embed(http_client, ["short one", text_with_tokens(600)], parameters={"truncate": False})
    assert "400" in str(info.value.status())
    assert "TEXT row 1 has" in info.value.message() and "truncate=false" in info.value.message()


def test_rows_of_one_request_in_different_buckets_come_back_in_order(http_client):
    # Interleave lengths so that the router must split and reassemble.
    texts = [text_with_tokens(n) for n in (200, 6, 40, 7, 120, 20, 250, 9)]
    together, tokens = http_embed(http_client, texts)
    alone = np.concatenate([http_embed(http_client, [t])[0] for t in texts])
    assert cosines(together, alone).min() >= 0.9999
    assert tokens.ravel().tolist() == [token_count(t) for t in texts]


@pytest.mark.parametrize("num_tokens", [8, 20, 50, 100, 200])
def test_each_length_lands_in_its_bucket(http_client, num_tokens):
    text = text_with_tokens(num_tokens)
    expected = next(b for b in BUCKETS if token_count(text) <= b)
    regimes = LingerRegimes.from_json(
        http_client.get_model_config("embed")["parameters"][REGIMES_PARAMETER]["string_value"])
    models = [*(f"encoder_{b}" for b in BUCKETS), regimes.express]
    before = {model: model_counts(http_client, model) for model in models}
    http_embed(http_client, [text])
    # A bucket that lingers at peak has its rows served by the express model while traffic is
    # light (as here, unless an earlier test left the router's regime at peak); padded to the
    # bucket either way (test_router_metric_counts_rows_per_bucket).
    wanted = [{f"encoder_{expected}": 1}]
    if f"encoder_{expected}" in regimes.peak_us:
        wanted.append({regimes.express: 1})
    # Triton records a model's statistics just after it responds; give it a moment.
    deadline = time.monotonic() + 5
    while True:
        after = {model: model_counts(http_client, model) for model in models}
        delta = {model: after[model][0] - before[model][0] for model in after if after[model] != before[model]}
        if delta in wanted or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta in wanted


def test_router_metric_counts_rows_per_bucket(triton, http_client):
    def rows_metric() -> dict[str, float]:
        with urllib.request.urlopen(triton.metrics_url, timeout=10) as response:
            lines = response.read().decode().splitlines()
        values = {}
        for line in lines:
            if line.startswith("embed_bucket_rows_total{"):
                labels, value = line.rsplit(" ", 1)
                bucket = labels.split('bucket="')[1].split('"')[0]
                values[bucket] = float(value)
        return values

    # Counts of earlier requests land before the baseline; then wait for this one's.
    time.sleep(ROUTER_COUNTERS_LAG_S)
    before = rows_metric()
    http_embed(http_client, [text_with_tokens(10), text_with_tokens(10), text_with_tokens(90)])
    after = settled(rows_metric, lambda rows: rows["16"] - before["16"] >= 2)
    assert after["16"] - before["16"] == 2
    assert after["128"] - before["128"] == 1
    assert after["32"] == before["32"]


def test_tenant_token_and_priority_are_accepted_over_all_protocols(triton, http_client, grpc_client):
    token = as_tenant("team-a")["tenant_token"]
    embedding, _ = http_embed(http_client, ["hello"], parameters={"tenant_token": token}, priority=1)
    assert embedding.shape == (1, 384)
    # As a header / gRPC metadata key: the server forwards `tenant-token` as a parameter.
    text = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=object))
    result = grpc_client.infer("embed", [text], headers={"tenant-token": token}, priority=2)
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    body = {"parameters": {"tenant_token": token, "tenant": "team-a", "priority": 1},
            "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]}]}
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/embed/infer",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_a_request_start_stamp_reaches_the_router_over_both_protocols(http_client, grpc_client):
    # Stamped 10 s ago (X-Request-Start, as a proxy writes it): refused as too late, retryably.
    old = {"X-Request-Start": stamp(time.time() - 10.0)}
    with pytest.raises(httpclient.InferenceServerException) as info:
        http_client.infer("embed", [_text_input(httpclient)], headers=old)
    assert info.value.status() == "503" and "too long to meet the latency SLO" in info.value.message()
    with pytest.raises(grpcclient.InferenceServerException) as info:
        grpc_client.infer("embed", [_text_input(grpcclient)], headers={"x-request-start": old["X-Request-Start"]})
    assert info.value.status() == "StatusCode.UNAVAILABLE" and "too long to meet" in info.value.message()
    # Stamped now: served.
    fresh = http_client.infer("embed", [_text_input(httpclient)], headers={"X-Request-Start": stamp(time.time())})
    assert fresh.as_numpy("EMBEDDING").shape == (1, 384)


def test_an_idle_server_serves_a_request_whose_deadline_is_too_close_rather_than_say_busy(http_client):
    # Stamped so that less than its bucket's longest batch is left of S - o: with work queued
    # ahead its chunk would not be sent (its answer would be late); on an idle server nothing
    # is ahead, dropping it frees nothing, and the server is not busy: it is served.
    policy = AdmissionPolicy.from_json(http_client.get_model_config("embed")["parameters"]["admission"]["string_value"])
    assert policy.batch_ms and policy.max_limit_ms > policy.batch_ms[16]
    waited_s = (policy.max_limit_ms - policy.batch_ms[16] / 2) / 1000.0
    for _ in range(3):
        result = http_client.infer("embed", [_text_input(httpclient)],
                                   headers={"X-Request-Start": stamp(time.time() - waited_s)})
        assert result.as_numpy("EMBEDDING").shape == (1, 384)


def _text_input(client_module):
    text = client_module.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=object))
    return text


def test_bad_tenant_is_rejected(http_client):
    with pytest.raises(httpclient.InferenceServerException) as info:
        http_embed(http_client, ["hello"], parameters={"tenant": "no spaces allowed"})
    assert info.value.status() == "400"
    assert "parameter 'tenant'" in info.value.message()


def test_on_a_cpu_the_bucket_models_run_at_the_spec_s_nice_value_and_the_router_at_zero(triton, http_client, texts):
    import psutil

    from tools.server.stubs import scan_stubs

    http_embed(http_client, texts)  # every bucket has served
    nice = {}
    for stub in scan_stubs(triton.process.pid).values():
        threads = [psutil.Process(thread.id) for thread in psutil.Process(stub.pid).threads()]
        nice.setdefault(stub.model, set()).update(thread.nice() for thread in threads)
    assert nice["embed"] == {0}
    assert nice["encoder_16"] == {10} and nice["encoder_256"] == {10}
