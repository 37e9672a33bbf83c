"""Tenant rate limits when Redis goes away and comes back, in one process against a
real Redis: the replica judges each limit on its share (limit // live replicas) with
what it charged itself, says so once, and once Redis answers again tells it every charge
of the last minute, so the other replicas count them until they leave the window."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from kvgateway.config.model import TenantLimits
from kvgateway.core.quota import REQUESTS, Charge, RateLimitHit
from kvgateway.ledger.quotas import SharedQuotas
from tests.support.eventually import eventually
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow

KEY = "{t}:qt:requests_per_minute:x"
LIMITS = TenantLimits(requests_per_minute=6)


async def test_a_replica_cut_off_keeps_its_share_then_tells_redis_what_it_charged(
    redis_server: RedisServer,
) -> None:
    client = Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    now = [0.0]
    flips: list[bool] = []
    a = SharedQuotas(
        client,
        "t",
        "a",
        0.5,
        shared=lambda: True,
        live=lambda: 2,
        clock=lambda: now[0],
        on_fallback=flips.append,
    )
    try:
        async with a.running():
            assert isinstance(await a.try_charge("x", LIMITS, 1, 1, now[0]), Charge)
            assert await client.get(KEY) == b"1"
            redis_server.stop()
            got = [await a.try_charge("x", LIMITS, 1, 1, now[0]) for _ in range(3)]
            # Its share is 6 // 2 = 3, and the charge Redis took counts in it.
            assert [isinstance(g, Charge) for g in got] == [True, True, False]
            hit = got[2]
            assert isinstance(hit, RateLimitHit) and (hit.value, hit.used) == (3, 3)
            assert flips == [True]  # said once, however many calls failed
            status = a.status("x", LIMITS, now[0])[REQUESTS]
            assert (status.limit, status.remaining) == (3, 0)

            redis_server.start()  # without its data: it holds none of the three
            now[0] = 2.0

            async def told() -> bool:
                return await client.get(KEY) == b"3"

            await eventually(told, timeout=10)
            assert flips == [True, False]
            # Another replica sees the three: 3 more this minute, wherever they come from.
            b = SharedQuotas(
                client, "t", "b", 0.5, shared=lambda: True, live=lambda: 2, clock=lambda: now[0]
            )
            more = [await b.try_charge("x", LIMITS, 1, 1, now[0]) for _ in range(4)]
            assert [isinstance(g, Charge) for g in more] == [True, True, True, False]
    finally:
        await client.aclose()


async def test_scripts_lost_by_redis_are_loaded_again(redis_server: RedisServer) -> None:
    """A Redis that forgot its scripts (SCRIPT FLUSH, a restart between two calls)
    answers NOSCRIPT: the script is loaded again and the charge goes through."""
    client = Redis.from_url(redis_server.url, socket_timeout=1)
    q = SharedQuotas(client, "t", "a", 1.0, shared=lambda: True, live=lambda: 1, clock=lambda: 0.0)
    try:
        assert isinstance(await q.try_charge("x", LIMITS, 1, 1, 0.0), Charge)
        await client.script_flush()
        assert isinstance(await q.try_charge("x", LIMITS, 1, 1, 0.0), Charge)
        assert await client.get(KEY) == b"2"
    finally:
        await client.aclose()
