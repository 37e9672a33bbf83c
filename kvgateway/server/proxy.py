"""The request path, in the order it happens: read, count, admit, forward, relay, release.

Each request is one :class:`~kvgateway.server.exchange.Exchange`; its reservation and
its upstream response are ``async with`` blocks (released whatever the way out).
Failover happens only before a response byte has reached the client. Shutdown ends a
request by moving its deadline forward; cancellation (a client gone) always propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from types import TracebackType
from typing import Any, Protocol, TypeVar, cast

from aiohttp import web

from kvgateway.core.backends import Backend
from kvgateway.core.output_model import client_key
from kvgateway.core.quota import charge
from kvgateway.core.reservation import Reservation
from kvgateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    NoHealthyBackend,
    RateLimited,
    Saturated,
    UpstreamError,
    UpstreamTimeout,
)
from kvgateway.plan.openai_request import Kind
from kvgateway.plan.planner import Plan, upstream_body
from kvgateway.server.appkeys import STATE
from kvgateway.server.edge import REQUEST_ID, TENANT, error_response, read_limited
from kvgateway.server.exchange import (
    ABANDONED,
    CLIENT_GONE,
    Exchange,
    Failure,
    Outcome,
    until_shutdown,
)
from kvgateway.server.relay import error_message, is_event_stream
from kvgateway.server.state import GatewayState
from kvgateway.server.telemetry import AccessRecord, set_attributes
from kvgateway.tokens.node_count import NodeCount, parse_context_length_error
from kvgateway.upstream.client import open_request
from kvgateway.upstream.feedback import request_failed, request_served, serving

log = logging.getLogger("kvgateway.server.proxy")

MAX_ATTEMPTS = 3


async def handle_completion(request: web.Request, kind: Kind) -> web.StreamResponse:
    """A chat, completion or Responses request: planned, admitted with a KV
    reservation, relayed and settled."""
    state = request.app[STATE]

    async def serve(ex: Exchange) -> web.StreamResponse:
        try:
            return await _count_and_forward(state, ex, kind)
        except ContextLengthExceeded as err:
            err.param = {"completion": "prompt", "responses": "input"}.get(kind, err.param)
            raise

    client = client_key(request.headers.get("Authorization", ""))
    return await run_exchange(state, request, serve, client=client)


async def run_exchange(
    state: GatewayState,
    request: web.Request,
    serve: Callable[[Exchange], Awaitable[web.StreamResponse]],
    *,
    client: str = "*",
) -> web.StreamResponse:
    """One request's life, whatever it is for: its :class:`Exchange`, its trace span, its
    place among the requests shutdown waits for (and ends: :func:`until_shutdown`); a
    gateway error answered as OpenAI's JSON with the tenant's limit headers; a client
    gone recorded as 499; and, however it ends, its charge settled, its metrics and its
    access line (:class:`Settle`)."""
    rid = request[REQUEST_ID]
    ex = Exchange(
        request=request,
        record=AccessRecord(
            request_id=rid,
            method=request.method,
            path=request.path,
            tenant=request.get(TENANT, state.live().auth.default_tenant.name),
        ),
        started=state.clock(),
        client=client,
    )
    task = asyncio.current_task()
    if task is not None:
        state.active[task] = ex
    try:
        with state.tracing.request("gateway.request", request.headers) as span:
            resp = await until_shutdown(ex, state.shutting_down, serve)
            set_attributes(span, status=resp.status, request_id=rid)
        ex.record.status = resp.status
        if state.draining and not resp.prepared:
            resp.force_close()  # the gateway is leaving: the client reconnects elsewhere
        return resp
    except GatewayError as err:
        ex.record.status = err.status
        ex.record.outcome = err.code
        ex.rejection = err.rejection_reason
        if isinstance(err, RateLimited):
            ex.limit_hit = err.param
        resp = error_response(err, rid)
        if ex.charge is not None:
            ex.limit_headers = state.settle.refused(ex)
        for name, value in ex.limit_headers.items():  # charged: the tenant's limits too
            resp.headers.setdefault(name, value)
        if state.draining:
            resp.force_close()  # leaving: the client reconnects elsewhere
        return resp
    except ConnectionResetError:
        # The client went away between two writes, before aiohttp cancelled us. Nothing
        # can reach it; returning (not raising) keeps aiohttp from logging a traceback.
        ex.record.status = CLIENT_GONE
        ex.record.outcome = Outcome.CLIENT_DISCONNECT
        return web.Response(status=CLIENT_GONE)
    except asyncio.CancelledError:
        ex.record.status = CLIENT_GONE
        ex.record.outcome = Outcome.CLIENT_DISCONNECT
        raise
    finally:
        if task is not None:
            state.active.pop(task, None)
        state.settle.close(ex)


async def _count_and_forward(state: GatewayState, ex: Exchange, kind: Kind) -> web.StreamResponse:
    cfg = state.live()
    raw = await read_limited(
        ex.request,
        cfg.admission.max_body_bytes,
        cfg.server.body_timeout_s,
        cfg.admission.max_messages if kind != "completion" else None,
    )
    plan = await state.planner.plan(
        raw,
        kind,
        session=ex.request.headers.get("x-session-id") or None,
        client=ex.client,
    )
    ex.plan = plan
    rec = ex.record
    rec.model = plan.model.name
    rec.prompt_tokens = plan.prompt.total
    rec.stream = plan.parsed.stream
    output = plan.demand.output_tokens * plan.demand.sequences
    ex.charge, ex.limit_headers = await charge(
        state.quotas, state.tenancy, rec.tenant, plan.prompt.total, output, state.clock()
    )
    return await _forward(state, ex, raw)


class Held(Protocol):
    """Room on one backend for one try (a KV reservation, or a place in flight)."""

    @property
    def backend(self) -> Backend: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


H = TypeVar("H", bound=Held)
T = TypeVar("T")


async def failover(
    state: GatewayState,
    ex: Exchange,
    hold: Callable[[frozenset[str]], Awaitable[H]],
    attempt: Callable[[H], Awaitable[T | UpstreamError | NodeCount]],
) -> T:
    """Every request's retry loop: ``hold`` room on a backend not in the set given,
    ``attempt`` it; on a failure before the first byte (``attempt`` returned it, having
    raised those it may not retry), try another. A node that refused a stand-in-counted
    prompt as too long (a :class:`NodeCount`) is tried again, once, re-planned with its
    count and its room given back first."""
    excluded: set[str] = set()
    last_error: UpstreamError | None = None
    while True:
        ex.record.attempts += 1
        held = await _hold_avoiding(ex, hold, excluded, last_error)
        if last_error is not None:  # the last failure is retried, here
            ex.failures[-1] = replace(ex.failures[-1], retried=True)
        async with held:
            outcome = await attempt(held)
            if isinstance(outcome, UpstreamError):
                # A busy node that still serves may be tried again.
                if not (outcome.slow and serving(held.backend, state.clock(), state.live().health)):
                    excluded.add(held.backend.name)
                last_error = outcome
                continue
            if not isinstance(outcome, NodeCount):
                return outcome
        await _recount(state, ex, held.backend, outcome)


async def _hold_avoiding(
    ex: Exchange,
    hold: Callable[[frozenset[str]], Awaitable[H]],
    excluded: set[str],
    last_error: UpstreamError | None,
) -> H:
    """Room on a backend that has not failed this request. When every backend that fits
    has failed once, anywhere but the last one; when nothing is left, the client gets the
    upstream failure rather than a misleading 503."""
    if not excluded:
        return await hold(frozenset())
    try:
        return await hold(frozenset(excluded))
    except NoHealthyBackend:
        pass
    assert last_error is not None
    try:
        return await hold(frozenset({ex.failures[-1].backend}))
    except NoHealthyBackend:
        raise last_error from None


def failed(
    state: GatewayState,
    ex: Exchange,
    backend: Backend,
    err: UpstreamError,
    *,
    may_eject: bool | None = None,
) -> UpstreamError:
    """A try failed before the first byte: recorded (as retried once another backend
    takes the request), and counted towards the backend's health (enough in a row eject
    it until a probe succeeds, unless ``may_eject`` is False: by default a failure that
    may be retried); returned to be retried, or raised when it may not be."""
    cause = "timeout" if isinstance(err, UpstreamTimeout) else err.code
    ex.failures.append(Failure(backend.name, cause, retried=False))
    error = err.detail or err.message
    health = state.live().health
    eject = err.retryable if may_eject is None else may_eject
    if request_failed(backend, error, state.clock(), health, may_eject=eject, slow=err.slow):
        log.warning(
            "backend %s ejected after %d failed requests in a row: %s",
            backend.name,
            backend.consecutive_failures,
            error,
        )
    if not err.retryable or ex.record.attempts >= MAX_ATTEMPTS:
        raise err
    return err


async def _forward(state: GatewayState, ex: Exchange, raw: bytes) -> web.StreamResponse:
    """Admit with a KV reservation, send, relay (:func:`failover`)."""
    cfg = state.live()
    deadline = ex.started + cfg.auth.queue_timeout(ex.record.tenant, cfg.admission.queue_timeout_s)
    body, body_of, cut = raw, cast("Plan | None", None), cast("int | None", None)

    async def admit(exclude: frozenset[str]) -> Reservation:
        plan = ex.plan
        assert plan is not None
        demand = replace(plan.demand, tenant=ex.record.tenant, exclude=exclude)
        with state.tracing.span("gateway.admission", tokens=demand.tokens) as span:
            asked = state.clock()
            try:
                r = await state.admission.admit(demand, max(0.0, deadline - state.clock()))
            except Saturated:
                ex.refused_after_s = state.clock() - asked  # waited, and was refused
                raise
            set_attributes(
                span,
                backend=r.backend.name,
                tier=r.backend.tier,
                reason=r.reason,
                queued_s=r.queued_s,
            )
        ex.admitted(r)
        return r

    async def attempt(r: Reservation) -> web.StreamResponse | UpstreamError | NodeCount:
        nonlocal body, body_of, cut
        plan = ex.plan
        assert plan is not None
        if body_of is not plan or cut != r.output_cut:
            # Written once admitted (a refused 16 MB prompt is never re-serialised), and
            # again only if a node's own count changed the plan or a node's context cuts
            # max_tokens otherwise.
            body, body_of, cut = upstream_body(plan, r.output_cut) or raw, plan, r.output_cut
        with state.tracing.span("gateway.upstream", backend=r.backend.name):
            return await _attempt(state, ex, r, body)

    return await failover(state, ex, admit, attempt)


async def _attempt(
    state: GatewayState, ex: Exchange, r: Reservation, body: bytes
) -> web.StreamResponse | UpstreamError | NodeCount:
    """One try on the backend ``r`` holds room on: the relayed answer, the failure to
    retry elsewhere (raised instead when it may not be retried), or the node's own count
    of a prompt it refused as too long (counted with a stand-in: admit again with it)."""
    plan = ex.plan
    assert plan is not None
    backend = r.backend
    timeouts = backend.config.timeouts
    ex.sent = state.clock()
    try:
        resp = await open_request(
            state.nodes,
            backend,
            ex.request.path,
            body,
            _upstream_headers(state, ex),
            timeouts,
            head_timeout=timeouts.first_byte_s if plan.parsed.stream else timeouts.total_s,
        )
    except UpstreamError as err:
        return failed(state, ex, backend, err)
    async with resp:
        if plan.parsed.stream and resp.status == 200 and is_event_stream(resp):
            streamed = await state.relay.stream(ex, resp, r)
            r.dropped = ex.record.outcome in ABANDONED
            if ex.record.outcome == Outcome.OK:
                request_served(backend, state.clock())
            state.settle.learn(ex)
            return streamed
        try:
            data = await state.relay.read_body(ex, resp, backend)
        except UpstreamError as err:  # a body cut or late: the node's failure, not retried
            raise failed(
                state, ex, backend, err, may_eject=not isinstance(err, UpstreamTimeout)
            ) from None
        request_served(backend, state.clock())
        if resp.status == 400 and not plan.prompt.exact and not ex.recounted:
            node = parse_context_length_error(error_message(data), backend.max_model_len)
            if node is not None and plan.prompt.prompts == 1:
                return node
        out = state.relay.answer(ex, resp, r, data)
    state.settle.learn(ex)
    await _send_now(state, ex, out)
    return out


async def _send_now(state: GatewayState, ex: Exchange, out: web.Response) -> None:
    """Put a whole answer on the wire at once, as a stream's events are: what follows it
    (releasing the reservation, metrics, the access line) is then bookkeeping the client
    does not wait for. aiohttp finishes a prepared response as it is."""
    if state.draining:
        out.force_close()  # the gateway is leaving: the client reconnects elsewhere
    ex.response = out
    await out.prepare(ex.request)
    await out.write_eof()


async def _recount(state: GatewayState, ex: Exchange, backend: Backend, node: NodeCount) -> None:
    """Re-plan with the count the node gave when it refused the prompt."""
    plan = ex.plan
    assert plan is not None
    backend.note_rejection(state.clock())
    ex.recounted = True
    ex.plan = await state.planner.replan(plan, node, backend.name)


def _upstream_headers(state: GatewayState, ex: Exchange) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-Id": ex.request_id}
    headers.update(state.tracing.for_node(ex.request.headers))
    return headers
