"""The gateway end to end: official openai client, simulated nodes, real sockets."""

from __future__ import annotations

import asyncio
import io
import json
import random
from typing import Any, cast

import aiohttp
import openai
import pytest

from tests.support.eventually import eventually
from tests.support.fleet import MODEL, SERVED, StartFleet


@pytest.fixture
async def clients():
    made: list[openai.AsyncOpenAI] = []

    def make(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


def words(n_tokens: int) -> str:
    # " hello" is one cl100k token.
    return "hello" + " hello" * (n_tokens - 1)


async def test_openai_client_non_streaming_and_streaming(start_fleet: StartFleet, clients):
    fleet = await start_fleet()
    oai = clients(fleet.url)
    raw = await oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=20
    )
    resp = raw.parse()
    assert resp.choices[0].message.content
    assert resp.usage and 0 < resp.usage.completion_tokens <= 20
    assert raw.headers["x-gateway-tier"] == "small"
    assert raw.headers["x-gateway-backend"].startswith("small-")
    assert int(raw.headers["x-gateway-prompt-tokens"]) > 0
    assert raw.headers["x-request-id"]

    stream = await oai.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text and usage is not None and usage.completion_tokens <= 30

    comp = await oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert comp.choices[0].text
    models = await oai.models.list()
    ids = {m.id for m in models.data}
    assert {MODEL, "gpt-4o-mini"} <= ids
    assert max(m.model_extra["max_model_len"] for m in models.data) == 131072
    assert fleet.leaks() == {}


async def test_long_prompt_lands_on_large_tier_and_huge_on_offload(
    start_fleet: StartFleet, clients
):
    fleet = await start_fleet()
    oai = clients(fleet.url)
    raw = await oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": words(12000)}], max_tokens=100
    )
    assert raw.headers["x-gateway-tier"] == "large"
    raw = await oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": words(60000)}], max_tokens=100
    )
    assert raw.headers["x-gateway-tier"] == "offload"


async def test_too_long_prompt_gets_400_and_no_backend_sees_it(start_fleet: StartFleet, clients):
    fleet = await start_fleet()
    oai = clients(fleet.url)
    with pytest.raises(openai.BadRequestError) as err:
        await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(140000)}], max_tokens=100
        )
    body = cast("dict[str, Any]", err.value.body)
    assert err.value.code == "context_length_exceeded"
    assert "131072" in body["message"] and "100 in the completion" in body["message"]
    for node in fleet.nodes.values():
        state = await node.state()
        assert sum(state["finished"].values()) + state["running"] + state["waiting"] == 0, state


async def test_saturated_small_tier_spills_to_large(start_fleet: StartFleet, clients):
    fleet = await start_fleet(time_scale=5.0)
    oai = clients(fleet.url)

    async def one():
        raw = await oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": words(3000)}], max_tokens=2000
        )
        return raw.headers["x-gateway-tier"]

    tiers = await asyncio.gather(*(one() for _ in range(20)))
    # Two small nodes hold ~30k tokens each: at most 5 x 5k-token requests apiece.
    assert tiers.count("small") <= 10
    assert tiers.count("large") >= 10
    for name in ("small-1", "small-2"):
        m = await fleet.nodes[name].state()
        assert m["preemptions"] == 0
    assert fleet.leaks() == {}


