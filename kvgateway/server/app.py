"""Building the gateway's aiohttp application: :func:`create_app` wires everything.

State lives on typed ``web.AppKey`` entries; the upstream client session, the worker
pool for big token counts and the backend monitor are opened and closed in
``cleanup_ctx`` in a fixed order.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvgateway import __version__
from kvgateway.config.model import GatewayConfig
from kvgateway.core.fleet import Fleet
from kvgateway.core.limits import Observed
from kvgateway.errors import GatewayError, MethodNotAllowed, NotFound, Unauthorized
from kvgateway.server.metrics import FleetCollector, GatewayMetrics
from kvgateway.server.proxy import error_response, handle_completion, request_id
from kvgateway.server.state import Clock, Counters, GatewayState
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.upstream.monitor import Monitor

STATE = web.AppKey("state", GatewayState)
MONITOR = web.AppKey("monitor", Monitor)

_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    config: GatewayConfig,
    *,
    clock: Clock = time.monotonic,
    registry: CollectorRegistry | None = None,
    encodings: EncodingCache | None = None,
    derived: dict[str, Observed] | None = None,
    count_workers: int = 2,
) -> web.Application:
    registry = registry if registry is not None else CollectorRegistry()
    metrics = GatewayMetrics(registry)
    fleet = Fleet(config, derived)
    counters = Counters(encodings or EncodingCache(), None)
    state = GatewayState(config, fleet, metrics, counters, clock=clock)
    registry.register(FleetCollector(lambda: state.fleet.backends, clock))
    metrics.build_info.labels(version=__version__, policy=config.routing.policy).set(1)
    # Load every tokenizer now: a bad encoding must fail start-up, not the first request.
    for model in config.models:
        counters.for_model(model)

    app = web.Application(
        middlewares=[_errors_middleware, _auth_middleware],
        client_max_size=config.admission.max_body_bytes,
    )
    app[STATE] = state
    app[MONITOR] = Monitor(state)
    app.cleanup_ctx.append(_count_pool(count_workers))
    app.cleanup_ctx.append(_http_session)
    app.cleanup_ctx.append(_monitor)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await handle_completion(request, state, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle_completion(request, state, "completion")

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/admin/backends", _admin_backends)
    app.router.add_get("/metrics", _metrics)
    return app


def _count_pool(workers: int) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gateway-count")
        app[STATE].counters.executor = pool
        app[STATE].counters._by_spec.clear()
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    return ctx


async def _http_session(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10),
    )
    app[STATE].session = session
    yield
    await session.close()


async def _monitor(app: web.Application) -> AsyncIterator[None]:
    monitor = app[MONITOR]
    await monitor.probe_all_once()
    monitor.sync()
    yield
    await monitor.close()


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request_id(request)
    try:
        return await handler(request)
    except GatewayError as err:
        return error_response(err, rid)
    except web.HTTPNotFound:
        return error_response(NotFound(f"No route for {request.method} {request.path}."), rid)
    except web.HTTPMethodNotAllowed:
        return error_response(
            MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}."), rid
        )
    except web.HTTPRequestEntityTooLarge as exc:
        from kvgateway.errors import BodyTooLarge

        return error_response(BodyTooLarge(exc.text or "Request body too large."), rid)


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[STATE].config.server.api_keys
    if keys and request.path not in _OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        # Compare against every key so timing does not reveal which prefix matched.
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(token.encode(), key.encode())
        if not ok:
            request.app[STATE].metrics.rejections.labels(reason="auth").inc()
            raise Unauthorized(
                "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'."
            )
    return await handler(request)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = []
    for model in state.config.models:
        backends = state.fleet.for_model(model.name)
        contexts = [b.context_limit for b in backends if b.limits.known]
        for name in (model.name, *model.aliases):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": int(state.started_at_wall),
                    "owned_by": "kv-gateway",
                    "root": model.served_name,
                    "parent": None if name == model.name else model.name,
                    "max_model_len": max(contexts, default=0),
                }
            )
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy = [b.name for b in state.fleet.active if b.usable]
    if state.draining or state.shutting_down:
        return web.json_response({"ready": False, "reason": "shutting down"}, status=503)
    if not healthy:
        return web.json_response({"ready": False, "reason": "no healthy backend"}, status=503)
    return web.json_response({"ready": True, "healthy_backends": len(healthy)})


async def _admin_backends(request: web.Request) -> web.Response:
    state = request.app[STATE]
    now = state.clock()
    out = []
    for b in state.fleet.backends:
        lim = b.limits
        out.append(
            {
                "name": b.name,
                "tier": b.tier,
                "url": b.config.url,
                "models": [b.model],
                "served_model": b.config.served_model,
                "offload": b.offload,
                "healthy": b.healthy,
                "accepting": b.accepting(now),
                "pause_reason": b.pause_reason,
                "draining": b.draining,
                "max_model_len": b.max_model_len,
                "kv_cache_tokens": b.kv_cache_tokens,
                "budget_tokens": b.budget_tokens,
                "max_num_seqs": b.max_num_seqs,
                "reserved_tokens": b.reserved_tokens,
                "reserved_seqs": b.reserved_seqs,
                "in_flight": b.in_flight,
                "limits": {
                    "max_model_len": {
                        "value": lim.max_model_len.value,
                        "source": lim.max_model_len.source,
                    },
                    "kv_cache_tokens": {
                        "value": lim.kv_cache_tokens.value,
                        "source": lim.kv_cache_tokens.source,
                    },
                    "max_num_seqs": {
                        "value": lim.max_num_seqs.value,
                        "source": lim.max_num_seqs.source,
                    },
                    "warnings": list(lim.warnings),
                },
                "load": None
                if b.load is None
                else {
                    "kv_usage": b.load.kv_usage,
                    "running": b.load.running,
                    "waiting": b.load.waiting,
                    "preemptions": b.load.preemptions,
                    "age_s": round(now - b.load.at, 3),
                },
                "last_error": b.last_error,
                "recent_rejections": b.recent_rejections(now),
            }
        )
    return web.json_response(
        {
            "backends": out,
            "queue_depth": state.admission.queue_depth,
            "policy": state.config.routing.policy,
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.queue_depth.set(state.admission.queue_depth)
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
