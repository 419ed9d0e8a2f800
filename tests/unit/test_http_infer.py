"""The load generator's lean HTTP client: request encoding, response heads, the keep-alive pool."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from tools.clients.http_infer import (
    HttpInferClient,
    ProtocolError,
    ResponseHead,
    WireTensor,
    bytes_tensor,
    encode_infer_request,
    error_message,
    infer_request,
    parse_response_head,
    with_header,
)


def split_request(raw: bytes) -> tuple[list[str], dict, bytes]:
    """(head lines, the JSON inference header, the binary data) of an encoded request."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    fields = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in lines[1:]}
    assert int(fields["Content-Length"]) == len(body)
    header_length = int(fields["Inference-Header-Content-Length"])
    return lines, json.loads(body[:header_length]), body[header_length:]


def test_a_bytes_tensor_prefixes_each_element_with_its_little_endian_length():
    assert bytes_tensor([b"ab", b"", "é".encode()]) == (
        struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0) + struct.pack("<I", 2) + "é".encode())


def test_an_infer_request_carries_its_rows_as_binary_data_and_asks_for_binary_outputs():
    lines, header, data = split_request(infer_request("localhost", "embed", "TEXT", [b"one", b"two words"],
                                                      {"priority": 1, "tenant_token": "v1.x"}))
    assert lines[0] == "POST /v2/models/embed/infer HTTP/1.1"
    assert "Host: localhost" in lines
    [tensor] = header["inputs"]
    assert tensor == {"name": "TEXT", "shape": [2, 1], "datatype": "BYTES",
                      "parameters": {"binary_data_size": len(data)}}
    assert data == bytes_tensor([b"one", b"two words"])
    # Triton reads priority (and timeout) from the parameters; the rest reach the model.
    assert header["parameters"] == {"priority": 1, "tenant_token": "v1.x", "binary_data_output": True}
    assert "outputs" not in header  # every output, each binary


def test_a_header_added_per_send_leaves_the_request_whole():
    request = infer_request("localhost", "embed", "TEXT", [b"one"])
    lines, header, data = split_request(with_header(request, "X-Request-Start", "t=1795714406123456"))
    assert lines[0] == "POST /v2/models/embed/infer HTTP/1.1"
    assert "X-Request-Start: t=1795714406123456" in lines
    assert (header, data) == split_request(request)[1:]


def test_an_infer_request_without_rows_is_refused():
    with pytest.raises(ValueError, match="at least one row"):
        infer_request("localhost", "embed", "TEXT", [])


def test_a_request_of_several_inputs_carries_each_one_binary_in_order():
    first, second = bytes_tensor([b"query"]), bytes_tensor([b"a passage"])
    ids = struct.pack("<2q", 101, 102)
    _, header, data = split_request(encode_infer_request("localhost", "rerank", [
        WireTensor("TEXT", "BYTES", (1, 1), first), WireTensor("TEXT_PAIR", "BYTES", (1, 1), second),
        WireTensor("IDS", "INT64", (1, 2), ids)]))
    sent = [(t["name"], t["shape"], t["datatype"], t["parameters"]["binary_data_size"]) for t in header["inputs"]]
    assert sent == [("TEXT", [1, 1], "BYTES", len(first)), ("TEXT_PAIR", [1, 1], "BYTES", len(second)),
                    ("IDS", [1, 2], "INT64", 16)]
    assert data == first + second + ids
    with pytest.raises(ValueError, match="at least one input"):
        encode_infer_request("localhost", "rerank", [])


@pytest.mark.parametrize(("head", "expected"), [
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 1620\r\n\r\n",
     ResponseHead(200, 1620, keep_alive=True)),
    (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 40\r\nConnection: close\r\n\r\n",
     ResponseHead(503, 40, keep_alive=False)),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n", ResponseHead(200, 2, keep_alive=False)),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n", ResponseHead(200, 2, keep_alive=True)),
    (b"HTTP/1.1 204 No Content\r\n\r\n", ResponseHead(204, 0, keep_alive=True)),
])
def test_response_heads_give_status_length_and_whether_the_connection_stays(head, expected):
    assert parse_response_head(head) == expected


def test_the_inference_header_length_is_not_taken_for_the_body_length():
    head = b"HTTP/1.1 200 OK\r\nInference-Header-Content-Length: 7\r\nContent-Length: 1547\r\n\r\n"
    assert parse_response_head(head).content_length == 1547


