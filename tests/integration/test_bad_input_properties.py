"""Property-based bad input (hypothesis) over HTTP JSON, HTTP binary and gRPC.

Every generated request is invalid by construction; each must get an error with the status
the error table of docs/serving.md documents and a message saying what is wrong, the server must stay
ready, and its memory (server plus backend processes) must not grow across the battery.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HTTP_REFUSED = {400, 404}  # bad request; unknown model or version
GRPC_REFUSED = {"StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND"}


def rss_kib(pid: int) -> int:
    """Resident memory of the server and every process it started (the backend stubs)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(entry.name) == pid or fields.get("PPid", "").strip() == str(pid):
            total += int(fields.get("VmRSS", "0 kB").split()[0])
    return total


def infer_url(triton) -> str:
    return f"http://{triton.http_url}/v2/models/embed/infer"


def assert_refused(status: int, body: str, allowed: set[int]) -> None:
    # Triton's HTTP front end answers 500 for data it cannot parse as JSON or as the declared
    # datatype ("failed to parse the request JSON buffer", "Unable to parse 'data'"): its own
    # status for these, documented in the error table of docs/serving.md.
    unparsable = status == 500 and "parse" in body
    assert status in allowed or unparsable, (status, body[:300])
    assert body.strip(), "an error must say what is wrong"


not_json = st.one_of(
    st.binary(min_size=1, max_size=200).filter(lambda b: not _is_json_object(b)),
    st.text(min_size=1, max_size=200).map(str.encode).filter(lambda b: not _is_json_object(b)),
)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, UnicodeDecodeError):
        return False


json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)


@st.composite
def wrong_json_requests(draw) -> dict:
    """Well-formed JSON whose tensor description is wrong in one way or another."""
    kind = draw(st.sampled_from(["datatype", "shape", "count", "name", "inputs", "parameters"]))
    tensor = {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]}
    if kind == "datatype":
        tensor["datatype"] = draw(st.sampled_from(["FP32", "INT64", "INT8", "BOOL", "FP16", "STRING", ""]))
        tensor["data"] = [1]
    elif kind == "shape":
        tensor["shape"] = draw(st.sampled_from([[1], [1, 2], [-1, 1], [1, 1, 1], [], [0, 0], [1, -3]]))
    elif kind == "count":
        rows = draw(st.integers(min_value=2, max_value=5))
        tensor["shape"] = [rows, 1]
        tensor["data"] = ["x"] * draw(st.integers(min_value=0, max_value=rows - 1))
    elif kind == "name":
        tensor["name"] = draw(st.text(min_size=1, max_size=10).filter(lambda n: n != "TEXT"))
    elif kind == "inputs":
        return {"inputs": draw(json_value.filter(lambda v: not isinstance(v, list) or not v))}
    else:
        return {"inputs": [tensor], "parameters": {
            draw(st.sampled_from(["tenant", "truncate", "version"])): draw(
                st.sampled_from([[], {}, 3.5, "not a bool", "has space", -1, "x" * 80]))}}
    return {"inputs": [tensor]}


@st.composite
def bad_texts(draw) -> list[bytes]:
    """Rows the router refuses: invalid UTF-8, blank, or over the 64 KiB limit."""
    rows = draw(st.lists(st.text(min_size=1, max_size=30).map(str.encode), min_size=0, max_size=3))
    bad = draw(st.sampled_from(["utf8", "blank", "huge"]))
    if bad == "utf8":
        bad_row = draw(st.binary(min_size=0, max_size=20)) + b"\xff\xfe" + draw(st.binary(max_size=5))
    elif bad == "blank":
        bad_row = draw(st.sampled_from([b"", b" ", b"\n\t ", b"   "]))
    else:
        bad_row = b"a" * draw(st.integers(min_value=65537, max_value=200_000))
    position = draw(st.integers(min_value=0, max_value=len(rows)))
    return [*rows[:position], bad_row, *rows[position:]]


def bytes_tensor(rows: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(row)) + row for row in rows)


@pytest.fixture(scope="module")
def memory(triton):
    """RSS after a warm-up of every kind of refusal, to compare with at the end."""
    for body in (b"{", b'{"inputs": 3}', json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1],
                                                                  "datatype": "BYTES", "data": [""]}]}).encode()):
        requests.post(infer_url(triton), data=body, timeout=30)
    return rss_kib(triton.process.pid)


