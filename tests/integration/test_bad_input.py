"""Bad input gets a clear error with the right status, and the server keeps serving.

Documented behaviour (docs/serving.md, "Errors"): Triton itself rejects requests that do not match
the model's signature; the router rejects content it cannot embed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

OK = np.array([[b"hello"]], dtype=object)


def texts(*rows: bytes) -> np.ndarray:
    return np.array([[row] for row in rows], dtype=object).reshape(len(rows), 1)


# (case id, input builder kwargs, model, version, HTTP status, gRPC status, message fragment)
CASES = [
    ("empty string", {"data": texts(b"ok", b"")}, "embed", "", "400", "INVALID_ARGUMENT",
     "TEXT row 1 is empty"),
    ("missing input", None, "embed", "", "400", "INVALID_ARGUMENT", "missing required input(s) ['TEXT']"),
    ("wrong input name", {"data": OK, "name": "TXT"}, "embed", "", "400", "INVALID_ARGUMENT",
     "unexpected inference input 'TXT'"),
    ("wrong datatype", {"data": np.zeros((1, 1), np.float32), "datatype": "FP32"}, "embed", "", "400",
     "INVALID_ARGUMENT", "data-type is 'FP32', but model 'embed' expects 'BYTES'"),
    ("wrong shape", {"data": np.array([[b"a", b"b"]], dtype=object)}, "embed", "", "400", "INVALID_ARGUMENT",
     "unexpected shape for input 'TEXT'"),
    ("invalid utf-8", {"data": texts(b"fine", b"bad \xff\xfe")}, "embed", "", "400", "INVALID_ARGUMENT",
     "TEXT row 1 is not valid UTF-8"),
    ("1 MB string", {"data": texts(b"a" * (1 << 20))}, "embed", "", "400", "INVALID_ARGUMENT",
     "TEXT row 0 is 1048576 bytes; the limit is 65536 bytes per row"),
    ("zero rows", {"data": np.zeros((0, 1), dtype=object)}, "embed", "", "400", "INVALID_ARGUMENT",
     "got 0"),
    ("too many rows", {"data": texts(*([b"a"] * 129))}, "embed", "", "400", "INVALID_ARGUMENT",
     "batch-size must be <= 128"),
    ("unknown model", {"data": OK}, "no_such_model", "", "404", "NOT_FOUND",
     "unknown model: 'no_such_model'"),
    ("unknown version", {"data": OK}, "embed", "7", "404", "NOT_FOUND", "'embed' version 7 is not found"),
]


def build_inputs(module, spec):
    if spec is None:
        return []
    data = spec["data"]
    tensor = module.InferInput(spec.get("name", "TEXT"), list(data.shape), spec.get("datatype", "BYTES"))
    tensor.set_data_from_numpy(data)
    return [tensor]


@pytest.mark.parametrize(("case", "spec", "model", "version", "http_status", "grpc_status", "message"),
                         CASES, ids=[c[0] for c in CASES])
def test_bad_input_over_http(http_client, case, spec, model, version, http_status, grpc_status, message):
    with pytest.raises(httpclient.InferenceServerException) as info:
        http_client.infer(model, build_inputs(httpclient, spec), model_version=version)
    assert info.value.status() == http_status, info.value.message()
    assert message in info.value.message()


@pytest.mark.parametrize(("case", "spec", "model", "version", "http_status", "grpc_status", "message"),
                         CASES, ids=[c[0] for c in CASES])
def test_bad_input_over_grpc(grpc_client, case, spec, model, version, http_status, grpc_status, message):
    with pytest.raises(grpcclient.InferenceServerException) as info:
        grpc_client.infer(model, build_inputs(grpcclient, spec), model_version=version)
    assert info.value.status() == f"StatusCode.{grpc_status}", info.value.message()
    assert message in info.value.message()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 500, "failed to parse the request JSON"),
        (json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [1]}]}).encode(),
         500, "non-string"),
        (json.dumps({"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": ["a"]}]}).encode(),
         400, "expected 2 string elements"),
        (json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [""]}]}).encode(),
         400, "TEXT row 0 is empty"),
    ],
    ids=["malformed json", "number instead of string", "shape and data disagree", "empty string"],
)
def test_bad_json_bodies(triton, body, status, message):
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/embed/infer", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == status
    assert message in json.loads(info.value.read())["error"]


def test_server_keeps_serving_after_bad_input(http_client, grpc_client):
    # Runs after the cases above (file order); every model must still be ready and answer.
    assert http_client.is_server_live() and http_client.is_server_ready()
    for model in ("embed", "encoder_16", "encoder_32", "encoder_64", "encoder_128", "encoder_256"):
        assert http_client.is_model_ready(model), model
    tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(OK)
    result = grpc_client.infer("embed", [tensor])
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
