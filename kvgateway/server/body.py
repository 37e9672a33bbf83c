"""Reading a request's body: bounded in size and time, refused while it arrives when it
holds too many messages, and not read further once it has been answered."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvgateway.errors import BadRequest, BodyTooLarge, RequestTimeout
from kvgateway.upstream.client import read_capped


async def read_limited(
    request: web.Request, limit: int, timeout: float, max_messages: int | None = None
) -> bytes:
    """The whole body, at most ``limit`` bytes and within ``timeout`` seconds. With
    ``max_messages``, a body with more messages is refused while it arrives, chunk by
    chunk, before it is read whole (a 30 MB body of 800k messages costs the loop
    nothing but the chunks it looked at)."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Request body is {request.content_length} bytes; the limit is {limit}.")
    inspect = None if max_messages is None else _MessageCounter(max_messages)
    try:
        if request.content.is_eof():
            # Arrived whole with its headers (most bodies): no wait, so no timer.
            raw = request.content.read_nowait()
            if len(raw) > limit:
                raise ValueError(f"more than {limit} bytes")
            if inspect is not None:
                inspect(b"", raw)
            return raw
        async with asyncio.timeout(timeout):
            return await read_capped(request.content, limit, inspect)
    except ValueError as exc:
        raise BodyTooLarge(f"Request body exceeds the limit of {limit} bytes.") from exc
    except TimeoutError as exc:
        raise RequestTimeout(
            f"The request body did not arrive within {timeout:g}s.", code="request_timeout"
        ) from exc
    except (HttpProcessingError, RequestPayloadError) as exc:
        # A body that cannot be decoded (a broken gzip stream, bad chunking).
        raise BadRequest(
            f"The request body could not be read ({type(exc).__name__}).", code="invalid_body"
        ) from exc


class _MessageCounter:
    """Counts ``"role"`` keys as a chat body arrives; past the limit, a 400."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen = 0

    def __call__(self, tail: bytes, chunk: bytes) -> None:
        # A key cut between two chunks is found in the joint (tail + chunk's start).
        self._seen += chunk.count(b'"role"') + (tail[-5:] + chunk[:5]).count(b'"role"')
        if self._seen > self._limit:
            raise BadRequest(
                f"Too many messages in one request: the limit is {self._limit}.",
                param="messages",
                code="too_many_messages",
            )


def end_unread_body(request: web.Request, resp: web.StreamResponse) -> None:
    """``resp`` answers ``request`` before its body arrived whole (a 400 for 800k
    messages, a 401, a 413): this connection ends after it, and a big rest of the body
    is not read at all."""
    if resp.prepared or request.content.is_eof():
        return
    resp.force_close()
    if unread_bytes(request) > LINGER_BYTES:
        stop_reading(request)


# An answered request with more than this much body still to come is not read further.
LINGER_BYTES = 1024 * 1024


def unread_bytes(request: web.Request) -> int:
    seen = request.content.total_bytes
    if request.content_length is None:  # chunked: what came so far is the best guess
        return seen
    return request.content_length - seen


def stop_reading(request: web.Request) -> None:
    """Read no more of a big request body that was answered early.

    aiohttp reads and drops what is left of it after the answer (``lingering_time``), so
    a client that sends its whole body before reading gets the answer, not a reset. For a
    30 MB body resent in a loop that reading was most of the event loop's time. So past
    LINGER_BYTES the transport is paused instead: clients that read while they send
    (aiohttp, httpx and so the OpenAI SDKs, curl) still get the answer; the connection
    is closed when lingering ends, as it would be anyway for a body still arriving."""
    with contextlib.suppress(Exception):
        # Emptied first: draining a paused buffer would resume reading.
        request.content.read_nowait()
    transport = request.transport
    if transport is not None:
        transport.pause_reading()
