"""What an absolute sync writes to Redis (after a lapsed lease or a fallback) and what
releases give back afterwards agree on every path: backends removed or replaced by a
reload while their requests run, prefix copies of a request Redis refused (real
redis-server; replicas in this process)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import pytest
from redis.asyncio import Redis

from kvgateway.config.load import parse_config
from kvgateway.core.demand import PrefixHint
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.reservation import Reservation
from kvgateway.core.shared_blocks import SharedBlocks
from kvgateway.errors import Saturated
from tests.support.eventually import eventually
from tests.support.ledger_replicas import (
    BUDGET,
    Replica,
    config_doc,
    demand,
    ledger_sum,
    replica,
)
from tests.support.redis_server import RedisServer


async def _lapse(url: str, rid: str) -> None:
    """Take ``rid``'s lease away, as a freeze longer than the lease would."""
    client = Redis.from_url(url)
    try:
        await client.zrem("{kvgw}:live", rid)
    finally:
        await client.aclose()


async def _held(url: str, rid: str, name: str = "n1") -> int:
    client = Redis.from_url(url)
    try:
        return int(await client.hget(f"{{kvgw}}:tok:{name}", rid) or 0)
    finally:
        await client.aclose()


async def _until(url: str, rid: str, want: int, name: str = "n1", within: float = 3.0) -> None:
    """Until Redis records ``want`` tokens held by ``rid`` on ``name`` (bounded)."""

    async def reached() -> bool:
        return await _held(url, rid, name) == want

    await eventually(reached, timeout=within, interval=0.02, what=f"{rid} holding {want}")


async def _no_stall(url: str, within: float = 5.0) -> None:
    """Until grants are no longer stalled (a lost lease stalls them; see ledger.scripts)."""
    client = Redis.from_url(url)

    async def unstalled() -> bool:
        return await client.zscore("{kvgw}:live", "!stall") is None

    try:
        await eventually(unstalled, timeout=within, what="grants unstalled")
    finally:
        await client.aclose()


async def _admit_all(url: str, r: Replica, n: int, tokens: int = 1000) -> list[Reservation]:
    await _no_stall(url)
    got = []
    for _ in range(n):
        try:
            got.append(await r.admission.admit(demand(tokens), 0.3))
        except Saturated:
            break
    return got


async def test_a_backend_removed_while_in_fallback_is_synced_back_to_nothing(
    redis_server: RedisServer,
) -> None:
    """A reload removes n2 while 3 requests run there; they end while Redis is slow
    (fallback: releases are not sent, the return sync writes the truth). The sync writes
    n2 too, as holding nothing: were only the active backends written, n2 would keep
    3,000 recorded, room lost to every replica."""
    url = redis_server.url
    doc = config_doc(url, credit_hold_s=0.0, name="n2")
    async with replica(url, "a", credit_hold_s=0.0) as a, replica(url, "b", credit_hold_s=0.0) as b:
        for r in (a, b):
            r.fleet.apply(parse_config(doc), {})
            r.admission.rebalance()
            for x in r.fleet.active:
                x.healthy = x.ever_healthy = True
        held = [await a.admission.admit(demand(1000), 1.0) for _ in range(3)]
        assert await ledger_sum(url, "n2") == 3000
        a.fleet.apply(parse_config(config_doc(url, credit_hold_s=0.0)), {})  # n2 goes
        a.admission.rebalance()
        client = Redis.from_url(url)
        try:
            await client.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
            await eventually(lambda: not a.ledger.in_shared_mode(), timeout=3, interval=0.02)
            for reservation in held:
                a.admission.release(reservation)
            await eventually(a.ledger.in_shared_mode, timeout=6)
        finally:
            await client.aclose()
        await _until(url, "a", 0, "n2")
        assert "n2" not in a.ledger._mine  # written once, then forgotten: gone, nothing held
        assert len(await _admit_all(url, b, 10)) == BUDGET // 1000


