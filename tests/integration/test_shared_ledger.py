"""Two gateway processes, one simulated node, one real Redis: the node's KV budget holds
across the gateways, a gateway killed with -9 gives its share back within the lease, and
Redis going away costs capacity (the local share, less what the others held while that
may still run), never an error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import aiohttp
import pytest

from tests.support.eventually import eventually
from tests.support.ledger_fleet import (
    GatewayProc,
    Sampler,
    chat,
    get_json,
    ledger_holds,
    ledger_says,
    ledger_sum,
    node_view,
    running_node,
    start_gateway,
    stop_gateway,
)
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow

# ~1k-token prompts generating 3k tokens each: ~4k KV tokens, 7 fit the node's budget.
# 12 at once per gateway would overflow the node if a gateway reserved alone.
PROMPT_WORDS, MAX_TOKENS, PER_GATEWAY = 1000, 3000, 12


@pytest.fixture
async def node() -> AsyncIterator[str]:
    async with running_node(time_scale=40) as url:
        yield url


@pytest.fixture
async def gateways() -> AsyncIterator[list[GatewayProc]]:
    running: list[GatewayProc] = []
    yield running
    for g in running:
        await stop_gateway(g)


def _series(text: str) -> dict[str, float]:
    """'name{first label' -> value, for the per-backend gauges."""
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_backend_") and "{" in line:
            out[line.split(",")[0]] = float(line.rsplit(" ", 1)[1])
    return out


async def _node_state(node: str) -> dict[str, object]:
    return await get_json(node + "/sim/state")


async def _load(urls: list[str], per: int) -> list[int]:
    timeout = aiohttp.ClientTimeout(total=50)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        return await asyncio.gather(
            *(chat(s, u, PROMPT_WORDS, MAX_TOKENS) for u in urls for _ in range(per))
        )


async def _two(
    tmp_path: Path, node: str, redis: RedisServer, gateways: list[GatewayProc]
) -> tuple[GatewayProc, GatewayProc]:
    a = await start_gateway(tmp_path, "a", node, redis.url)
    gateways.append(a)
    b = await start_gateway(tmp_path, "b", node, redis.url)
    gateways.append(b)
    return a, b


async def _reserves_nothing(gateway_url: str) -> bool:
    return bool((await node_view(gateway_url))["reserved_tokens"] == 0)


async def test_two_gateways_share_the_node_budget(
    tmp_path: Path, node: str, redis_server: RedisServer, gateways: list[GatewayProc]
) -> None:
    a, b = await _two(tmp_path, node, redis_server, gateways)
    budget = (await node_view(a.url))["budget_tokens"]
    sampler, stop = Sampler(redis_server.url), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    statuses = await _load([a.url, b.url], PER_GATEWAY)
    stop.set()
    await sampling
    assert statuses == [200] * len(statuses)
    state = await _node_state(node)
    assert state["preemptions"] == 0
    assert sampler.samples > 20 and 0 < sampler.peak <= budget
    # Each gateway admitted more than its half at some point: the budget was shared.
    await asyncio.sleep(0.2)
    assert await ledger_sum(redis_server.url) == 0
    for g in (a, b):
        ready = await get_json(g.url + "/ready")
        assert ready["ledger"]["shared"] is True and ready["ledger"]["live_replicas"] == 2


async def test_a_gateway_killed_mid_stream_loses_its_reservations_within_the_lease(
    tmp_path: Path, node: str, redis_server: RedisServer, gateways: list[GatewayProc]
) -> None:
    a, b = await _two(tmp_path, node, redis_server, gateways)
    timeout = aiohttp.ClientTimeout(total=50)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        held = [asyncio.create_task(chat(s, a.url, PROMPT_WORDS, 6000)) for _ in range(3)]
        for _ in range(100):
            if (await node_view(b.url))["reserved_tokens"] > 0 and (
                await ledger_sum(redis_server.url)
            ) >= 3 * 6000:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("a's reservations never showed in the ledger")
        # b's view holds a's reservations (admin, fleet gauge); its own gauge does not.
        async with s.get(b.url + "/metrics") as r:
            metrics = _series(await r.text())
        assert metrics['gateway_backend_reserved_tokens{backend="n0"'] == 0
        assert metrics['gateway_backend_fleet_reserved_tokens{backend="n0"'] >= 3 * 6000
        a.proc.kill()  # -9: no release, no goodbye
        await a.proc.wait()
        killed = time.monotonic()
        await asyncio.gather(*held, return_exceptions=True)
        # b sees the fleet-wide reservations on the node drop to nothing within the
        # lease (2 s) plus one heartbeat (0.5 s).
        await eventually(
            partial(_reserves_nothing, b.url),
            timeout=killed + 4.0 - time.monotonic(),
            what="a's holdings gone within its lease",
        )
        # b serves on with the whole budget.
        statuses = await asyncio.gather(*(chat(s, b.url, PROMPT_WORDS, 1500) for _ in range(6)))
    assert statuses == [200] * 6


async def test_redis_down_under_load_falls_back_without_errors_then_returns(
    tmp_path: Path, node: str, redis_server: RedisServer, gateways: list[GatewayProc]
) -> None:
    a, b = await _two(tmp_path, node, redis_server, gateways)
    load = asyncio.create_task(_load([a.url, b.url], PER_GATEWAY))
    await asyncio.sleep(0.5)
    redis_server.stop()
    for g in (a, b):
        for _ in range(100):
            ready = await get_json(g.url + "/ready")
            if not ready["ledger"]["shared"]:
                break
            await asyncio.sleep(0.05)
        assert "local share 1/2" in ready["ledger"]["fallback"], ready
        async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
            assert "gateway_ledger_fallback 1.0" in await r.text()
    statuses = await load
    assert all(st < 500 for st in statuses) and statuses.count(200) >= len(statuses) // 2
    assert (await _node_state(node))["preemptions"] == 0
    redis_server.start()
    for g in (a, b):
        await eventually(
            partial(ledger_says, g.url, "shared", True),
            timeout=5,
            what=f"{g.url} back on the shared ledger",
        )
    # Back to shared, counted once: a fresh load through both still fits the node.
    statuses = await _load([a.url, b.url], 6)
    assert statuses == [200] * 12
    await asyncio.sleep(0.2)
    assert await ledger_sum(redis_server.url) == 0
    assert (await _node_state(node))["preemptions"] == 0


async def test_workers_share_the_port_the_budget_and_the_metrics(
    tmp_path: Path, node: str, redis_server: RedisServer, gateways: list[GatewayProc]
) -> None:
    g = await start_gateway(tmp_path, "w", node, redis_server.url, "--workers", "2")
    gateways.append(g)
    await eventually(partial(ledger_says, g.url, "live_replicas", 2), timeout=5)
    budget = (await node_view(g.url))["budget_tokens"]
    sampler, stop = Sampler(redis_server.url), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    statuses = await _load([g.url], 2 * PER_GATEWAY)
    stop.set()
    await sampling
    assert statuses == [200] * len(statuses)
    assert (await _node_state(node))["preemptions"] == 0
    assert 0 < sampler.peak <= budget
    # Both workers served (each holds a lease) and /metrics adds up their counts.
    replicas = {(await get_json(g.url + "/ready"))["ledger"]["replica_id"] for _ in range(20)}
    async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
        text = await r.text()
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_requests_total{") and 'status="200"' in line
    )
    assert served == len(statuses), text[:2000]
    assert len(replicas) == 2, replicas


async def test_workers_without_a_shared_ledger_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="needs the shared ledger"):
        await start_gateway(tmp_path, "w", "http://127.0.0.1:9", None, "--workers", "2")


async def test_a_worker_killed_mid_stream_is_restarted_without_double_counting(
    tmp_path: Path, node: str, redis_server: RedisServer, gateways: list[GatewayProc]
) -> None:
    g = await start_gateway(tmp_path, "w", node, redis_server.url, "--workers", "2")
    gateways.append(g)
    workers = [
        int(p) for p in Path(f"/proc/{g.proc.pid}/task/{g.proc.pid}/children").read_text().split()
    ]
    assert len(workers) == 2
    timeout = aiohttp.ClientTimeout(total=50)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        held = [asyncio.create_task(chat(s, g.url, PROMPT_WORDS, 4000)) for _ in range(4)]
        await eventually(lambda: ledger_holds(redis_server.url, 4 * 4000), timeout=5)
        os.kill(workers[0], signal.SIGKILL)
        # The killed worker's streams break (the kernel may have given it all of them).
        await asyncio.gather(*held, return_exceptions=True)
        # Restarted under the same identity, whose lease it renews at once: had it added to
        # the dead worker's holdings instead of replacing them, they would never expire.
        ids: set[str] = set()

        async def both_seen_and_nothing_held() -> bool:
            # Connections the kernel steered to the dying worker fail: clients retry.
            with contextlib.suppress(aiohttp.ClientError):
                ids.add((await get_json(g.url + "/ready"))["ledger"]["replica_id"])
            return len(ids) == 2 and await ledger_sum(redis_server.url) == 0

        # Bounded by time, not tries: a restart on a loaded 2-core machine takes seconds.
        await eventually(both_seen_and_nothing_held, timeout=30, interval=0.1)
        statuses = await asyncio.gather(*(chat(s, g.url, PROMPT_WORDS, 1500) for _ in range(8)))
    assert statuses == [200] * 8
    assert (await _node_state(node))["preemptions"] == 0


@pytest.mark.timeout(120)
async def test_without_redis_a_replica_leaves_what_the_others_held_while_it_may_run(
    tmp_path: Path, redis_server: RedisServer, gateways: list[GatewayProc]
) -> None:
    """When Redis goes, each replica keeps within its share of a node's budget, and also
    leaves the others what they were last seen holding for as long as its own requests
    lately lived: A holds five ~4k-token requests (20k of the node's 30.7k), so B, idle
    then, takes two (8k) beside them, not the three its half (15.3k) would allow."""
    async with running_node(time_scale=4) as node:  # a 3,000-token answer: ~15 s
        a, b = await _two(tmp_path, node, redis_server, gateways)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            # B's own request lives ~7 s: what it saw held is kept that long after.
            warm = asyncio.create_task(chat(s, b.url, PROMPT_WORDS, 1500))
            held = [asyncio.create_task(chat(s, a.url, PROMPT_WORDS, MAX_TOKENS)) for _ in range(5)]
            await eventually(partial(ledger_holds, redis_server.url, 5 * 3900 + 2400), timeout=10)
            assert await warm == 200
            redis_server.stop()
            await eventually(
                partial(ledger_says, b.url, "shared", False), timeout=10, what="B in fallback"
            )
            more = [asyncio.create_task(chat(s, b.url, PROMPT_WORDS, MAX_TOKENS)) for _ in range(4)]
            peak = 0
            deadline = time.monotonic() + 6  # B's lease (2 s) ends within it
            while time.monotonic() < deadline:
                assert not any(t.done() for t in held), "A's requests ended too early"
                peak = max(peak, int((await get_json(node + "/sim/state"))["running"]))
                await asyncio.sleep(0.05)
            assert peak == 7, f"{peak} running beside A's 5 (B may take 2)"
            redis_server.start()
            assert await asyncio.gather(*held, *more) == [200] * 9
        assert (await _node_state(node))["preemptions"] == 0
