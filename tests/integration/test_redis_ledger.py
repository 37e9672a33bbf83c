"""The Redis ledger against a real redis-server: replicas in one test process, each with
its own Fleet and Admission (the multi-process versions are in test_shared_ledger.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvgateway.core.admission import Admission
from kvgateway.core.demand import PrefixHint
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.shared_blocks import SharedBlocks
from kvgateway.errors import Saturated
from kvgateway.ledger.connect import redis_client
from kvgateway.ledger.redis_ledger import RedisLedger
from tests.support.eventually import eventually
from tests.support.ledger_replicas import (
    BUDGET,
    Replica,
    demand,
    fleet_and_config,
    ledger_sum,
    replica,
    settles_at,
)
from tests.support.redis_server import RedisServer


async def _evalsha_calls(url: str) -> int:
    client = Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    finally:
        await client.aclose()


async def test_two_replicas_never_reserve_more_than_the_budget(redis_server: RedisServer) -> None:
    async with replica(redis_server.url, "a") as a, replica(redis_server.url, "b") as b:
        assert a.ledger.status().shared and b.ledger.status().shared
        peak = 0

        async def one(r: Replica) -> None:
            async with r.admission.reserve(demand(1000), 20.0):
                nonlocal peak
                peak = max(peak, await ledger_sum(redis_server.url))
                await asyncio.sleep(0.02)

        await asyncio.gather(*(one(r) for _ in range(20) for r in (a, b)))
        assert 0 < peak <= BUDGET
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_release_wakes_a_waiter_in_another_replica(redis_server: RedisServer) -> None:
    async with (
        replica(redis_server.url, "a", lease_s=20) as a,
        replica(redis_server.url, "b", lease_s=20) as b,
    ):
        held = await a.admission.admit(demand(8000), 1.0)
        # b does not know yet: its local grant is refused by Redis and it waits.
        waiting = asyncio.create_task(b.admission.admit(demand(4000), 5.0))
        await asyncio.sleep(0.2)
        assert not waiting.done() and b.node.reserved_tokens >= 8000
        started = time.monotonic()
        held.release()
        got = await asyncio.wait_for(waiting, 4.0)
        # Woken by pub/sub, well before a heartbeat (every 5 s here) would have told it.
        assert time.monotonic() - started < 2.5
        got.release()


async def test_a_replica_that_stops_heartbeating_loses_its_holdings(
    redis_server: RedisServer,
) -> None:
    async with replica(redis_server.url, "b", lease_s=1.0) as b:
        fleet, cfg = fleet_and_config(redis_server.url, 1.0)
        dead = RedisLedger(cfg, "dead", fleet, redis_client(cfg))
        adm = Admission.for_fleet(fleet, lambda: fleet.config, time.monotonic, ledger=dead)
        async with dead.running(adm):
            await adm.admit(demand(9000), 1.0)  # never released
            dead._shared = False
        with pytest.raises(Saturated):
            await b.admission.admit(demand(4000), 0.3)
        started = time.monotonic()
        r = await b.admission.admit(demand(4000), 3.0)
        assert time.monotonic() - started < 1.5  # within the 1 s lease (+ a heartbeat)
        r.release()


async def test_restart_with_the_same_identity_does_not_double_count(
    redis_server: RedisServer,
) -> None:
    async with replica(redis_server.url, "a") as a:
        r = await a.admission.admit(demand(6000), 1.0)
        a.ledger._shared = False
        del r
    assert await ledger_sum(redis_server.url) == 6000
    async with replica(redis_server.url, "a") as again:
        assert await ledger_sum(redis_server.url) == 0
        r2 = await again.admission.admit(demand(9000), 1.0)
        r2.release()


async def test_redis_down_falls_back_to_a_share_then_returns(redis_server: RedisServer) -> None:
    async with replica(redis_server.url, "a") as a, replica(redis_server.url, "b") as b:
        await asyncio.sleep(0.3)  # a heartbeat: both see 2 live replicas
        assert a.ledger.status().live_replicas == 2
        kept = await a.admission.admit(demand(3000), 1.0)
        redis_server.stop()
        # The next call fails within timeout_s; the replica falls back, it does not fail:
        # past what Redis records for it once its lease (1 s) has run out.
        r = await a.admission.admit(demand(1000), 3.0)
        r.release()
        assert not a.ledger.status().shared and a.ledger.status().reason
        # Blind: a's share is half the budget and it already holds 3000 of it.
        with pytest.raises(Saturated):
            await a.admission.admit(demand(3000), 0.2)
        r = await a.admission.admit(demand(2000), 0.2)
        redis_server.start()
        await eventually(lambda: a.ledger.status().shared and b.ledger.status().shared, timeout=4)
        assert a.statuses[-1].shared and a.ledger.status().fallbacks == 1
        # Counted once: what a holds, written as absolute values on return.
        assert await ledger_sum(redis_server.url) == 5000
        r.release()
        kept.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_started_while_redis_is_down_serves_a_share_then_joins(
    redis_server: RedisServer,
) -> None:
    redis_server.stop()
    async with replica(redis_server.url, "a", lease_s=1.0) as a:
        status = a.ledger.status()
        assert not status.shared and "unreachable" in status.reason
        # Never saw the real count: fallback_replicas (2) is assumed.
        assert a.node.free_tokens == BUDGET // 2
        r = await a.admission.admit(demand(4000), 0.2)
        with pytest.raises(Saturated):
            await a.admission.admit(demand(2000), 0.2)
        redis_server.start()
        await eventually(lambda: a.ledger.status().shared, timeout=4)
        assert a.ledger.status().shared and a.ledger.status().live_replicas == 1
        assert await ledger_sum(redis_server.url) == 4000
        assert a.node.free_tokens == BUDGET - 4000  # alone: the whole budget again
        r.release()


async def test_new_requests_leave_freed_room_to_another_replicas_queue(
    redis_server: RedisServer,
) -> None:
    async with (
        replica(redis_server.url, "a", lease_s=20) as a,
        replica(redis_server.url, "b", lease_s=20) as b,
    ):
        held = await a.admission.admit(demand(8000), 1.0)
        big = asyncio.create_task(b.admission.admit(demand(4000), 5.0))
        await asyncio.sleep(0.2)
        assert not big.done() and b.admission.queue_depth == 1
        # 2,000 tokens are free, but b's request has been queued for them longer: a new
        # request at a queues behind it instead of taking the room first.
        small = asyncio.create_task(a.admission.admit(demand(1000), 5.0))
        await asyncio.sleep(0.2)
        assert not small.done() and a.admission.queue_depth == 1
        held.release()
        got_big = await asyncio.wait_for(big, 2.0)
        got_small = await asyncio.wait_for(small, 2.0)
        got_big.release()
        got_small.release()
        assert await settles_at(redis_server.url, 0) == 0
        # Nobody queues any more: new requests pass at once again.
        r = await a.admission.admit(demand(1000), 0.01)
        r.release()


async def test_a_request_that_fits_in_credit_skips_redis(redis_server: RedisServer) -> None:
    async with replica(redis_server.url, "a", credit_hold_s=0.2) as a:
        first = await a.admission.admit(demand(2000), 1.0)
        first.release()
        # The room stays recorded as a's for the hold: nobody else can count on it.
        assert await ledger_sum(redis_server.url) == 2000
        calls = await _evalsha_calls(redis_server.url)
        second = await a.admission.admit(demand(1900), 1.0)
        third = await a.admission.admit(demand(1500), 1.0)  # more than is left: asks
        assert a.ledger.credit_grants == 1
        assert await _evalsha_calls(redis_server.url) == calls + 1
        # What is held is recorded once: the credit's 2,000 and 1,400 more asked for.
        assert await ledger_sum(redis_server.url) == 3400
        second.release()
        third.release()
        # Idle for the hold, the credit goes back.
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_refusal_elsewhere_takes_the_credit_back_at_once(
    redis_server: RedisServer,
) -> None:
    async with (
        replica(redis_server.url, "a", lease_s=8, credit_hold_s=2.0) as a,
        replica(redis_server.url, "b", lease_s=8, credit_hold_s=2.0) as b,
    ):
        held = await a.admission.admit(demand(6000), 1.0)
        held.release()  # 6,000 kept as a's credit for up to 2 s
        assert await ledger_sum(redis_server.url) == 6000
        started = time.monotonic()
        # b has not heard of it (no release was published): Redis refuses b, b waits,
        # and the refusal, published, makes a give its credit back.
        got = await b.admission.admit(demand(6000), 3.0)
        assert time.monotonic() - started < 1.0, "b waited for the credit's hold"
        assert b.ledger.credit_grants == 0
        got.release()
        assert await settles_at(redis_server.url, 6000) == 6000  # b's credit now
        assert await settles_at(redis_server.url, 0, within=4.0) == 0


async def test_a_grant_that_waits_for_a_sync_is_recorded_once(redis_server: RedisServer) -> None:
    # A sync writes this replica's holdings as absolute values (here a resync, as after a
    # confirm cancelled mid-call), once the confirms already out have answered. A request
    # granted locally meanwhile waits for the sync and is then recorded on its own: it
    # must not be in the snapshot too (counted twice, or never released from Redis when
    # Redis then refuses it).
    async with replica(redis_server.url, "a", lease_s=20, credit_hold_s=0) as a:
        kept = await a.admission.admit(demand(1000), 1.0)
        ctl = Redis.from_url(redis_server.url)
        try:
            await ctl.execute_command("CLIENT", "PAUSE", "400", "WRITE")  # scripts wait
            out = asyncio.create_task(a.admission.admit(demand(300), 3.0))
            await asyncio.sleep(0.05)  # its confirm is out
            a.ledger._resync = True
            sync = asyncio.create_task(a.ledger._heartbeat_once())
            await asyncio.sleep(0.05)  # the sync waits for that confirm
            late = await a.admission.admit(demand(500), 3.0)  # granted, parked, confirmed
            await sync
            first = await out
            assert a.ledger.status().shared
            assert await ledger_sum(redis_server.url) == 1800
        finally:
            await ctl.aclose()
        for r in (late, first, kept):
            r.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_replica_whose_lease_lapsed_writes_its_holdings_again(
    redis_server: RedisServer,
) -> None:
    # A replica frozen (SIGSTOP, a long GC pause, a VM migration) past its lease: the
    # others deleted its holdings while its requests still run. Its next call to Redis
    # learns the lease had lapsed and it writes them again, so no one admits on top.
    async with (
        replica(redis_server.url, "a", lease_s=1.0) as a,
        replica(redis_server.url, "b", lease_s=1.0) as b,
    ):
        held = await a.admission.admit(demand(6000), 1.0)
        ctl = Redis.from_url(redis_server.url)
        try:
            await ctl.zrem("{kvgw}:live", "a")  # a's lease ran out while it was frozen
        finally:
            await ctl.aclose()
        other = await b.admission.admit(demand(3000), 1.0)  # b's call drops a's holdings
        assert await settles_at(redis_server.url, 9000) == 9000  # a's next heartbeat
        with pytest.raises(Saturated):
            await b.admission.admit(demand(4000), 0.6)
        other.release()
        held.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_replica_that_stops_waiting_leaves_the_wait_set_at_once(
    redis_server: RedisServer,
) -> None:
    # b's request is refused (b now waits there, so new requests elsewhere leave the
    # room to it), then gives up. b must leave the wait set then, not at its next
    # heartbeat (lease_s / 4 = 2.5 s here), or a's new requests wait for nothing.
    async with (
        replica(redis_server.url, "a", lease_s=10) as a,
        replica(redis_server.url, "b", lease_s=10) as b,
    ):
        held = await a.admission.admit(demand(8000), 1.0)
        with pytest.raises(Saturated):
            await b.admission.admit(demand(4000), 0.3)
        held.release()
        assert await settles_at(redis_server.url, 0) == 0
        ctl = Redis.from_url(redis_server.url)
        try:
            assert await ctl.zrange("{kvgw}:wait:n1", 0, -1) == []
        finally:
            await ctl.aclose()
        started = time.monotonic()
        r = await a.admission.admit(demand(4000), 3.0)
        assert time.monotonic() - started < 0.5
        r.release()


async def test_a_fallback_keeps_within_what_redis_records_while_the_lease_may_live(
    redis_server: RedisServer,
) -> None:
    # Redis gone for this replica (it may be there for the others, who count this
    # replica at what Redis records for it until its lease runs out): it keeps within
    # that; once the lease has run out for sure, within its blind share (the whole
    # budget: it was alone).
    async with replica(redis_server.url, "a", lease_s=2.0, credit_hold_s=0) as a:
        kept = await a.admission.admit(demand(3000), 1.0)
        redis_server.stop()
        started = time.monotonic()
        with pytest.raises(Saturated):
            await a.admission.admit(demand(1000), 0.5)
        assert not a.ledger.status().shared
        r = await a.admission.admit(demand(1000), 4.0)  # once the lease is over
        assert time.monotonic() - started < 2.6
        with pytest.raises(Saturated):
            await a.admission.admit(demand(6500), 0.2)  # 3000 + 1000 + 6500 > 10000
        redis_server.start()
        await eventually(lambda: a.ledger.status().shared, timeout=4)
        assert await ledger_sum(redis_server.url) == 4000
        r.release()
        kept.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_credit_goes_back_when_another_replica_queues_on_its_own_view(
    redis_server: RedisServer,
) -> None:
    # a filled the node in a burst and keeps the freed room as credit while it runs one
    # request at a time (each use keeps the credit alive). b's view says the node is
    # full, so b queues without asking Redis: its entering the wait set is announced,
    # and a gives the credit back.
    async with (
        replica(redis_server.url, "a", lease_s=10, timeout_s=2.0) as a,
        replica(redis_server.url, "b", lease_s=10, timeout_s=2.0) as b,
    ):
        burst = [await a.admission.admit(demand(1000), 1.0) for _ in range(10)]
        for r in burst:
            r.release()
        stop = False

        async def trickle() -> None:
            while not stop:
                async with a.admission.reserve(demand(1000), 5.0):
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(trickle())
        try:
            # b hears of a's holdings (a release or a heartbeat).
            await eventually(lambda: b.ledger.others_tokens(b.node) > 8000, timeout=5)
            started = time.monotonic()
            got = await b.admission.admit(demand(1000), 3.0)
            assert time.monotonic() - started < 1.0
            got.release()
        finally:
            stop = True
            await task


async def test_a_request_queued_in_the_fallback_and_granted_after_it_is_recorded(
    redis_server: RedisServer,
) -> None:
    async with replica(redis_server.url, "a", lease_s=10, credit_hold_s=0) as a:
        held = await a.admission.admit(demand(6000), 1.0)
        redis_server.stop()
        await eventually(lambda: not a.ledger.status().shared, timeout=6)
        waiting = asyncio.create_task(a.admission.admit(demand(4500), 30.0))
        await asyncio.sleep(0.2)
        redis_server.start()
        await eventually(lambda: a.ledger.status().shared, timeout=10)
        held.release()
        late = await asyncio.wait_for(waiting, 5.0)  # granted once shared again
        assert await settles_at(redis_server.url, 4500) == 4500
        late.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_steady_holder_keeps_no_credit_where_another_replica_waits(
    redis_server: RedisServer,
) -> None:
    # b runs one request at a time and would keep each one's room as credit, taking it
    # again without asking Redis; a's request queues for that room. Once a waits there,
    # b keeps no credit on that backend, so Redis decides who goes first.
    async with (
        replica(redis_server.url, "a", lease_s=10) as a,
        replica(redis_server.url, "b", lease_s=10) as b,
    ):
        held = [await a.admission.admit(demand(1000), 1.0) for _ in range(9)]
        stop = False

        async def trickle() -> None:
            while not stop:
                async with b.admission.reserve(demand(1000), 5.0):
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.005)

        task = asyncio.create_task(trickle())
        try:
            await asyncio.sleep(0.3)
            for _ in range(4):
                started = time.monotonic()
                r = await a.admission.admit(demand(1000), 2.0)
                assert time.monotonic() - started < 1.0
                await asyncio.sleep(0.02)
                r.release()
                await asyncio.sleep(0.1)
        finally:
            stop = True
            await task
        for r in held:
            r.release()
        assert await settles_at(redis_server.url, 0, within=4.0) == 0


async def test_a_grant_made_as_a_return_sync_begins_is_recorded_once(
    redis_server: RedisServer,
) -> None:
    # A request queued in the fallback is granted in the same step as the sync that ends
    # the fallback starts (here: a release inside its first call to Redis). The sync's
    # snapshot holds the grant, so its confirm must not record it again.
    async with replica(redis_server.url, "a", lease_s=10, credit_hold_s=0) as a:
        held = await a.admission.admit(demand(6000), 1.0)
        redis_server.stop()
        await eventually(lambda: not a.ledger.status().shared, timeout=6)
        waiting = asyncio.create_task(a.admission.admit(demand(4500), 30.0))
        await asyncio.sleep(0.2)
        calls = a.ledger._calls
        ping = calls.ping

        async def ping_then_release() -> None:
            await ping()
            if not held.released:
                held.release()  # the waiter is granted now, before the snapshot

        calls.ping = ping_then_release  # type: ignore[method-assign]
        redis_server.start()
        late = await asyncio.wait_for(waiting, 10.0)
        await eventually(lambda: a.ledger.status().shared, timeout=10)
        assert await settles_at(redis_server.url, 4500) == 4500
        late.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_grant_given_up_before_its_confirm_gives_nothing_back(
    redis_server: RedisServer,
) -> None:
    # A resync is out (its call held here). A release hands the room to a queued request,
    # whose client goes away in the same step: it is released before its confirm ran.
    # Neither the sync's snapshot nor Redis ever held it, so nothing may be given back.
    async with replica(redis_server.url, "a", lease_s=10, credit_hold_s=0) as a:
        x = await a.admission.admit(demand(6000), 1.0)
        y = await a.admission.admit(demand(2000), 1.0)
        waiting = asyncio.create_task(a.admission.admit(demand(4500), 30.0))
        await asyncio.sleep(0.2)
        gate = await _hold_a_resync(a)
        x.release()  # the queued request is granted...
        waiting.cancel()  # ...and its client goes away in the same step
        gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert await settles_at(redis_server.url, 2000) == 2000
        y.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_grant_made_while_a_sync_fails_is_in_the_next_snapshot(
    redis_server: RedisServer,
) -> None:
    # A resync is out when a queued request is granted; the resync then fails (the
    # replica falls back) and the grant runs locally. The sync that ends the fallback
    # must write it, or another replica could be granted into its room.
    async with replica(redis_server.url, "a", lease_s=10, credit_hold_s=0) as a:
        x = await a.admission.admit(demand(6000), 1.0)
        waiting = asyncio.create_task(a.admission.admit(demand(4500), 30.0))
        await asyncio.sleep(0.2)
        gate = await _hold_a_resync(a, fail=True)
        gate.set()  # the sync fails at its next step...
        x.release()  # ...and the queued request is granted in this one, while it is out
        w = await asyncio.wait_for(waiting, 5.0)
        assert not a.ledger.status().shared
        await eventually(lambda: a.ledger.status().shared, timeout=10)
        assert await settles_at(redis_server.url, 4500) == 4500
        w.release()
        assert await settles_at(redis_server.url, 0) == 0


async def test_shared_prefix_blocks_stay_recorded_until_their_last_holder_ends(
    redis_server: RedisServer,
) -> None:
    # B's prompt shares A's 6 full blocks, credited while A runs. A ends first: the book
    # keeps one copy of those blocks charged (B's), and so must Redis, or the other
    # replicas see the node 96 tokens freer than it is while B runs.
    router = PrefixRouter(PrefixIndex(), shared=SharedBlocks())
    keys = tuple(block_keys(list(range(4000, 4100)), 16))
    shared = replace(demand(1000), longest_prompt=100, prefix=PrefixHint(keys, 16))
    async with replica(redis_server.url, "a", credit_hold_s=0, prefix=router) as a:
        first = await a.admission.admit(shared, 1.0)
        first.prefill_done()
        second = await a.admission.admit(shared, 1.0)
        assert second.holding is not None and second.holding.credited_tokens == 96
        assert await settles_at(redis_server.url, 1000 + 904) == 1904
        first.release()
        assert a.node.reserved_tokens == 1000
        assert await settles_at(redis_server.url, 1000) == 1000
        await asyncio.sleep(0.3)  # and it stays so
        assert await ledger_sum(redis_server.url) == 1000
        second.release()
        assert a.node.reserved_tokens == 0
        assert await settles_at(redis_server.url, 0) == 0


async def test_a_refused_follower_gives_back_the_shared_copy_it_took_over(
    redis_server: RedisServer,
) -> None:
    # B is credited A's blocks; A ends while B's reserve is out (the book keeps one copy
    # charged, now B's, and A gives Redis back all but it); then Redis refuses B. That
    # copy was recorded by A and must leave Redis with B: left, it would stay for good.
    router = PrefixRouter(PrefixIndex(), shared=SharedBlocks())
    keys = tuple(block_keys(list(range(4000, 4100)), 16))
    shared = replace(demand(1000), longest_prompt=100, prefix=PrefixHint(keys, 16))
    async with (
        replica(redis_server.url, "a", lease_s=2, credit_hold_s=0, prefix=router) as a,
        replica(redis_server.url, "b", lease_s=2, credit_hold_s=0) as b,
    ):
        first = await a.admission.admit(shared, 1.0)
        first.prefill_done()
        assert await settles_at(redis_server.url, 1000) == 1000
        other = await b.admission.admit(demand(8500), 1.0)  # a's view does not know yet
        assert await settles_at(redis_server.url, 9500) == 9500
        reserve = a.ledger._calls.reserve

        async def holder_ends_meanwhile(*args: Any, **kw: Any) -> Any:
            a.ledger._calls.reserve = reserve  # type: ignore[method-assign]
            first.release()
            return await reserve(*args, **kw)

        a.ledger._calls.reserve = holder_ends_meanwhile  # type: ignore[method-assign]
        again = await a.admission.admit(shared, 0.3)  # refused once, then uncredited
        again.release()
        assert await settles_at(redis_server.url, 8500) == 8500
        other.release()
        assert await settles_at(redis_server.url, 0) == 0
        assert a.node.reserved_tokens == 0


async def _hold_a_resync(a: Replica, *, fail: bool = False) -> asyncio.Event:
    """Start a resync of ``a`` whose heartbeat call waits for the returned gate, then
    answers (or, with ``fail``, raises a Redis error); returns once the sync is out. The
    heartbeat call is put back as it was after this one."""
    calls = a.ledger._calls
    heartbeat = calls.heartbeat
    gate = asyncio.Event()

    async def held(*args: Any, **kw: Any) -> list[int]:
        calls.heartbeat = heartbeat  # type: ignore[method-assign]
        await gate.wait()
        if fail:
            raise RedisError("injected")
        return await heartbeat(*args, **kw)

    calls.heartbeat = held  # type: ignore[method-assign]
    a.ledger._resync = True
    a.ledger._wake.set()
    await asyncio.sleep(0.1)
    assert a.ledger._sync_done is not None, "the resync is out"
    return gate
