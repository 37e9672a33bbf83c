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


# The large node answers at length whatever is asked (what learning never saw).
NODES = [
    *NODE,
    ("large-1", "large", "gpu80-8b", {"output_mean": 4000.0, "output_sigma": 0.0}),
]


async def test_learned_reservations_shrink_and_long_streams_stay_covered(start_fleet: StartFleet):
    fleet = await start_fleet(
        NODES,
        gateway={"admission": {"output_reservation": "learned", "preemption_risk": 0.05}},
    )
    b = fleet.backend("small-1")
    large = fleet.backend("large-1")
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
        # n > 1: the mean of its sequences is not one sequence's length; not learned.
        seen = model.statistics().observations
        await _post(s, fleet.url, {**body, "n": 2})
        assert model.statistics().observations == seen
        # A request that fixes its own length (ignore_eos, min_tokens) learns nothing:
        # it reserves its max_tokens.
        for fixed in ({"ignore_eos": True}, {"min_tokens": 300}):
            task = asyncio.create_task(_post(s, fleet.url, {**body, **fixed, "stream": True}))
            while b.in_flight == 0:
                await asyncio.sleep(0.001)
            assert b.reserved_tokens >= 400, fixed
            await task
        # A prompt only the large node holds, whose answer runs to all 400 tokens: its
        # reservation grows ahead of the node's footprint as it streams.
        long = {**body, "messages": [{"role": "user", "content": "hello " * 9000}], "stream": True}
        seen = []
        async with s.post(fleet.url + "/v1/chat/completions", json=long) as r:
            assert r.status == 200
            assert r.headers["x-gateway-backend"] == "large-1"
            async for _ in r.content.iter_any():
                footprint = sum(fleet.state.outputs.statistics().values())
                seen.append(footprint)
                assert large.reserved_tokens >= footprint
    # It did stream well past its learned reservation (the footprint is sampled between
    # runs of events, so its last tokens may not be seen).
    assert max(seen) > 300
    metrics = fleet.state.metrics.registry.get_sample_value(
        "gateway_reservation_grown_tokens_total", {"model": MODEL}
    )
    assert metrics is not None and metrics > 0
    assert fleet.leaks() == {}


async def test_learned_mode_reserves_prompts_as_the_nodes_count_them(start_fleet: StartFleet):
    # Without the model's tokenizer a prompt is reserved at the stand-in's worst-case
    # bound; once the node's usage reports taught the gateway how it counts, learned
    # mode reserves that instead (the context check keeps the bound).
    fleet = await start_fleet(NODE, gateway={"admission": {"output_reservation": "learned"}})
    b = fleet.backend("small-1")
    text = "the quick brown fox jumps over the lazy dog " * 150  # ~1,350 tokens
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},  # the node's count comes back
    }

    async def reserved_while_streaming(s: aiohttp.ClientSession) -> int:
        async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            tokens = b.reserved_tokens
            prompt = int(r.headers["x-gateway-prompt-tokens"])
            await r.read()
        assert prompt > 1.2 * 1_350  # the header tells the bound
        return tokens

    async with aiohttp.ClientSession() as s:
        before = await reserved_while_streaming(s)
        for _ in range(5):
            await asyncio.gather(*(_post(s, fleet.url, body) for _ in range(10)))
        after = await reserved_while_streaming(s)
    assert before > 1.2 * 1_350
    assert after < 1_350 * 1.05 + 32
    assert fleet.leaks() == {}