async def test_full_fleet_gives_429_with_retry_after(start_fleet: StartFleet, clients):
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        time_scale=0.5,
        gateway={"admission": {"queue_timeout_s": 0.3}},
    )
    oai = clients(fleet.url)
    hogs = [
        asyncio.create_task(
            oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": words(6000)}], max_tokens=2000
            )
        )
        for _ in range(4)
    ]
    await asyncio.sleep(0.3)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": words(6000)}],
                "max_tokens": 2000,
            },
        ) as r,
    ):
        assert r.status == 429
        assert int(r.headers["Retry-After"]) >= 1
        body = await r.json()
        assert body["error"]["type"] == "rate_limit_error"
    # Its wait in the queue is in the histogram the runbook reads against
    # queue_timeout_s (a refused request's wait, not only admitted ones').
    waits = fleet.state.metrics.registry.get_sample_value("gateway_queue_wait_seconds_count")
    waited = fleet.state.metrics.registry.get_sample_value("gateway_queue_wait_seconds_sum")
    assert waits is not None and waits >= 1 and waited is not None and waited >= 0.25
    for h in hogs:
        h.cancel()
    await asyncio.gather(*hogs, return_exceptions=True)
    # Disconnected clients' reservations are held until the node's abort lands (0.2 s).
    await asyncio.sleep(0.3)
    assert fleet.leaks() == {}


async def test_many_requests_with_random_disconnects_leave_nothing_reserved(
    start_fleet: StartFleet,
):
    fleet = await start_fleet(time_scale=200.0)
    rnd = random.Random(3)
    sem = asyncio.Semaphore(64)
    outcomes: dict[str, int] = {}

    async def one(i: int, session: aiohttp.ClientSession):
        stream = rnd.random() < 0.5
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words(rnd.choice([50, 500, 3000, 9000]))}],
            "max_tokens": rnd.choice([16, 200, 1000]),
            "stream": stream,
        }
        disconnect_after = rnd.random() * 0.05 if rnd.random() < 0.3 else None
        async with sem:
            try:
                async with asyncio.timeout(disconnect_after or 30):
                    async with session.post(fleet.url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        key = str(r.status)
            except TimeoutError:
                key = "disconnected"
        outcomes[key] = outcomes.get(key, 0) + 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(i, session) for i in range(1000)))
    await eventually(lambda: fleet.leaks() == {}, timeout=5, what="no reservation leaked")
    assert outcomes.get("200", 0) > 500, outcomes
    assert set(outcomes) <= {"200", "disconnected"}, outcomes
    # The nodes freed the blocks of aborted requests too.

    async def nodes_empty() -> bool:
        states = [await n.state() for n in fleet.nodes.values()]
        return all(s["used_blocks"] == 0 for s in states)

    await eventually(nodes_empty, timeout=5, what="every node's blocks freed")


MALFORMED = [
    (b"not json", 400, None),
    (b"[1,2]", 400, None),
    (b"{}", 400, "model"),
    (b'{"model": "llama"}', 400, "messages"),
    (b'{"model": 5, "messages": []}', 400, "model"),
    (b'{"model": "llama", "messages": []}', 400, "messages"),
    (b'{"model": "llama", "messages": "hi"}', 400, "messages"),
    (b'{"model": "llama", "messages": [1]}', 400, "messages[0]"),
    (b'{"model": "llama", "messages": [{"content": "x"}]}', 400, "messages[0].role"),
    (
        b'{"model": "llama", "messages": [{"role": 7, "content": "x"}]}',  # any string goes
        400,
        "messages[0].role",
    ),
    (
        b'{"model": "llama", "messages": [{"role": "user", "content": 7}]}',
        400,
        "messages[0].content",
    ),
    (
        b'{"model": "llama", "messages": [{"role": "user", "content": [1]}]}',
        400,
        "messages[0].content[0]",
    ),
    (
        b'{"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
        400,
        "max_tokens",
    ),
    (
        b'{"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        400,
        "max_tokens",
    ),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
    (
        b'{"model": "llama", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}',
        400,
        "stream",
    ),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b"\xff\xfe", 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), MALFORMED)
async def test_malformed_requests_get_openai_style_4xx(
    start_fleet: StartFleet, body, status, param
):
    fleet = await start_fleet([("only", "small", "tiny", {})])
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == status
        err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param
        assert err["message"]


