"""Tenants at the edge: which tenant a key belongs to, its per-minute quotas (charged at
admission, settled with the usage at the end), ``x-ratelimit-*`` headers, per-tenant
metrics and the ``/admin/backends`` view ``gateway top`` reads.

Quotas live in a :class:`~kvgateway.core.quota.QuotaLedger`: :class:`LocalQuotaLedger` (this
process only) unless a shared one is passed to ``create_app``.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgateway.config.model import AuthConfig
from kvgateway.core.quota import OUTPUT, PROMPT, REQUESTS, Charge, QuotaLedger, RateLimitHit
from kvgateway.core.tenancy import Tenancy
from kvgateway.errors import RateLimited
from kvgateway.server.exchange import CLIENT_GONE, Exchange, Outcome
from kvgateway.server.metrics import TENANT_GRANTED, TENANT_HELD, TENANT_KV, TENANT_MINUTE

TENANT = web.RequestKey("tenant", str)

# OpenAI's header names: `tokens` is the prompt (input) token limit; output tokens have
# their own limit here, reported under `output-tokens`.
_HEADER_NAMES = {REQUESTS: "requests", PROMPT: "tokens", OUTPUT: "output-tokens"}


def tenant_for_key(auth: AuthConfig, header: str) -> str | None:
    """The tenant whose key is in ``Authorization: Bearer``; the default tenant when the
    gateway is open."""
    if auth.open:
        return auth.default_tenant.name
    return key_owner(header, ((t.name, k) for t in auth.tenants for k in t.keys))


def key_owner(header: str, keys: Iterable[tuple[str, str]]) -> str | None:
    """Whose key (``(owner, key)`` pairs) the ``Authorization: Bearer`` header holds. An
    empty token never matches; every key is compared, in constant time, so timing tells
    nothing; header bytes that are not UTF-8 (surrogate escapes) are compared as bytes."""
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    if not token:
        return None
    given = token.encode("utf-8", "surrogateescape")
    found: str | None = None
    for owner, key in keys:
        if hmac.compare_digest(given, key.encode()):
            found = owner
    return found


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def limit_headers(ledger: QuotaLedger, tenancy: Tenancy, tenant: str, now: float) -> dict[str, str]:
    headers = {}
    for name, status in ledger.status(tenant, tenancy.tenant(tenant).limits, now).items():
        word = _HEADER_NAMES[name]
        headers[f"x-ratelimit-limit-{word}"] = str(status.limit)
        headers[f"x-ratelimit-remaining-{word}"] = str(status.remaining)
        headers[f"x-ratelimit-reset-{word}"] = reset_text(status.reset_s)
    return headers


async def charge(
    ledger: QuotaLedger, tenancy: Tenancy, tenant: str, prompt: int, output: int, now: float
) -> tuple[Charge, dict[str, str]]:
    """Charge one request against the tenant's limits; :class:`RateLimited` names the
    limit that refused it and when it frees."""
    outcome = await ledger.try_charge(tenant, tenancy.tenant(tenant).limits, prompt, output, now)
    headers = limit_headers(ledger, tenancy, tenant, now)
    if isinstance(outcome, RateLimitHit):
        raise _refusal(tenant, outcome, headers)
    return outcome, headers


def _refusal(tenant: str, hit: RateLimitHit, headers: dict[str, str]) -> RateLimited:
    unit = "requests" if hit.limit == REQUESTS else "tokens"
    if math.isinf(hit.retry_after_s):
        return RateLimited(
            f"Tenant '{tenant}': this request needs {hit.asked} {unit} but the "
            f"{hit.limit} limit is {hit.value}; it can never fit. Reduce the request.",
            param=hit.limit,
            limit_headers=headers,
        )
    return RateLimited(
        f"Tenant '{tenant}' reached its {hit.limit} limit ({hit.value}; {hit.used} used in "
        f"the last minute, this request needs {hit.asked}). Retry in "
        f"{reset_text(hit.retry_after_s)}.",
        param=hit.limit,
        limit_headers=headers,
        retry_after=max(1.0, math.ceil(hit.retry_after_s)),
    )


class TenantCollector(Collector):
    """KV tokens and requests each tenant holds now, and its usage over the last minute,
    read when Prometheus scrapes (labels: tenant names from the config only)."""

    def __init__(
        self,
        tenancy: Tenancy,
        ledger: QuotaLedger,
        clock: Callable[[], float],
        *,
        per_worker: bool = False,
    ) -> None:
        self._tenancy = tenancy
        self._ledger = ledger
        self._clock = clock
        # With `serve --workers`: every tenant gauge comes from WorkerGauges (summed
        # over the workers); nothing is read here.
        self._per_worker = per_worker

    def collect(self) -> Iterable[Metric]:
        if self._per_worker:
            return
        kv = GaugeMetricFamily(*TENANT_KV, labels=["tenant"])
        held = GaugeMetricFamily(*TENANT_HELD, labels=["tenant"])
        name, doc = TENANT_MINUTE
        minute = GaugeMetricFamily(name, doc, labels=["tenant", "limit"])
        granted = CounterMetricFamily(*TENANT_GRANTED, labels=["tenant"])
        now = self._clock()
        for t in self._tenancy.auth.tenants:
            kv.add_metric([t.name], self._tenancy.tokens[t.name])
            granted.add_metric([t.name], self._tenancy.granted_tokens[t.name])
            held.add_metric([t.name], self._tenancy.requests[t.name])
            for name, used in self._ledger.usage(t.name, now).items():
                minute.add_metric([t.name, name], used)
        yield from (kv, held, minute, granted)


def tenant_holdings(
    t: Tenancy, ledger: QuotaLedger, now: float
) -> list[tuple[str, int, int, int, dict[str, int]]]:
    """Per tenant: name, KV tokens and requests held now, tokens granted so far, and
    its use of each per-minute limit over the last minute."""
    return [
        (
            c.name,
            t.tokens[c.name],
            t.requests[c.name],
            t.granted_tokens[c.name],
            ledger.usage(c.name, now),
        )
        for c in t.auth.tenants
    ]


def tenants_view(tenancy: Tenancy, ledger: QuotaLedger, now: float) -> list[dict[str, Any]]:
    """Per tenant: class, weight, what it holds and its last minute (``gateway top``)."""
    auth = tenancy.auth
    out = []
    for t in auth.tenants:
        usage = ledger.usage(t.name, now)
        out.append(
            {
                "name": t.name,
                "class": auth.class_of(t),
                "weight": t.weight,
                "kv_tokens": tenancy.tokens[t.name],
                "in_flight": tenancy.requests[t.name],
                "requests_last_minute": usage[REQUESTS],
                "prompt_tokens_last_minute": usage[PROMPT],
                "output_tokens_last_minute": usage[OUTPUT],
                "limits": {k: v for k, v in asdict(t.limits).items() if v is not None},
            }
        )
    return out


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


def settle(ex: Exchange, ledger: QuotaLedger, now: float) -> None:
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
