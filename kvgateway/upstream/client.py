"""Talking to backends: the one place aiohttp client errors become gateway errors.

``aiohttp.ClientConnectorError`` / ``ServerDisconnectedError`` / ``ClientOSError`` before
the response head          -> UpstreamError(retryable=True)   (nothing reached the node's engine)
HTTP 5xx before any byte   -> UpstreamError(retryable=True)   (vLLM 503 admission rejection too)
no head within the phase   -> UpstreamTimeout(retryable=False) (the node may still be working)
failures while relaying    -> MidStreamError                  (bytes already reached the client)
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from kvgateway.config.model import TimeoutConfig
from kvgateway.core.backends import Backend
from kvgateway.errors import UpstreamError, UpstreamTimeout

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
_LARGE_BODY = 512 * 1024
_USAGE_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class MidStreamError(Exception):
    """The upstream failed after response bytes were sent to the client."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int | None


def find_usage(data: bytes) -> Usage | None:
    """Usage from a response body or final stream chunk (it sits near the end)."""
    tail = data[-2048:]
    m = _USAGE_RE.search(tail) or _USAGE_RE.search(data)
    if m is None:
        return None
    c = _COMPLETION_RE.search(tail) or _COMPLETION_RE.search(data)
    return Usage(int(m.group(1)), int(c.group(1)) if c else None)


class UpstreamResponse:
    """One backend response, owned by whoever opened it: ``async with`` (or
    :meth:`close`) gives the connection back on every path, like httpx's streamed
    ``Response``. It offers what the proxy needs: the status, the headers to relay, the
    whole body (bounded) or the SSE events as they come."""

    __slots__ = ("_resp", "backend_name")

    def __init__(self, resp: aiohttp.ClientResponse, backend_name: str) -> None:
        self._resp = resp
        self.backend_name = backend_name

    @property
    def status(self) -> int:
        return self._resp.status

    def relay_headers(self) -> dict[str, str]:
        """The node's headers minus hop-by-hop and length headers (each side sets its own)."""
        return {
            k: v for k, v in self._resp.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS
        }

    async def read(self, limit: int) -> bytes:
        """The whole body; failures here are upstream errors (nothing was sent yet)."""
        try:
            return await read_capped(self._resp.content, limit)
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise UpstreamError(
                f"Backend connection broke while reading the response: {exc.__class__.__name__}",
                code="upstream_reset",
                retryable=False,
            ) from exc
        except ValueError as exc:
            raise UpstreamError("Backend response too large.", retryable=False) from exc

    def events(self, idle_s: float) -> AsyncIterator[bytes]:
        """Runs of complete SSE events as they arrive (see :func:`sse_events`)."""
        return sse_events(self._resp, idle_s)

    def close(self) -> None:
        self._resp.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


async def open_request(
    session: aiohttp.ClientSession,
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
    url = backend.config.url + path
    resp: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(head_timeout):
            resp = await session.post(
                url,
                # Big bodies as a stream: aiohttp writes raw bytes in one piece.
                data=io.BytesIO(body) if len(body) > _LARGE_BODY else body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s
                ),
            )
            if resp.status >= 500:
                detail = await _read_bounded(resp)
                raise UpstreamError(
                    f"Backend {backend.name} answered HTTP {resp.status}.",
                    code=f"upstream_{resp.status}",
                    retryable=True,
                    detail=f"HTTP {resp.status}: {detail[:300]}",
                )
            return UpstreamResponse(resp, backend.name)
    except TimeoutError as exc:
        if resp is not None:
            resp.close()
        raise UpstreamTimeout(
            f"Backend {backend.name} did not answer within {head_timeout:g}s.", retryable=False
        ) from exc
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
        raise UpstreamError(
            f"Could not reach backend {backend.name}: {exc.__class__.__name__}",
            code="upstream_connect",
            retryable=True,
            detail=f"{exc.__class__.__name__}: {exc}",
        ) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(
            f"Backend {backend.name} failed: {exc.__class__.__name__}",
            code="upstream_connect",
            retryable=True,
            detail=f"{exc.__class__.__name__}: {exc}",
        ) from exc
    except BaseException:
        if resp is not None:
            resp.close()
        raise


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


async def _read_bounded(resp: aiohttp.ClientResponse) -> str:
    try:
        raw = await read_capped(resp.content, _MAX_ERROR_BODY)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        raw = b""
    finally:
        resp.close()
    return raw.decode("utf-8", "replace")


async def sse_events(resp: aiohttp.ClientResponse, idle_s: float) -> AsyncIterator[bytes]:
    """Yield runs of complete SSE events (ending in a blank line) as they arrive.

    Partial events are held back so an error event the gateway appends never lands in the
    middle of one. Raises MidStreamError on reset or an idle gap longer than ``idle_s``.
    """
    pending = b""
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await resp.content.readany()
        except TimeoutError as exc:
            raise MidStreamError("timeout", f"the backend sent nothing for {idle_s:g}s") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise MidStreamError(
                "reset", f"the backend connection broke ({exc.__class__.__name__})"
            ) from exc
        if not chunk:
            if pending.strip():
                yield pending + b"\n\n"
            return
        pending += chunk
        cut = pending.rfind(b"\n\n")
        if cut < 0:
            continue
        ready, pending = pending[: cut + 2], pending[cut + 2 :]
        yield ready
