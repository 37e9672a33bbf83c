"""`gateway serve --workers 2`, a worker killed with -9: its gauges leave /metrics with it
(live multiprocess modes), so an alert on a killed worker's last values
(GatewayLedgerFallback, GatewayAdmissionQueueBacklog) ends when the live workers' ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

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


async def _until(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(aiohttp.ClientError):  # a connection to the killed worker
            if await check():
                return
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


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

        await _until(both_in_fallback, "the workers did not fall back with Redis down")
        text = await _metrics(g.url)
        assert "gateway_ledger_fallback 1.0" in text
        os.kill(workers[0], signal.SIGKILL)
        redis_server.start()

        async def back_with_no_trace_of_the_dead() -> bool:
            text = await _metrics(g.url)
            return "gateway_ledger_fallback 0.0" in text and f'pid="{workers[0]}"' not in text

        # The surviving worker is shared again within a heartbeat (0.5 s); the killed
        # one's last 1 must not hold the gauge (it did, for good, in "max" mode).
        await _until(back_with_no_trace_of_the_dead, "the killed worker's gauges stayed")
        text = await _metrics(g.url)
        assert "pid=" not in text, [line for line in text.splitlines() if "pid=" in line]
        gauges = [line for line in text.splitlines() if line.startswith("gateway_queue_depth")]
        assert gauges == ["gateway_queue_depth 0.0"], gauges
    finally:
        await stop_gateway(g)
