"""admission.output_reservation: learned, against a simulated node: reservations shrink to
what such requests generate, and a stream that runs long is covered as it streams."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.fleet import MODEL, StartFleet

NODE = [("small-1", "small", "gpu24-8b", {"output_mean": 40.0, "output_sigma": 0.3})]


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def test_learned_reservations_shrink_and_long_streams_stay_covered(start_fleet: StartFleet):
    fleet = await start_fleet(
        NODE,
        gateway={"admission": {"output_reservation": "learned", "preemption_risk": 0.05}},
    )
    b = fleet.backend("small-1")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400}
    async with aiohttp.ClientSession() as s:
        # Before anything is learned: the whole max_tokens is reserved.
        first = asyncio.create_task(_post(s, fleet.url, {**body, "stream": True}))
        while b.in_flight == 0:
            await asyncio.sleep(0.001)
        assert b.reserved_tokens >= 400
        await first
        for _ in range(3):
            await asyncio.gather(*(_post(s, fleet.url, body) for _ in range(20)))
        model = fleet.state.outputs.model
        learned = model.reservation(MODEL, "*", 400, 0.05)
        assert learned < 200  # outputs are ~40 tokens
        # A stream that generates all 400 tokens anyway (ignore_eos): its reservation
        # grows ahead of the node's footprint as it streams.
        long = {**body, "stream": True, "ignore_eos": True}
        seen = []
        async with s.post(fleet.url + "/v1/chat/completions", json=long) as r:
            assert r.status == 200
            async for _ in r.content.iter_any():
                footprint = sum(fleet.state.outputs.statistics().values())
                seen.append(footprint)
                assert b.reserved_tokens >= footprint
    assert max(seen) > 400 - 16  # it did stream well past its learned reservation
    metrics = fleet.state.metrics.registry.get_sample_value(
        "gateway_reservation_grown_tokens_total", {"model": MODEL}
    )
    assert metrics is not None and metrics > 0
    assert fleet.leaks() == {}
