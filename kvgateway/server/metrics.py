"""The gateway's own Prometheus metrics, all prefixed ``gateway_``.

One :class:`GatewayMetrics` per app, on its own registry (tests get fresh ones). Per
backend gauges are not updated on the hot path: :class:`FleetCollector` reads the live
backend state when Prometheus scrapes. No label carries per-request values.

With ``serve --workers N`` every gauge here takes a *live* multiprocess mode: the files of a
worker that died are removed (``mark_process_dead``), so its last values do not stay in
/metrics (a dead worker's queue would hold an alert up for good). Counters and histograms
keep a dead worker's counts, as totals must.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from kvgateway.core.backends import Backend
from kvgateway.upstream.kv_event_decode import EventCount

TOKEN_BUCKETS = (
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
    131072,
    262144,
)
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATIO_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, *, multiprocess: bool = False) -> None:
        self.registry = registry
        self._multiprocess = multiprocess
        # Backends missing at the last scrape: dropped at the next if still missing.
        self._absent: set[str] = set()
        # Labelled children by (metric, label values): `labels()` validates and locks on
        # every call, ~11 times per request. Label values come from bounded sets (models,
        # tiers, backends, statuses, tenants), as the registry's own children do.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by model, tier, backend and HTTP status.",
            ["model", "tier", "backend", "status"],
            registry=registry,
        )
        self.decisions = Counter(
            "gateway_routing_decisions",
            "Routing decisions by tier and reason (fit, spill, offload, overflow, queued).",
            ["tier", "reason"],
            registry=registry,
        )
        self.rejections = Counter(
            "gateway_rejections",
            "Requests refused by the gateway, by reason (context_length, saturated, "
            "no_backend, bad_request, unknown_model, auth, shutting_down).",
            ["reason"],
            registry=registry,
        )
        self.prompt_tokens = Histogram(
            "gateway_prompt_tokens",
            "Prompt tokens counted by the gateway per request.",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.output_budget = Histogram(
            "gateway_output_budget_tokens",
            "Output tokens reserved per request (max_tokens or the default, times n).",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "gateway_queue_depth",
            "Requests waiting in the admission queue for KV budget.",
            registry=registry,
            multiprocess_mode="livesum",  # the instance's queue: its live workers' sum
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time requests spent in the admission queue: until a backend had room, or until "
            "refused (429: the queue timeout, or displaced).",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from request arrival to the last byte sent, by model and tier.",
            ["model", "tier"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Time from request arrival to the first response byte, by model and tier.",
            ["model", "tier"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Per tenant: the label's values are tenant names from the config only.
        self.tenant_requests = Counter(
            "gateway_tenant_requests",
            "Requests answered per tenant, by HTTP status.",
            ["tenant", "status"],
            registry=registry,
        )
        self.tenant_tokens = Counter(
            "gateway_tenant_tokens",
            "Tokens charged per tenant: counted prompt, and output as settled from usage.",
            ["tenant", "kind"],
            registry=registry,
        )
        self.tenant_rate_limited = Counter(
            "gateway_tenant_rate_limited",
            "Requests refused by a tenant's own per-minute limit, by limit.",
            ["tenant", "limit"],
            registry=registry,
        )
        self.tenant_ttft = Histogram(
            "gateway_tenant_time_to_first_token_seconds",
            "Time from request arrival to the first response byte, by tenant.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream_retries = Counter(
            "gateway_upstream_retries",
            "Requests retried on another backend after a failure before any byte was sent.",
            ["backend", "cause"],
            registry=registry,
        )
        self.upstream_failures = Counter(
            "gateway_upstream_failures",
            "Upstream failures by backend and cause (connect, timeout, status_5xx, "
            "reset, mid_stream, invalid_answer).",
            ["backend", "cause"],
            registry=registry,
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects",
            "Requests whose client went away before the response ended.",
            registry=registry,
        )
        self.estimate_ratio = Histogram(
            "gateway_prompt_estimate_ratio",
            "Prompt tokens the backend reported divided by the gateway's estimate.",
            ["model"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.watcher_restarts = Counter(
            "gateway_monitor_watcher_restarts",
            "Backend watchers (health, discovery, load scrapes) restarted after a crash.",
            ["backend"],
            registry=registry,
        )
        self.reloads = Counter(
            "gateway_config_reloads",
            "Configuration reloads by result (ok, invalid).",
            ["result"],
            registry=registry,
        )
        self.prefix_credited = Counter(
            "gateway_prefix_credited_tokens",
            "KV tokens not reserved because a running request on the node holds those "
            "prompt blocks (admission.prefix_credit).",
            ["model"],
            registry=registry,
        )
        # Each backend's KV event stream (`kv_events`), counted by its subscriber.
        self.kv_events = {
            what: Counter(f"gateway_kv_event_{what}", what.doc, ["backend"], registry=registry)
            for what in EventCount
        }
        # The metrics labelled by backend, and where that label is (forget_backends).
        self._by_backend: dict[int, tuple[MetricWrapperBase, int]] = {
            id(m): (m, at)
            for m, at in (
                (self.requests, 2),
                (self.upstream_retries, 0),
                (self.upstream_failures, 0),
                (self.watcher_restarts, 0),
                *((m, 0) for m in self.kv_events.values()),
            )
        }
        self.build_info = Gauge(
            "gateway_build_info",
            "Gateway version and routing policy.",
            ["version", "policy"],
            registry=registry,
            multiprocess_mode="livemax",  # one series per instance, as without workers
        )

    def of(self, metric: MetricWrapperBase, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once (values in label-name order)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe_estimate_ratio(self, model: str, ratio: float) -> None:
        self.of(self.estimate_ratio, model).observe(ratio)

    def count_kv_event(self, backend: str, what: EventCount) -> None:
        """One of ``backend``'s KV event counters, by one (a subscriber's tally)."""
        self.of(self.kv_events[what], backend).inc()

    def forget_backends(self, present: set[str]) -> None:
        """Drop the series of backends gone from the fleet (a reload removed them, or DNS
        discovery's members came and went: ``pool@IP:port`` names would pile up for as
        long as the process runs), once they were exposed one more time after leaving
        (their last requests are counted). ``-`` (answered by the gateway itself) always
        stays. Not in multi-process mode: the workers' files keep every series."""
        if self._multiprocess:
            return
        by_id = self._by_backend
        absent = {
            key[1][by_id[key[0]][1]]
            for key in self._children
            if key[0] in by_id and key[1][by_id[key[0]][1]] not in present
        } - {"-"}
        gone = [
            (key, by_id[key[0]][0])
            for key in self._children
            if key[0] in by_id and key[1][by_id[key[0]][1]] in absent & self._absent
        ]
        self._absent = absent
        for key, metric in gone:
            del self._children[key]
            with contextlib.suppress(KeyError):
                metric.remove(*key[1])


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
