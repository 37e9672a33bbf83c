"""One request's way through the proxy, as one object (mitmproxy's ``Flow``), and
Settle, the last stage: what it teaches and what it costs once it has ended.

An :class:`Exchange` is created when a request arrives and carries everything the
handlers learn about it: the plan, each admission, each upstream failure, the response
being relayed, what the relay saw of the answer and the final access record. When it
ends, :class:`Settle` (synchronous, fed only by the exchange: the relay records what it
saw in :class:`Answer` and trains nothing) learns from its usage (the output the tenant
is charged, the nodes' prompt count for calibration, one sequence's length for the
output model), settles the tenant's charge, and computes the metrics and the access
line once, from that final state, so the control flow of the proxy never interleaves
bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from aiohttp import web

from kvgateway.core.output_model import OutputModel
from kvgateway.core.quota import Charge, QuotaLedger, limit_headers
from kvgateway.core.reservation import Reservation
from kvgateway.core.tenancy import Tenancy
from kvgateway.errors import ShuttingDown, UpstreamError
from kvgateway.plan.budget import output_is_set
from kvgateway.server.telemetry import AccessRecord, GatewayMetrics, log_access
from kvgateway.tokens.prompt_estimate import PromptCalibration
from kvgateway.upstream.client import Usage

if TYPE_CHECKING:
    from kvgateway.plan.planner import Plan


class Outcome(StrEnum):
    """How a request ended, beside its status (the access log's ``outcome``).

    Errors the gateway answers itself use their OpenAI ``code`` instead; answers relayed
    from a node with an error status are ``backend_<status>``."""

    PENDING = "-"
    OK = "ok"
    CLIENT_DISCONNECT = "client_disconnect"
    CANCELLED_SHUTDOWN = "cancelled_shutdown"
    MID_STREAM_TIMEOUT = "mid_stream_timeout"
    MID_STREAM_RESET = "mid_stream_reset"
    MID_STREAM_TRUNCATED = "mid_stream_truncated"
    MID_STREAM_NODE_ERROR = "mid_stream_node_error"
    MID_STREAM_TOTAL_TIMEOUT = "mid_stream_total_timeout"
    # An SSE event past the gateway's cap (upstream.client.MAX_EVENT_BYTES).
    MID_STREAM_TOO_LARGE = "mid_stream_too_large"


# The gateway stopped reading a stream the node was still writing: the node frees its
# blocks once the abort its closed connection causes lands.
ABANDONED = frozenset(
    {
        Outcome.MID_STREAM_TIMEOUT,
        Outcome.MID_STREAM_TOTAL_TIMEOUT,
        Outcome.MID_STREAM_TOO_LARGE,
        Outcome.CANCELLED_SHUTDOWN,
    }
)

# The status recorded for a request whose client closed the connection (nginx's).
CLIENT_GONE = 499


@dataclass(frozen=True, slots=True)
class Failure:
    backend: str
    cause: str
    retried: bool


@dataclass(frozen=True, slots=True)
class Answer:
    """What the relay saw of an answer its node finished (status 200, ended cleanly)."""

    backend: str
    # The node's usage report, if it sent one.
    usage: Usage | None
    # A stream's own count of its output, when it is the output and not a bound of it.
    streamed: int | None = None
    # The max_tokens its node's context cut the request to (None: as planned).
    cap: int | None = None


@dataclass(slots=True, eq=False)
class Exchange:
    request: web.Request
    record: AccessRecord
    started: float
    # How long a request refused by admission (a 429) had waited in the queue.
    refused_after_s: float = 0.0
    # When the current attempt's request went to its node (the first event's wait of a
    # stream counts from here, not from a wait in the queue).
    sent: float = 0.0
    plan: Plan | None = None
    # Admitted again with the node's own count after it refused the prompt as too long.
    recounted: bool = False
    # Every admission of this request (one per attempt), in order.
    admissions: list[tuple[str, str, float]] = field(default_factory=list)  # tier, reason, queued_s
    failures: list[Failure] = field(default_factory=list)
    rejection: str | None = None
    ttft_s: float | None = None
    # The response being written to the client (a stream, or a whole answer), if any.
    response: web.StreamResponse | None = None
    # The request's own deadline: shutdown moves it forward to end the request properly.
    deadline: asyncio.Timeout | None = None
    shutdown: bool = False
    # The tenant's quota charge, its x-ratelimit-* headers, and the output it is settled
    # with (from the node's usage when it reports it).
    charge: Charge | None = None
    limit_headers: dict[str, str] = field(default_factory=dict)
    output_tokens: int | None = None
    # Output tokens relayed so far in a stream (the live count), for settling a stream
    # the client left before its usage.
    streamed_tokens: int | None = None
    limit_hit: str | None = None
    # Who sent it (a hash of the API key; "*" without one): output lengths learned per client.
    client: str = "*"
    # KV tokens credited for shared prompt blocks.
    credited_tokens: int = 0
    # The finished answer, as the relay saw it (None: no answer finished).
    answer: Answer | None = None

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def admitted(self, r: Reservation) -> None:
        rec = self.record
        rec.backend = r.backend.name
        rec.tier = r.backend.tier
        rec.route = r.reason
        rec.reserved_tokens = r.tokens
        if r.holding is not None:
            self.credited_tokens += r.holding.credited_tokens
        if r.flight is not None:
            self.credited_tokens += r.flight.credited * r.backend.limits.block_size
        rec.queued_ms += r.queued_s * 1000
        self.admissions.append((r.backend.tier, r.reason, r.queued_s))

    def first_byte(self, now: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = now - self.started
            self.record.ttft_ms = self.ttft_s * 1000

    def end_now(self) -> None:
        """Shutdown: end this request at once (its handler answers with a reason)."""
        self.shutdown = True
        if self.deadline is not None:
            # A deadline already expiring or left behind has nothing more to end.
            with contextlib.suppress(RuntimeError):
                self.deadline.reschedule(asyncio.get_running_loop().time())


def error_event(message: str, code: str) -> bytes:
    """The SSE events that end a stream with an OpenAI error: the error, then [DONE]."""
    err = UpstreamError(message, code=code)
    return b"data: " + err.body_bytes() + b"\n\ndata: [DONE]\n\n"


async def until_shutdown(
    ex: Exchange,
    shutting_down: bool,
    serve: Callable[[Exchange], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """``serve(ex)``, refused once shutdown has begun and ended when shutdown moves the
    exchange's deadline: a 503, the error event that ends a stream, or a whole answer
    already being written, left to finish."""
    if shutting_down:
        raise ShuttingDown("The gateway is shutting down; retry.", retry_after=1)
    try:
        async with asyncio.timeout(None) as deadline:
            ex.deadline = deadline
            if ex.shutdown:  # shutdown began before the deadline existed
                ex.end_now()
            return await serve(ex)
    except TimeoutError:
        if not ex.shutdown:
            raise
    # The gateway's shutdown ended this request: say so properly.
    out = ex.response
    if out is None:
        ex.record.outcome = Outcome.CANCELLED_SHUTDOWN
        raise ShuttingDown("The gateway is shutting down; retry.", retry_after=1)
    if isinstance(out, web.Response):
        return out  # a whole answer, prepared: aiohttp finishes writing it as it is
    ex.record.outcome = Outcome.CANCELLED_SHUTDOWN
    with contextlib.suppress(ConnectionError, RuntimeError):
        await out.write(error_event("The gateway is shutting down; retry.", "shutting_down"))
        await out.write_eof()
    return out


# Shorter than this, a refusal was made at once (a full queue), not after a wait.
_QUEUED_S = 0.001


def failure_cause(code: str) -> str:
    """The metrics' ``cause`` for a failure's code (the access log keeps the code):
    connect, timeout, reset, status_5xx, mid_stream, invalid_answer."""
    cause = code.removeprefix("upstream_")
    if len(cause) == 3 and cause.startswith("5") and cause.isdigit():
        return "status_5xx"
    return cause


def finish(ex: Exchange, m: GatewayMetrics, now: float, access_log: bool) -> None:
    """The exchange's metrics and access line, from its final state."""
    rec = ex.record
    rec.latency_ms = (now - ex.started) * 1000
    if ex.plan is not None:
        model = ex.plan.model.name
        m.of(m.prompt_tokens, model).observe(ex.plan.prompt.total)
        m.of(m.output_budget, model).observe(ex.plan.output_tokens * ex.plan.demand.sequences)
    if ex.plan is not None and ex.credited_tokens:
        m.of(m.prefix_credited, ex.plan.model.name).inc(ex.credited_tokens)
    for tier, reason, queued_s in ex.admissions:
        m.of(m.decisions, tier, reason).inc()
        if queued_s > 0:
            m.queue_wait.observe(queued_s)
    if ex.refused_after_s > _QUEUED_S:
        m.queue_wait.observe(ex.refused_after_s)  # a wait that ended in a 429 is one too
    for f in ex.failures:
        cause = failure_cause(f.cause)
        m.of(m.upstream_failures, f.backend, cause).inc()
        if f.retried:
            m.of(m.upstream_retries, f.backend, cause).inc()
    if ex.rejection is not None:
        m.of(m.rejections, ex.rejection).inc()
    if rec.tenant != "-":
        _tenant_metrics(ex, m)
    if rec.outcome == Outcome.CLIENT_DISCONNECT:
        m.client_disconnects.inc()
    if ex.ttft_s is not None and rec.tier != "-":
        m.of(m.ttft, rec.model, rec.tier).observe(ex.ttft_s)
    m.of(m.requests, rec.model, rec.tier, rec.backend, str(rec.status)).inc()
    if rec.tier != "-":
        m.of(m.duration, rec.model, rec.tier).observe(rec.latency_ms / 1000)
    if access_log:
        log_access(rec)


def _tenant_metrics(ex: Exchange, m: GatewayMetrics) -> None:
    rec = ex.record
    m.of(m.tenant_requests, rec.tenant, str(rec.status)).inc()
    if ex.charge is not None and ex.plan is not None:
        m.of(m.tenant_tokens, rec.tenant, "prompt").inc(ex.plan.prompt.total)
        m.of(m.tenant_tokens, rec.tenant, "output").inc(ex.output_tokens or 0)
    if ex.rejection == "rate_limited" and ex.limit_hit:
        m.of(m.tenant_rate_limited, rec.tenant, ex.limit_hit).inc()
    if ex.ttft_s is not None:
        m.of(m.tenant_ttft, rec.tenant).observe(ex.ttft_s)


# A stream the node failed, stalled or ended early, or the gateway's own shutdown ended:
# the gateway wrote the error event.
_CUT_SHORT = frozenset(
    {
        Outcome.CANCELLED_SHUTDOWN,
        Outcome.MID_STREAM_TIMEOUT,
        Outcome.MID_STREAM_RESET,
        Outcome.MID_STREAM_TRUNCATED,
        Outcome.MID_STREAM_NODE_ERROR,
        Outcome.MID_STREAM_TOTAL_TIMEOUT,
        Outcome.MID_STREAM_TOO_LARGE,
    }
)


def settle_charge(ex: Exchange, ledger: QuotaLedger, now: float) -> None:
    """Replace the reserved output with what was generated: the usage when the node
    reported it; what a stream had relayed when its client left (499), its node failed or
    cut it, or the gateway's shutdown ended it before the usage (capped at the
    reservation: a failure not the tenant's does not cost it its whole max_tokens); nothing when no answer was relayed or the node
    refused; else the reservation (a stream without usage is charged in full). A request
    never admitted costs nothing."""
    c = ex.charge
    if c is None:
        return
    status = ex.record.status
    if ex.output_tokens is not None:
        output = ex.output_tokens
        if ex.plan is not None:  # a node cannot generate past max_tokens x n
            output = min(output, ex.plan.output_tokens * ex.plan.demand.sequences)
    elif ex.ttft_s is None:
        output = 0
    elif ex.streamed_tokens is not None and (
        status == CLIENT_GONE or ex.record.outcome in _CUT_SHORT
    ):
        output = min(ex.streamed_tokens, c.reserved_output)
    elif status >= 400:
        output = 0
    else:
        output = c.reserved_output
    ex.output_tokens = output
    ledger.settle(c, output, now, served=bool(ex.admissions))


class Settle:
    """Owns the Settle stage. ``access_log`` is read per request (a reload may turn it)."""

    def __init__(
        self,
        calibration: PromptCalibration,
        outputs: OutputModel,
        quotas: QuotaLedger,
        tenancy: Tenancy,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        access_log: Callable[[], bool],
        cuts_learned: Callable[[], None] = lambda: None,
    ) -> None:
        self._calibration = calibration
        self._outputs = outputs
        self._quotas = quotas
        self._tenancy = tenancy
        self._metrics = metrics
        self._clock = clock
        self._access_log = access_log
        # Told when a group's answers first allow a node's context to cut its requests:
        # requests waiting for such a cut may be served now.
        self._cuts_learned = cuts_learned

    def learn(self, ex: Exchange) -> None:
        """What a finished answer (``ex.answer``) says: the output it generated (from
        ``usage``, else a stream's own count), the nodes' count of a stand-in-counted
        prompt, and one sequence's output length."""
        plan, answer = ex.plan, ex.answer
        if plan is None or answer is None:
            return
        usage = answer.usage
        output = usage.completion_tokens if usage is not None else None
        if output is None:
            output = answer.streamed
        if output is not None:
            ex.output_tokens = output
        # vLLM reports the prompt once per request, whatever n is. Learned on the
        # stand-in's own count (what calibration scales); exact counts need no correction.
        prompt = plan.prompt
        if (
            usage is not None
            and prompt.prompts == 1
            and not prompt.exact
            and not prompt.truncated
            and not prompt.uncalibrated
        ):
            self._calibration.observe(
                answer.backend, plan.model.name, prompt.standin, usage.prompt_tokens
            )
        # One sequence's length per request: the mean of n sequences is narrower than the
        # lengths it averages (and hides one cut at its cap), so n > 1 teaches nothing; nor
        # does a request that fixes its own length (ignore_eos, min_tokens).
        if output is None or plan.parsed.echo_only or plan.demand.sequences != 1:
            return
        if output_is_set(plan.parsed.body):
            return
        if self._outputs.observe(
            plan.model.name, ex.client, plan.output_tokens, output, cap=answer.cap
        ):
            self._cuts_learned()

    def refused(self, ex: Exchange) -> dict[str, str]:
        """Settle a refused request's charge now (one never admitted is refunded) and
        give the tenant's ``x-ratelimit-*`` headers: what it has left after this request,
        not what its charge had taken ({} for a request never charged)."""
        if ex.charge is None:
            return {}
        now = self._clock()
        settle_charge(ex, self._quotas, now)
        return limit_headers(self._quotas, self._tenancy, ex.charge.tenant, now)

    def close(self, ex: Exchange) -> None:
        """The request has ended: settle its charge, count it, log it."""
        now = self._clock()
        settle_charge(ex, self._quotas, now)
        finish(ex, self._metrics, now, self._access_log())
