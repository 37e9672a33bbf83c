"""Streams through the gateway against a real vLLM node: the node's own count reaches the
client as it asked for it, a client that leaves frees the node's sequence, and a drain
lets a running stream finish."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.support.eventually import eventually
from tests.support.gateway_process import serve_process
from tests.support.real_fleet import StartGateway, backend_entry, gateway_config, state_of
from tests.support.vllm_nodes import RealNode

pytestmark = pytest.mark.real_vllm


def _ask(content: str, max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "model": "qwen",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        **extra,
    }


async def _chunks(url: str, body: dict[str, object]) -> list[dict[str, Any]]:
    out = []
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                out.append(json.loads(line[6:]))
    return out


async def test_usage_reaches_the_client_as_it_asked_for_it(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    """The gateway always asks the node for per-chunk usage; the client sees it only
    where it asked: none, the final usage chunk, or usage on every chunk. A stream
    without usage carries the node's system_fingerprint where the node alone puts it."""
    node = qwen_fleet["S"]
    gw = await real_gateway(gateway_config([node]))
    url = str(gw.make_url("")).rstrip("/")
    plain = await _chunks(url, _ask("usage plain", 12))
    assert all("usage" not in c or c["usage"] is None for c in plain)
    # The node's fingerprint where the node alone puts it on such a stream: the last chunk.
    alone = await _chunks(node.url, _ask("usage plain", 12))
    prints = [[c.get("system_fingerprint") for c in chunks] for chunks in (plain, alone)]
    assert prints[0] == prints[1] and prints[0][-1] and not any(prints[0][:-1])
    final = await _chunks(url, _ask("usage final", 12, stream_options={"include_usage": True}))
    usages = [c["usage"] for c in final if c.get("usage")]
    assert len(usages) == 1 and usages[0]["completion_tokens"] == 12
    assert final[-1]["choices"] == []
    every = await _chunks(
        url,
        _ask(
            "usage every chunk",
            12,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
    )
    counts = [c["usage"]["completion_tokens"] for c in every if c.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 12 and len(counts) >= 12
    # The node's counts moved the request's place in the projection as they came.
    b = state_of(gw).fleet.get("S")
    assert b is not None and b.step_s > 0


async def test_a_client_leaving_mid_stream_frees_the_nodes_sequence(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    node = qwen_fleet["S"]
    gw = await real_gateway(gateway_config([node]))
    url = str(gw.make_url("")).rstrip("/")
    b = state_of(gw).fleet.get("S")
    assert b is not None
    await eventually(lambda: node.metric("vllm:num_requests_running") == 0, timeout=60)
    oai = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = await oai.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "a long answer please"}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    async for _ in stream:
        got += 1
        if got == 5:
            break
    assert node.metric("vllm:num_requests_running") >= 1
    await stream.close()
    await eventually(lambda: node.metric("vllm:num_requests_running") == 0, timeout=15)
    await eventually(lambda: b.in_flight == 0 and b.reserved_tokens == 0, timeout=5)
    await oai.close()


def test_a_drain_lets_a_running_stream_finish(
    qwen_fleet: dict[str, RealNode], tmp_path: Path
) -> None:
    """SIGTERM while a stream runs: the stream ends whole (its last usage and [DONE])
    within the grace period, and the process exits 0."""
    node = qwen_fleet["S"]
    config = gateway_config([node], server={"shutdown_grace_s": 60})
    with serve_process(config, tmp_path) as (url, proc):
        body = json.dumps(_ask("drain me", 200, stream_options={"include_usage": True})).encode()
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            first = resp.readline()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            rest = resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert b'"completion_tokens":200' in rest.replace(b" ", b"")
        assert proc.wait(60) == 0


async def test_streams_close_cleanly_when_many_leave_at_once(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    """Eight clients leave mid-stream together: the node runs nothing afterwards and the
    gateway holds nothing (each reservation released once)."""
    node = qwen_fleet["S"]
    gw = await real_gateway(gateway_config([node]))
    url = str(gw.make_url("")).rstrip("/")
    b = state_of(gw).fleet.get("S")
    assert b is not None

    async def leave_early(i: int) -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/chat/completions", json=_ask(f"leave {i}", 2000)) as r,
        ):
            assert r.status == 200
            async for _ in r.content.iter_any():
                break

    await asyncio.gather(*(leave_early(i) for i in range(8)))
    await eventually(lambda: node.metric("vllm:num_requests_running") == 0, timeout=20)
    await eventually(lambda: (b.in_flight, b.reserved_tokens, len(b.projection)) == (0, 0, 0))


async def test_streams_queued_inside_a_busy_node_are_not_cut_and_pause_nothing(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway takes S for 40 sequences (it runs 16): of 20 streams sent at once, 4
    wait inside the node for longer than first_byte_s (2 s) while it serves the others.
    None is cut, and the node's waiting gauge, which counts only the gateway's own
    requests that have not started, pauses nothing."""
    node = qwen_fleet["S"]
    entry = backend_entry(node, max_num_seqs=40, timeouts={"first_byte_s": 2})
    gw = await real_gateway(gateway_config([node], tiers=[{"name": "t", "backends": [entry]}]))
    url = str(gw.make_url("")).rstrip("/")
    caplog.set_level(logging.WARNING, logger="kvgateway.upstream.monitor")
    ask = {"stream_options": {"include_usage": True}}
    runs = await asyncio.gather(*(_chunks(url, _ask(f"queued {i}", 160, **ask)) for i in range(20)))
    counts = [next(c["usage"]["completion_tokens"] for c in r if c.get("usage")) for r in runs]
    assert counts == [160] * 20
    assert not [r.getMessage() for r in caplog.records if "queueing" in r.getMessage()]
