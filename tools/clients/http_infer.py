"""A lean HTTP/1.1 inference client for load generation: requests encoded once, sent as bytes.

Hand-written on purpose, where `tritonclient` would otherwise do: the load generator shares
the machine with the server it measures, so every CPU millisecond it spends per request is
one the server does not get, and the goodput benchmark would then measure the client. Measured
on this project's 2-core reference machine against the same slo_bucketed server at 128-144
req/s (the goodput benchmark's open loop): this client costs the load generator 0.27-0.41
CPU ms per request against 0.64-0.77 with tritonclient's gRPC client, and tritonserver
itself 0.72-1.02 CPU ms per request against 0.93-1.10. Nearly all of the gRPC cost is the
gRPC runtime (a bare `grpc.aio` call with a pre-serialised request costs the same). Triton's
HTTP endpoint with the binary tensor extension needs no runtime at all: each distinct request is
encoded to its final bytes once, and a keep-alive connection writes them and reads back a
status line, a `Content-Length` and the body (0.13 CPU ms per request in a closed loop).
It sends inference requests only; the server's statistics still come through tritonclient.

The pure part encodes requests and parses response heads; `HttpInferClient` keeps a pool
of keep-alive connections, one request at a time on each (no pipelining), so the pool
grows to the number of requests in flight, up to `max_connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024  # a response head longer than this is not Triton's


class ProtocolError(Exception):
    """The server's answer is not an HTTP/1.1 response this client can read."""


# ---------------------------------------------------------------------------------------
# Pure: request bytes, response heads


def bytes_tensor(rows: Sequence[bytes]) -> bytes:
    """A BYTES tensor in the binary tensor extension: each element as a 4-byte
    little-endian length and its bytes."""
    return b"".join(struct.pack("<I", len(row)) + row for row in rows)


@dataclass(frozen=True)
class WireTensor:
    """One input of a request as the binary tensor extension carries it."""

    name: str  # the model's input
    datatype: str  # Triton's protocol type: BYTES, FP32, INT64, ...
    shape: tuple[int, ...]  # batch axis first
    data: bytes  # the elements, row-major, little-endian (BYTES: `bytes_tensor`)


def encode_infer_request(host: str, model: str, inputs: Sequence[WireTensor],
                         parameters: Mapping[str, object] | None = None) -> bytes:
    """The whole HTTP request (head and body) that sends `inputs` to `model`. Every output
    comes back binary (`binary_data_output`), so the server never formats floats as JSON
    text. `parameters` go in the request's `parameters` (Triton reads `priority` and
    `timeout` there, the rest reach the model)."""
    if not inputs:
        raise ValueError("an inference request needs at least one input")
    header = json.dumps({
        "inputs": [{"name": tensor.name, "shape": list(tensor.shape), "datatype": tensor.datatype,
                    "parameters": {"binary_data_size": len(tensor.data)}} for tensor in inputs],
        "parameters": {**(parameters or {}), "binary_data_output": True},
    }, separators=(",", ":")).encode()
    body_size = len(header) + sum(len(tensor.data) for tensor in inputs)
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\n"
            f"Host: {host}\r\n"
            "Content-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n"
            f"Content-Length: {body_size}\r\n\r\n")
    return head.encode("ascii") + header + b"".join(tensor.data for tensor in inputs)


def infer_request(host: str, model: str, input_name: str, rows: Sequence[bytes],
                  parameters: Mapping[str, object] | None = None) -> bytes:
    """The request that sends `rows` as a [len(rows), 1] BYTES input to `model`
    (`encode_infer_request`)."""
    if not rows:
        raise ValueError("an inference request needs at least one row")
    tensor = WireTensor(input_name, "BYTES", (len(rows), 1), bytes_tensor(rows))
    return encode_infer_request(host, model, [tensor], parameters)


def with_header(request: bytes, name: str, value: str) -> bytes:
    """`request` (`encode_infer_request`'s bytes) with one more header line after its request
    line: a per-send header such as `X-Request-Start` without encoding the request again."""
    end = request.index(b"\r\n") + 2
    return request[:end] + f"{name}: {value}\r\n".encode("ascii") + request[end:]


@dataclass(frozen=True)
class ResponseHead:
    """What the client needs from a response's status line and headers."""

    status: int  # HTTP status code
    content_length: int  # body bytes that follow the head
    keep_alive: bool  # False when the server closes the connection after this response


def parse_response_head(head: bytes) -> ResponseHead:
    """Parse the status line and headers (up to and including the blank line).

    Raises ProtocolError for anything but an HTTP/1.x response with a Content-Length body
    (Triton sends no chunked inference responses)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ProtocolError("chunked response bodies are not supported")
    length = headers.get("content-length", "0")
    if not length.isdigit():
        raise ProtocolError(f"bad Content-Length {length!r}")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if parts[0] == "HTTP/1.1" else connection == "keep-alive"
    return ResponseHead(status=int(parts[1]), content_length=int(length), keep_alive=keep_alive)


def error_message(body: bytes) -> str:
    """The message of an error response: Triton's `{"error": "..."}`, else the body as text."""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        return parsed["error"]
    return text.strip()


# ---------------------------------------------------------------------------------------
# I/O: keep-alive connections


class HttpInferClient:
    """Sends pre-encoded requests over a pool of keep-alive connections to one server.

    A connection carries one request at a time. A request that times out or breaks
    mid-way closes its connection (its half-read response could not be skipped);
    answers from a connection the server closes are read to the end first."""

    def __init__(self, host: str, port: int, max_connections: int = 256):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.host = host
        self.port = port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._open: set[asyncio.StreamWriter] = set()

    async def post(self, request: bytes, timeout_s: float) -> tuple[int, bytes]:
        """Send one encoded request; (status, body) of its response.

        Raises TimeoutError past `timeout_s` (waiting for a free connection included),
        OSError or ProtocolError when the connection fails."""
        async with asyncio.timeout(timeout_s), self._slots:
            reader, writer = self._idle.pop() if self._idle else await self._connect()
            try:
                writer.write(request)
                head = parse_response_head(await reader.readuntil(b"\r\n\r\n"))
                body = await reader.readexactly(head.content_length)
            except BaseException:
                self._discard(writer)
                raise
            if head.keep_alive:
                self._idle.append((reader, writer))
            else:
                self._discard(writer)
            return head.status, body

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEAD_BYTES)
        self._open.add(writer)
        return reader, writer

    def _discard(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def close(self) -> None:
        writers = list(self._open)
        self._idle.clear()
        self._open.clear()
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(OSError):  # already reset by the server: closed either way
                await writer.wait_closed()

    async def __aenter__(self) -> HttpInferClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
