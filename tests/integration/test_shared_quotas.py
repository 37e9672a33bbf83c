"""Tenant rate limits across two gateway processes sharing one real Redis: a limit holds
for the fleet whichever replica a request reaches, with the fleet-wide state in its
headers; with Redis stopped each replica keeps within its share and fails nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from kvgateway.config.model import TenantLimits
from kvgateway.core.quota import OUTPUT, REQUESTS, Charge, RateLimitHit
from kvgateway.ledger.quotas import SharedQuotas, share_of
from tests.support.eventually import eventually
from tests.support.ledger_fleet import (
    GatewayProc,
    get_json,
    ledger_says,
    running_node,
    start_gateway,
    stop_gateway,
)
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow

LIMIT = 10
AUTH = {
    "auth": {
        "keys": [
            {"name": "metered", "key": "k-metered", "limits": {"requests_per_minute": LIMIT}},
            {"name": "free", "key": "k-free"},
        ]
    }
}


@contextlib.asynccontextmanager
async def _replicas(
    work: Path, redis_url: str, config: dict[str, Any]
) -> AsyncIterator[tuple[str, list[GatewayProc]]]:
    """A simulated node and two `gateway serve` replicas sharing ``redis_url``, each
    having seen the other's lease; yields the node's URL and the replicas."""
    async with running_node(time_scale=40) as node:
        running: list[GatewayProc] = []
        try:
            for name in ("a", "b"):
                running.append(await start_gateway(work, name, node, redis_url, config=config))
            for g in running:
                await eventually(partial(ledger_says, g.url, "live_replicas", 2), timeout=5)
            yield node, running
        finally:
            for g in running:
                await stop_gateway(g)


async def _node_peak(node: str, stop: asyncio.Event) -> int:
    """The most requests the node had at once (running or queued there) until ``stop``."""
    peak = 0
    while not stop.is_set():
        state = await get_json(node + "/sim/state")
        peak = max(peak, state["running"] + state["waiting"])
        await asyncio.sleep(0.005)
    return peak


@pytest.fixture
async def two(
    tmp_path: Path, redis_server: RedisServer
) -> AsyncIterator[tuple[GatewayProc, GatewayProc]]:
    async with _replicas(tmp_path, redis_server.url, AUTH) as (_, (a, b)):
        yield a, b


async def _ask(url: str, key: str = "k-metered") -> tuple[int, dict[str, str]]:
    """One short chat through the official client (no retries): status and headers."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return raw.status_code, dict(raw.headers)
    except openai.RateLimitError as err:
        return err.status_code, dict(err.response.headers)
    finally:
        await client.close()


async def _redis_holds(client: Redis, limit: str, want: bytes) -> bool:
    return bool(await client.get("{t}:qt:" + limit + ":x") == want)


async def _metrics_show(url: str, line: str) -> bool:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return line in await r.text()


async def test_a_requests_per_minute_limit_holds_across_two_replicas(
    two: tuple[GatewayProc, GatewayProc],
) -> None:
    a, b = two
    answers = await asyncio.gather(*(_ask((a, b)[i % 2].url) for i in range(3 * LIMIT)))
    statuses = [s for s, _ in answers]
    assert statuses.count(200) == LIMIT and statuses.count(429) == 2 * LIMIT, statuses
    for status, headers in answers:
        assert headers["x-ratelimit-limit-requests"] == str(LIMIT)
        if status == 429:
            # The fleet-wide state, whichever replica answered: nothing left this minute.
            assert headers["x-ratelimit-remaining-requests"] == "0", headers
            assert 1 <= int(headers["retry-after"]) <= 60, headers
    # Each replica served some: the limit was judged across both, not per replica.
    assert {s for s, _ in answers[0::2]} >= {200} or {s for s, _ in answers[1::2]} >= {200}
    # A tenant without limits is not held by the other's.
    assert (await _ask(a.url, "k-free"))[0] == 200


async def test_a_requests_per_minute_limit_holds_across_workers(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with running_node(time_scale=40) as node:
        g = await start_gateway(
            tmp_path, "w", node, redis_server.url, "--workers", "2", config=AUTH
        )
        try:
            await eventually(partial(ledger_says, g.url, "live_replicas", 2), timeout=5)
            answers = await asyncio.gather(*(_ask(g.url) for _ in range(2 * LIMIT)))
            statuses = [s for s, _ in answers]
            assert statuses.count(200) == LIMIT and statuses.count(429) == LIMIT, statuses
            # The instance's minute, summed over its workers whichever answers the scrape.
            series = 'gateway_tenant_minute_usage{limit="requests_per_minute",tenant="metered"}'
            line = f"{series} {float(LIMIT)}"
            await eventually(partial(_metrics_show, g.url, line), timeout=6, what=line)
        finally:
            await stop_gateway(g)


async def test_without_redis_each_replica_keeps_its_share_and_fails_nothing(
    two: tuple[GatewayProc, GatewayProc], redis_server: RedisServer
) -> None:
    a, b = two
    assert [(await _ask(g.url))[0] for g in (a, b)] == [200, 200]
    redis_server.stop()
    for g in (a, b):
        await eventually(partial(ledger_says, g.url, "shared", False), timeout=5)
    # Each judges the limit on what it admitted itself against its share, 10 // 2.
    for g in (a, b):
        statuses = [(await _ask(g.url))[0] for _ in range(LIMIT)]
        assert statuses.count(200) == LIMIT // 2 - 1 and set(statuses) == {200, 429}, statuses
        async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
            assert "gateway_tenant_quota_fallback 1.0" in await r.text()
    redis_server.start()
    for g in (a, b):
        await eventually(
            partial(ledger_says, g.url, "shared", True),
            timeout=10,
            what=f"{g.url} back on the shared ledger",
        )
    for g in (a, b):  # each has added what it charged meanwhile to Redis
        for _ in range(200):
            async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
                if "gateway_tenant_quota_fallback 0.0" in await r.text():
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"{g.url} still judges limits on its share")
    # Back in Redis, what each admitted on its share counts: the minute is used up.
    for g in (a, b):
        status, headers = await _ask(g.url)
        assert status == 429 and headers["x-ratelimit-remaining-requests"] == "0", headers


