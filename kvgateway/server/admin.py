"""The gateway's own endpoints: models, health, readiness, the admin view and metrics."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvgateway.core.backends import Backend
from kvgateway.errors import ModelNotFound
from kvgateway.server.appkeys import EXPOSITION, STATE
from kvgateway.server.ledger_view import ready_details
from kvgateway.server.state import GatewayState
from kvgateway.server.tenants import tenants_view


def _model_entries(state: GatewayState) -> list[dict[str, Any]]:
    data = []
    for model in state.live().models:
        largest = state.fleet.largest_context(model.name)
        for name in (model.name, *model.aliases):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": int(state.started_at_wall),
                    "owned_by": "kv-gateway",
                    "root": model.served_name,
                    "parent": None if name == model.name else model.name,
                    "max_model_len": largest,
                }
            )
    return data


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_entries(request.app[STATE])})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (``client.models.retrieve``), from the gateway's own list."""
    wanted = request.match_info["model_id"]
    state = request.app[STATE]
    entries = {entry["id"]: entry for entry in _model_entries(state)}
    if wanted in entries:
        return web.json_response(entries[wanted])
    model = state.live().resolve_model(wanted)  # the name answers carry (the nodes')
    if model is not None and model.name in entries:
        return web.json_response({**entries[model.name], "id": wanted})
    raise ModelNotFound(
        f"The model `{wanted}` does not exist or you do not have access to it.", param="model"
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy = [b.name for b in state.fleet.active if b.usable]
    if state.draining or state.shutting_down:
        return web.json_response({"ready": False, "reason": "shutting down"}, status=503)
    if not healthy:
        return web.json_response({"ready": False, "reason": "no healthy backend"}, status=503)
    return web.json_response(
        {
            "ready": True,
            "healthy_backends": len(healthy),
            "ledger": ready_details(state.ledger),
        }
    )


def _projected_view(b: Backend) -> dict[str, Any]:
    block = b.limits.block_size
    peak = b.projection.peak(block, 0.0)
    return {
        "requests": len(b.projection),
        "started": sum(1 for f in b.projection.flights if f.started),
        "tokens_now": b.projected_tokens,
        "blocks_now": b.projection.current_blocks(block),
        "peak_tokens": round(peak.blocks) * block,
        "peak_in_steps": peak.step,
    }


def _backend_view(b: Backend, now: float) -> dict[str, Any]:
    lim = b.limits
    return {
        "name": b.name,
        "tier": b.tier,
        "url": _without_userinfo(b.config.url),
        "models": [b.model],
        "served_model": b.config.served_model,
        "offload": b.offload,
        "healthy": b.healthy,
        "accepting": b.accepting(now),
        "pause_reason": b.pause_reason if b.paused_at(now) else "",
        "draining": b.draining,
        "max_model_len": b.max_model_len,
        "kv_cache_tokens": b.kv_cache_tokens,
        "budget_tokens": b.budget_tokens,
        "max_num_seqs": b.max_num_seqs,
        "reserved_tokens": b.reserved_tokens,
        "reserved_seqs": b.reserved_seqs,
        "in_flight": b.in_flight,
        # Requests admitted by the projected peak: what they hold now, and the most
        # they are projected to hold together from now on (z = 0).
        "projected": _projected_view(b),
        "limits": {
            name: {"value": limit.value, "source": limit.source}
            for name, limit in (
                ("max_model_len", lim.max_model_len),
                ("kv_cache_tokens", lim.kv_cache_tokens),
                ("max_num_seqs", lim.max_num_seqs),
            )
        }
        | {"warnings": list(lim.warnings)},
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


async def admin_backends(request: web.Request) -> web.Response:
    state = request.app[STATE]
    now = state.clock()
    views = []
    for b in state.fleet.backends:
        view = _backend_view(b, now)
        if state.prefix is not None:
            stats = state.prefix.index.statistics(b.name, now)
            view["prefix_index"] = {
                "precise": stats.precise,
                "approximate_blocks": stats.approximate_blocks,
                "precise_blocks": stats.precise_blocks,
                "resyncs": stats.resyncs,
            }
        views.append(view)
    return web.json_response(
        {
            "backends": views,
            "queue_depth": state.admission.queue_depth,
            "policy": state.live().routing.policy,
            "tenants": tenants_view(state.tenancy, state.quotas, now),
            "prefix_aware": state.live().routing.prefix_aware,
            "output_reservation": state.live().admission.output_reservation,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.queue_depth.set(state.admission.queue_depth)
    state.metrics.forget_backends({b.name for b in state.fleet.backends})
    body = generate_latest(request.app[EXPOSITION])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


def _without_userinfo(url: str) -> str:
    """``url`` without ``user:password@`` (a credential in a configured URL is no one's
    business at /admin, which client keys may read when no admin key is set)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    if "@" in host:
        host = host.rsplit("@", 1)[1]
    return f"{scheme}{sep}{host}{slash}{path}"
