"""The request path's HTTP/1.1 client against real loopback servers that answer with
hand-written bytes: framing, keep-alive reuse, the keep-alive race, bad responses,
flow control and timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.upstream.http1 import BadResponse, ConnectFailed, Connection, Disconnected
from kvgateway.upstream.node_pool import NodePool, Origin

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server; yields its URL and the list of connections it accepted."""
    accepted: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


def _serve(responses: list[bytes] | Callable[[bytes], bytes], pieces: int = 1) -> Handler:
    """Answer each request on a connection with the next canned response (or
    ``responses(body)``), written in ``pieces`` writes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = 0
        while True:
            try:
                _, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            raw = responses(body) if callable(responses) else responses[i]
            i += 1
            step = max(1, len(raw) // pieces)
            for start in range(0, len(raw), step):
                writer.write(raw[start : start + step])
                await writer.drain()
                await asyncio.sleep(0)

    return handler


async def _body(conn: Connection, timeout: float | None = None) -> bytes:
    out = b""
    while chunk := await conn.readany(timeout):
        out += chunk
    return out


def _chunked(parts: list[bytes]) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p)
    return out + b"0\r\n\r\n"


async def test_content_length_body_and_keep_alive_reuse() -> None:
    ok = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
    async with _server(_serve([ok, ok, ok])) as (url, accepted):
        pool = NodePool()
        origin = pool.origin(url)
        for _ in range(3):
            conn = await pool.request(url, "/v1/x", b"{}", {"X-Request-Id": "a"}, connect_s=2)
            assert conn.status == 200
            assert ("Content-Type", "application/json") in conn.headers
            assert await _body(conn) == b'{"ok":true}'
            pool.release(conn, origin)
        assert len(accepted) == 1  # one connection carried all three
        pool.close()


async def test_the_request_carries_host_length_path_and_headers() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await _read_request(reader)
        seen.extend([head, body])
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with _server(handler) as (url, _):
        pool = NodePool()
        conn = await pool.request(
            url + "/base/",
            "/v1/chat",
            b"hello",
            {"A": "1", "Evil": "x\r\nInjected: 1"},
            connect_s=2,
        )
        assert conn.status == 204
        assert await _body(conn) == b""
        pool.close()
    head, body = seen
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/v1/chat HTTP/1.1"
    assert b"Content-Length: 5" in lines
    assert b"A: 1" in lines
    assert not any(line.startswith(b"Injected") or line.startswith(b"Evil") for line in lines)
    assert body == b"hello"


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(st.binary(min_size=0, max_size=300), min_size=0, max_size=8),
    pieces=st.integers(min_value=1, max_value=40),
    trailer=st.booleans(),
)
def test_chunked_bodies_split_anywhere_decode_exactly(
    parts: list[bytes], pieces: int, trailer: bool
) -> None:
    body = _chunked(parts)
    if trailer:
        body = body[:-2] + b"X-Trailer: 1\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body

    async def run() -> None:
        async with _server(_serve([raw, raw], pieces=pieces)) as (url, accepted):
            pool = NodePool()
            for _ in range(2):
                conn = await pool.request(url, "/", b"", {}, connect_s=2)
                assert await _body(conn) == b"".join(parts)
                assert conn.reusable
                pool.release(conn, pool.origin(url))
            assert len(accepted) == 1
            pool.close()

    asyncio.run(run())


async def test_a_body_up_to_the_close_is_read_and_never_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async with _server(handler) as (url, _):
        pool = NodePool()
        conn = await pool.request(url, "/", b"x", {}, connect_s=2)
        assert await _body(conn) == b"until the end"
        assert not conn.reusable
        pool.close()


async def test_interim_responses_are_skipped() -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
    async with _server(_serve([raw], pieces=7)) as (url, _):
        pool = NodePool()
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        assert conn.status == 201
        assert await _body(conn) == b"ok"
        pool.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"SMTP 220 hello\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_garbage_from_a_node_is_a_bad_response(raw: bytes) -> None:
    async with _server(_serve([raw])) as (url, _):
        pool = NodePool()
        with pytest.raises(BadResponse):
            conn = await pool.request(url, "/", b"", {}, connect_s=2)
            await _body(conn)
        pool.close()


async def test_a_reused_connection_the_node_closed_is_replaced_once() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers one request per connection but claims keep-alive, then closes as the
        # next request arrives: the keep-alive race.
        await _read_request(reader)
        writer.write(ok)
        await writer.drain()
        await reader.read(1)

    async with _server(handler) as (url, accepted):
        pool = NodePool()
        origin = pool.origin(url)
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        assert await _body(conn) == b"ok"
        pool.release(conn, origin)
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        assert await _body(conn) == b"ok"
        assert len(accepted) == 2
        pool.close()


async def test_a_node_that_drops_the_connection_mid_body_is_disconnected() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async with _server(handler) as (url, _):
        pool = NodePool()
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        with pytest.raises(Disconnected):
            await _body(conn)
        assert not conn.reusable
        pool.close()


async def test_nothing_listening_is_connect_failed() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    pool = NodePool()
    with pytest.raises(ConnectFailed):
        await pool.request(f"http://127.0.0.1:{port}", "/", b"", {}, connect_s=2)


async def test_a_silent_node_times_out_the_read_and_the_connection_is_closed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with _server(handler) as (url, _):
        pool = NodePool()
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        assert await conn.readany(1.0) == b"first"
        with pytest.raises(TimeoutError):
            await conn.readany(0.2)
        pool.release(conn, pool.origin(url))
        assert conn.closed  # an unfinished response is never pooled
        pool.close()


async def test_a_fast_node_and_a_slow_reader_pause_the_socket() -> None:
    size = 4 * 1024 * 1024
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size
    async with _server(_serve([raw])) as (url, _):
        pool = NodePool()
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        await asyncio.sleep(0.3)  # the node writes as fast as it can; nobody reads
        assert conn._buffered < 1024 * 1024  # paused near the high-water mark
        assert len(await _body(conn)) == size
        pool.close()


async def test_idle_connections_expire() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    async with _server(_serve([ok, ok])) as (url, accepted):
        pool = NodePool(idle_s=0.05)
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        await _body(conn)
        pool.release(conn, pool.origin(url))
        await asyncio.sleep(0.2)
        assert conn.closed
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        assert len(accepted) == 2
        pool.close()


def test_origins_know_their_default_ports() -> None:
    assert Origin.of("https://node.example/v").port == 443
    assert Origin.of("http://node.example").port == 80
    assert Origin.of("http://10.0.0.1:8000/").base_path == ""
    with pytest.raises(ValueError):
        Origin.of("ftp://x")


async def test_a_large_body_arrives_whole() -> None:
    payload = bytes(range(256)) * (32 * 1024)  # 8 MB

    def answer(body: bytes) -> bytes:
        ok = b"1" if body == payload else b"0"
        return b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + ok

    async with _server(_serve(answer)) as (url, _):
        pool = NodePool()
        conn = await pool.request(url, "/", payload, {}, connect_s=2)
        assert await _body(conn) == b"1"
        pool.close()


async def test_a_node_answering_before_it_reads_a_large_body_is_heard() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\n\r\nbig")
        await writer.drain()
        await asyncio.sleep(1)

    async with _server(handler) as (url, _):
        pool = NodePool()
        async with asyncio.timeout(5):
            conn = await pool.request(url, "/", b"x" * (16 * 1024 * 1024), {}, connect_s=2)
        assert conn.status == 413
        assert await _body(conn) == b"big"
        pool.release(conn, pool.origin(url))
        assert conn.closed  # the rest of the body is still queued: never reused
        pool.close()


async def test_connections_the_node_closed_while_idle_leave_the_pool() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(ok)
        await writer.drain()  # then closes: the pooled connection dies while idle

    async with _server(handler) as (url, accepted):
        pool = NodePool(idle_s=0.2, max_idle=2)
        origin = pool.origin(url)
        for _ in range(2):
            conns = [await pool.request(url, "/", b"", {}, connect_s=2) for _ in range(2)]
            for conn in conns:
                await _body(conn)
                pool.release(conn, origin)
            await asyncio.sleep(0.05)
            assert all(c.closed for c in conns)
        # The full list of dead connections made room for a live one, and the timers
        # clear the rest.
        await asyncio.sleep(0.3)
        assert not pool._idle.get(origin)
        assert len(accepted) == 4
        pool.close()


async def test_a_stream_left_at_its_end_marker_is_reused_once_its_body_ends() -> None:
    """uvicorn writes a chunked body's terminator apart from the last event: a reader
    that stops at [DONE] leaves the connection waiting for it, and the pool reuses it
    once it comes (not closed: no new connection per stream)."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    event = b"data: [DONE]\n\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(head + b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with _server(handler) as (url, accepted):
        pool = NodePool()
        origin = pool.origin(url)
        for _ in range(3):
            conn = await pool.request(url, "/v1/x", b"{}", {}, connect_s=2)
            assert await conn.readany(2) == event  # the stream's own end: the reader stops
            pool.release(conn, origin, ending=True)
            await asyncio.sleep(0.1)  # the body's end comes
        assert len(accepted) == 1
        # Not ended by its marker (a client gone): closed, so the node aborts it.
        conn = await pool.request(url, "/v1/x", b"{}", {}, connect_s=2)
        assert await conn.readany(2) == event
        pool.release(conn, origin)
        assert conn.closed
        pool.close()


async def test_an_origin_whose_last_idle_connection_expired_leaves_nothing() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    async with _server(_serve([ok])) as (url, _):
        pool = NodePool(idle_s=0.05)
        origin = pool.origin(url)
        conn = await pool.request(url, "/", b"", {}, connect_s=2)
        assert await _body(conn) == b"{}"
        pool.release(conn, origin)
        await asyncio.sleep(0.15)
        assert pool._idle == {}  # a DNS member gone for good keeps no empty list
        pool.close()
