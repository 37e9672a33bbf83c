"""Building the gateway's aiohttp application: :func:`create_app` wires everything.

What needs no running loop is built at once (config, fleet, metrics, encodings); the
resources that do (the counting pool, the upstream HTTP session) are opened in one
``cleanup_ctx``, and only then is the :class:`GatewayState` built, complete, with the
backend monitor. They close in the reverse order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from kvgateway import __version__
from kvgateway.config.model import GatewayConfig, LiveConfig
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Observed
from kvgateway.core.demand import Demand
from kvgateway.core.derived_limits import derive_all
from kvgateway.core.fleet import Fleet
from kvgateway.core.output_model import OutputModel
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.quota import LocalQuotaLedger, QuotaLedger
from kvgateway.core.routing import Decision, Wait
from kvgateway.core.shared_blocks import SharedBlocks
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.redis_ledger import RedisLedger
from kvgateway.plan.planner import Planner
from kvgateway.server import admin
from kvgateway.server.appkeys import DNS, EXPOSITION, KV_EVENTS, MONITOR, STATE, WORKER_GAUGES
from kvgateway.server.collectors import FleetCollector, TenantCollector
from kvgateway.server.edge import auth_middleware, errors_middleware, request_id_middleware
from kvgateway.server.exchange import Settle
from kvgateway.server.ledger_view import LedgerMetrics, build_ledger
from kvgateway.server.observability import from_environment
from kvgateway.server.passthrough import PATHS as PASSTHROUGH_PATHS
from kvgateway.server.passthrough import handle_passthrough
from kvgateway.server.proxy import handle_completion
from kvgateway.server.relay import Relay
from kvgateway.server.reload import FleetMembers
from kvgateway.server.state import Clock, GatewayState, Stages
from kvgateway.server.telemetry import GatewayMetrics, Tracing
from kvgateway.server.worker_gauges import WorkerGauges
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.prompt_estimate import PromptCalibration
from kvgateway.upstream.dns import DnsDiscovery
from kvgateway.upstream.kv_events import KVEventHub, kv_event_sources
from kvgateway.upstream.monitor import Monitor
from kvgateway.upstream.node_pool import NodePool
from kvgateway.upstream.node_tokenize import NodeTokenizer

__all__ = ["KV_EVENTS", "MONITOR", "STATE", "create_app"]


def create_app(
    config: GatewayConfig,
    *,
    clock: Clock = time.monotonic,
    registry: CollectorRegistry | None = None,
    encodings: EncodingCache | None = None,
    derived: dict[str, Observed] | None = None,
    count_workers: int = 2,
    tracer_provider: Any | None = None,
    quota_ledger: QuotaLedger | None = None,
    worker: int | None = None,
    metrics_dir: str | None = None,
    kv_events_silence_s: float = 30.0,
) -> web.Application:
    """The gateway. ``quota_ledger`` holds the tenants' per-minute quotas; by default in
    the shared ledger's Redis when one is configured, else in this process. ``worker`` / ``metrics_dir``: this app is worker ``worker`` of
    ``serve --workers``, its metrics written to (and /metrics read from) the shared
    ``metrics_dir``. ``kv_events_silence_s``: how long a backend sent prompts it does not
    hold may publish no KV event before that is logged as a warning."""
    registry = registry if registry is not None else CollectorRegistry()
    tracing = from_environment(config.tracing.enabled, tracer_provider)
    metrics = GatewayMetrics(registry, multiprocess=metrics_dir is not None)
    # Limits derived from capacity blocks (and each hybrid model's KV groups).
    fleet = Fleet(config, derive_all(config) if derived is None else derived)
    encodings = encodings or EncodingCache()
    shared = build_ledger(config, fleet, LedgerMetrics(registry), clock, worker)
    ledger, shared_quotas = shared if shared is not None else (None, None)
    if quota_ledger is None:
        quota_ledger = shared_quotas
    per_worker = metrics_dir is not None
    live = FleetCollector(
        lambda: fleet.backends,
        clock,
        ledger.others_tokens if ledger is not None else None,
        per_worker=per_worker,
    )
    registry.register(live)
    exposition = registry
    worker_gauges = None
    if metrics_dir is not None:
        exposition = CollectorRegistry()
        MultiProcessCollector(exposition, path=metrics_dir)  # type: ignore[no-untyped-call]
        exposition.register(live)
        worker_gauges = WorkerGauges(registry)
    metrics.build_info.labels(version=__version__, policy=config.routing.policy).set(1)
    # Load every tokenizer now: a bad encoding must fail start-up, not the first request.
    for model in config.models:
        encodings.get(model.tokenizer.encoding)

    app = web.Application(
        middlewares=[request_id_middleware, errors_middleware, auth_middleware],
        client_max_size=config.admission.max_body_bytes,
        # A connection with no complete request for this long (idle keep-alive, headers
        # sent half-way) is closed: aiohttp's timer runs from the connection's start.
        # After an answer sent before the body was read (413, 408, a broken body), wait
        # at most a second for the rest of it, then close.
        handler_args={
            "keepalive_timeout": config.server.keepalive_timeout_s,
            "lingering_time": 1.0,
        },
    )

    async def runtime(app: web.Application) -> AsyncIterator[None]:
        pool = ThreadPoolExecutor(max_workers=count_workers, thread_name_prefix="gateway-count")
        huge = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-count-huge")
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10),
        )
        nodes = NodePool()
        prefix_index = PrefixIndex()
        hub = KVEventHub(
            prefix_index, clock=clock, tally=metrics.count_kv_event, silence_s=kv_events_silence_s
        )
        try:
            live_config = LiveConfig(config)
            prefix = PrefixRouter(
                prefix_index,
                shared=SharedBlocks(),
                credit=live_config.prefix_credit,
            )
            state = _build_state(
                live_config,
                fleet,
                metrics,
                TokenCounters(encodings, pool, huge),
                session,
                nodes,
                clock=clock,
                tracing=tracing,
                quotas=quota_ledger if quota_ledger is not None else LocalQuotaLedger(),
                ledger=ledger,
                prefix=prefix,
            )
            collector = TenantCollector(state.tenancy, state.quotas, clock, per_worker=per_worker)
            registry.register(collector)
            if exposition is not registry:
                exposition.register(collector)
            monitor = Monitor(
                fleet=fleet,
                admission=state.admission,
                session=session,
                config=state.live,
                clock=clock,
                on_crash=lambda b: metrics.of(metrics.watcher_restarts, b.name).inc(),
            )
            app[STATE] = state
            app[MONITOR] = monitor
            app[KV_EVENTS] = hub
            app[DNS] = discovery = DnsDiscovery(
                config.dns_groups,
                FleetMembers(app),
                nameservers=config.discovery.nameservers,
                timeout_s=config.discovery.timeout_s,
            )
            hub.follow(kv_event_sources(config))
            await monitor.probe_all_once()
            monitor.sync()
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if ledger is not None:
                        await stack.enter_async_context(
                            ledger.running(state.admission, state.tenancy)
                        )
                    if shared_quotas is not None:
                        await stack.enter_async_context(shared_quotas.running())
                    await stack.enter_async_context(discovery)
                    yield
            finally:
                await monitor.close()
                registry.unregister(collector)
                if exposition is not registry:
                    exposition.unregister(collector)
        finally:
            await hub.close()
            nodes.close()
            await session.close()
            pool.shutdown(wait=False, cancel_futures=True)
            huge.shutdown(wait=False, cancel_futures=True)

    app[EXPOSITION] = exposition
    if worker_gauges is not None:
        app[WORKER_GAUGES] = worker_gauges
    app.cleanup_ctx.append(runtime)

    app.router.add_post("/v1/chat/completions", partial(handle_completion, kind="chat"))
    app.router.add_post("/v1/completions", partial(handle_completion, kind="completion"))
    app.router.add_post("/v1/responses", partial(handle_completion, kind="responses"))
    for path in PASSTHROUGH_PATHS:
        app.router.add_post(path, handle_passthrough)
    app.router.add_get("/v1/models", admin.models)
    app.router.add_get(r"/v1/models/{model_id:.+}", admin.model)
    app.router.add_get("/health", admin.health)
    app.router.add_get("/ready", admin.ready)
    app.router.add_get("/admin/backends", admin.admin_backends)
    app.router.add_get("/metrics", admin.metrics)
    return app


def _build_state(
    live: LiveConfig,
    fleet: Fleet,
    metrics: GatewayMetrics,
    counters: TokenCounters,
    session: aiohttp.ClientSession,
    nodes: NodePool,
    *,
    clock: Clock,
    tracing: Tracing,
    quotas: QuotaLedger,
    ledger: RedisLedger | None,
    prefix: PrefixRouter,
) -> GatewayState:
    """The four stages, each built with what it needs, and the state that holds them."""
    calibration = PromptCalibration(metrics.observe_estimate_ratio)
    tenancy = Tenancy(live.auth)
    # The learned output lengths: Settle teaches them, Plan reads them.
    outputs = OutputModel()

    def count_decision(decision: Decision, demand: Demand) -> None:
        # Admissions are counted with their tier when the exchange ends; here: the
        # requests that had to queue (whether or not they were served in the end).
        if isinstance(decision, Wait):
            metrics.decisions.labels(tier="-", reason="queued").inc()

    admission = Admission.for_fleet(
        fleet,
        live,
        clock,
        on_decision=count_decision,
        tenancy=tenancy,
        ledger=ledger,
        prefix=prefix,
    )
    stages = Stages(
        planner=Planner(
            live,
            counters,
            calibration,
            fleet,
            # Asked for a node's own count when a stand-in bound comes near a limit.
            node_counter=NodeTokenizer(session, fleet),
            outputs=outputs,
        ),
        admission=admission,
        relay=Relay(clock, live.health),
        settle=Settle(
            calibration,
            outputs,
            quotas,
            tenancy,
            metrics,
            clock,
            live.access_log,
            cuts_learned=admission.rebalance,
        ),
    )
    return GatewayState(
        live,
        stages,
        fleet,
        metrics,
        counters,
        nodes,
        calibration=calibration,
        quotas=quotas,
        tenancy=tenancy,
        clock=clock,
        tracing=tracing,
        ledger=ledger,
        prefix=prefix,
    )
