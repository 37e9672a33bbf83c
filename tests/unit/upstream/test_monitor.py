"""The backend monitor against a real simulated node on loopback."""

import asyncio
import contextlib
import dataclasses
from typing import Any

import aiohttp
import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.model import GatewayConfig
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.server import create_node_app as create_node
from kvgateway.upstream.monitor import Monitor
from tests.support.backends import healthy
from tests.support.fleet import ENCODINGS, SERVED


def _monitored(
    url: str, load_feedback: dict[str, object] | None = None, **health: object
) -> tuple[Fleet, Admission, GatewayConfig]:
    """One backend ``n`` at ``url``, watched every 50 ms, without load feedback unless
    ``load_feedback`` says otherwise."""
    config = parse_config(
        {
            "models": [{"name": "m", "served_name": SERVED}],
            "health": {"interval_s": 0.05, "timeout_s": 1, **health},
            "load_feedback": load_feedback or {"enabled": False},
            "tiers": [{"name": "t", "backends": [{"name": "n", "url": url, "model": "m"}]}],
        }
    )
    fleet = Fleet(config)
    adm = Admission(
        index_for=fleet.index,
        adjust=fleet.adjust,
        policy=lambda: config.routing.policy,
        offload_overflow=lambda: False,
        queue_size=lambda: 100,
        clock=asyncio.get_running_loop().time,
    )
    return fleet, adm, config


def _monitor(
    fleet: Fleet, adm: Admission, config: GatewayConfig, session: aiohttp.ClientSession
) -> Monitor:
    return Monitor(
        fleet=fleet,
        admission=adm,
        session=session,
        config=lambda: config,
        clock=asyncio.get_running_loop().time,
    )


async def test_a_crashing_watcher_is_restarted_and_health_keeps_updating(aiohttp_server):
    settings = dataclasses.replace(get_profile("gpu24-8b"), name="n", model=SERVED, seed=1)
    node = await aiohttp_server(create_node(settings, encodings=ENCODINGS))
    url = str(node.make_url("")).rstrip("/")
    fleet, adm, config = _monitored(url, rediscover_interval_s=60)
    calls = [0]

    def flaky_config():
        # The watcher's third look at its config blows up (a bug in a watcher).
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("bug in a watcher")
        return config

    crashed: list[Backend] = []
    async with aiohttp.ClientSession() as session:
        monitor = Monitor(
            fleet=fleet,
            admission=adm,
            session=session,
            config=flaky_config,
            clock=asyncio.get_running_loop().time,
            on_crash=crashed.append,
            restart_delay_s=0.05,
        )
        monitor.sync()
        b = fleet.get("n")
        assert b is not None
        try:
            for _ in range(100):
                if crashed and b.healthy and b.limits.known:
                    break
                await asyncio.sleep(0.02)
            assert crashed == [b]
            assert b.healthy and b.limits.known
            # A preemption cool-down ends on its own: the monitor ends it through
            # admission at its time, and the queued waiters are served.
            from kvgateway.core.backends import PauseReason
            from tests.support.backends import demand

            now = asyncio.get_running_loop().time()
            b.paused, b.pause_reason, b.paused_until = True, PauseReason.PREEMPTING, now + 0.2
            waiters = [
                asyncio.create_task(adm.admit(demand(500, 100, model="m"), 5.0)) for _ in range(13)
            ]
            await asyncio.sleep(0.05)
            assert adm.queue_depth == 13
            served = await asyncio.wait_for(asyncio.gather(*waiters), 2.0)
            assert len(served) == 13 and not b.paused
            for r in served:
                r.release()
            # The restarted watcher still follows the node: stop it, it turns unhealthy.
            await node.close()
            for _ in range(200):
                if not healthy(b):
                    break
                await asyncio.sleep(0.02)
            assert not b.healthy
        finally:
            await monitor.close()


def _node_app(state: dict[str, Any]) -> "aiohttp.web.Application":
    """A node that answers as vLLM does, but for what ``state`` says to break."""
    from aiohttp import web

    async def models(_: web.Request) -> web.Response:
        mml = state.get("max_model_len", 8192)
        return web.json_response({"data": [{"id": SERVED, "max_model_len": mml}]})

    async def metrics(_: web.Request) -> web.Response:
        if state.get("metrics_down"):
            return web.Response(status=503)
        return web.Response(
            text='vllm:cache_config_info{block_size="16",num_gpu_blocks="2000"} 1.0\n'
        )

    async def health(request: web.Request) -> web.StreamResponse:
        if state.get("down"):
            return web.Response(status=503)
        if not state.get("endless_health"):
            return web.Response()
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"x" * 65536
        with contextlib.suppress(ConnectionError):
            while True:  # a broken node: an answer without end
                await resp.write(chunk)
                state["sent"] = state.get("sent", 0) + len(chunk)
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


