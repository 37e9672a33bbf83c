"""UpstreamResponse.events: the SSE events a node streams, relayed in runs of whole events
as they arrive (against a real loopback node writing hand-made bytes, and against a
scripted connection for exact read boundaries)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.upstream import client
from kvgateway.upstream.client import MidStreamError, UpstreamResponse
from kvgateway.upstream.http1 import Connection
from kvgateway.upstream.node_pool import NodePool, Origin

Writer = Callable[[asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _event(content: str, end: bytes = b"\n\n") -> bytes:
    body = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": content}}]}
    return b"data: " + json.dumps(body).encode() + end


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One HTTP chunk of the body."""
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    await writer.drain()


async def _end(writer: asyncio.StreamWriter) -> None:
    writer.write(b"0\r\n\r\n")
    await writer.drain()


@asynccontextmanager
async def _node(body: Writer) -> AsyncIterator[UpstreamResponse]:
    """A loopback node answering one request with a chunked SSE body written by ``body``;
    yields the response as the proxy gets it."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(HEAD)
            await body(writer)
            await done.wait()  # hold the connection: the body's end is explicit
        except ConnectionError:
            pass
        finally:
            writer.close()

    done = asyncio.Event()
    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = NodePool()
    try:
        conn = await pool.request(url, "/v1/chat/completions", b"{}", {}, connect_s=2)
        async with UpstreamResponse(conn, pool, pool.origin(url), "n1") as resp:
            yield resp
    finally:
        pool.close()
        done.set()
        server.close()
        await server.wait_closed()


async def _all(resp: UpstreamResponse, max_event: int | None = None) -> list[bytes]:
    return [run async for run in resp.events(5.0, max_event)]


async def test_a_large_event_arrives_whole() -> None:
    big = b"data: " + json.dumps({"prompt_logprobs": "x" * (8 << 20)}).encode() + b"\n\n"

    async def body(w: asyncio.StreamWriter) -> None:
        for i in range(0, len(big), 65536):
            await _send(w, big[i : i + 65536])
        await _send(w, b"data: [DONE]\n\n")
        await _end(w)

    async with _node(body) as resp:
        runs = await asyncio.wait_for(_all(resp), 20)  # generous: a few 100 ms are expected
    assert runs[0][: len(big)] == big  # with [DONE] too when both came in one read
    assert b"".join(runs) == big + b"data: [DONE]\n\n"


async def test_an_event_past_the_cap_fails_the_stream_as_too_large() -> None:
    first = _event("a")

    async def body(w: asyncio.StreamWriter) -> None:
        await _send(w, first)
        for _ in range(40):  # 2.5 MiB, never a blank line; the node keeps the stream open
            await _send(w, b"data: " + b"x" * 65536)

    async with _node(body) as resp:
        got = []
        with pytest.raises(MidStreamError) as err:
            async for run in resp.events(5.0, max_event=1 << 20):
                got.append(run)
    assert err.value.cause == "too_large"
    assert got == [first]


async def test_the_default_cap_is_max_event_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "MAX_EVENT_BYTES", 100_000)

    async def body(w: asyncio.StreamWriter) -> None:
        await _send(w, b"data: " + b"x" * 200_000)

    async with _node(body) as resp:
        with pytest.raises(MidStreamError) as err:
            await _all(resp)
    assert err.value.cause == "too_large"


async def test_an_event_cut_by_the_end_of_the_body_is_dropped() -> None:
    whole, cut = _event("a"), _event("b")[:40]

    async def body(w: asyncio.StreamWriter) -> None:
        await _send(w, whole)
        await _send(w, cut)
        await _end(w)

    async with _node(body) as resp:
        runs = await _all(resp)
    assert b"".join(runs) == whole  # the relay then writes its "ended early" error event


@pytest.mark.parametrize(
    ("tail", "relayed"),
    [
        (b"data: [DONE]\n", b"data: [DONE]\n\n"),  # the end marker's line is whole
        (b"data: [DONE]\r\n", b"data: [DONE]\n\n"),
        (b"data: [DONE]", b""),  # its line is not
        (b"data: [DO", b""),
        (_event("b", b"\n"), b""),  # an event's line, but more lines may have followed
        (b"event: response.completed\n", b""),
    ],
)
async def test_only_a_whole_done_line_passes_without_its_blank_line_at_the_end(
    tail: bytes, relayed: bytes
) -> None:
    runs = await _scripted([_event("a"), tail])
    assert b"".join(runs) == _event("a") + relayed


async def test_crlf_events_are_relayed_one_by_one_as_they_come() -> None:
    first, second = _event("a", b"\r\n\r\n"), _event("b", b"\r\n\r\n")
    may_send = asyncio.Event()
    sent_second = False

    async def body(w: asyncio.StreamWriter) -> None:
        nonlocal sent_second
        await _send(w, first)
        await may_send.wait()
        sent_second = True
        await _send(w, second)
        await _send(w, b"data: [DONE]\r\n\r\n")
        await _end(w)

    async with _node(body) as resp:
        events = resp.events(5.0)
        got = await asyncio.wait_for(anext(events), 2)
        assert not sent_second
        may_send.set()
        rest = [run async for run in events]
    # Line ends come out as LF: what reads the events (the relay's end of stream, the
    # usage tap) looks for "\n\n".
    assert got == _event("a")
    assert b"".join(rest) == _event("b") + b"data: [DONE]\n\n"


# Exact read boundaries: a connection whose reads return the given pieces, in order.


class _Reads:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = iter(pieces)
        self.reads = 0

    async def readany(self, timeout: float | None = None) -> bytes:
        self.reads += 1
        return next(self.pieces, b"")


async def _scripted(pieces: list[bytes], at: list[int] | None = None) -> list[bytes]:
    """The runs events() yields over reads returning ``pieces``; ``at`` gets how many
    reads each run took."""
    reads = _Reads(pieces)
    conn, pool, origin = cast(Connection, reads), cast(NodePool, None), cast(Origin, None)
    runs = []
    async for run in UpstreamResponse(conn, pool, origin, "n1").events(5.0):
        if at is not None:
            at.append(reads.reads)
        runs.append(run)
    return runs


async def test_an_event_end_split_between_reads_is_found() -> None:
    a, b = _event("a"), _event("b")
    at: list[int] = []
    runs = await _scripted([a[:-1], a[-1:] + b[:10], b[10:]], at)
    assert runs == [a, b]
    assert at == [2, 3]  # each event left with the read that completed it


async def test_an_event_in_many_small_reads_is_put_together_in_linear_time() -> None:
    # 8 MiB in 8192 reads: each read scanned and copied once (a few ms). Appending each
    # read to the event and searching all of it again moves tens of GB (many seconds).
    big = b"data: " + b"x" * (8 << 20) + b"\n\n"
    pieces = [big[i : i + 1024] for i in range(0, len(big), 1024)]
    started = time.perf_counter()
    runs = await _scripted(pieces)
    assert time.perf_counter() - started < 5  # generous
    assert runs == [big]


@pytest.mark.parametrize(
    ("pieces", "first_at"),
    [
        ([b"data: 1\r\n", b"\r\ndata: 2\r\n\r\n"], 2),
        ([b"data: 1\r\n\r", b"\ndata: 2\r\n\r\n"], 1),  # a CRLF split between reads
        ([b"data: 1\r", b"\r", b"data: 2\r\r"], 2),  # CR alone ends lines too
        ([b"data: 1\r", b"\n", b"\r", b"\ndata: 2\n\r\n"], 3),
    ],
)
async def test_crlf_and_cr_event_ends_split_between_reads(
    pieces: list[bytes], first_at: int
) -> None:
    at: list[int] = []
    runs = await _scripted(pieces, at)
    assert b"".join(runs) == b"data: 1\n\ndata: 2\n\n"
    assert runs[0].startswith(b"data: 1\n\n") and at[0] == first_at  # the blank line's read


def _lf(data: bytes) -> bytes:
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


_LINE_END = st.sampled_from([b"\n", b"\r\n", b"\r"])
_TEXT = st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
# Two line ends, one after the other (CR then LF would be one CRLF).
_BLANK = st.tuples(_LINE_END, _LINE_END).filter(lambda e: e != (b"\r", b"\n"))
_EVENT = st.builds(lambda t, e: b"data: " + t + e[0] + e[1], _TEXT, _BLANK)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(_EVENT, min_size=1, max_size=6), data=st.data())
def test_any_split_relays_every_event_as_soon_as_it_is_whole(
    events: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(events)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(stream) - 1), max_size=8)))
    pieces = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    at: list[int] = []
    runs = asyncio.run(_scripted(pieces, at))
    assert b"".join(runs) == _lf(stream)
    for n, run in enumerate(runs):
        # After its read, all that was read up to its last event end, and nothing more.
        received = _lf(b"".join(pieces[: at[n]]))
        assert b"".join(runs[: n + 1]) == received[: received.rfind(b"\n\n") + 2]
        assert run.endswith(b"\n\n")


class _Silent:
    """A connection whose first ``quiet`` reads time out (the node queues the request),
    then returns ``pieces``."""

    def __init__(self, quiet: int, pieces: list[bytes]) -> None:
        self.quiet = quiet
        self.pieces = iter(pieces)

    async def readany(self, timeout: float | None = None) -> bytes:
        if self.quiet > 0:
            self.quiet -= 1
            raise TimeoutError
        return next(self.pieces, b"")


async def test_a_first_event_queued_inside_a_serving_node_is_waited_for() -> None:
    """A stream queued behind others inside a busy node sends nothing for longer than
    first_byte_s: while the node's other streams progress it is not cut; a silent node,
    or a gap after the first event, still is."""
    a = _event("a")

    def run(quiet: int) -> UpstreamResponse:
        conn = cast(Connection, _Silent(quiet, [a]))
        return UpstreamResponse(conn, cast(NodePool, None), cast(Origin, None), "n1")

    got = [r async for r in run(3).events(5.0, first_s=1.0, serving=lambda: True)]
    assert got == [a]
    with pytest.raises(MidStreamError):
        _ = [r async for r in run(1).events(5.0, first_s=1.0, serving=lambda: False)]

    class _GapAfterFirst(_Silent):
        async def readany(self, timeout: float | None = None) -> bytes:
            if self.quiet == 0:
                self.quiet = -1
                return a
            raise TimeoutError

    gap = UpstreamResponse(
        cast(Connection, _GapAfterFirst(0, [])), cast(NodePool, None), cast(Origin, None), "n1"
    )
    with pytest.raises(MidStreamError):
        _ = [r async for r in gap.events(5.0, first_s=1.0, serving=lambda: True)]
