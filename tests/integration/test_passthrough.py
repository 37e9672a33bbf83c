"""Requests that hold no KV (embeddings, rerank, tokenize...) live as every request does:
shutdown ends and refuses them with a 503, and the node's queue of the gateway's own
passthrough requests is not taken for someone else's (real gateway, a vLLM-shaped node on
loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.eventually import eventually
from tests.support.fleet import MODEL, SERVED, RunningFleet, StartFleet

EMBED = {"model": MODEL, "input": "hello"}


def embeddings_node(
    embed: Callable[[web.Request], Awaitable[web.Response]], load: dict[str, int] | None = None
) -> web.Application:
    """A vLLM-shaped node serving ``embed`` at /v1/embeddings, with /v1/models (8k
    context), /health and a /metrics page of its requests running and waiting (``load``,
    which ``embed`` keeps)."""
    app = web.Application()
    gauges = load if load is not None else {"running": 0, "waiting": 0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": SERVED, "max_model_len": 8192}]}
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:num_requests_running{{engine="0"}} {gauges["running"]}\n'
            f'vllm:num_requests_waiting{{engine="0"}} {gauges["waiting"]}\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.0\n'
        )

    app.router.add_post("/v1/embeddings", embed)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def embedding() -> web.Response:
    data = [{"object": "embedding", "index": 0, "embedding": [0.1]}]
    usage = {"prompt_tokens": 2, "total_tokens": 2}
    return web.json_response({"object": "list", "data": data, "model": SERVED, "usage": usage})


async def over(start_fleet: StartFleet, node: Any, **gateway: Any) -> RunningFleet:
    url = str(node.make_url("")).rstrip("/")
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        gateway=gateway,
        backend_extra={"only": {"url": url, "max_model_len": 8192, "kv_cache_tokens": 8192}},
    )
    await eventually(lambda: fleet.backend("only").usable, timeout=5, what="the node healthy")
    return fleet


async def test_shutdown_ends_a_running_passthrough_request_and_refuses_new_ones(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """An embeddings request still running when shutdown ends the requests in progress
    gets the 503 ``shutting_down`` a chat gets, at once (not the node's answer, nor a
    connection dropped when the server stops); one arriving after is refused the same
    way, not sent to a node."""
    sent = [0]

    async def slow(request: web.Request) -> web.Response:
        sent[0] += 1
        await asyncio.sleep(20)
        return embedding()

    fleet = await over(start_fleet, await aiohttp_server(embeddings_node(slow)))
    async with aiohttp.ClientSession() as s:
        running = asyncio.create_task(s.post(fleet.url + "/v1/embeddings", json=EMBED))
        await eventually(lambda: sent[0] == 1)
        fleet.state.shutting_down = True
        for ex in list(fleet.state.active.values()):
            ex.end_now()
        async with asyncio.timeout(3):
            r = await running
        assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
        r.release()
        async with asyncio.timeout(3), s.post(fleet.url + "/v1/embeddings", json=EMBED) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
    assert sent[0] == 1
    await eventually(lambda: fleet.leaks() == {})


async def test_the_gateways_own_passthrough_queue_does_not_pause_the_node(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """A node serving one embeddings request at a time holds the gateway's others in its
    queue: its "waiting" gauge counts them, and load feedback does not take them for
    another client's queue (a pause would answer the gateway's next request 503)."""

    load = {"running": 0, "waiting": 0}
    gate = asyncio.Semaphore(1)

    async def one_at_a_time(request: web.Request) -> web.Response:
        await request.read()
        load["waiting"] += 1
        async with gate:
            load["waiting"] -= 1
            load["running"] += 1
            await asyncio.sleep(0.4)
            load["running"] -= 1
        return embedding()

    node = await aiohttp_server(embeddings_node(one_at_a_time, load))
    fleet = await over(start_fleet, node, load_feedback={"interval_s": 0.1})
    b = fleet.backend("only")

    async def post(s: aiohttp.ClientSession) -> int:
        async with s.post(fleet.url + "/v1/embeddings", json=EMBED) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        burst = [asyncio.create_task(post(s)) for _ in range(8)]
        await asyncio.sleep(1.0)  # scrapes see the burst waiting on the node
        paused = b.pause_reason
        late = await post(s)
        statuses = await asyncio.gather(*burst)
    assert statuses == [200] * 8 and late == 200
    assert not paused, paused
    assert b.unstarted == 0 and fleet.leaks() == {}
