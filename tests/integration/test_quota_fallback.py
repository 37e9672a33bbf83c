"""Tenant rate limits when Redis goes away and comes back, in one process against a
real Redis: the replica judges each limit on its share (limit // live replicas) with
what it charged itself, says so once, and once Redis answers again tells it every charge
of the last minute, so the other replicas count them until they leave the window."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from redis.asyncio import Redis

from kvgateway.config.model import TenantLimits
from kvgateway.core.quota import REQUESTS, Charge, RateLimitHit
from kvgateway.ledger.connect import REDIS_FAILURES
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


async def test_a_redis_restarted_empty_is_told_the_last_minute_before_the_next_charge(
    redis_server: RedisServer,
) -> None:
    """Redis restarts without its data while this replica makes no call (another user of
    the client met the broken connection): the next charge finds the scripts gone, sends
    the last minute's charges first, and is judged with them, so a tenant at its limit
    stays refused for the rest of its minute."""
    client = Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    q = SharedQuotas(client, "t", "a", 0.5, shared=lambda: True, live=lambda: 1, clock=lambda: 0.0)
    try:
        got = [await q.try_charge("x", LIMITS, 1, 1, 0.0) for _ in range(6)]
        assert all(isinstance(g, Charge) for g in got)
        redis_server.stop()
        redis_server.start()
        with contextlib.suppress(*REDIS_FAILURES):
            await client.ping()  # the broken connection, met by another caller
        assert isinstance(await q.try_charge("x", LIMITS, 1, 1, 1.0), RateLimitHit)
        assert await client.get(KEY) == b"6"
    finally:
        await client.aclose()


async def test_a_charge_on_the_share_while_the_minute_is_sent_is_sent_too(
    redis_server: RedisServer,
) -> None:
    """Back from a fallback the replica sends the last minute's charges; one it judges
    on its share while that is under way (the ledger fell back again for a moment) is in
    neither the batch nor Redis, and goes with the next send: Redis ends up with every
    charge of the minute."""
    client = Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    now, shared = [0.0], [True]
    q = SharedQuotas(
        client, "t", "a", 0.5, shared=lambda: shared[0], live=lambda: 2, clock=lambda: now[0]
    )
    sending, go_on = asyncio.Event(), asyncio.Event()
    call = q._eval

    async def slow_import(name: str, src: str, keys: list[str], args: list[str | int]) -> Any:
        if name == "import":  # the batch is built; its round trip takes a while
            sending.set()
            await go_on.wait()
        return await call(name, src, keys, args)

    q._eval = slow_import  # type: ignore[method-assign]
    try:
        async with q.running():
            assert isinstance(await q.try_charge("x", LIMITS, 1, 1, now[0]), Charge)
            shared[0] = False  # the ledger's fallback: judged on the share, kept to send
            assert isinstance(await q.try_charge("x", LIMITS, 1, 1, now[0]), Charge)
            shared[0] = True
            await asyncio.wait_for(sending.wait(), 5)  # the flush loop sends the minute
            shared[0] = False
            assert isinstance(await q.try_charge("x", LIMITS, 1, 1, now[0]), Charge)
            shared[0] = True
            go_on.set()

            async def all_three() -> bool:
                return await client.get(KEY) == b"3"

            await eventually(all_three, timeout=5)
    finally:
        await client.aclose()


async def test_the_settle_loop_ends_though_a_redis_call_swallowed_its_cancel(
    redis_server: RedisServer,
) -> None:
    """On Python 3.11 the client's ``wait_for`` returns a reply that lands together with
    the task's cancel, and the cancel is lost: the block still ends within its bound,
    and the settlement still reaches Redis."""
    client = Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    q = SharedQuotas(client, "t", "a", 0.5, shared=lambda: True, live=lambda: 1, clock=lambda: 0.0)
    inside = asyncio.Event()
    send = q._send_adjustments
    calls = 0

    async def swallowing() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the loop's send: the cancel lands in it and is lost
            inside.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.3)
            return
        await send()

    q._send_adjustments = swallowing  # type: ignore[method-assign]
    try:
        charge = await q.try_charge("x", LIMITS, 1, 1, 0.0)
        assert isinstance(charge, Charge)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(10):
            async with q.running():
                q.settle(charge, 0, 0.0, served=False)  # wakes the loop's send
                await asyncio.wait_for(inside.wait(), 5)
                started = loop.time()
        assert loop.time() - started < 0.5 * 2 + 1.0
        assert calls == 2  # the block's own send after the loop
        assert await client.get(KEY) == b"0"  # the refund reached Redis
    finally:
        await client.aclose()
