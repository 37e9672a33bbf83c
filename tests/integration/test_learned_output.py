"""admission.output_reservation: learned, against simulated nodes: learned lengths say when
running streams are likely to end, so more of them run at once than their max_tokens
would allow, and a stream that runs long stays in its node's projection as it grows."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.fleet import MODEL, StartFleet

# Answers of ~40 tokens whatever max_tokens says.
SHORT = {"output_mean": 40.0, "output_sigma": 0.3}
NODE = [("small-1", "small", "gpu24-8b", SHORT)]
# The large node answers at length whatever is asked (what learning never saw).
NODES = [*NODE, ("large-1", "large", "gpu80-8b", {"output_mean": 4000.0, "output_sigma": 0.0})]


def _body(prompt_words: int, max_tokens: int, **extra: object) -> dict[str, object]:
    text = "pallets leave the harbor at dawn " * (prompt_words // 6)
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def _most_at_once(mode: str, start_fleet: StartFleet) -> tuple[int, float]:
    """The most streams the small node runs at once in a burst, after 60 answers taught
    the gateway their lengths; and the node's preemptions."""
    fleet = await start_fleet(
        NODE,
        gateway={"admission": {"output_reservation": mode, "queue_timeout_s": 120}},
    )
    b = fleet.backend("small-1")
    body = _body(1500, 4000, stream=True)
    most = 0
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            await asyncio.gather(*(_post(s, fleet.url, body) for _ in range(10)))
        burst = [asyncio.create_task(_post(s, fleet.url, body)) for _ in range(40)]
        while not all(t.done() for t in burst):
            most = max(most, b.in_flight)
            await asyncio.sleep(0.002)
        await asyncio.gather(*burst)
    preempted = await fleet.nodes["small-1"].state()
    assert fleet.leaks() == {}
    return most, float(preempted.get("preemptions", 0))


async def test_learned_lengths_run_more_streams_at_once_and_preempt_nothing(
    start_fleet: StartFleet,
) -> None:
    by_bound, pre_bound = await _most_at_once("max_tokens", start_fleet)
    learned, pre_learned = await _most_at_once("learned", start_fleet)
    assert learned >= 2 * by_bound, (learned, by_bound)
    assert pre_bound == 0 and pre_learned == 0


async def test_a_stream_running_past_its_learned_length_stays_in_the_projection(
    start_fleet: StartFleet,
) -> None:
    fleet = await start_fleet(
        NODES,
        gateway={"admission": {"output_reservation": "learned", "preemption_risk": 0.05}},
    )
    large = fleet.backend("large-1")
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            await asyncio.gather(*(_post(s, fleet.url, _body(60, 400)) for _ in range(10)))
        # A prompt only the large node holds, whose answer runs to all 400 tokens.
        long = _body(9000, 400, stream=True)
        seen = 0
        async with s.post(fleet.url + "/v1/chat/completions", json=long) as r:
            assert r.status == 200
            assert r.headers["x-gateway-backend"] == "large-1"
            prompt = int(r.headers["x-gateway-prompt-tokens"])
            async for _ in r.content.iter_any():
                flights = list(large.projection.flights)
                if not flights:
                    continue
                f = flights[0]
                seen = max(seen, f.generated)
                # What the node holds for it now is in the node's book.
                assert large.reserved_tokens >= min(prompt, f.prompt) + f.generated
    assert seen > 300
    assert fleet.leaks() == {}


async def test_a_node_whose_context_cuts_max_tokens_serves_what_its_answers_never_reach(
    start_fleet: StartFleet,
) -> None:
    """A prompt of ~1,700 tokens with max_tokens 8,000 passes the small node's 8k context
    whole; once the answers of such requests are known to end near 40 tokens, the small
    node serves it with max_tokens cut to what its context leaves (sent to the node, and
    told to the client), instead of the large tier holding it."""
    both = [("small-1", "small", "gpu24-8b", SHORT), ("large-1", "large", "gpu80-8b", SHORT)]
    fleet = await start_fleet(both)
    long = _body(1500, 8000)
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + "/v1/chat/completions", json=long) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-gateway-backend"] == "large-1"
            assert "x-gateway-max-tokens" not in r.headers
        for _ in range(4):
            await asyncio.gather(*(_post(s, fleet.url, _body(60, 8000)) for _ in range(10)))
        async with s.post(fleet.url + "/v1/chat/completions", json={**long, "stream": True}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-gateway-backend"] == "small-1"
            prompt = int(r.headers["x-gateway-prompt-tokens"])
            assert int(r.headers["x-gateway-max-tokens"]) == 8192 - prompt
            text = await r.text()
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    assert fleet.leaks() == {}