async def test_a_backend_replaced_by_a_reload_is_synced_under_its_name_whole(
    redis_server: RedisServer,
) -> None:
    """n1 given a new URL: its old object drains 3 requests, the new one runs 7. A sync
    writes the name's whole 10,000, so the old ones' releases leave 7,000 and another
    replica fits 3 more. Were the new object's 7,000 written alone, those releases would
    take 3,000 off it and another replica would fill the new node to 13,000 of 10,000."""
    url = redis_server.url
    async with replica(url, "a", credit_hold_s=0.0) as a, replica(url, "b", credit_hold_s=0.0) as b:
        old = [await a.admission.admit(demand(1000), 1.0) for _ in range(3)]
        doc = config_doc(url, credit_hold_s=0.0)
        doc["tiers"][0]["backends"][0]["url"] = "http://127.0.0.2:9"
        a.fleet.apply(parse_config(doc), {})
        a.admission.rebalance()
        a.node.healthy = a.node.ever_healthy = True
        new = [await a.admission.admit(demand(1000), 1.0) for _ in range(7)]
        await _lapse(url, "a")
        await asyncio.sleep(0.6)
        await _until(url, "a", 10_000)
        for r in old:
            a.admission.release(r)
        await _until(url, "a", 7000)
        assert len(await _admit_all(url, b, 10)) == 3
        for r in new:
            a.admission.release(r)


async def test_a_refused_payers_prefix_copy_left_to_a_follower_is_recorded(
    redis_server: RedisServer,
) -> None:
    """R pays for prefix blocks; while its confirm is out the other copy's payer ends,
    then Redis refuses R. The book keeps R's copy charged to a credited follower F, so
    Redis records the copy with F's grant: F gives it back when it ends, and a copy left
    unrecorded would have Redis undercount the replica by it for good."""
    url = redis_server.url
    router = PrefixRouter(PrefixIndex(), shared=SharedBlocks())
    keys = tuple(block_keys(list(range(4000, 4100)), 16))
    shared = replace(demand(1000), longest_prompt=100, prefix=PrefixHint(keys, 16))
    async with (
        replica(url, "a", lease_s=2.0, credit_hold_s=0.0, prefix=router) as a,
        replica(url, "b", lease_s=2.0, credit_hold_s=0.0) as b,
    ):
        q = await a.admission.admit(demand(2000), 1.0)
        p1 = await a.admission.admit(shared, 1.0)  # pays the prefix blocks
        await b.admission.admit(demand(5000), 1.0)
        reserve = a.ledger._calls.reserve
        box: dict[str, Reservation] = {}

        async def slow_reserve(*args: object, **kw: object) -> object:
            a.ledger._calls.reserve = reserve  # type: ignore[method-assign]
            p1.prefill_done()
            box["f"] = await a.admission.admit(shared, 1.0)  # credited P1's ready blocks
            p1.release()  # R's copy is now the one charged
            await _until(url, "a", 2000 + box["f"].tokens)
            await b.admission.admit(demand(1200), 1.0)  # B fills the room: R is refused
            return await reserve(*args, **kw)  # type: ignore[arg-type]

        a.ledger._calls.reserve = slow_reserve  # type: ignore[method-assign, assignment]
        with pytest.raises(Saturated):
            await a.admission.admit(shared, 0.3)  # R, refused by Redis
        f = box["f"]
        assert f.holding is not None and f.holding.credited_tokens > 0
        own = a.node.reserved_tokens - a.ledger.others_tokens(a.node)
        await _until(url, "a", own)  # the copy is recorded with F's grant
        f.release()
        await _until(url, "a", 2000)  # Q alone, as the book says
        q.release()


