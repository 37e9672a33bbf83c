"""What each tenant holds and used over the last minute, as ``/admin/backends`` and
``gateway top`` show it (Prometheus reads it through
:class:`~kvgateway.server.collectors.TenantCollector`).

Quotas live in a :class:`~kvgateway.core.quota.QuotaLedger`: :class:`LocalQuotaLedger` (this
process only) unless a shared one is passed to ``create_app``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvgateway.core.quota import OUTPUT, PROMPT, REQUESTS, QuotaLedger
from kvgateway.core.tenancy import Tenancy


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
