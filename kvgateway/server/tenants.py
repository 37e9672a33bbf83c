"""What each tenant holds and used over the last minute, as Prometheus reads it
(:class:`TenantCollector`) and as ``/admin/backends`` and ``gateway top`` show it.

Quotas live in a :class:`~kvgateway.core.quota.QuotaLedger`: :class:`LocalQuotaLedger` (this
process only) unless a shared one is passed to ``create_app``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgateway.core.quota import OUTPUT, PROMPT, REQUESTS, QuotaLedger
from kvgateway.core.tenancy import Tenancy
from kvgateway.server.metrics import TENANT_GRANTED, TENANT_HELD, TENANT_KV, TENANT_MINUTE


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
