"""Reading a client's body, in-process with aiohttp's own server and a raw socket for
the client (so the body can arrive slowly, in pieces, or chunked): bounded in size and
time, refused while it arrives when it holds too many messages, and not read further
once it has been answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvgateway.errors import GatewayError
from kvgateway.server.edge import end_unread_body, read_limited

LIMIT = 4096


def _app(timeout: float = 1.0, max_messages: int | None = 2) -> web.Application:
    async def read(request: web.Request) -> web.StreamResponse:
        try:
            raw = await read_limited(request, LIMIT, timeout, max_messages)
        except GatewayError as err:
            resp = web.Response(status=err.status, body=err.body_bytes())
            end_unread_body(request, resp)
            return resp
        return web.json_response({"bytes": len(raw)})

    app = web.Application()
    app.router.add_post("/read", read)
    return app


Serve = Callable[[web.Application], Awaitable[TestServer]]


@pytest.fixture
async def serve(aiohttp_server: Any) -> Serve:
    async def start(app: web.Application) -> TestServer:
        server: TestServer = await aiohttp_server(app)
        return server

    return start


async def _send(server: TestServer, head: str, parts: list[bytes], pause: float = 0.0) -> bytes:
    """Send a request's head and its body in ``parts`` (``pause`` s apart); the answer."""
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(head.encode())
        for part in parts:
            await asyncio.sleep(pause)
            writer.write(part)
            await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read(65536)
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _code(answer: bytes) -> str:
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    code: str = body["error"]["code"]
    return code


def _head(length: int | None) -> str:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST /read HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}\r\n\r\n"


async def test_a_body_arriving_in_pieces_is_read_whole(serve: Serve) -> None:
    server = await serve(_app())
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 500}]}).encode()
    answer = await _send(server, _head(len(body)), [body[:300], body[300:]], pause=0.05)
    assert _status(answer) == 200 and json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
        "bytes": len(body)
    }


async def test_a_body_past_the_limit_is_refused_as_it_arrives(serve: Serve) -> None:
    """Chunked, so no Content-Length tells in advance: refused once the limit is passed."""
    server = await serve(_app())
    chunk = b"x" * 3000
    piece = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    answer = await _send(server, _head(None), [piece, piece, b"0\r\n\r\n"], pause=0.05)
    assert _status(answer) == 413


async def test_a_body_that_stops_arriving_times_out(serve: Serve) -> None:
    server = await serve(_app(timeout=0.3))
    answer = await _send(server, _head(100), [b'{"messages": ['], pause=0.0)
    assert _status(answer) == 408 and _code(answer) == "request_timeout"


async def test_too_many_messages_are_refused_before_the_body_ends(serve: Serve) -> None:
    """The third "role" arrives: the 400 goes out and the connection closes, though the
    body's declared rest never came."""
    server = await serve(_app())
    message = b'{"role": "user", "content": "hi"},'
    answer = await _send(server, _head(LIMIT), [b'{"messages": [', message * 3], pause=0.05)
    assert _status(answer) == 400 and _code(answer) == "too_many_messages"
    assert b"Connection: close" in answer


async def test_a_body_that_cannot_be_decoded_is_a_clear_400(serve: Serve) -> None:
    server = await serve(_app())
    garbage = b"this is not gzip at all"
    head = _head(len(garbage)).replace("\r\n\r\n", "\r\nContent-Encoding: gzip\r\n\r\n")
    answer = await _send(server, head, [garbage], pause=0.05)
    assert _status(answer) == 400 and _code(answer) == "invalid_body"
