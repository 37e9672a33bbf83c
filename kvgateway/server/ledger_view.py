"""The ledger as the server shows it: building it from the config, its metrics and the
``ledger`` block of ``/ready``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvgateway.config.model import GatewayConfig
from kvgateway.core.fleet import Fleet
from kvgateway.ledger.connect import default_replica_id, redis_client
from kvgateway.ledger.quotas import SharedQuotas
from kvgateway.ledger.redis_ledger import RedisLedger
from kvgateway.ledger.shared_book import LedgerStatus


class LedgerMetrics:
    # Gauges in `serve --workers` take a live mode: a worker's values go with it (the
    # supervisor marks a dead worker's files); "max" kept a killed worker's last 1.
    def __init__(self, registry: CollectorRegistry) -> None:
        self.fallback = Gauge(
            "gateway_ledger_fallback",
            "1 while a shared ledger is configured but unreachable or slow, and this gateway "
            "admits on a blind local share of each budget; 0 otherwise.",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.live_replicas = Gauge(
            "gateway_ledger_live_replicas",
            "Gateway replicas holding a live lease in the shared ledger, as last seen.",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.fallbacks = Counter(
            "gateway_ledger_fallbacks",
            "Times this gateway fell back from the shared ledger to its local share.",
            registry=registry,
        )
        self.credit_admissions = Counter(
            "gateway_ledger_credit_admissions",
            "Admissions confirmed from this gateway's ledger credit (room a finished "
            "request left, still recorded as this gateway's), without a Redis round trip.",
            registry=registry,
        )
        self.quota_fallback = Gauge(
            "gateway_tenant_quota_fallback",
            "1 while tenants' per-minute limits are judged on this gateway's share "
            "(limit / live replicas) because the shared ledger's Redis is unavailable; 0 "
            "while they are judged across every replica (or no shared ledger is set).",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self._seen_fallbacks = 0

    def update(self, status: LedgerStatus) -> None:
        self.fallback.set(0 if status.shared else 1)
        self.live_replicas.set(status.live_replicas)
        if status.fallbacks > self._seen_fallbacks:
            self.fallbacks.inc(status.fallbacks - self._seen_fallbacks)
            self._seen_fallbacks = status.fallbacks


def build_ledger(
    config: GatewayConfig,
    fleet: Fleet,
    metrics: LedgerMetrics,
    clock: Callable[[], float],
    worker: int | None = None,
) -> tuple[RedisLedger, SharedQuotas] | None:
    """The Redis ledger and the tenants' fleet-wide rate limits, over one client, when
    the config names a Redis (None: both in this process)."""
    cfg = config.ledger
    if not cfg.shared:
        return None
    rid = cfg.replica_id or default_replica_id(config.server.port)
    if worker is not None:
        rid = f"{rid}/w{worker}"
    client = redis_client(cfg)
    ledger = RedisLedger(
        cfg,
        rid,
        fleet,
        client,
        on_status=metrics.update,
        on_credit=metrics.credit_admissions.inc,
    )
    quotas = SharedQuotas(
        client,
        cfg.namespace,
        rid,
        cfg.timeout_s,
        shared=ledger.in_shared_mode,
        live=lambda: ledger.status().live_replicas,
        clock=clock,
        on_fallback=lambda on: metrics.quota_fallback.set(1 if on else 0),
    )
    return ledger, quotas


def ready_details(ledger: RedisLedger | None) -> dict[str, Any]:
    if ledger is None:
        return {"kind": "local", "shared": False}
    s = ledger.status()
    out: dict[str, Any] = {
        "kind": s.kind,
        "shared": s.shared,
        "replica_id": s.replica_id,
        "live_replicas": s.live_replicas,
        "fallbacks": s.fallbacks,
        "credit_admissions": ledger.credit_grants,
    }
    if not s.shared:
        out["fallback"] = f"local share 1/{s.live_replicas} of each budget: {s.reason}"
    return out
