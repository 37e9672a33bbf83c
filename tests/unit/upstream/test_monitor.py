"""The backend monitor against a real simulated node on loopback."""

import asyncio
import dataclasses

import aiohttp

from kvgateway.config.load import parse_config
from kvgateway.core.admission import Admission
from kvgateway.core.fleet import Fleet
from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.server import create_node_app as create_node
from kvgateway.upstream.monitor import Monitor
from tests.support.fleet import ENCODINGS, SERVED


async def test_a_crashing_watcher_is_restarted_and_health_keeps_updating(aiohttp_server):
    settings = dataclasses.replace(get_profile("gpu24-8b"), name="n", model=SERVED, seed=1)
    node = await aiohttp_server(create_node(settings, encodings=ENCODINGS))
    url = str(node.make_url("")).rstrip("/")
    config = parse_config(
        {
            "models": [{"name": "m", "served_name": SERVED}],
            "health": {"interval_s": 0.05, "timeout_s": 1, "rediscover_interval_s": 60},
            "load_feedback": {"enabled": False},
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
    calls = [0]

    def flaky_config():
        # The watcher's third look at its config blows up (a bug in a watcher).
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("bug in a watcher")
        return config

    crashed = []
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
                if not b.healthy:
                    break
                await asyncio.sleep(0.02)
            assert not b.healthy
        finally:
            await monitor.close()
