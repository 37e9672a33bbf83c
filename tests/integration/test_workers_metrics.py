"""`gateway serve --workers 2`, a worker killed with -9: its gauges leave /metrics with it
(live multiprocess modes), so an alert on a killed worker's last values
(GatewayLedgerFallback, GatewayAdmissionQueueBacklog) ends when the live workers' ends."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import ClientError

from tests.support.eventually import eventually
from tests.support.ledger_fleet import (
    GatewayProc,
    get_json,
    running_node,
    start_gateway,
    stop_gateway,
)
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow


@pytest.fixture
async def node() -> AsyncIterator[str]:
    async with running_node(time_scale=40) as url:
        yield url


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def test_a_killed_workers_gauges_leave_metrics_with_it(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    g: GatewayProc = await start_gateway(tmp_path, "w", node, redis_server.url, "--workers", "2")
    try:
        pid = g.proc.pid
        workers = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        redis_server.stop()

        async def both_in_fallback() -> bool:
            ids = {}
            for _ in range(10):  # a new connection each: the kernel picks the worker
                ledger = (await get_json(g.url + "/ready"))["ledger"]
                ids[ledger["replica_id"]] = ledger["shared"]
            return len(ids) == 2 and not any(ids.values())

        await eventually(
            both_in_fallback, timeout=15, what="both workers in fallback", not_yet=(ClientError,)
        )
        text = await _metrics(g.url)
        assert "gateway_ledger_fallback 1.0" in text
        os.kill(workers[0], signal.SIGKILL)
        redis_server.start()

        async def back_with_no_trace_of_the_dead() -> bool:
            text = await _metrics(g.url)
            return "gateway_ledger_fallback 0.0" in text and f'pid="{workers[0]}"' not in text

        # The surviving worker is shared again within a heartbeat (0.5 s); the killed
        # one's last 1 does not hold the gauge.
        await eventually(
            back_with_no_trace_of_the_dead,
            timeout=15,
            what="the killed worker's gauges gone",
            not_yet=(ClientError,),
        )
        text = await _metrics(g.url)
        assert "pid=" not in text, [line for line in text.splitlines() if "pid=" in line]
        gauges = [line for line in text.splitlines() if line.startswith("gateway_queue_depth")]
        assert gauges == ["gateway_queue_depth 0.0"], gauges
    finally:
        await stop_gateway(g)


def _samples(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]


async def test_the_instances_reservations_and_tenants_are_whole_whichever_worker_answers(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """A scrape reaches one worker, yet gateway_backend_reserved_tokens is the instance's
    (every worker's, summed: what the fleet gauge says is held), and the tenant families
    are there."""
    g: GatewayProc = await start_gateway(tmp_path, "w", node, redis_server.url, "--workers", "2")
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "Tell me everything. " * 50}],
        "max_tokens": 3000,  # 2-3 s at this time scale: the gauges are written every 1 s
        "stream": True,
        "ignore_eos": True,
    }

    async def stream() -> None:
        # A session each: a new connection, so the kernel spreads them over the workers.
        async with (
            aiohttp.ClientSession() as s,
            s.post(g.url + "/v1/chat/completions", json=body) as r,
        ):
            await r.read()

    streams = [asyncio.create_task(stream()) for _ in range(6)]  # all fit the node
    try:

        async def whole() -> bool:
            text = await _metrics(g.url)
            ours = sum(_samples(text, "gateway_backend_reserved_tokens{"))
            fleet = max(_samples(text, "gateway_backend_fleet_reserved_tokens{"), default=0)
            # Every worker's own, summed, is the instance's: all 6 streams (the kernel
            # spreads them over the workers), and what the ledger sees held.
            held = sum(_samples(text, "gateway_backend_in_flight{"))
            return held == 6 and fleet > 0 and abs(ours - fleet) <= 0.05 * fleet

        await eventually(
            whole, timeout=15, what="the instance's reserved tokens", not_yet=(ClientError,)
        )
        text = await _metrics(g.url)
        for family in ("gateway_tenant_kv_tokens", "gateway_tenant_in_flight"):
            assert _samples(text, family + "{"), family
    finally:
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await stop_gateway(g)
