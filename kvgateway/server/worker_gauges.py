"""With ``serve --workers``: each worker's holdings, written every second for /metrics
to sum over the live workers (prometheus-client multiprocess ``livesum`` gauges), and
its view of each backend's health, which /metrics reports as the live workers' lowest
(``livemin``: 1 only while every worker finds the backend healthy)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvgateway.core.backends import Backend
from kvgateway.core.quota import RATE_LIMITS
from kvgateway.server.collectors import (
    ACCEPTING,
    HEALTHY,
    IN_FLIGHT,
    RESERVED,
    TENANT_GRANTED,
    TENANT_HELD,
    TENANT_KV,
    TENANT_MINUTE,
)


class WorkerGauges:
    """With ``serve --workers`` a scrape reaches one worker: what each worker holds is
    written here (every second, :meth:`publish`) to gauges that /metrics sums over the
    live workers, and each tenant's granted tokens to a counter, so the instance's
    figures are whole whichever worker answers. A backend or tenant gone after a reload
    stays at 0 (the workers' metric files keep its series)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["backend", "tier", "model"]
        live = {"registry": registry, "multiprocess_mode": "livesum"}
        self._reserved = Gauge(*RESERVED, labels, **live)  # type: ignore[arg-type]
        self._in_flight = Gauge(*IN_FLIGHT, labels, **live)  # type: ignore[arg-type]
        self._tenant_kv = Gauge(*TENANT_KV, ["tenant"], **live)  # type: ignore[arg-type]
        self._tenant_held = Gauge(*TENANT_HELD, ["tenant"], **live)  # type: ignore[arg-type]
        self._minute = Gauge(*TENANT_MINUTE, ["tenant", "limit"], **live)  # type: ignore[arg-type]
        lowest = {"registry": registry, "multiprocess_mode": "livemin"}
        self._healthy = Gauge(*HEALTHY, labels, **lowest)  # type: ignore[arg-type]
        self._accepting = Gauge(*ACCEPTING, labels, **lowest)  # type: ignore[arg-type]
        self._granted = Counter(*TENANT_GRANTED, ["tenant"], registry=registry)
        self._granted_sent: dict[str, int] = {}
        self._backends_seen: set[tuple[str, str, str]] = set()
        self._tenants_seen: set[str] = set()

    def publish(
        self,
        backends: Sequence[Backend],
        others: Callable[[Backend], int] | None,
        tenants: Iterable[tuple[str, int, int, int, dict[str, int]]],
        now: float,
    ) -> None:
        """This worker's own reservations and view of health per backend (first of each
        name, as the collector; ``now`` on the admission clock), and per tenant (name, KV
        tokens, requests, tokens granted so far, its last minute per limit)."""
        seen: set[tuple[str, str, str]] = set()
        names: set[str] = set()
        for b in backends:
            if b.name in names:
                continue
            names.add(b.name)
            lv = (b.name, b.tier, b.model)
            seen.add(lv)
            own = b.reserved_tokens - (others(b) if others is not None else 0)
            self._reserved.labels(*lv).set(own)
            self._in_flight.labels(*lv).set(b.in_flight)
            self._healthy.labels(*lv).set(1 if b.healthy else 0)
            self._accepting.labels(*lv).set(1 if b.accepting(now) else 0)
        for lv in self._backends_seen - seen:
            for g in (self._reserved, self._in_flight, self._healthy, self._accepting):
                g.labels(*lv).set(0)
        self._backends_seen = seen
        present: set[str] = set()
        for name, kv, held, granted, minute in tenants:
            present.add(name)
            self._tenant_kv.labels(name).set(kv)
            self._tenant_held.labels(name).set(held)
            for limit, used in minute.items():
                self._minute.labels(name, limit).set(used)
            sent = self._granted_sent.get(name, 0)
            if granted > sent:
                self._granted.labels(name).inc(granted - sent)
                self._granted_sent[name] = granted
        for name in self._tenants_seen - present:
            self._tenant_kv.labels(name).set(0)
            self._tenant_held.labels(name).set(0)
            for limit in RATE_LIMITS:
                self._minute.labels(name, limit).set(0)
        self._tenants_seen = present