async def test_body_too_large_and_unknown_route(start_fleet: StartFleet):
    fleet = await start_fleet(
        [("only", "small", "tiny", {})], gateway={"admission": {"max_body_bytes": 1000}}
    )
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + "/v1/chat/completions", data=b"x" * 5000) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"
        async with s.get(fleet.url + "/v1/nothing") as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.get(fleet.url + "/v1/chat/completions") as r:
            assert r.status == 405


async def test_huge_prompt_does_not_freeze_small_requests(start_fleet: StartFleet):
    fleet = await start_fleet()
    huge = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words(200_000)}],
        "max_tokens": 10,
    }
    small = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:

        async def send_huge():
            data = io.BytesIO(json.dumps(huge).encode())
            headers = {"Content-Type": "application/json"}
            async with s.post(fleet.url + "/v1/chat/completions", data=data, headers=headers) as r:
                assert r.status == 400  # 200k tokens fit no node: counted, then refused
                return await r.json()

        async def send_small():
            t = loop.time()
            async with s.post(fleet.url + "/v1/chat/completions", json=small) as r:
                assert r.status == 200
            latencies.append(loop.time() - t)

        huge_tasks = [asyncio.create_task(send_huge()) for _ in range(3)]
        while not all(t.done() for t in huge_tasks):
            await send_small()
        results = await asyncio.gather(*huge_tasks)
    assert all(r["error"]["code"] == "context_length_exceeded" for r in results)
    assert len(latencies) >= 3
    # While ~600k tokens were being counted, small requests kept flowing.
    assert sorted(latencies)[len(latencies) // 2] < 0.25, latencies


async def test_api_keys(start_fleet: StartFleet, clients):
    fleet = await start_fleet(
        [("only", "small", "tiny", {})], gateway={"server": {"api_keys": ["sk-good"]}}
    )
    bad = clients(fleet.url, "sk-bad")
    with pytest.raises(openai.AuthenticationError):
        await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    good = clients(fleet.url, "sk-good")
    r = await good.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
    )
    assert r.choices
    async with aiohttp.ClientSession() as s, s.get(fleet.url + "/health") as r2:
        assert r2.status == 200


async def test_reservations_learn_from_the_nodes_own_token_counts(start_fleet: StartFleet):
    # The node's tokenizer counts 25% more than the gateway's tiktoken estimate.
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {"tokenizer_scale": 1.25})],
        # The stand-in's count as it is, corrected by what the node reports.
        gateway={
            "models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"upper_bound": False}}]
        },
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(1000)}], "max_tokens": 4}
    reserved = [fleet.state.calibration.scaled(MODEL, 1000, 0.0)]  # before any answer
    async with aiohttp.ClientSession() as s:
        for _ in range(30):
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            reserved.append(
                fleet.state.calibration.scaled(
                    MODEL, int(r.headers["x-gateway-prompt-tokens"]), 0.0
                )
            )
    counted = int(r.headers["x-gateway-prompt-tokens"])
    assert usage["prompt_tokens"] > counted * 1.2
    ratio = fleet.state.calibration.ratio(MODEL)
    assert 1.15 < ratio < 1.3
    # What admission reserves for this prompt grew toward the node's own count.
    assert reserved[-1] > counted * 1.15 and reserved[0] == 1000


async def test_completions_n_and_too_long_prompt(start_fleet: StartFleet):
    fleet = await start_fleet()
    async with aiohttp.ClientSession() as s:
        # (The simulator serves one prompt per completions request; batches of prompts
        # are counted per prompt by the gateway, see test_counting.)
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 5, "n": 3}
        async with s.post(fleet.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            data = await r.json()
            assert len(data["choices"]) == 3
        body = {"model": MODEL, "prompt": words(140_000), "max_tokens": 5}
        async with s.post(fleet.url + "/v1/completions", json=body) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        bad_id = "x" * 500
        async with s.post(
            fleet.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"x-request-id": bad_id},
        ) as r:
            assert r.status == 200 and r.headers["x-request-id"] != bad_id
    assert fleet.leaks() == {}
