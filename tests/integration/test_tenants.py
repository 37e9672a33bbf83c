"""Tenants end to end: real gateway, real simulated nodes on loopback."""

from __future__ import annotations

import asyncio

from bench.tenants import TenantRun, flooded, gateway_config, interactive
from tests.support.fleet import MODEL, RunningFleet, StartFleet

# One node whose KV budget (not its sequence slots) is what the flood exhausts.
NODE = [("only", "small", "gpu24-8b", {"max_num_seqs": 128})]
ADMISSION = {"queue_timeout_s": 3, "queue_size": 64, "default_output_tokens": 256}


async def _flood_scenario(
    fleet: RunningFleet, requests: int
) -> tuple[TenantRun, TenantRun, TenantRun, dict[str, int]]:
    """Interactive alone, then the same interactive load while batch floods; with the
    peak queue depth and KV reserved on the node during the flood."""
    args = {"clients": 3, "requests": requests}
    alone = await interactive(fleet.url, MODEL, **args)
    peaks = {"queue": 0, "reserved": 0}
    stop = asyncio.Event()
    b = fleet.backend("only")

    async def watch() -> None:
        while not stop.is_set():
            peaks["queue"] = max(peaks["queue"], fleet.state.admission.queue_depth)
            peaks["reserved"] = max(peaks["reserved"], b.reserved_tokens)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        inter, batch = await flooded(fleet.url, MODEL, batch_clients=40, settle_s=1.0, **args)
    finally:
        stop.set()
        await watcher
    peaks["budget"] = b.budget_tokens
    return alone, inter, batch, peaks


async def test_interactive_keeps_its_ttft_and_gets_no_429_while_batch_floods(
    start_fleet: StartFleet,
):
    fleet = await start_fleet(
        NODE, time_scale=1.5, gateway={**gateway_config("classes"), "admission": ADMISSION}
    )
    alone, inter, batch, peaks = await _flood_scenario(fleet, requests=30)
    assert alone.statuses == {200: 90} and inter.statuses == {200: 90}
    assert inter.percentile(99) <= 1.5 * alone.percentile(99), (alone.summary(), inter.summary())
    # The fleet was saturated: batch holds all but the interactive floor, and its excess
    # waited in the queue or was refused.
    assert peaks["reserved"] >= 0.7 * peaks["budget"], peaks
    assert peaks["queue"] > 0 and batch.statuses[200] > 0, (peaks, batch.summary())
    await asyncio.sleep(0.2)
    assert fleet.leaks() == {}


async def test_one_shared_queue_makes_interactive_wait_behind_the_flood(start_fleet: StartFleet):
    """The control for the test above: with both keys in one tenant (one FIFO queue, as
    before tenants) the same load does hurt the interactive user."""
    fleet = await start_fleet(
        NODE, time_scale=1.5, gateway={**gateway_config("shared"), "admission": ADMISSION}
    )
    alone, inter, _, _ = await _flood_scenario(fleet, requests=3)
    assert inter.percentile(50) > 3 * alone.percentile(99), (alone.summary(), inter.summary())
