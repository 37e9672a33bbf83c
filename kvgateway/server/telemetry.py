"""What a request leaves behind for operators: the gateway's Prometheus metrics, its
access line and its trace spans.

Metrics are all prefixed ``gateway_``: one :class:`GatewayMetrics` per app, on its own
registry (tests get fresh ones). Per-backend gauges are not updated on the hot path:
:class:`~kvgateway.server.collectors.FleetCollector` reads the live backend state when
Prometheus scrapes. No label carries per-request values. With ``serve --workers N``
every gauge here takes a *live* multiprocess mode: the files of a worker that died are
removed (``mark_process_dead``), so its last values do not stay in /metrics (a dead
worker's queue would hold an alert up for good). Counters and histograms keep a dead
worker's counts, as totals must.

One access line per request (:func:`log_access`). Spans, when tracing is on
(:mod:`.observability` sets it up): ``gateway.request`` (continuing the client's
``traceparent``), inside it ``gateway.admission`` (the wait for KV room, with the
routing decision as attributes) and ``gateway.upstream`` (the call to the node, whose
``traceparent`` then names this span, so the node's own spans join the trace). Without
tracing the client's trace context is passed to the node unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

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


ACCESS = logging.getLogger("kvgateway.access")


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    method: str
    path: str
    model: str = "-"
    tenant: str = "-"
    tier: str = "-"
    backend: str = "-"
    route: str = "-"
    prompt_tokens: int = 0
    reserved_tokens: int = 0
    status: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    queued_ms: float = 0.0
    attempts: int = 0
    stream: bool = False
    outcome: str = "-"

    def fields(self) -> dict[str, object]:
        return asdict(self)


def log_access(record: AccessRecord) -> None:
    if ACCESS.isEnabledFor(logging.INFO):
        ACCESS.info("access", extra={"access": record.fields()})


class Tracing:
    """Spans when a tracer is given; every method is a no-op otherwise."""

    def __init__(self, tracer: Any | None = None) -> None:
        self._tracer = tracer

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextlib.contextmanager
    def request(self, name: str, headers: Mapping[str, str]) -> Iterator[Any]:
        """The request's root span, continuing the client's trace context if any."""
        if self._tracer is None:
            yield None
            return
        from opentelemetry import propagate

        parent = propagate.extract(dict(headers))
        with self._tracer.start_as_current_span(name, context=parent, kind=_server()) as span:
            yield span

    @contextlib.contextmanager
    def span(self, name: str, **attributes: str | int | float) -> Iterator[Any]:
        if self._tracer is None:
            yield None
            return
        with self._tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Put the current span's context into ``headers`` (traceparent, tracestate)."""
        if self._tracer is None:
            return
        from opentelemetry import propagate

        propagate.inject(headers)

    def for_node(self, client: Mapping[str, str]) -> dict[str, str]:
        """W3C trace context for the node, so its spans join the trace: the gateway's own
        span when tracing is on, else the client's (``client``: its request's headers)
        unchanged."""
        out: dict[str, str] = {}
        if self._tracer is not None:
            self.inject(out)
            return out
        for name in ("traceparent", "tracestate"):
            value = client.get(name)
            if value is not None:
                out[name] = value
        return out


def _server() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER


def set_attributes(span: Any, **attributes: str | int | float) -> None:
    if span is not None:
        span.set_attributes(attributes)
