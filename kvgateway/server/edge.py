"""The client's side of a request, before any stage: its id, its tenant (from its API
key), its body (bounded in size and time, refused while it arrives when it holds too
many messages, not read further once answered) and every gateway error as OpenAI's JSON.
The middlewares here run for every path; the completion routes then go to
:mod:`kvgateway.server.proxy`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvgateway.config.model import AuthConfig, key_digest
from kvgateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    RequestTimeout,
    Unauthorized,
)
from kvgateway.server.appkeys import STATE
from kvgateway.server.state import GatewayState
from kvgateway.server.telemetry import AccessRecord, log_access
from kvgateway.upstream.client import read_capped

REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)

_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: GatewayError, request_id: str) -> web.Response:
    headers = {"x-request-id": request_id, **err.headers()}
    return web.Response(
        status=err.status,
        body=err.body_bytes(),
        content_type="application/json",
        headers=headers,
    )


def _client_request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token (it is logged and echoed)."""
    rid = request.headers.get("x-request-id", "")
    if 0 < len(rid) <= 128 and rid.isascii() and rid.isprintable() and " " not in rid:
        return rid
    return uuid.uuid4().hex


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # The one place a request gets its id: handlers, errors and logs all read it here.
    request[REQUEST_ID] = rid = _client_request_id(request)
    resp = await handler(request)
    if not resp.prepared:  # every answer names its request (OpenAI SDKs read it)
        resp.headers.setdefault("x-request-id", rid)
    end_unread_body(request, resp)
    return resp


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request[REQUEST_ID]
    try:
        return await handler(request)
    except GatewayError as err:
        return error_response(err, rid)
    except web.HTTPNotFound:
        return error_response(NotFound(f"No route for {request.method} {request.path}."), rid)
    except web.HTTPMethodNotAllowed:
        return error_response(
            MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}."), rid
        )
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(BodyTooLarge(exc.text or "Request body too large."), rid)


def _refused_key(state: GatewayState, request: web.Request) -> None:
    """A request without a valid key: counted, and in the access log (no key in it)."""
    state.metrics.rejections.labels(reason="auth").inc()
    if state.live().server.access_log:
        rid = request.get(REQUEST_ID, "-")
        log_access(
            AccessRecord(
                rid, request.method, request.path, status=401, outcome=Unauthorized.default_code
            )
        )


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    server = state.live().server
    path = request.path
    if path in _OPEN_PATHS:
        return await handler(request)
    header = request.headers.get("Authorization", "")
    if path.startswith("/admin/") and server.admin_api_keys:
        if not is_admin(header, server.admin_api_keys):
            _refused_key(state, request)
            raise Unauthorized(
                "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'. "
                "/admin/* takes an admin key."
            )
        return await handler(request)
    tenant = tenant_for_key(state.live().auth, header)
    if tenant is None:
        _refused_key(state, request)
        raise Unauthorized("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.")
    request[TENANT] = tenant
    return await handler(request)


def tenant_for_key(auth: AuthConfig, header: str) -> str | None:
    """The tenant whose key is in ``Authorization: Bearer``; the default tenant when the
    gateway is open."""
    if auth.open:
        return auth.default_tenant.name
    token = _bearer(header)
    return auth.owner(token) if token else None


def _bearer(header: str) -> str:
    """The token of ``Authorization: Bearer <token>`` (empty if none)."""
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def is_admin(header: str, admin_keys: tuple[str, ...]) -> bool:
    """Whether ``Authorization: Bearer`` holds one of ``admin_keys``: found by its
    SHA-256 as a tenant's key is (:meth:`AuthConfig.owner`); an empty token never is."""
    token = _bearer(header)
    return bool(token) and key_digest(token) in _digests(admin_keys)


@functools.lru_cache(maxsize=8)
def _digests(keys: tuple[str, ...]) -> frozenset[bytes]:
    return frozenset(key_digest(k) for k in keys)


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
    LINGER_BYTES the transport is paused instead, and the connection closed when
    lingering ends: a client that reads while it sends still gets the answer; one that
    writes its whole body first (httpx, so the OpenAI SDKs) gets it only while the rest
    fits the sockets' buffers, else a reset."""
    with contextlib.suppress(Exception):
        # Emptied first: draining a paused buffer would resume reading.
        request.content.read_nowait()
    transport = request.transport
    if transport is not None:
        transport.pause_reading()
