"""Tenants end to end: real gateway, real simulated nodes on loopback."""

from __future__ import annotations

import asyncio
import random
import re

import aiohttp

from bench.tenants import TenantRun, flooded, gateway_config, interactive, one
from tests.support.fleet import MODEL, RunningFleet, StartFleet

# One node whose KV budget (not its sequence slots) is what the flood exhausts.
NODE = [("only", "small", "gpu24-8b", {"max_num_seqs": 128})]
# The flood is sized against 95% of the node's KV: with all of it, the shared queue of the
# control below holds interactive requests too briefly to tell the two apart.
ADMISSION = {
    "queue_timeout_s": 3,
    "queue_size": 64,
    "default_output_tokens": 256,
    "budget_fraction": 0.95,
}


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
            # What the node is projected to hold at most from now on (its book holds
            # what the requests hold now).
            block = b.limits.block_size
            peak = b.projection.peak(block, 0.0).blocks * block
            held = b.reserved_tokens - b.projected_tokens + peak
            peaks["reserved"] = max(peaks["reserved"], int(held))
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
        NODE,
        time_scale=1.5,
        gateway={
            **gateway_config("classes"),
            "admission": ADMISSION,
            # The node's own queue pausing it for everyone (load feedback) is another
            # matter: here the classes are under test.
            "load_feedback": {"max_waiting": 1000},
        },
    )
    alone, inter, batch, peaks = await _flood_scenario(fleet, requests=30)
    assert alone.statuses == {200: 90} and inter.statuses == {200: 90}
    # The flood's decoding steps slow every prefill on the node, so interactive TTFT does
    # rise (p50 by 1.5-1.9x here); what the class floor removes is the wait in the queue.
    # The median stays within the tail of the run alone (0.85-0.96x its p99, against 6x
    # with one shared queue), and the p90 within 2.5x. A p99 of 90 samples is two
    # samples: on a shared CI machine one scheduling stall moves it, so it is not bounded.
    bounds = (alone.summary(), inter.summary())
    assert inter.percentile(50) <= 1.5 * alone.percentile(99), bounds
    assert inter.percentile(90) <= 2.5 * alone.percentile(90), bounds
    # The fleet was saturated: batch holds all but the interactive floor, and its excess
    # waited in the queue or was refused.
    assert peaks["reserved"] >= 0.7 * peaks["budget"], peaks
    assert peaks["queue"] > 0 and batch.statuses[200] > 0, (peaks, batch.summary())
    await asyncio.sleep(0.2)
    assert fleet.leaks() == {}


async def test_one_shared_queue_makes_interactive_wait_behind_the_flood(start_fleet: StartFleet):
    """The control for the test above: with both keys in one tenant (one FIFO queue, as
    without tenants) the same load does hurt the interactive user."""
    fleet = await start_fleet(
        NODE, time_scale=1.5, gateway={**gateway_config("shared"), "admission": ADMISSION}
    )
    alone, inter, _, _ = await _flood_scenario(fleet, requests=3)
    assert inter.percentile(50) > 3 * alone.percentile(99), (alone.summary(), inter.summary())


async def test_two_equal_tenants_of_one_class_get_kv_tokens_within_ten_percent(
    start_fleet: StartFleet,
):
    """One sends 1.5k-token prompts, the other 150-token ones; both flood the same node.
    Fair queuing on KV tokens gives them the same KV tokens, not the same requests."""
    keys = [{"name": "big", "key": "k-big"}, {"name": "small", "key": "k-small"}]
    fleet = await start_fleet(
        NODE,
        time_scale=4.0,
        gateway={
            "auth": {"keys": keys},
            "admission": {**ADMISSION, "queue_timeout_s": 30, "queue_size": 256},
        },
    )
    stop = asyncio.Event()
    runs = {"big": TenantRun(), "small": TenantRun()}

    async def loop(session: aiohttp.ClientSession, name: str, prompt_tokens: int, i: int):
        rnd = random.Random(i)
        while not stop.is_set():
            await one(
                session,
                fleet.url,
                MODEL,
                f"k-{name}",
                prompt_tokens,
                200,
                rnd,
                runs[name],
                stream=False,
            )

    async def granted(session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(fleet.url + "/metrics") as r:
            text = await r.text()
        found = re.findall(r'gateway_tenant_kv_tokens_granted_total\{tenant="(\w+)"\} (\S+)', text)
        return {name: float(value) for name, value in found}

    async with aiohttp.ClientSession() as session:
        # The big tenant starts first and takes the whole node; fairness has to win it back.
        tasks = [asyncio.create_task(loop(session, "big", 1500, i)) for i in range(16)]
        tasks += [asyncio.create_task(loop(session, "small", 150, 100 + i)) for i in range(48)]
        await asyncio.sleep(3.0)
        before = await granted(session)
        await asyncio.sleep(4.0)
        after = await granted(session)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    served = {name: after[name] - before[name] for name in ("big", "small")}
    assert min(served.values()) > 20_000, served
    assert abs(served["big"] - served["small"]) <= 0.1 * max(served.values()), served
    # Shared by tokens, not by requests: the small tenant ran many more of them.
    assert runs["small"].statuses[200] > 2 * runs["big"].statuses[200]