async def test_a_redis_restart_without_persistence_does_not_lend_room_in_use(
    redis_server: RedisServer,
) -> None:
    """Redis restarts empty while A runs 8,000 of n1's 10,000: a lost lease stalls every
    grant until each live replica has written its holdings again, so B gets the 2,000
    A leaves and no more. The first replica back, seeing the others at 0, would
    otherwise admit the whole budget (18,000 recorded)."""
    url = redis_server.url
    async with (
        replica(url, "a", lease_s=2.0, credit_hold_s=0.0) as a,
        replica(url, "b", lease_s=2.0, credit_hold_s=0.0) as b,
    ):
        held = [await a.admission.admit(demand(1000), 1.0) for _ in range(8)]
        redis_server.stop()
        redis_server.start()
        got: list[Reservation] = []
        deadline = asyncio.get_running_loop().time() + 6.0
        while asyncio.get_running_loop().time() < deadline and len(got) < 4:
            with contextlib.suppress(Saturated):
                got.append(await b.admission.admit(demand(1000), 1.0))
        assert len(got) == 2, len(got)  # the room A's running requests leave, no more
        await _until(url, "a", 8000)
        for r in (*held, *got):
            r.release()


async def test_a_lease_lost_while_redis_kept_its_data_stalls_nobody(
    redis_server: RedisServer,
) -> None:
    """Only a Redis that lost its data stalls grants: after a replica's own lapse (a
    freeze) or a clean stop of another process under the same identity (a supervisor that
    stopped waiting for its previous run's workers) a grant comes within 0.5 s, where a
    stall would hold every replica's grants for seconds."""
    url = redis_server.url
    async with replica(url, "a") as a, replica(url, "b") as b:
        async with replica(url, "a"):  # the same identity, stopped cleanly: leave()
            pass
        await _lapse(url, "b")
        await asyncio.sleep(0.6)  # both find their leases gone at their next heartbeat
        assert a.ledger.status().shared and b.ledger.status().shared
        assert await redis_server_stall(url) is None
        started = asyncio.get_running_loop().time()
        r = await b.admission.admit(demand(1000), 5.0)
        assert asyncio.get_running_loop().time() - started < 0.5
        r.release()


async def redis_server_stall(url: str) -> float | None:
    client = Redis.from_url(url)
    try:
        return await client.zscore("{kvgw}:live", "!stall")
    finally:
        await client.aclose()


async def test_an_outage_longer_than_every_lease_does_not_lend_room_in_use(
    redis_server: RedisServer,
) -> None:
    """Redis frozen past every replica's lease, its data kept (a Sentinel failover, a
    long GC of the Redis host): the first replica back finds the others' leases lapsed;
    deleting their holdings as it reads them would let it take their room (more than
    the budget recorded, more requests than the node holds). Grants stall as after a
    restart without persistence, until the others have written theirs again.
    Here the leases are made to lapse in Redis (as the freeze would) just after A's
    heartbeat, and B asks for room at once: B's call comes first."""
    url = redis_server.url
    async with (
        replica(url, "a", lease_s=1.0, credit_hold_s=0.0) as a,
        replica(url, "b", lease_s=1.0, credit_hold_s=0.0) as b,
    ):
        held = [await a.admission.admit(demand(1000), 1.0) for _ in range(8)]
        await _until(url, "a", 8000)
        client = Redis.from_url(url)
        try:
            renewed = await client.zscore("{kvgw}:live", "a")

            async def renewed_again() -> bool:
                return await client.zscore("{kvgw}:live", "a") != renewed

            await eventually(renewed_again, timeout=2.0, interval=0.005, what="a renews")
            await client.zadd("{kvgw}:live", {"a": 1, "b": 1})  # both leases long gone
        finally:
            await client.aclose()
        got: list[Reservation] = []
        deadline = asyncio.get_running_loop().time() + 6.0
        while asyncio.get_running_loop().time() < deadline and len(got) < 4:
            with contextlib.suppress(Saturated):
                got.append(await b.admission.admit(demand(1000), 1.0))
        assert len(got) <= 2, len(got)  # the room A's running requests leave, no more
        await _until(url, "a", 8000, within=6.0)
        for r in (*held, *got):
            r.release()


