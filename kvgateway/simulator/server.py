"""The HTTP surface of one simulated vLLM node.

vLLM's endpoints (``/health``, ``/version``, ``/v1/models``, ``/tokenize``, ``/metrics``,
``/v1/chat/completions``, ``/v1/completions``; embeddings, rerank, score, detokenize and
responses in ``endpoints_extra.py``; any other path is FastAPI's JSON 404) plus the
simulator's own:

- ``GET /sim/state``: engine state as JSON (running, waiting, used/free blocks,
  kv_usage, preemptions, finished counts, simulated time, lag);
- ``GET|POST|DELETE /sim/fault``: fault injection, see ``faults.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from kvgateway.simulator import protocol as p
from kvgateway.simulator import wire
from kvgateway.simulator.completions import ClientGone, handle_chat, handle_completion
from kvgateway.simulator.endpoints_extra import register_extra_endpoints
from kvgateway.simulator.errors import ApiError, bad_request, invalid_fields, missing
from kvgateway.simulator.faults import FaultError, parse_fault
from kvgateway.simulator.node import NODE_KEY, SimNode
from kvgateway.simulator.settings import NodeSettings
from kvgateway.simulator.tokenizer import TemplateError
from kvgateway.tokens.encoding import EncodingCache

log = logging.getLogger("kvgateway.simulator.server")

METRICS_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
# vLLM has no body limit of note; this one only keeps a broken client from eating memory.
MAX_BODY_BYTES = 64 * 1024 * 1024
# Request bodies larger than this are tokenized in a worker thread.
_THREAD_THRESHOLD_CHARS = 32_000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_node_app(
    settings: NodeSettings,
    *,
    clock: Callable[[], float] = time.monotonic,
    encodings: EncodingCache | None = None,
    disconnect_poll_s: float | None = 0.05,
) -> web.Application:
    """A fresh node: its own engine, registry and faults; nothing is shared.

    ``disconnect_poll_s``: how often a handler waiting for tokens checks whether its
    client left. Pass None only when serving with ``AppRunner(handler_cancellation=True)``
    (aiohttp then cancels the handler itself); the default suits any runner.
    """
    node = SimNode(settings, clock=clock, encodings=encodings, disconnect_poll_s=disconnect_poll_s)
    app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_BODY_BYTES)
    app[NODE_KEY] = node
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_stop_engine)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_completion)
    register_extra_endpoints(app)
    app.router.add_get("/sim/state", _state)
    app.router.add_get("/sim/fault", _get_fault)
    app.router.add_post("/sim/fault", _set_fault)
    app.router.add_delete("/sim/fault", _clear_fault)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE_KEY]
    if node.publisher is not None:
        await node.publisher.start()
    node.driver.start()
    yield
    await node.driver.stop()
    if node.publisher is not None:
        await node.publisher.close()


async def _stop_engine(app: web.Application) -> None:
    # on_shutdown runs before aiohttp waits for open handlers: failing the in-flight
    # requests here lets streams end at once instead of holding shutdown up.
    await app[NODE_KEY].driver.stop()


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    traceparent = request.headers.get("traceparent")
    if traceparent is not None:
        request.app[NODE_KEY].last_traceparent = traceparent
    try:
        return await handler(request)
    except ApiError as exc:
        return wire.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status not in (404, 405):
            raise
        # FastAPI's answer for a path or method it does not route.
        return wire.json_response({"detail": exc.reason}, status=exc.status)
    except ClientGone:
        # Nobody is listening; aiohttp discards whatever is returned on a closed socket.
        return web.Response(status=499)


async def _health(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    status = node.faults.health_status
    if status is None:
        status = 503 if node.driver.dead else 200
    return web.Response(status=status)


async def _version(request: web.Request) -> web.Response:
    return wire.json_response({"version": wire.VLLM_VERSION})


async def _models(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    s = node.settings
    return wire.json_response(
        wire.models_body(s.model, s.served_root, s.max_model_len, node.created)
    )


_NOT_TOKENIZE_FIELDS = frozenset({"documents", "reasoning_effort"})


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``: a completion form (``prompt``, ``add_special_tokens``
    default true) or a chat form (``messages`` rendered with the template, as for
    /v1/chat/completions; ``add_special_tokens`` default false)."""
    node = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    if "messages" not in body and "prompt" not in body:
        raise invalid_fields([missing("prompt", body), missing("messages", body)])
    model = body.get("model")
    node.check_model(model if isinstance(model, str) else None)
    try:
        if "messages" in body:
            messages = p.parse_messages(body["messages"])
            # vLLM's TokenizeChatRequest has no documents or reasoning_effort (they reach
            # the template only through chat_template_kwargs there): not rendered.
            chat = {k: v for k, v in body.items() if k not in _NOT_TOKENIZE_FIELDS}
            tokens = await _off_loop(node.tokenizer.encode_chat_request, chat, messages)
        elif isinstance(body.get("prompt"), str):
            tokens = await _off_loop(node.tokenizer.encode_completion_request, body, body["prompt"])
        else:
            raise bad_request("Either prompt (a string) or messages is required.", "prompt")
    except TemplateError as exc:
        raise bad_request(str(exc)) from exc
    strs = None
    if body.get("return_token_strs") is True:
        strs = [_decode_one(node, t) for t in tokens]
    return wire.json_response(
        {
            "count": len(tokens),
            "max_model_len": node.settings.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
    )


def _decode_one(node: SimNode, token: int) -> str:
    try:
        return node.tokenizer.token_str(token)
    except (ValueError, KeyError, OverflowError):
        return ""


async def _off_loop(
    fn: Callable[[dict[str, Any], Any], list[int]], body: dict[str, Any], arg: Any
) -> list[int]:
    if len(json.dumps(body.get("messages") or body.get("prompt") or "")) < _THREAD_THRESHOLD_CHARS:
        return fn(body, arg)
    return await asyncio.to_thread(fn, body, arg)


async def _metrics(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body = node.metrics.render(node.driver.core)
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def _state(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    state = node.driver.snapshot()
    fault = node.faults.current
    state["fault"] = None if fault is None else fault.as_json()
    state["last_traceparent"] = node.last_traceparent
    return wire.json_response(state)


async def _get_fault(request: web.Request) -> web.Response:
    fault = request.app[NODE_KEY].faults.current
    return wire.json_response({"fault": None if fault is None else fault.as_json()})


async def _set_fault(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    try:
        fault = parse_fault(body)
    except FaultError as exc:
        raise bad_request(str(exc)) from exc
    node.faults.set(fault)
    log.info("node %s: fault set to %s", node.settings.name, fault)
    current = node.faults.current
    return wire.json_response({"fault": None if current is None else current.as_json()})


async def _clear_fault(request: web.Request) -> web.Response:
    request.app[NODE_KEY].faults.clear()
    return wire.json_response({"fault": None})