@SETTINGS
@given(body=not_json)
def test_a_body_that_is_not_json_is_refused(triton, memory, body):
    reply = requests.post(infer_url(triton), data=body, timeout=30)
    assert_refused(reply.status_code, reply.text, {400})


@SETTINGS
@given(request=wrong_json_requests())
def test_json_with_a_wrong_tensor_description_is_refused(triton, memory, request):
    reply = requests.post(infer_url(triton), json=request, timeout=30)
    assert_refused(reply.status_code, reply.text, HTTP_REFUSED)


@SETTINGS
@given(rows=bad_texts())
def test_bad_rows_in_the_binary_protocol_are_refused(triton, memory, rows):
    data = bytes_tensor(rows)
    header = json.dumps({"inputs": [{"name": "TEXT", "shape": [len(rows), 1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    reply = requests.post(infer_url(triton), data=header + data, timeout=60,
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert_refused(reply.status_code, reply.text, {400})


@SETTINGS
@given(declared=st.integers(min_value=0, max_value=1 << 20), rows=st.lists(st.binary(max_size=40), min_size=1,
                                                                           max_size=4))
def test_a_binary_tensor_whose_sizes_do_not_add_up_is_refused(triton, memory, declared, rows):
    data = bytes_tensor(rows)
    if declared == len(data):
        declared += 1
    truncated = data[: max(0, len(data) - 3)] if declared > len(data) else data
    header = json.dumps({"inputs": [{"name": "TEXT", "shape": [len(rows), 1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": declared}}]}).encode()
    reply = requests.post(infer_url(triton), data=header + truncated, timeout=30,
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert_refused(reply.status_code, reply.text, {400})


@SETTINGS
@given(datatype=st.sampled_from(["FP32", "INT64", "INT32", "BOOL", "UINT8"]),
       shape=st.sampled_from([(1, 1), (2, 1), (1, 3), (4,)]))
def test_grpc_with_the_wrong_datatype_or_shape_is_refused(triton, grpc_client, memory, datatype, shape):
    numpy_type = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_, "UINT8": np.uint8}
    tensor = grpcclient.InferInput("TEXT", list(shape), datatype)
    tensor.set_data_from_numpy(np.zeros(shape, dtype=numpy_type[datatype]))
    with pytest.raises(InferenceServerException) as refused:
        grpc_client.infer("embed", [tensor])
    assert refused.value.status() in GRPC_REFUSED and refused.value.message()


@SETTINGS
@given(rows=bad_texts())
def test_grpc_bad_rows_are_refused_naming_the_row(triton, grpc_client, memory, rows):
    tensor = grpcclient.InferInput("TEXT", [len(rows), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(rows, dtype=object).reshape(-1, 1))
    with pytest.raises(InferenceServerException) as refused:
        grpc_client.infer("embed", [tensor])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "TEXT row" in refused.value.message()


INVALID_PARAMETERS = {
    "tenant": ["has space", "x" * 80, "", "semi;colon", "ünïcode"],
    "truncate": ["maybe", "yes", "-3", "has space", ""],
    "version": ["abc", "-3", "0", "1.5", "two"],
}


@SETTINGS
@given(case=st.sampled_from([(key, value) for key, values in INVALID_PARAMETERS.items() for value in values]))
def test_grpc_bad_parameters_are_refused(triton, grpc_client, memory, case):
    key, value = case
    tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"hello"]], dtype=object))
    with pytest.raises(InferenceServerException) as refused:
        grpc_client.infer("embed", [tensor], parameters={key: value})
    assert refused.value.status() in GRPC_REFUSED and f"'{key}'" in refused.value.message()


def test_after_the_battery_the_server_serves_and_its_memory_has_not_grown(triton, grpc_client, memory):
    # Runs after the battery in file order: a last pass of every kind of refusal, then the checks.
    for body in (b"{" * 1000, b'{"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [""]}]}'):
        requests.post(infer_url(triton), data=body, timeout=30)
    assert requests.get(f"http://{triton.http_url}/v2/health/ready", timeout=10).status_code == 200
    tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"still serving"]], dtype=object))
    assert grpc_client.infer("embed", [tensor]).as_numpy("EMBEDDING").shape == (1, 384)
    grown_mib = (rss_kib(triton.process.pid) - memory) / 1024
    # Allocators keep some of what they touched; a leak per request would grow with the
    # few hundred requests of the battery.
    assert grown_mib < 64, f"server memory grew by {grown_mib:.0f} MiB across the battery"