async def test_a_nodes_endless_health_answer_is_not_read_to_its_end(aiohttp_server):
    """A /health body is not read whole, or a node could push any amount into the
    gateway's memory (600 MiB measured): the status decides, not a few KiB of body."""
    from kvgateway.upstream.monitor import _health

    state = {"endless_health": True}
    node = await aiohttp_server(_node_app(state))
    fleet, _, _ = _monitored(str(node.make_url("")).rstrip("/"))
    b = fleet.get("n")
    assert b is not None
    async with aiohttp.ClientSession() as session:
        assert await _health(session, b, 5.0) == (True, "")
    assert state["sent"] < 8 * 1024 * 1024


async def test_a_failed_metrics_scrape_keeps_the_pool_last_reported(aiohttp_server):
    """Rediscovery whose /metrics fails once (a 503 blip) keeps the node's pool as last
    reported, and the node stays usable (an unknown KV budget would take it out)."""
    state: dict[str, Any] = {}
    node = await aiohttp_server(_node_app(state))
    fleet, adm, config = _monitored(str(node.make_url("")).rstrip("/"))
    b = fleet.get("n")
    assert b is not None
    async with aiohttp.ClientSession() as session:
        monitor = _monitor(fleet, adm, config, session)
        await monitor.probe_all_once()
        assert b.usable and b.kv_cache_tokens == 1999 * 16
        state["metrics_down"] = True
        await monitor._discover(b, periodic=True)  # the routine rediscovery
        assert b.usable and b.kv_cache_tokens == 1999 * 16
        assert b.limits.kv_cache_tokens.source == "discovered"
        await monitor.close()


async def test_a_node_back_with_a_failing_metrics_page_is_not_given_its_old_pool(aiohttp_server):
    """A node that went down and came back (restarted, maybe with a smaller pool) while
    its /metrics fails has an unknown pool: keeping the last report could budget it at
    twice what it holds."""
    state: dict[str, Any] = {}
    node = await aiohttp_server(_node_app(state))
    fleet, adm, config = _monitored(str(node.make_url("")).rstrip("/"))
    b = fleet.get("n")
    assert b is not None
    async with aiohttp.ClientSession() as session:
        monitor = _monitor(fleet, adm, config, session)
        monitor.sync()
        for _ in range(100):
            if b.usable:
                break
            await asyncio.sleep(0.02)
        assert b.kv_cache_tokens == 1999 * 16
        state.update(down=True)
        for _ in range(200):
            if not b.healthy:
                break
            await asyncio.sleep(0.02)
        state.update(down=False, metrics_down=True, max_model_len=4096)
        for _ in range(200):
            if b.healthy:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert b.healthy and b.max_model_len == 4096
        assert not b.usable and b.limits.kv_cache_tokens.source == "unknown"
        await monitor.close()


@pytest.mark.parametrize(
    "due",
    [
        {"rediscover_interval_s": 0.05},
        {"load_feedback": {"enabled": True, "interval_s": 0.05}},
    ],
    ids=["rediscovery", "load-scrape"],
)
async def test_an_unhealthy_node_is_not_polled_in_a_tight_loop(
    aiohttp_server: Any, due: dict[str, Any]
) -> None:
    """Rediscovery and load scrapes wait for health, and their due times wake nothing:
    an unhealthy node's watcher wakes once per health interval, not every 10 ms once
    such a time has passed."""
    state: dict[str, Any] = {"down": True}
    node = await aiohttp_server(_node_app(state))
    fleet, adm, config = _monitored(str(node.make_url("")).rstrip("/"), interval_s=1.0, **due)
    loops = [0]
    end_pause = adm.end_pause

    def counting(b: object, now: float) -> None:
        loops[0] += 1
        end_pause(b, now)  # type: ignore[arg-type]

    adm.end_pause = counting  # type: ignore[method-assign, assignment]
    async with aiohttp.ClientSession() as session:
        monitor = _monitor(fleet, adm, config, session)
        monitor.sync()
        await asyncio.sleep(1.5)
        await monitor.close()
    assert loops[0] <= 4, loops[0]  # one per health interval (1 s), not ~100 a second


async def test_close_returns_within_its_bound_though_a_watcher_lost_its_cancel(monkeypatch):
    """A watcher whose cancel was lost (a client that returns the answer landing with
    it) does not hold the gateway's shutdown: close waits at most CLOSE_S for it."""
    monkeypatch.setattr("kvgateway.upstream.monitor.CLOSE_S", 0.2)
    fleet, adm, config = _monitored("http://127.0.0.1:9")
    stop = asyncio.Event()

    async def stubborn(b: Backend) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.02)

    async with aiohttp.ClientSession() as session:
        monitor = _monitor(fleet, adm, config, session)
        monitor._supervise = stubborn  # type: ignore[method-assign]
        monitor.sync()
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await monitor.close()
        assert 0.2 <= loop.time() - started < 1.0
    stop.set()
    await asyncio.sleep(0.05)
