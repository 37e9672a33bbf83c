"""The multi-turn workloads' pacing: back to back, or with a client's think time."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from typing import Any

from aiohttp import web

from bench.prefix_fleet import (
    REQUEST_S,
    THINK_S,
    Stats,
    default_sessions,
    make_session,
    session_loop,
    text,
    think_s,
)

SHARED = [text(20, random.Random(i)) for i in range(8)]


def test_the_think_variant_has_the_same_conversations() -> None:
    for seed in range(20):
        a = make_session("multiturn", random.Random(seed), SHARED)
        b = make_session("multiturn_think", random.Random(seed), SHARED)
        assert a == b


def test_think_times_are_exponential_with_the_configured_mean() -> None:
    rnd = random.Random(3)
    draws = [think_s("multiturn_think", rnd) for _ in range(20_000)]
    mean = statistics.fmean(draws)
    assert abs(mean - THINK_S["multiturn_think"]) < 0.03 * THINK_S["multiturn_think"]
    # An exponential's standard deviation is its mean.
    assert abs(statistics.pstdev(draws) / mean - 1) < 0.05
    assert think_s("multiturn", rnd) == 0.0


def test_thinking_clients_keep_as_many_requests_in_flight() -> None:
    back_to_back = default_sessions("multiturn")
    thinking = default_sessions("multiturn_think")
    assert back_to_back == 40  # the README's figure for 90% load
    # Each thinking client is in a request REQUEST_S / (REQUEST_S + think) of the time.
    in_flight = thinking * REQUEST_S / (REQUEST_S + THINK_S["multiturn_think"])
    assert back_to_back <= in_flight < back_to_back + 1


async def _arrivals(aiohttp_server: Any, workload: str, window: float, scale: float) -> list[float]:
    """When one client's requests reached a loopback server that answers at once."""
    seen: list[float] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(time.monotonic())
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n')
        await resp.write(b'data: {"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await aiohttp_server(app)
    start = time.monotonic()
    url = str(server.make_url("")).rstrip("/")
    rnd = random.Random(1)
    st = Stats()
    await session_loop(
        url, workload, rnd, SHARED, start + window, st, random.Random(2), time_scale=scale
    )
    assert st.ok == len(seen) > 0
    return [t - start for t in seen]


async def test_a_thinking_client_waits_between_requests(aiohttp_server: Any) -> None:
    scale = 100.0  # a mean think of 0.15 wall seconds
    seen = await _arrivals(aiohttp_server, "multiturn_think", 3.0, scale)
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    mean = THINK_S["multiturn_think"] / scale
    assert len(gaps) >= 8
    assert 0.5 * mean < statistics.fmean(gaps) < 2 * mean


async def test_a_back_to_back_client_does_not_wait(aiohttp_server: Any) -> None:
    seen = await _arrivals(aiohttp_server, "multiturn", 0.5, 100.0)
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    assert len(gaps) >= 8
    assert statistics.median(gaps) < 0.02
