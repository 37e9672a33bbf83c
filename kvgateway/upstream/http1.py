"""A lean HTTP/1.1 client for the request path: one connection to a node.

The gateway sends nodes one kind of request: a POST whose body is already in memory,
answered by a JSON body or an SSE stream. aiohttp's client does that for ~0.27 ms of CPU
per request on the 2-core machine (its request and response objects, headers merging,
cookie and trace hooks), four times what a plain protocol over the same socket costs
(measured with the fake upstream: 273-322 us against 54-79 us); this module is that plain
protocol, for the request path only. Health probes, metrics scrapes and ``/tokenize``
stay on aiohttp.

One :class:`Connection` carries one request at a time (:mod:`.node_pool` keeps them
alive between requests). It parses the response head, then the body
(``Content-Length``, chunked, or up to the close), and hands body bytes over through
:meth:`Connection.readany`, pausing the socket while more than ``_HIGH_WATER`` bytes
wait unread.

Errors, all :class:`HTTPClientError` (``client.py`` maps them to gateway errors once)::

    HTTPClientError
     +-- ConnectFailed    no connection (refused, unreachable, TLS)
     |    +-- ConnectTimedOut   none within the connect timeout
     +-- Disconnected     the node closed or reset the connection before the end
     +-- BadResponse      not an HTTP/1.x response this client can read
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

_MAX_HEAD = 64 * 1024
_MAX_LINE = 8 * 1024
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024

# Body framing of the response being read.
_NONE, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _TO_CLOSE, _DONE = range(8)


class HTTPClientError(Exception):
    """Talking to a node failed."""


class ConnectFailed(HTTPClientError):
    pass


class ConnectTimedOut(ConnectFailed):
    """No connection within the connect timeout: the node is unreachable, or its API
    server too busy to accept (a node on 2 loaded cores can take seconds)."""


class Disconnected(HTTPClientError):
    pass


class BadResponse(HTTPClientError):
    pass


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request and response on it at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_handle: asyncio.TimerHandle | None = None
        self._reset_response()

    def _reset_response(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.received = False  # a byte of this response arrived
        self.keep_alive = True
        self._head_done = False
        self._buf = bytearray()
        self._mode = _NONE
        self._left = 0
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._eof = False
        self._error: HTTPClientError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused_reading = False

    # ---- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: duck-typed.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            if not self._head_done:
                self._buf += data
                self._parse_head()
            elif self._mode == _LENGTH and not self._buf:
                self._length_body(data)
            else:
                self._buf += data
                self._parse_body()
        except BadResponse as exc:
            self._fail(exc)
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        # (An idle connection stays in its pool's list until its idle timer, or the next
        # request that takes it, finds it closed.)
        self.closed = True
        if self._mode == _TO_CLOSE:
            self._mode = _DONE
            self._eof = True
            self._wake()
        elif self._mode != _DONE:
            why = f": {exc}" if exc else ""
            self._fail(Disconnected(f"the node closed the connection{why}"))

    # ---- parsing -------------------------------------------------------------------

    def _parse_head(self) -> None:
        while not self._head_done:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise BadResponse("response head too large")
                return
            lines = bytes(self._buf[:end]).split(b"\r\n")
            del self._buf[: end + 4]
            status_line = lines[0].split(b" ", 2)
            if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
                raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            try:
                status = int(status_line[1])
            except ValueError:
                raise BadResponse(f"bad status code: {status_line[1][:16]!r}") from None
            if 100 <= status < 200:
                continue  # an interim response (100 Continue, 103 Early Hints): skip it
            self.status = status
            self.keep_alive = status_line[0] == b"HTTP/1.1"
            length: int | None = None
            chunked = False
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep:
                    raise BadResponse(f"bad header line: {line[:80]!r}")
                key = name.strip().decode("latin-1")
                text = value.strip().decode("latin-1")
                self.headers.append((key, text))
                low = key.lower()
                if low == "content-length":
                    try:
                        length = int(text)
                    except ValueError:
                        raise BadResponse(f"bad Content-Length: {text[:32]!r}") from None
                    if length < 0:
                        raise BadResponse("negative Content-Length")
                elif low == "transfer-encoding":
                    chunked = text.lower().endswith("chunked")
                elif low == "connection":
                    tokens = text.lower()
                    if "close" in tokens:
                        self.keep_alive = False
                    elif "keep-alive" in tokens:
                        self.keep_alive = True
            self._head_done = True
            if status in (204, 304) or (length == 0 and not chunked):
                self._mode = _DONE
                self._eof = True
            elif chunked:
                self._mode = _CHUNK_SIZE
            elif length is not None:
                self._mode, self._left = _LENGTH, length
            else:
                self._mode = _TO_CLOSE
                self.keep_alive = False
            self._wake()
            if self._buf:
                rest = bytes(self._buf)
                self._buf.clear()
                if self._mode == _LENGTH:
                    self._length_body(rest)
                else:
                    self._buf += rest
                    self._parse_body()

    def _length_body(self, data: bytes) -> None:
        if len(data) > self._left:
            self.keep_alive = False  # bytes after the response: never reuse this one
            data = data[: self._left]
        self._left -= len(data)
        if self._left == 0:
            self._mode = _DONE
            self._eof = True
        self._emit(data)

    def _parse_body(self) -> None:
        buf = self._buf
        while buf:
            mode = self._mode
            if mode in (_CHUNK_SIZE, _TRAILER):
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > _MAX_LINE:
                        raise BadResponse("chunk size line too long")
                    break
                line = bytes(buf[:end])
                del buf[: end + 2]
                if mode == _TRAILER:
                    if not line:
                        self._mode = _DONE
                        self._eof = True
                        if buf:
                            self.keep_alive = False
                            buf.clear()
                        self._wake()
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadResponse(f"bad chunk size: {line[:32]!r}") from None
                if size < 0:
                    raise BadResponse("negative chunk size")
                self._mode, self._left = (_CHUNK_DATA, size) if size else (_TRAILER, 0)
            elif mode == _CHUNK_DATA:
                take = min(self._left, len(buf))
                piece = bytes(buf[:take])
                del buf[:take]
                self._left -= take
                if self._left == 0:
                    self._mode = _CHUNK_CRLF
                self._emit(piece)
            elif mode == _CHUNK_CRLF:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise BadResponse("chunk not followed by CRLF")
                del buf[:2]
                self._mode = _CHUNK_SIZE
            elif mode == _TO_CLOSE:
                piece = bytes(buf)
                buf.clear()
                self._emit(piece)
            else:  # _DONE (or _LENGTH after buffered bytes): anything more is not ours
                self.keep_alive = False
                buf.clear()

    def _emit(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if (
                self._buffered > _HIGH_WATER
                and not self._paused_reading
                and self._transport is not None
            ):
                self._paused_reading = True
                self._transport.pause_reading()
        self._wake()

    def _fail(self, exc: HTTPClientError) -> None:
        if self._error is None:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---- the request -----------------------------------------------------------------

    async def send(self, head: bytes, body: bytes) -> None:
        """Write the request and wait for the response head (the caller bounds it)."""
        self._reset_response()
        transport = self._transport
        if transport is None or self.closed or transport.is_closing():
            raise Disconnected("the connection is closed")
        # The transport keeps what the socket does not take at once; no drain is awaited:
        # a node may answer (413, 400) before it reads a large body, and its head, or the
        # connection's end, is what the request waits for either way.
        if len(body) < 65536:
            transport.write(head + body)
        else:
            transport.write(head)
            transport.write(body)
        while not self._head_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def _wait(self, timeout: float | None = None) -> None:
        fut = self._waiter = self._loop.create_future()
        handle = None
        if timeout is not None:
            handle = self._loop.call_later(timeout, _expire, fut)
        try:
            await fut
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    async def readany(self, timeout: float | None = None) -> bytes:
        """Body bytes that arrived (all of them), b'' at the end; TimeoutError when
        nothing came within ``timeout`` seconds."""
        while not self._chunks:
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait(timeout)
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused_reading and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return (
            self._mode == _DONE
            and not self._chunks
            and self.keep_alive
            and self._error is None
            and not self.closed
            # A node that answered before taking all of the request body: the rest would
            # be read as the next request.
            and self._transport is not None
            and self._transport.get_write_buffer_size() == 0
        )

    @property
    def ending(self) -> bool:
        """Only the end of a chunked body may still come: every chunk that arrived was
        read, and the parser waits at a chunk boundary (for the terminator)."""
        return (
            self._mode in (_CHUNK_CRLF, _CHUNK_SIZE, _TRAILER)
            and not self._chunks
            and not self._buf
            and self.keep_alive
            and self._error is None
            and not self.closed
            and self._transport is not None
            and self._transport.get_write_buffer_size() == 0
        )

    def close(self) -> None:
        self.closed = True
        if self.idle_handle is not None:
            self.idle_handle.cancel()
        if self._transport is not None:
            self._transport.close()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())