async def test_token_windows_settle_and_free_in_redis_as_they_do_in_one_process(
    redis_server: RedisServer,
) -> None:
    """The shared windows keep the local ones' rules: a refusal says when room frees, a
    settlement gives back the unused reservation, a refund all of it."""
    client = Redis.from_url(redis_server.url, socket_timeout=1)
    now = [0.0]
    quotas = SharedQuotas(
        client, "t", "r1", 1.0, shared=lambda: True, live=lambda: 2, clock=lambda: now[0]
    )
    limits = TenantLimits(output_tokens_per_minute=1000, requests_per_minute=5)
    try:
        async with quotas.running():
            first = await quotas.try_charge("x", limits, 10, 600, now[0])
            assert isinstance(first, Charge) and first.ref
            hit = await quotas.try_charge("x", limits, 10, 500, now[0])
            assert isinstance(hit, RateLimitHit) and hit.limit == OUTPUT
            assert 59 <= hit.retry_after_s <= 60 and (hit.used, hit.asked) == (600, 500)
            never = await quotas.try_charge("x", limits, 10, 1001, now[0])
            assert isinstance(never, RateLimitHit) and never.retry_after_s == float("inf")
            quotas.settle(first, 200, now[0])  # generated 200 of the 600 reserved
            await eventually(partial(_redis_holds, client, "output_tokens_per_minute", b"200"))
            second = await quotas.try_charge("x", limits, 10, 500, now[0])
            assert isinstance(second, Charge)
            status = quotas.status("x", limits, now[0])
            assert status[OUTPUT].remaining == 300 and status[REQUESTS].remaining == 3
            quotas.settle(second, 0, now[0], served=False)  # never admitted: refunded
            await eventually(
                partial(_redis_holds, client, "requests_per_minute", b"1"),
                what="the refund reached Redis",
            )
    finally:
        await client.aclose()


def test_a_replicas_share_of_each_limit_is_the_limit_over_the_live_replicas() -> None:
    limits = TenantLimits(requests_per_minute=10, prompt_tokens_per_minute=1001, max_concurrent=4)
    share = share_of(limits, 3)
    assert (share.requests_per_minute, share.prompt_tokens_per_minute) == (3, 333)
    assert share.output_tokens_per_minute is None and share.max_concurrent == 4
    assert share_of(limits, 0) == limits


HOLDERS = {
    "auth": {
        "keys": [
            {"name": "shared", "key": "k-shared", "limits": {"max_kv_share": 0.3}},
            {"name": "few", "key": "k-few", "limits": {"max_concurrent": 3}},
        ]
    },
    "admission": {"queue_timeout_s": 60},
}


async def _long(s: aiohttp.ClientSession, url: str, key: str) -> int:
    """~1k-token prompt generating 3k tokens: ~4k KV tokens held for ~2 s."""
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hello " * 1000}],
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_max_kv_share_and_max_concurrent_hold_across_two_replicas(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Flooded through both replicas, a tenant never has more than its share of the
    fleet's KV budget on the node, nor more requests than its max_concurrent, counted
    over both (each replica alone lets it have twice that); every request is served."""
    async with _replicas(tmp_path, redis_server.url, HOLDERS) as (node, running):
        auth = {"Authorization": "Bearer k-shared"}
        async with (
            aiohttp.ClientSession(headers=auth) as s,
            s.get(running[0].url + "/admin/backends") as r,
        ):
            (b,) = (await r.json())["backends"]
        # Each request holds at most ~4.3k KV tokens (prompt + max_tokens).
        most = int(0.3 * b["budget_tokens"]) // 4_000
        for key, limit in (("k-shared", most), ("k-few", 3)):
            stop = asyncio.Event()
            sampler = asyncio.create_task(_node_peak(node, stop))
            timeout = aiohttp.ClientTimeout(total=90)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                statuses = await asyncio.gather(
                    *(_long(s, running[i % 2].url, key) for i in range(12))
                )
            stop.set()
            peak = await sampler
            assert statuses == [200] * 12, (key, statuses)
            assert peak == limit, (key, peak, limit)
        assert (await get_json(node + "/sim/state"))["preemptions"] == 0


async def test_redis_stopped_mid_flood_fails_nothing_and_each_replica_keeps_its_share(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """max_concurrent 4 over two replicas: with Redis gone each keeps within its share
    (2) and, while its lease may still be live, within what Redis records for it (as
    the KV budgets' fallback does: the other may still count it so), so the two stay
    within 4; no request fails. Judged by each replica alone the node would see up to
    8."""
    config = {
        **HOLDERS,
        "auth": {"keys": [{"name": "few", "key": "k-few", "limits": {"max_concurrent": 4}}]},
    }
    async with _replicas(tmp_path, redis_server.url, config) as (node, running):
        stop = asyncio.Event()
        sampler = asyncio.create_task(_node_peak(node, stop))
        timeout = aiohttp.ClientTimeout(total=90)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            flood = asyncio.gather(*(_long(s, running[i % 2].url, "k-few") for i in range(16)))
            await asyncio.sleep(1.0)
            redis_server.stop()
            statuses = await flood
        stop.set()
        peak = await sampler
        assert statuses == [200] * 16, statuses
        assert peak <= 4, peak
        for g in running:
            assert not (await get_json(g.url + "/ready"))["ledger"]["shared"]
