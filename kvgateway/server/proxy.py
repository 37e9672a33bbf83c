"""The request path: validate, count, admit, forward, relay, release.

Every admitted request holds a :class:`~kvgateway.core.admission.Reservation` that is released
in a ``finally`` (success, upstream error, timeout, client disconnect, cancellation).
Failover happens only before a response byte has reached the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web

from kvgateway.config.model import ModelConfig
from kvgateway.core.admission import Reservation
from kvgateway.core.routing import Demand, demand_tokens
from kvgateway.errors import (
    BodyTooLarge,
    ContextLengthExceeded,
    GatewayError,
    ModelNotFound,
    NoHealthyBackend,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from kvgateway.server.accesslog import AccessRecord, log_access
from kvgateway.server.openai_request import ParsedRequest, parse_body, parse_chat, parse_completion
from kvgateway.server.state import GatewayState
from kvgateway.tokens.counting import PromptTokens, plan_chat, plan_completion
from kvgateway.upstream import client as upstream

MAX_ATTEMPTS = 3
_MAX_RESPONSE_BYTES = 256 * 1024 * 1024
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's documented default


@dataclass(slots=True)
class Counted:
    model: ModelConfig
    parsed: ParsedRequest
    prompt: PromptTokens
    output_tokens: int
    demand: Demand


async def read_limited(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Request body is {request.content_length} bytes; the limit is {limit}.")
    try:
        return await upstream.read_capped(request.content, limit)
    except ValueError as exc:
        raise BodyTooLarge(f"Request body exceeds the limit of {limit} bytes.") from exc


async def count_request(state: GatewayState, raw: bytes, kind: str) -> Counted:
    body = parse_body(raw)
    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    model = state.config.resolve_model(parsed.model)
    if model is None:
        raise ModelNotFound(
            f"The model `{parsed.model}` does not exist or you do not have access to it.",
            param="model",
        )
    counter = state.counters.for_model(model)
    if parsed.kind == "chat":
        prompt = await counter.count(plan_chat(body, model.tokenizer))
        default_out = state.config.admission.default_output_tokens
    else:
        plan, known = plan_completion(body["prompt"])
        prompt = await counter.count(plan, known)
        default_out = _COMPLETIONS_DEFAULT_MAX_TOKENS
    output = parsed.requested_output or default_out
    scaled_total = state.scaled_prompt(model.name, prompt.total)
    scaled_longest = state.scaled_prompt(model.name, prompt.longest)
    per_prompt = (
        [scaled_longest]
        if prompt.prompts == 1
        else _spread(scaled_total, scaled_longest, prompt.prompts)
    )
    block = state.fleet.index(model.name).block_size
    demand = Demand(
        model=model.name,
        prompt_tokens=scaled_total,
        longest_prompt=scaled_longest,
        output_tokens=output,
        sequences=prompt.prompts * parsed.n,
        tokens=demand_tokens(per_prompt, output, parsed.n, block),
    )
    return Counted(model, parsed, prompt, output, demand)


def _spread(total: int, longest: int, prompts: int) -> list[int]:
    # Batched completion prompts: the longest as itself, the others as their average;
    # the sum never falls below the counted total.
    rest = max(0, total - longest)
    others = prompts - 1
    return [longest] + [-(-rest // others)] * others


def upstream_body(counted: Counted, inject_output: bool) -> bytes | None:
    """The body to send, or None to forward the client's bytes unchanged."""
    body = counted.parsed.body
    changed = False
    if counted.parsed.model != counted.model.served_name:
        body["model"] = counted.model.served_name
        changed = True
    if inject_output and counted.parsed.requested_output is None and counted.parsed.kind == "chat":
        # vLLM's default for chat is "the rest of the context": cap it at what was
        # reserved, or the reservation would not hold.
        body[counted.parsed.output_field] = counted.output_tokens
        changed = True
    return json.dumps(body, separators=(",", ":")).encode() if changed else None


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token (it is logged and echoed)."""
    rid = request.headers.get("x-request-id", "")
    if 0 < len(rid) <= 128 and rid.isascii() and rid.isprintable() and " " not in rid:
        return rid
    return uuid.uuid4().hex


async def handle_completion(
    request: web.Request, state: GatewayState, kind: str
) -> web.StreamResponse:
    rid = request_id(request)
    rec = AccessRecord(request_id=rid, method=request.method, path=request.path)
    start = state.clock()
    status = 500
    task = asyncio.current_task()
    if task is not None:
        state.active.add(task)
    try:
        if state.shutting_down:
            raise ShuttingDown("The gateway is shutting down; retry.", retry_after=1)
        raw = await read_limited(request, state.config.admission.max_body_bytes)
        counted = await count_request(state, raw, kind)
        rec.model = counted.model.name
        rec.prompt_tokens = counted.prompt.total
        rec.stream = counted.parsed.stream
        m = state.metrics
        m.prompt_tokens.labels(model=counted.model.name).observe(counted.prompt.total)
        m.output_budget.labels(model=counted.model.name).observe(
            counted.output_tokens * counted.demand.sequences
        )
        body = upstream_body(counted, state.config.admission.inject_default_output) or raw
        resp = await _forward(request, state, counted, body, rec, start)
        status = resp.status
        return resp
    except GatewayError as err:
        if isinstance(err, ContextLengthExceeded) and kind == "completion":
            err.param = "prompt"
        status = err.status
        rec.outcome = err.code
        if err.rejection_reason is not None:
            state.metrics.rejections.labels(reason=err.rejection_reason).inc()
        return error_response(err, rid)
    except ConnectionResetError:
        # The client went away between two writes, before aiohttp cancelled us. Nothing
        # can reach it; returning (not raising) keeps aiohttp from logging a traceback.
        status = 499
        rec.outcome = "client_disconnect"
        state.metrics.client_disconnects.inc()
        return web.Response(status=499)
    except asyncio.CancelledError:
        if _shutdown_cancel(state):
            status = 503
            rec.outcome = "cancelled_shutdown"
            return error_response(
                ShuttingDown("The gateway is shutting down; retry.", retry_after=1), rid
            )
        status = 499  # client closed the connection (nginx's convention)
        rec.outcome = "client_disconnect"
        state.metrics.client_disconnects.inc()
        raise
    finally:
        if task is not None:
            state.active.discard(task)
        rec.status = status
        rec.latency_ms = (state.clock() - start) * 1000
        state.metrics.requests.labels(
            model=rec.model, tier=rec.tier, backend=rec.backend, status=str(status)
        ).inc()
        if rec.tier != "-":
            state.metrics.duration.labels(model=rec.model, tier=rec.tier).observe(
                rec.latency_ms / 1000
            )
        if state.config.server.access_log:
            log_access(rec)


def _shutdown_cancel(state: GatewayState) -> bool:
    """True when this cancellation is the gateway's shutdown ending the request (it is
    then taken back, so the client still gets a proper answer)."""
    task = asyncio.current_task()
    if not state.shutdown_reason or task is None or task.cancelling() == 0:
        return False
    task.uncancel()
    return True


def error_response(err: GatewayError, request_id: str) -> web.Response:
    headers = {"x-request-id": request_id, **err.headers()}
    return web.Response(
        status=err.status,
        body=err.body_bytes(),
        content_type="application/json",
        headers=headers,
    )


async def _forward(
    request: web.Request,
    state: GatewayState,
    counted: Counted,
    body: bytes,
    rec: AccessRecord,
    start: float,
) -> web.StreamResponse:
    demand = counted.demand
    deadline = start + state.config.admission.queue_timeout_s
    excluded: set[str] = set()
    last_error: UpstreamError | None = None
    last_failed = ""
    while True:
        rec.attempts += 1
        waited_from = state.clock()
        reservation = await _admit_retry(state, demand, deadline, excluded, last_failed, last_error)
        _note_admitted(state, reservation, rec, waited_from)
        backend = reservation.backend
        try:
            timeouts = backend.config.timeouts
            head_timeout = timeouts.first_byte_s if counted.parsed.stream else timeouts.total_s
            resp = await upstream.open_request(
                state.http(),
                backend,
                request.path,
                body,
                {"Content-Type": "application/json", "X-Request-Id": rec.request_id},
                timeouts,
                head_timeout=head_timeout,
            )
        except UpstreamError as err:
            state.admission.release(reservation)
            _note_failure(state, backend.name, err)
            if err.retryable and rec.attempts < MAX_ATTEMPTS:
                state.metrics.upstream_retries.labels(backend=backend.name, cause=err.code).inc()
                excluded.add(backend.name)
                last_error, last_failed = err, backend.name
                continue
            raise
        except BaseException:
            state.admission.release(reservation)
            raise
        try:
            backend.consecutive_failures = 0
            if counted.parsed.stream and resp.status == 200:
                return await _relay_stream(request, state, counted, resp, reservation, rec, start)
            return await _relay_body(state, counted, resp, reservation, rec, start)
        finally:
            resp.close()
            state.admission.release(reservation)


async def _admit_retry(
    state: GatewayState,
    demand: Demand,
    deadline: float,
    excluded: set[str],
    last_failed: str,
    last_error: UpstreamError | None,
) -> Reservation:
    """Admit, avoiding backends that already failed this request. When every fitting
    backend has failed once, try again anywhere but the last one; when nothing is left,
    the client gets the upstream failure rather than a misleading 503."""
    if not excluded:
        return await state.admission.admit(demand, max(0.0, deadline - state.clock()))
    try:
        return await state.admission.admit(
            replace(demand, exclude=frozenset(excluded)), max(0.0, deadline - state.clock())
        )
    except NoHealthyBackend:
        pass
    assert last_error is not None
    try:
        return await state.admission.admit(
            replace(demand, exclude=frozenset({last_failed})), max(0.0, deadline - state.clock())
        )
    except NoHealthyBackend:
        raise last_error from None


def _note_admitted(
    state: GatewayState, r: Reservation, rec: AccessRecord, waited_from: float
) -> None:
    rec.backend = r.backend.name
    rec.tier = r.backend.tier
    rec.reserved_tokens = r.tokens
    rec.queued_ms += r.queued_s * 1000
    state.metrics.decisions.labels(tier=r.backend.tier, reason=r.reason).inc()
    if r.queued_s > 0:
        state.metrics.queue_wait.observe(r.queued_s)


def _note_failure(state: GatewayState, backend_name: str, err: UpstreamError) -> None:
    cause = "timeout" if isinstance(err, UpstreamTimeout) else err.code
    state.metrics.upstream_failures.labels(backend=backend_name, cause=cause).inc()
    b = state.fleet.get(backend_name)
    if b is None:
        return
    b.note_rejection(state.clock())
    b.last_error = err.message
    b.consecutive_failures += 1
    if err.retryable and b.consecutive_failures >= state.config.health.eject_after_failures:
        # Passive ejection: the health checker's next successful probe brings it back.
        b.healthy = False


def _gateway_headers(counted: Counted, r: Reservation, rec: AccessRecord) -> dict[str, str]:
    return {
        "x-request-id": rec.request_id,
        "x-gateway-backend": r.backend.name,
        "x-gateway-tier": r.backend.tier,
        "x-gateway-prompt-tokens": str(counted.prompt.total),
    }


def _reconcile(state: GatewayState, counted: Counted, data: bytes) -> None:
    usage = upstream.find_usage(data)
    if usage is not None and counted.prompt.prompts == 1:
        # vLLM reports the prompt once per request, whatever n is.
        state.observe_usage(counted.model.name, counted.prompt.total, usage.prompt_tokens)


async def _relay_body(
    state: GatewayState,
    counted: Counted,
    resp: aiohttp.ClientResponse,
    r: Reservation,
    rec: AccessRecord,
    start: float,
) -> web.Response:
    remaining = start + r.backend.config.timeouts.total_s - state.clock()
    try:
        async with asyncio.timeout(max(0.1, remaining)):
            data = await upstream.read_body(resp, _MAX_RESPONSE_BYTES)
    except TimeoutError as exc:
        raise UpstreamTimeout(
            f"Backend {r.backend.name} did not finish within the total timeout.", retryable=False
        ) from exc
    if resp.status == 200:
        _reconcile(state, counted, data)
        rec.outcome = "ok"
    else:
        rec.outcome = f"backend_{resp.status}"
        r.backend.note_rejection(state.clock())
    ttft = state.clock() - start
    rec.ttft_ms = ttft * 1000
    state.metrics.ttft.labels(model=counted.model.name, tier=r.backend.tier).observe(ttft)
    headers = upstream.response_headers(resp)
    headers.update(_gateway_headers(counted, r, rec))
    return web.Response(status=resp.status, body=data, headers=headers)


def _error_event(message: str, code: str) -> bytes:
    err = UpstreamError(message, code=code)
    return b"data: " + err.body_bytes() + b"\n\ndata: [DONE]\n\n"


async def _relay_stream(
    request: web.Request,
    state: GatewayState,
    counted: Counted,
    resp: aiohttp.ClientResponse,
    r: Reservation,
    rec: AccessRecord,
    start: float,
) -> web.StreamResponse:
    out = web.StreamResponse(status=200)
    out.headers.update(upstream.response_headers(resp))
    out.headers.update(_gateway_headers(counted, r, rec))
    out.headers.setdefault("Content-Type", "text/event-stream")
    out.headers["Cache-Control"] = "no-cache"
    out.headers["X-Accel-Buffering"] = "no"
    await out.prepare(request)
    timeouts = r.backend.config.timeouts
    done = False
    last = b""
    first = True
    try:
        async with asyncio.timeout_at(_loop_deadline(start + timeouts.total_s, state)):
            async for events in upstream.sse_events(resp, timeouts.idle_s):
                if first:
                    first = False
                    ttft = state.clock() - start
                    rec.ttft_ms = ttft * 1000
                    state.metrics.ttft.labels(
                        model=counted.model.name, tier=r.backend.tier
                    ).observe(ttft)
                await out.write(events)
                last = events
                if events.endswith(b"data: [DONE]\n\n"):
                    done = True
                    break
    except upstream.MidStreamError as err:
        state.metrics.upstream_failures.labels(backend=r.backend.name, cause="mid_stream").inc()
        r.backend.note_rejection(state.clock())
        rec.outcome = f"mid_stream_{err.cause}"
        await out.write(
            _error_event(
                f"Backend {r.backend.name} failed mid-stream: {err}", "upstream_" + err.cause
            )
        )
        done = True
    except asyncio.CancelledError:
        if not _shutdown_cancel(state):
            raise
        # Cancelled by the gateway's own shutdown: end the stream properly, with a reason.
        rec.outcome = "cancelled_shutdown"
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(_error_event("The gateway is shutting down; retry.", "shutting_down"))
            await out.write_eof()
        return out
    except TimeoutError:
        rec.outcome = "mid_stream_total_timeout"
        state.metrics.upstream_failures.labels(backend=r.backend.name, cause="timeout").inc()
        await out.write(
            _error_event("The response exceeded the gateway's total timeout.", "upstream_timeout")
        )
        done = True
    if not done:
        rec.outcome = "mid_stream_truncated"
        await out.write(
            _error_event(f"Backend {r.backend.name} ended the stream early.", "upstream_reset")
        )
    elif rec.outcome == "-":
        rec.outcome = "ok"
        if b'"usage"' in last:
            _reconcile(state, counted, last)
    await out.write_eof()
    return out


def _loop_deadline(deadline: float, state: GatewayState) -> float:
    # asyncio deadlines are in loop time; ours are in the injected clock's time.
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - state.clock())
