"""`gateway serve --workers 3` started while Redis is down: each worker's blind share
assumes at least the 3 replicas its supervisor runs (not ledger.fallback_replicas, 2),
so together they take one budget, not 1.5."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.eventually import eventually
from tests.support.ledger_fleet import NODE, start_gateway, start_node, stop_gateway
from tests.support.live import free_ports

pytestmark = pytest.mark.slow


async def _one_worker(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """/ready's ledger block and the node's /admin/backends entry, from one worker (one
    keep-alive connection; a new one per call, so the kernel picks the worker)."""
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.get(url + "/ready") as r:
            ledger = (await r.json())["ledger"]
        async with s.get(url + "/admin/backends") as r:
            (node,) = [b for b in (await r.json())["backends"] if b["name"] == NODE]
    return ledger, node


async def test_workers_started_without_redis_share_each_budget_by_their_number(
    tmp_path: Path,
) -> None:
    (nothing,) = free_ports(1)  # no Redis listens here
    node = await start_node(time_scale=40)
    redis_url = f"redis://127.0.0.1:{nothing}/0"
    try:
        url = str(node.make_url("")).rstrip("/")
        g = await start_gateway(tmp_path, "w", url, redis_url, "--workers", "3")
        try:
            seen: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

            async def every_worker_seen() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    ledger, b = await _one_worker(g.url)
                    seen[ledger["replica_id"]] = (ledger, b)
                assert len(seen) == 3, seen
                return True

            await eventually(every_worker_seen, timeout=30, interval=0.02)
            # Said in /metrics as any fallback is, by a replica that never reached Redis
            # too (at 0 the documented alert could not fire).
            async with aiohttp.ClientSession() as s, s.get(g.url + "/metrics") as r:
                text = await r.text()
            assert "gateway_ledger_fallback 1.0" in text, text[-3000:]
        finally:
            await stop_gateway(g)
    finally:
        await node.close()
    for ledger, _ in seen.values():
        assert ledger["shared"] is False and ledger["live_replicas"] == 3, ledger
        assert ledger["fallback"].startswith("local share 1/3 "), ledger
    # Idle, each worker's view leaves it its share only (the others are taken to hold
    # the rest): the three shares add up to one budget.
    budget = {b["budget_tokens"] for _, b in seen.values()}
    room = [b["budget_tokens"] - b["reserved_tokens"] for _, b in seen.values()]
    assert len(budget) == 1 and 0 < sum(room) <= budget.pop(), seen
