"""Endpoints a vLLM node serves that hold no KV cache beyond the request itself:
embeddings, rerank and score, tokenize and detokenize. They go to a healthy node of the
model with the fewest requests in flight (:func:`kvgateway.core.routing.least_in_flight`),
with no KV reservation, bounded like every other upstream call and failing over before
the first byte. Their life (exchange, errors, settling) is every request's
(:func:`kvgateway.server.proxy.run_exchange`), and a node's failures count towards its
health as a chat's do. Each counts against its tenant's requests_per_minute (refused with a 429 and the
``x-ratelimit-*`` headers like the rest of the API), and the prompt tokens the node
reports in its ``usage`` (embeddings, rerank, score) count against its prompt tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvgateway.config.model import ModelConfig
from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.core.quota import charge
from kvgateway.core.routing import least_in_flight
from kvgateway.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    NoHealthyBackend,
    UpstreamError,
)
from kvgateway.plan.openai_request import parse_body
from kvgateway.server.appkeys import STATE
from kvgateway.server.edge import REQUEST_ID, read_limited
from kvgateway.server.exchange import Exchange, Outcome
from kvgateway.server.proxy import failed, failover, run_exchange
from kvgateway.server.state import GatewayState
from kvgateway.upstream.client import find_usage, open_request
from kvgateway.upstream.error_body import is_error_object, openai_error_body
from kvgateway.upstream.feedback import request_served

PATHS = (
    "/v1/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/tokenize",
    "/detokenize",
)


async def handle_passthrough(request: web.Request) -> web.StreamResponse:
    """One passthrough request, in the access log and the metrics as every request is
    (model, backend, status, failures, refusals) and in the client's trace."""
    state = request.app[STATE]

    async def serve(ex: Exchange) -> web.StreamResponse:
        resp = await _serve(state, request, ex)
        ex.record.outcome = Outcome.OK if resp.status < 400 else f"backend_{resp.status}"
        return resp

    return await run_exchange(state, request, serve)


async def _serve(state: GatewayState, request: web.Request, ex: Exchange) -> web.Response:
    cfg = state.live()
    raw = await read_limited(request, cfg.admission.max_body_bytes, cfg.server.body_timeout_s)
    body = parse_body(raw)
    model = _model(state, body)
    ex.record.model = model.name
    if body.get("model") != model.served_name and "model" in body:
        body["model"] = model.served_name
        raw = json.dumps(body, separators=(",", ":")).encode()
    tenant = ex.record.tenant
    paid, limit_headers = await charge(state.quotas, state.tenancy, tenant, 0, 0, state.clock())
    served = False
    prompt: int | None = None
    try:
        with state.tracing.span("gateway.upstream"):
            resp, data = await _relay(state, request, model, raw, ex)
        served = True
        usage = find_usage(data) if b'"prompt_tokens"' in data else None
        if usage is not None:
            # Not more than each input (or query-document pair) at the longest context
            # the model's nodes take: a node reporting 10^9 is not believed (it locked
            # its tenant out for a minute).
            context = state.fleet.largest_context(model.name) or usage.prompt_tokens
            prompt = min(usage.prompt_tokens, _inputs(body) * context)
        resp.headers.update(limit_headers)
        return resp
    except GatewayError as err:
        err.extra_headers = {**limit_headers, **err.extra_headers}
        raise
    finally:
        state.quotas.settle(paid, 0, state.clock(), served=served, prompt=prompt)


async def _relay(
    state: GatewayState, request: web.Request, model: ModelConfig, raw: bytes, ex: Exchange
) -> tuple[web.Response, bytes]:
    """The node's answer and its body, through every request's retry loop
    (:func:`~kvgateway.server.proxy.failover`) with no KV held: the least busy node."""

    async def pick(exclude: frozenset[str]) -> _InFlight:
        state.passthrough_turn += 1
        backend = least_in_flight(
            state.fleet.for_model(model.name), state.clock(), exclude, state.passthrough_turn
        )
        if backend is None:
            raise NoHealthyBackend(f"No healthy backend for model '{model.name}'.", retry_after=5)
        ex.record.backend, ex.record.tier = backend.name, backend.tier
        return _InFlight(backend, state.fleet)

    async def attempt(held: _InFlight) -> tuple[web.Response, bytes] | UpstreamError:
        backend = held.backend
        timeouts = backend.config.timeouts
        try:
            resp = await open_request(
                state.nodes,
                backend,
                request.path,
                raw,
                _headers(state, request),
                timeouts,
                head_timeout=timeouts.total_s,
            )
            async with resp:
                data = await state.relay.read_body(ex, resp, backend)
                request_served(backend, state.clock())
                headers = resp.relay_headers()
        except UpstreamError as err:  # the answer is sent whole: nothing reached the client
            return failed(state, ex, backend, err)
        headers.update({"x-request-id": request[REQUEST_ID], "x-gateway-backend": backend.name})
        if resp.status >= 400 and not is_error_object(data):
            data = openai_error_body(resp.status, data, backend.name)
            headers["Content-Type"] = "application/json"
        return web.Response(status=resp.status, body=data, headers=headers), data

    return await failover(state, ex, pick, attempt)


@dataclass(frozen=True)
class _InFlight:
    """A passthrough request's place among its backend's requests in flight, and among
    the gateway's own requests the node may be holding in its queue (it never reports
    progress: it counts as unstarted until it ends, so its wait there is not taken for
    someone else's queue)."""

    backend: Backend
    fleet: Fleet

    async def __aenter__(self) -> _InFlight:
        self.fleet.adjust(self.backend, 0, 0, 1)
        self.backend.unstarted += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.backend.unstarted -= 1
        self.fleet.adjust(self.backend, 0, 0, -1)


def _inputs(body: dict[str, Any]) -> int:
    """How many sequences the node encodes for this request (each at most its context):
    embeddings' inputs, score's pairs, rerank's documents; one otherwise."""
    counts = [1]
    for field in ("input", "documents", "text_1", "text_2", "data_1", "data_2", "messages"):
        value = body.get(field)
        if isinstance(value, list) and value:
            # A list of token ids is one input; a list of lists or strings is many.
            counts.append(1 if all(isinstance(v, int) for v in value) else len(value))
    return max(counts)


def _model(state: GatewayState, body: dict[str, Any]) -> ModelConfig:
    name = body.get("model")
    if name is None:
        if len(state.live().models) == 1:
            return state.live().models[0]  # /tokenize without a model, as vLLM allows
        raise BadRequest("Missing required parameter: 'model'.", param="model")
    if not isinstance(name, str):
        raise BadRequest("Invalid type for 'model': expected a string.", param="model")
    model = state.live().resolve_model(name)
    if model is None:
        raise ModelNotFound(
            f"The model `{name}` does not exist or you do not have access to it.", param="model"
        )
    return model


def _headers(state: GatewayState, request: web.Request) -> dict[str, str]:
    out = {"Content-Type": "application/json", "X-Request-Id": request[REQUEST_ID]}
    out.update(state.tracing.for_node(request.headers))
    return out
