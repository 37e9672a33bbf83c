"""Talking to backends: the one place client errors become gateway errors.

Requests go out on :mod:`.http1`'s pooled connections. Its errors map as:

``ConnectFailed`` / ``Disconnected`` / ``BadResponse`` before
the response head          -> UpstreamError(retryable=True)   (nothing reached the node's engine)
HTTP 5xx before any byte   -> UpstreamError(retryable=True)   (vLLM 503 admission rejection too)
no head within the phase   -> UpstreamTimeout(retryable=False) (the node may still be working)
failures while relaying    -> MidStreamError                  (bytes already reached the client)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from kvgateway.config.model import TimeoutConfig
from kvgateway.core.backends import Backend
from kvgateway.errors import UpstreamError, UpstreamTimeout
from kvgateway.upstream.http1 import (
    ConnectFailed,
    Connection,
    ConnectTimedOut,
    Disconnected,
    HTTPClientError,
)
from kvgateway.upstream.node_pool import NodePool, Origin

# Hop-by-hop and length headers are recomputed by each side.
_DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "server",
        "date",
        "proxy-authenticate",
        "trailer",
        "upgrade",
    }
)
_MAX_ERROR_BODY = 64 * 1024
# Chat and completions usage, or the Responses API's (input/output tokens).
_USAGE_RE = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d{1,15})(?!\d)')
_COMPLETION_RE = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d{1,15})(?!\d)')
USAGE_MARKS = (b'"prompt_tokens"', b'"input_tokens"')
# The largest SSE event held while it arrives: as large as a whole non-streamed answer
# (server.relay.MAX_RESPONSE_BYTES), since a Responses stream's final event carries the
# whole response. A node that never ends its event fails the stream here instead of
# being buffered without limit.
MAX_EVENT_BYTES = 256 * 1024 * 1024


class MidStreamError(Exception):
    """The upstream failed after response bytes were sent to the client."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int | None


_USAGE_KEY = re.compile(rb"\s*:\s*\{")


def find_usage(data: bytes) -> Usage | None:
    """Usage from a response body or final stream chunk: read from the last ``usage``
    *key* (``"usage": {``) on. What comes before it can hold client-made keys named like
    usage fields (a Responses answer echoes the request's JSON schema and tools just
    before its usage); a string value "usage" after it (a rerank document echoed, a
    prompt token in prompt_logprobs, a Responses ``user``) is never followed by a colon."""
    end = len(data)
    while True:
        at = data.rfind(b'"usage"', 0, end)
        if at < 0:
            return None
        if _USAGE_KEY.match(data, at + 7):
            break
        end = at
    tail = data[at:]
    m = _USAGE_RE.search(tail)
    if m is None:
        return None
    c = _COMPLETION_RE.search(tail)
    return Usage(int(m.group(1)), int(c.group(1)) if c else None)


