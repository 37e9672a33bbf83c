"""Disconnects, stalls, admission rejection and injected faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from tests.support.eventually import eventually
from tests.support.sim import SimClient, SimFactory, chat


async def _until(
    node: SimClient, predicate: Callable[[dict[str, Any]], bool], timeout: float = 2.0
) -> dict[str, Any]:
    """Poll /sim/state until ``predicate`` holds; returns that state."""

    async def held() -> dict[str, Any]:
        state = await node.state()
        assert predicate(state), f"condition never held: {state}"
        return state

    return await eventually(held, timeout=timeout, interval=0.01)


async def test_streaming_disconnect_aborts_and_frees_blocks(sim: SimFactory) -> None:
    node = await sim(time_scale=2.0)  # ~200 tokens/s of wall time: the stream is long
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            node.url + "/v1/chat/completions",
            json=chat("hello " * 100, max_tokens=400, ignore_eos=True, stream=True),
        )
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: {")
        state = await node.state()
        assert state["running"] == 1 and state["used_blocks"] > 0
        resp.close()  # drop the connection mid-stream
    started = time.monotonic()
    state = await _until(node, lambda s: s["running"] == 0 and s["used_blocks"] == 0)
    assert time.monotonic() - started < 1.0
    assert state["finished"]["abort"] == 1
    assert await node.metric("vllm:request_success_total", finished_reason="abort") == 1
    assert await node.metric("vllm:kv_cache_usage_perc") == 0.0


async def test_non_streaming_disconnect_aborts(sim: SimFactory) -> None:
    node = await sim(time_scale=2.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                node.url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True},
            )
    state = await _until(node, lambda s: s["running"] == 0 and s["waiting"] == 0)
    assert state["used_blocks"] == 0 and state["finished"]["abort"] == 1


async def test_request_bigger_than_the_pool_stalls_until_aborted(sim: SimFactory) -> None:
    # 16 usable blocks = 256 tokens, but max_model_len 512 lets a 300-token prompt in.
    node = await sim(num_gpu_blocks=17)
    stuck = asyncio.create_task(
        node.post("/v1/completions", {"prompt": "hello " * 300, "max_tokens": 10}), name="stuck"
    )
    await _until(node, lambda s: s["waiting"] == 1)
    behind = asyncio.create_task(
        node.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}), name="behind"
    )
    await _until(node, lambda s: s["waiting"] == 2)
    await asyncio.sleep(0.2)  # thousands of simulated steps' worth of time
    state = await node.state()
    assert (state["running"], state["waiting"], state["used_blocks"]) == (0, 2, 0)
    assert not behind.done()  # FCFS head-of-line blocking, as in vLLM
    stuck.cancel()  # the client gives up: the head leaves the queue
    with pytest.raises(asyncio.CancelledError):
        await stuck
    status, body = await behind
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    state = await node.wait_idle()
    assert state["finished"]["abort"] == 1


async def test_max_num_queued_reqs_answers_503(sim: SimFactory) -> None:
    node = await sim(max_num_queued_reqs=2, time_scale=5.0)
    body = chat("hi", max_tokens=400, ignore_eos=True)
    load = [
        asyncio.create_task(node.post("/v1/chat/completions", body), name=f"q{i}") for i in range(2)
    ]
    await _until(node, lambda s: s["running"] + s["waiting"] == 2)
    status, reply = await node.post("/v1/chat/completions", chat("hi", max_tokens=2))
    assert status == 503
    assert reply["error"]["type"] == "Service Unavailable" and reply["error"]["code"] == 503
    for task in load:
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    await node.wait_idle()
    status, _ = await node.post("/v1/chat/completions", chat("hi", max_tokens=2))
    assert status == 200


async def test_injected_status_applies_to_the_next_requests_only(sim: SimFactory) -> None:
    node = await sim()
    status, body = await node.post("/sim/fault", {"status": 503, "remaining": 2})
    assert status == 200 and body["fault"]["status"] == 503
    for _ in range(2):
        status, reply = await node.post("/v1/chat/completions", chat(max_tokens=2))
        assert status == 503
        assert reply["error"]["type"] == "ServiceUnavailableError"
    status, _ = await node.post("/v1/chat/completions", chat(max_tokens=2))
    assert status == 200
    async with node.session.get(node.url + "/sim/fault") as r:
        assert (await r.json()) == {"fault": None}


async def test_injected_hang_delays_the_first_byte(sim: SimFactory) -> None:
    node = await sim()
    await node.post("/sim/fault", {"hang_s": 0.3, "remaining": 1})
    started = time.monotonic()
    status, _ = await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and time.monotonic() - started >= 0.3
    started = time.monotonic()
    await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert time.monotonic() - started < 0.3


async def test_injected_drop_mid_stream(sim: SimFactory) -> None:
    node = await sim(time_scale=10.0)
    await node.post("/sim/fault", {"drop_after_chunks": 3, "remaining": 1})
    events = []
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(
                node.url + "/v1/chat/completions",
                json=chat(max_tokens=100, ignore_eos=True, stream=True),
            ) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line)
    assert len(events) == 3  # the role chunk and two tokens, then the connection died
    assert b"[DONE]" not in b"".join(events)
    state = await _until(node, lambda s: s["running"] == 0)
    assert state["used_blocks"] == 0 and state["finished"]["abort"] == 1
    # Non-streaming: the connection closes without any response.
    await node.post("/sim/fault", {"drop_after_chunks": 0, "remaining": 1})
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await session.post(node.url + "/v1/completions", json={"prompt": "hi"})


async def test_health_fault_and_bad_fault_bodies(sim: SimFactory) -> None:
    node = await sim()
    await node.post("/sim/fault", {"health_status": 503})
    async with node.session.get(node.url + "/health") as r:
        assert r.status == 503
    status, _ = await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200  # a health fault leaves requests alone
    async with node.session.delete(node.url + "/sim/fault") as r:
        assert r.status == 200
    async with node.session.get(node.url + "/health") as r:
        assert r.status == 200
    for bad in ({"status": 200}, {"hang_s": -1}, {"bogus": 1}, {"remaining": 0}):
        status, body = await node.post("/sim/fault", bad)
        assert status == 400, bad
        assert body["error"]["type"] == "BadRequestError"
