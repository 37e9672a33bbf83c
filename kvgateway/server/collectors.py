"""What Prometheus reads when it scrapes, from live state: each backend's budget,
holdings, health and the node's last reported load (:class:`FleetCollector`), and each
tenant's holdings and last minute (:class:`TenantCollector`). Nothing here runs on a
request's path; the gauges' names and help are shared with
:class:`~kvgateway.server.worker_gauges.WorkerGauges` (``serve --workers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgateway.core.backends import Backend
from kvgateway.core.quota import QuotaLedger
from kvgateway.core.tenancy import Tenancy

# What this gateway instance reserves on a backend (name, help): read live, or with
# `serve --workers` summed over the workers (WorkerGauges).
RESERVED = (
    "gateway_backend_reserved_tokens",
    "KV tokens reserved by requests in flight through this gateway instance.",
)
IN_FLIGHT = ("gateway_backend_in_flight", "Requests in flight through this gateway instance.")
# A worker's view of a backend: with `serve --workers`, the lowest of the live workers'.
HEALTHY = ("gateway_backend_healthy", "1 when the backend passes checks.")
ACCEPTING = (
    "gateway_backend_accepting",
    "1 when the backend takes new work (healthy, not paused).",
)
TENANT_KV = ("gateway_tenant_kv_tokens", "KV tokens reserved for the tenant now.")
TENANT_HELD = ("gateway_tenant_in_flight", "The tenant's admitted requests.")
TENANT_MINUTE = (
    "gateway_tenant_minute_usage",
    "The tenant's use of each per-minute limit over the last minute, through this "
    "gateway instance (with a shared ledger the limit itself is judged across replicas).",
)
TENANT_GRANTED = (
    "gateway_tenant_kv_tokens_granted",
    "KV tokens reserved for the tenant's requests, summed over admissions "
    "(its KV-token throughput; fair queuing evens it out within a class).",
)


class FleetCollector(Collector):
    """Per-backend gauges read from live state at scrape time. ``per_worker``: the
    instance's reservations come from :class:`WorkerGauges` (a scrape reaches one worker
    only), not from this process."""

    def __init__(
        self,
        backends: Callable[[], Sequence[Backend]],
        now: Callable[[], float],
        others: Callable[[Backend], int] | None = None,
        *,
        per_worker: bool = False,
    ) -> None:
        self._backends = backends
        self._now = now
        self._per_worker = per_worker
        # With a shared ledger: what the other replicas hold on a backend (folded into
        # its counters). `reserved` stays this process's own, so sums over replicas hold.
        self._others = others

    def collect(self) -> Iterable[Metric]:
        labels = ["backend", "tier", "model"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        fams = {
            "budget": gauge(
                "gateway_backend_kv_budget_tokens",
                "KV tokens the gateway may reserve on the backend.",
            ),
            "kv": gauge(
                "gateway_backend_kv_cache_tokens", "The backend's KV-cache capacity in tokens."
            ),
            "reserved": gauge(RESERVED[0], RESERVED[1]),
            "fleet_reserved": gauge(
                "gateway_backend_fleet_reserved_tokens",
                "KV tokens reserved on the backend by every gateway replica, as this one's "
                "ledger last saw (its own only with the in-process ledger).",
            ),
            "in_flight": gauge(IN_FLIGHT[0], IN_FLIGHT[1]),
            "cap": gauge(
                "gateway_backend_max_num_seqs", "Concurrency cap (sequences) of the backend."
            ),
            "ctx": gauge("gateway_backend_max_model_len", "The backend's context length."),
            "healthy": gauge(*HEALTHY),
            "accepting": gauge(*ACCEPTING),
            "usage": gauge(
                "gateway_backend_scraped_kv_usage_ratio",
                "KV-cache usage the node last reported (0..1).",
            ),
            "waiting": gauge(
                "gateway_backend_scraped_requests_waiting",
                "Requests waiting on the node, as it last reported.",
            ),
        }
        preempt = CounterMetricFamily(
            "gateway_backend_node_preemptions",
            "Preemptions the node reported in its own /metrics (vllm:num_preemptions_total).",
            labels=labels,
        )
        now = self._now()
        # A node replaced under the same name (new url) drains beside its successor: one
        # series per name, the active one's, else the first draining one's (Prometheus
        # rejects a scrape with repeated label sets). Active backends come first.
        seen: set[str] = set()
        for b in self._backends():
            if b.name in seen:
                continue
            seen.add(b.name)
            lv = [b.name, b.tier, b.model]
            fams["budget"].add_metric(lv, b.budget_tokens)
            fams["kv"].add_metric(lv, b.kv_cache_tokens)
            others = self._others(b) if self._others is not None else 0
            fams["reserved"].add_metric(lv, b.reserved_tokens - others)
            fams["fleet_reserved"].add_metric(lv, b.reserved_tokens)
            fams["in_flight"].add_metric(lv, b.in_flight)
            fams["cap"].add_metric(lv, b.max_num_seqs)
            fams["ctx"].add_metric(lv, b.max_model_len)
            fams["healthy"].add_metric(lv, 1.0 if b.healthy else 0.0)
            fams["accepting"].add_metric(lv, 1.0 if b.accepting(now) else 0.0)
            if b.load is not None:
                if b.load.kv_usage is not None:
                    fams["usage"].add_metric(lv, b.load.kv_usage)
                if b.load.waiting is not None:
                    fams["waiting"].add_metric(lv, b.load.waiting)
                if b.load.preemptions is not None:
                    preempt.add_metric(lv, b.load.preemptions)
        if self._per_worker:
            del fams["reserved"], fams["in_flight"], fams["healthy"], fams["accepting"]
        yield from fams.values()
        yield preempt


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
