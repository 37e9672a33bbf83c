"""Relay, the third stage: a node's answer to the client, a whole body or a stream of SSE
events.

Both run while the request's reservation is held (the caller's ``async with``). Once a
stream has sent its first byte nothing is retried: a failure ends it with an error event
and ``data: [DONE]`` so SDK clients see a clean end. The relay moves bytes and records
what it saw on the exchange (:class:`~kvgateway.server.exchange.Answer`); a stream's
live count goes to admission as its progress. What an answer teaches is
:class:`~kvgateway.server.exchange.Settle`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable

from aiohttp import web

from kvgateway.config.model import HealthConfig
from kvgateway.core.backends import Backend
from kvgateway.core.reservation import Reservation
from kvgateway.errors import UpstreamTimeout
from kvgateway.plan.stream_usage import LiveRequest, UsageTap, live_request
from kvgateway.server.exchange import Answer, Exchange, Failure, Outcome, error_event
from kvgateway.upstream.client import USAGE_MARKS, MidStreamError, UpstreamResponse, find_usage
from kvgateway.upstream.error_body import is_error_object, is_json_object, openai_error_body
from kvgateway.upstream.feedback import request_failed
from kvgateway.upstream.feedback import serving as node_serving

log = logging.getLogger("kvgateway.server.relay")

MAX_RESPONSE_BYTES = 256 * 1024 * 1024


def gateway_headers(ex: Exchange, r: Reservation) -> dict[str, str]:
    assert ex.plan is not None
    headers = {
        "x-request-id": ex.request_id,
        "x-gateway-backend": r.backend.name,
        "x-gateway-tier": r.backend.tier,
        "x-gateway-prompt-tokens": str(ex.plan.prompt.total),
        **ex.limit_headers,
    }
    sent = r.output_cut if r.output_cut is not None else ex.plan.injected_output
    if sent is not None:
        # The client left the output budget open, or asked for more than the node's
        # context leaves: the node was sent this one.
        headers["x-gateway-max-tokens"] = str(sent)
    return headers


def error_message(data: bytes) -> str:
    """The ``message`` of an OpenAI-style error body ('' if it is not one)."""
    try:
        body = json.loads(data)
    except ValueError:
        return ""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        body = err
    message = body.get("message") if isinstance(body, dict) else None
    return message if isinstance(message, str) else ""


def is_event_stream(resp: UpstreamResponse) -> bool:
    """A streamed answer (vLLM's text/event-stream); anything else is answered whole."""
    return resp.header("content-type").lower().startswith("text/event-stream")


_ERROR_EVENT = re.compile(rb'(?:^|\n)data: *\{"error" *: *\{.*?"message" *: *"((?:[^"\\]|\\.)*)"')


def inband_error(events: bytes) -> str | None:
    """The message of an error event in ``events`` (vLLM's in-band error: an exception
    in its stream generator, e.g. its engine died, sent as ``data: {"error": ...}``
    before ``data: [DONE]``), or None."""
    if b'{"error"' not in events:
        return None
    m = _ERROR_EVENT.search(events)
    if m is None:
        return None
    return m.group(1).decode("utf-8", "replace")[:200]


# Chat and completions streams end with [DONE]; Responses streams with a final event,
# which carries the whole response (as long as the answer, and its tools echoed).
_RESPONSES_END = (
    b"event: response.completed\n",
    b"event: response.failed\n",
    b"event: response.incomplete\n",
)


def _ends_stream(events: bytes) -> bool:
    if events.endswith(b"data: [DONE]\n\n"):
        return True
    # The run's last event: from the blank line before it (if any) to its end.
    cut = events.rfind(b"\n\n", 0, len(events) - 2)
    return events.startswith(_RESPONSES_END, cut + 2 if cut >= 0 else 0)


Clock = Callable[[], float]


class Relay:
    """Owns the Relay stage: built with the clock and the health settings (read per
    request: a reload may change them) that judge a node failing mid-stream."""

    def __init__(self, clock: Clock, health: Callable[[], HealthConfig]) -> None:
        self._clock = clock
        self._health = health

    async def read_body(self, ex: Exchange, resp: UpstreamResponse, backend: Backend) -> bytes:
        """A non-streamed answer, whole, within the backend's total timeout."""
        remaining = ex.started + backend.config.timeouts.total_s - self._clock()
        try:
            async with asyncio.timeout(max(0.1, remaining)):
                return await resp.read(MAX_RESPONSE_BYTES)
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"Backend {backend.name} did not finish within the total timeout.",
                retryable=False,
            ) from exc

    def answer(
        self, ex: Exchange, resp: UpstreamResponse, r: Reservation, data: bytes
    ) -> web.Response:
        """The response for a whole answer ``data`` (an OpenAI error for one a client
        cannot read)."""
        now = self._clock()
        if resp.status == 200 and not is_json_object(data):
            # Not an answer an OpenAI client can read (plain text, HTML, cut-off JSON): the
            # SDK would hand the caller a bare string. A bad gateway, and nothing generated.
            ex.record.outcome = "backend_invalid_answer"
            r.backend.note_rejection(now)
            ex.first_byte(now)
            headers = gateway_headers(ex, r)
            body = openai_error_body(502, data, r.backend.name, code="upstream_invalid_answer")
            return web.Response(
                status=502, body=body, content_type="application/json", headers=headers
            )
        if resp.status == 200:
            usage = find_usage(data) if b'"usage"' in data else None
            ex.answer = Answer(r.backend.name, usage, cap=r.output_cut)
            ex.record.outcome = Outcome.OK
        else:
            ex.record.outcome = f"backend_{resp.status}"
            r.backend.note_rejection(now)
        ex.first_byte(now)
        relayed = resp.relay_headers()
        relayed.update(gateway_headers(ex, r))
        if resp.status >= 400 and not is_error_object(data):
            data = openai_error_body(resp.status, data, r.backend.name)
            relayed["Content-Type"] = "application/json"
        return web.Response(status=resp.status, body=data, headers=relayed)

    async def stream(
        self, ex: Exchange, resp: UpstreamResponse, r: Reservation
    ) -> web.StreamResponse:
        """Relay a stream event by event, its count told to admission as it comes."""
        out = web.StreamResponse(status=200)
        out.headers.update(resp.relay_headers())
        out.headers.update(gateway_headers(ex, r))
        out.headers.setdefault("Content-Type", "text/event-stream")
        out.headers["Cache-Control"] = "no-cache"
        out.headers["X-Accel-Buffering"] = "no"
        await out.prepare(ex.request)
        ex.response = out
        plan = ex.plan
        assert plan is not None
        live = live_request(
            r,
            plan.demand.sequences,
            max_output=r.output_cut or plan.output_tokens,
            tokens_per_event=1 + r.backend.config.num_speculative_tokens,
        )
        ask = plan.usage_ask
        tap = UsageTap(ask, plan.demand.sequences) if ask is not None else None
        await self._events(ex, resp, r, out, live, tap)
        if ex.record.outcome == Outcome.OK:
            resp.ended()  # its body's own end may still be on its way: the pool waits for it
        await out.write_eof()
        return out

    async def _events(
        self,
        ex: Exchange,
        resp: UpstreamResponse,
        r: Reservation,
        out: web.StreamResponse,
        live: LiveRequest,
        tap: UsageTap | None,
    ) -> None:
        timeouts = r.backend.config.timeouts
        rec = ex.record
        plan = ex.plan
        assert plan is not None
        done = False

        def cut(message: str, code: str) -> bytes:  # what the tap holds goes first
            return (tap.flush() if tap is not None else b"") + error_event(message, code)

        # The events holding the usage chunk: vLLM yields it and [DONE] apart, so it is often
        # not in the last read.
        usage = b""
        prefilled = False
        try:
            async with asyncio.timeout_at(self._loop_deadline(ex.started + timeouts.total_s)):
                # The node sends a stream's head at once and its first event after the prefill:
                # that wait is bounded by first_byte_s (from when the request went to the node,
                # not from a wait in the queue), not idle_s.
                first_s = max(0.1, ex.sent + timeouts.first_byte_s - self._clock())

                def serving() -> bool:  # the node's other streams progress: it works its queue
                    return node_serving(r.backend, self._clock(), self._health())

                async for got in resp.events(timeouts.idle_s, first_s=first_s, serving=serving):
                    ex.first_byte(self._clock())
                    events = got
                    if tap is not None:
                        events = tap.feed(got)
                        prompt = tap.prompt_tokens if plan.prompt.prompts == 1 else None
                        live.feed(events, tap.completion_tokens, prompt)
                        usage = tap.final
                    else:
                        live.feed(events)
                        if USAGE_MARKS[0] in events or USAGE_MARKS[1] in events:
                            usage = events
                    if not prefilled and live.generated > 0:
                        # A token came: the prompt's blocks are in the node's cache now (not at
                        # the first event: a Responses stream announces itself before prefill).
                        prefilled = True
                        r.prefill_done()
                    if events:
                        await out.write(events)
                    ex.streamed_tokens = live.generated  # relayed (a failed write was not)
                    failed = inband_error(events)
                    if failed is not None and rec.outcome == Outcome.PENDING:
                        # The node ended the stream with an error event (its engine failed):
                        # relayed as it came, and the node's failure.
                        rec.outcome = Outcome.MID_STREAM_NODE_ERROR
                        self._stream_failed(ex, r, f"error event: {failed}")
                    if _ends_stream(events):
                        done = True
                        break
        except MidStreamError as err:
            self._stream_failed(ex, r, str(err))
            rec.outcome = f"mid_stream_{err.cause}"
            await out.write(
                cut(f"Backend {r.backend.name} failed mid-stream: {err}", "upstream_" + err.cause)
            )
            done = True
        except TimeoutError:
            rec.outcome = Outcome.MID_STREAM_TOTAL_TIMEOUT
            ex.failures.append(Failure(r.backend.name, "timeout", retried=False))
            await out.write(
                cut("The response exceeded the gateway's total timeout.", "upstream_timeout")
            )
            done = True
        if not done:
            rec.outcome = Outcome.MID_STREAM_TRUNCATED
            self._stream_failed(ex, r, "the stream ended before its last event")
            await out.write(
                cut(f"Backend {r.backend.name} ended the stream early.", "upstream_reset")
            )
        elif rec.outcome == Outcome.PENDING:
            rec.outcome = Outcome.OK
            # The live count is the output only if the node reported it or sent one token per
            # choice: a speculative node's chunk count is a bound, and teaches nothing.
            ex.answer = Answer(
                r.backend.name,
                find_usage(usage) if b'"usage"' in usage else None,
                live.generated if live.exact else None,
                r.output_cut,
            )

    def _stream_failed(self, ex: Exchange, r: Reservation, error: str) -> None:
        ex.failures.append(Failure(r.backend.name, "mid_stream", retried=False))
        if request_failed(r.backend, error, self._clock(), self._health()):
            log.warning("backend %s ejected after failed streams: %s", r.backend.name, error)

    def _loop_deadline(self, deadline: float) -> float:
        # asyncio deadlines are in loop time; ours are in the injected clock's time.
        loop = asyncio.get_running_loop()
        return loop.time() + (deadline - self._clock())