@pytest.mark.parametrize(("head", "message"), [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", "bad Content-Length"),
])
def test_responses_this_client_cannot_read_are_protocol_errors(head, message):
    with pytest.raises(ProtocolError, match=message):
        parse_response_head(head)


def test_error_messages_come_from_tritons_json_or_the_raw_text():
    assert error_message(b'{"error":"Exceeds maximum queue size"}') == "Exceeds maximum queue size"
    assert error_message(b"upstream went away\n") == "upstream went away"
    assert error_message(b'{"detail": 1}') == '{"detail": 1}'
    assert error_message(b"\xff oops") == "\ufffd oops"


# ---------------------------------------------------------------------------------------
# The pool, against a small local HTTP peer (the protocol layer only; the integration tests
# send through it to a real tritonserver)


class Peer:
    """Answers each request on a connection with `answer(n)` (n counts requests over all
    connections); counts connections."""

    def __init__(self, answer):
        self.answer = answer
        self.num_connections = 0
        self.num_requests = 0

    async def handle(self, reader, writer):
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.num_requests += 1
                reply = await self.answer(self.num_requests)
                if reply is None:
                    return
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def with_peer(answer, use, max_connections=256):
    peer = Peer(answer)
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with HttpInferClient("127.0.0.1", port, max_connections) as client:
            return peer, await use(client)
    finally:
        server.close()
        await server.wait_closed()


REQUEST = infer_request("127.0.0.1", "embed", "TEXT", [b"hello"])


def test_sequential_requests_reuse_one_keep_alive_connection():
    async def answer(n):
        return ok(f"answer {n}".encode())

    async def use(client):
        return [await client.post(REQUEST, 5.0) for _ in range(3)]

    peer, results = asyncio.run(with_peer(answer, use))
    assert results == [(200, b"answer 1"), (200, b"answer 2"), (200, b"answer 3")]
    assert peer.num_connections == 1


@pytest.mark.parametrize(("max_connections", "num_connections"), [(256, 4), (1, 1)])
def test_concurrent_requests_each_get_a_connection_up_to_the_pools_limit(max_connections, num_connections):
    """Below the limit each request in flight has a connection of its own; at the limit the
    others wait for one to come free."""
    async def answer(n):
        await asyncio.sleep(0.05)
        return ok(b"x")

    async def use(client):
        return await asyncio.gather(*(client.post(REQUEST, 5.0) for _ in range(4)))

    peer, results = asyncio.run(with_peer(answer, use, max_connections))
    assert results == [(200, b"x")] * 4
    assert peer.num_connections == num_connections


def test_a_connection_the_server_closes_is_not_reused():
    async def answer(n):
        return ok(b"bye", "Connection: close\r\n")

    async def use(client):
        return [await client.post(REQUEST, 5.0) for _ in range(2)]

    peer, results = asyncio.run(with_peer(answer, use))
    assert results == [(200, b"bye")] * 2
    assert peer.num_connections == 2


def test_a_late_answer_times_out_and_its_connection_is_dropped():
    async def answer(n):
        if n == 1:
            await asyncio.sleep(0.5)
        return ok(b"late" if n == 1 else b"fresh")

    async def use(client):
        with pytest.raises(TimeoutError):
            await client.post(REQUEST, 0.1)
        return await client.post(REQUEST, 5.0)  # not the first request's answer on a reused connection

    peer, result = asyncio.run(with_peer(answer, use))
    assert result == (200, b"fresh")
    assert peer.num_connections == 2


def test_a_connection_cut_mid_request_is_an_error_and_the_next_request_still_works():
    async def answer(n):
        return None if n == 1 else ok(b"fine")

    async def use(client):
        with pytest.raises(asyncio.IncompleteReadError):
            await client.post(REQUEST, 5.0)
        return await client.post(REQUEST, 5.0)

    _, result = asyncio.run(with_peer(answer, use))
    assert result == (200, b"fine")


def test_an_unreachable_server_raises_oserror():
    async def use():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with HttpInferClient("127.0.0.1", port) as client:
            await client.post(REQUEST, 5.0)

    with pytest.raises(OSError):
        asyncio.run(use())


def test_the_pool_needs_room_for_a_connection():
    with pytest.raises(ValueError, match="max_connections"):
        HttpInferClient("localhost", 8000, max_connections=0)