async def test_a_redis_out_of_memory_refuses_grants_too_not_only_releases(
    redis_server: RedisServer,
) -> None:
    """With Redis at maxmemory (noeviction) every script is refused at its first write,
    grants as well as releases: the replica stays in the fallback with nothing recorded.
    A grant script writing on (its first write, a delete, passes Redis' memory check)
    while releases are refused would let holdings only grow, and the replica would flap
    between fallback and shared every second."""
    url = redis_server.url
    async with replica(url, "a", lease_s=2.0, credit_hold_s=0.0) as a:
        r = await a.admission.admit(demand(1000), 1.0)
        r.release()
        await _until(url, "a", 0)
        redis_server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        redis_server.command("CONFIG", "SET", "maxmemory", "1")
        try:
            for _ in range(5):
                with contextlib.suppress(Saturated):
                    got = await a.admission.admit(demand(1000), 0.5)
                    got.release()
                await asyncio.sleep(0.3)
            assert not a.ledger.status().shared  # in the fallback, and staying there
            client = Redis.from_url(url)
            try:
                assert int(await client.hget("{kvgw}:tok:n1", "a") or 0) == 0
            finally:
                await client.aclose()
        finally:
            redis_server.command("CONFIG", "SET", "maxmemory", "0")


class _Beats:
    """The ledger's HEARTBEAT script called as replicas would (leases in ms)."""

    def __init__(self, url: str, lease_ms: int = 500, stall_ms: int = 650) -> None:
        import redis

        from kvgateway.ledger.scripts import HEARTBEAT, Keys

        self.client = redis.Redis.from_url(url)
        self.keys = Keys("kvgw")
        self.script = self.client.register_script(HEARTBEAT)
        self.lease, self.stall = lease_ms, stall_ms
        self.epochs: dict[str, str] = {}

    def beat(self, me: str, held: int | None = None) -> dict[str, int]:
        k = self.keys
        out = self.script(
            keys=[k.live, k.epoch, k.tokens("n1"), k.seqs("n1"), k.waiting("n1")],
            args=[
                *(me, self.lease, int(held is not None), self.epochs.get(me, "0"), self.stall),
                *(held or 0, 1 if held else 0, 0),
            ],
        )
        epoch = out[3]
        self.epochs[me] = epoch.decode() if isinstance(epoch, bytes) else str(epoch)
        return {"lapsed": int(out[1]), "stall_ms": int(out[2])}


def test_a_replica_starting_during_an_outage_stalls_as_the_first_back(
    redis_server: RedisServer,
) -> None:
    """A replica that started during the outage (no epoch known yet) and is first back
    stalls grants as the first back does, and the stall holds while the others write
    back what they hold."""
    b = _Beats(redis_server.url)
    b.beat("A", 20000)
    b.beat("B", 9000)
    time.sleep(0.7)  # every lease lapses, Redis keeps its data
    assert b.beat("D")["stall_ms"] > 0
    assert b.beat("A", 20000)["stall_ms"] > 0  # the stall holds while the others write back


def test_one_replica_back_while_another_is_live_stalls_nobody(redis_server: RedisServer) -> None:
    """A back from a freeze while B is live, C's lease having lapsed just before (killed
    -9): that is no outage, and nothing stalls."""
    b = _Beats(redis_server.url, lease_ms=1000)
    for me in ("A", "B", "C"):
        b.beat(me)
    start = time.monotonic()
    b.beat("A")  # A's last beat before its freeze
    b.beat("B")

    def at(t: float) -> None:
        time.sleep(max(0.0, start + t - time.monotonic()))

    at(0.1)
    b.beat("C")  # C's last beat, then it dies: its lease lapses at 1.1 s
    for t in (0.25, 0.5, 0.75, 1.0):  # B beats every lease / 4; A is frozen
        at(t)
        b.beat("B")
    at(1.15)  # A's lease lapsed at 1.0 (B swept it), C's at 1.1; B sweeps next at 1.25
    assert b.beat("A") == {"lapsed": 1, "stall_ms": 0}
    assert b.client.zscore("{kvgw}:live", "!stall") is None