class UpstreamResponse:
    """One backend response, owned by whoever opened it: ``async with`` (or
    :meth:`close`) gives the connection back on every path, like httpx's streamed
    ``Response``. It offers what the proxy needs: the status, the headers to relay, the
    whole body (bounded) or the SSE events as they come."""

    __slots__ = ("_conn", "_ended", "_origin", "_pool", "backend_name")

    def __init__(self, conn: Connection, pool: NodePool, origin: Origin, backend_name: str):
        self._conn = conn
        self._ended = False
        self._pool = pool
        self._origin = origin
        self.backend_name = backend_name

    @property
    def status(self) -> int:
        return self._conn.status

    def header(self, name: str) -> str:
        """One header's value ("" if absent)."""
        wanted = name.lower()
        return next((v for k, v in self._conn.headers if k.lower() == wanted), "")

    def relay_headers(self) -> CIMultiDict[str]:
        """The node's headers minus hop-by-hop and length headers (each side sets its own),
        case-insensitive: a header the gateway sets replaces the node's however it is
        spelled (uvicorn sends lower case)."""
        return CIMultiDict(
            (k, v) for k, v in self._conn.headers if k.lower() not in _DROP_RESPONSE_HEADERS
        )

    async def read(self, limit: int) -> bytes:
        """The whole body; failures here are upstream errors (nothing was sent yet)."""
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await self._conn.readany():
                size += len(chunk)
                if size > limit:
                    raise UpstreamError("Backend response too large.", retryable=False)
                chunks.append(chunk)
        except HTTPClientError as exc:
            raise UpstreamError(
                f"Backend connection broke while reading the response: {exc}",
                code="upstream_reset",
                retryable=False,
            ) from exc
        return b"".join(chunks)

    async def events(
        self,
        idle_s: float,
        max_event: int | None = None,
        first_s: float | None = None,
        serving: Callable[[], bool] | None = None,
    ) -> AsyncIterator[bytes]:
        """Runs of complete SSE events as they arrive, each ending in a blank line.

        Partial events are held back so an error event the gateway appends never lands in
        the middle of one; one left incomplete when the body ends is dropped (the relay
        then writes its own error event), except a lone ``data: [DONE]`` line. Line ends
        are normalised to ``\\n`` (SSE also allows CRLF and CR; what reads the events
        looks for ``\\n\\n``). Raises MidStreamError on reset, an idle gap longer than
        ``idle_s`` (``first_s`` until the first event: a node sends a stream's head
        before its prefill, which may take longer, and waits in the node's own queue for
        as long as ``serving()`` says the node serves others meanwhile) or an incomplete
        event larger than ``max_event`` bytes (default :data:`MAX_EVENT_BYTES`)."""
        cap = MAX_EVENT_BYTES if max_event is None else max_event
        # The incomplete event, in the pieces it came in (never joined until complete:
        # each read is scanned once, however long the event).
        parts: list[bytes] = []
        size = 0
        cr_tail = False  # the last read ended in CR, which was made a LF
        conn = self._conn
        wait = idle_s if first_s is None else first_s
        first = first_s is not None  # no event yet
        while True:
            try:
                chunk = await conn.readany(wait)
            except TimeoutError as exc:
                if first and serving is not None and serving():
                    continue  # queued inside a node that works through its queue
                raise MidStreamError("timeout", f"the backend sent nothing for {wait:g}s") from exc
            except HTTPClientError as exc:
                raise MidStreamError("reset", f"the backend connection broke ({exc})") from exc
            if not chunk:
                # A stream's end marker is whole once its line is; any other event may
                # have lost lines (a Responses event's data after its event line).
                if 0 < size < 64 and b"".join(parts).lstrip(b"\n") == b"data: [DONE]\n":
                    yield b"data: [DONE]\n\n"
                return
            if cr_tail or b"\r" in chunk:
                if cr_tail and chunk.startswith(b"\n"):
                    chunk = chunk[1:]  # the LF of a CRLF split between reads
                cr_tail = chunk.endswith(b"\r")
                chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                if not chunk:
                    continue
            # The last event end in this read, or one split between reads ("\n" | "\n").
            cut = chunk.rfind(b"\n\n")
            if cut >= 0:
                cut += 2
            elif chunk[0] == 0x0A and parts and parts[-1].endswith(b"\n"):
                cut = 1
            if cut < 0:
                parts.append(chunk)
                size += len(chunk)
            else:
                parts.append(chunk[:cut] if cut < len(chunk) else chunk)
                ready = b"".join(parts) if len(parts) > 1 else parts[0]
                rest = chunk[cut:]
                parts = [rest] if rest else []
                size = len(rest)
                wait = idle_s
                first = False
                yield ready
            if size > cap:
                raise MidStreamError(
                    "too_large", f"the backend sent an event larger than {cap} bytes"
                )

    def ended(self) -> None:
        """The stream reached its own end marker ([DONE], a Responses stream's last event):
        what may still come is the body's own end (the chunked terminator, which uvicorn
        writes apart), after which the connection can serve another request."""
        self._ended = True

    def close(self) -> None:
        self._pool.release(self._conn, self._origin, ending=self._ended)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


async def open_request(
    pool: NodePool,
    backend: Backend,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    timeouts: TimeoutConfig,
    *,
    head_timeout: float,
) -> UpstreamResponse:
    """Send the request and wait for the response head (bounded by ``head_timeout``).

    A 5xx answer is read (bounded) and raised as a retryable :class:`UpstreamError`; any
    other status is returned, as an :class:`UpstreamResponse` the caller owns.
    """
    url = backend.config.url
    try:
        async with asyncio.timeout(head_timeout):
            conn = await pool.request(url, path, body, headers, connect_s=timeouts.connect_s)
    except TimeoutError as exc:
        raise UpstreamTimeout(
            f"Backend {backend.name} did not answer within {head_timeout:g}s.", retryable=False
        ) from exc
    except (ConnectFailed, Disconnected) as exc:
        raise UpstreamError(
            f"Could not reach backend {backend.name}: {exc.__class__.__name__}",
            code="upstream_connect",
            retryable=True,
            detail=f"{exc.__class__.__name__}: {exc}",
            slow=isinstance(exc, ConnectTimedOut),
        ) from exc
    except HTTPClientError as exc:
        raise UpstreamError(
            f"Backend {backend.name} failed: {exc.__class__.__name__}",
            code="upstream_connect",
            retryable=True,
            detail=f"{exc.__class__.__name__}: {exc}",
        ) from exc
    resp = UpstreamResponse(conn, pool, pool.origin(url), backend.name)
    if conn.status >= 500:
        async with resp:
            detail = await _read_bounded(resp, head_timeout)
        raise UpstreamError(
            f"Backend {backend.name} answered HTTP {conn.status}.",
            code=f"upstream_{conn.status}",
            retryable=True,
            detail=f"HTTP {conn.status}: {detail[:300]}",
        )
    return resp


async def read_capped(
    stream: aiohttp.StreamReader,
    limit: int,
    inspect: Callable[[bytes, bytes], None] | None = None,
) -> bytes:
    """Read to EOF, failing with ValueError past ``limit`` bytes (``read(n)`` alone may
    return any prefix). ``inspect(previous_tail, chunk)`` sees each chunk as it arrives
    (with the end of the one before) and may raise to stop reading early."""
    chunks: list[bytes] = []
    size = 0
    tail = b""
    while True:
        chunk = await stream.readany()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise ValueError(f"more than {limit} bytes")
        if inspect is not None:
            inspect(tail, chunk)
            tail = chunk[-16:]
        chunks.append(chunk)


async def _read_bounded(resp: UpstreamResponse, timeout: float) -> str:
    try:
        async with asyncio.timeout(timeout):
            raw = await resp.read(_MAX_ERROR_BODY)
    except (UpstreamError, TimeoutError):
        raw = b""
    return raw.decode("utf-8", "replace")
