"""The gateway as a real process: `gateway serve`, SIGTERM drain, SIGHUP reload."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import socket
import sys
from typing import Any

import aiohttp
import pytest
import yaml

from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.server import create_node_app as create_node
from tests.support.fleet import ENCODINGS, MODEL, SERVED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_node(aiohttp_server: Any, name: str, time_scale: float = 1.0):
    settings = dataclasses.replace(
        get_profile("gpu24-8b"), name=name, model=SERVED, time_scale=time_scale, seed=1
    )
    return await aiohttp_server(create_node(settings, encodings=ENCODINGS))


def config(port: int, node_urls: list[str], **server: Any) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, **server},
        "models": [{"name": MODEL, "served_name": SERVED}],
        "health": {"interval_s": 0.2},
        "tiers": [
            {
                "name": "small",
                "backends": [
                    {"name": f"n{i}", "url": u, "model": MODEL} for i, u in enumerate(node_urls)
                ],
            }
        ],
    }


async def start_gateway(tmp_path, cfg: dict[str, Any]):
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgateway",
        "serve",
        "--config",
        str(path),
        stderr=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{cfg['server']['port']}"
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return proc, url, path
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    proc.kill()
    await proc.wait()
    raise AssertionError("gateway did not become ready")


async def stream_events(
    s: aiohttp.ClientSession, url: str, max_tokens: int, started: asyncio.Event
):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    events = []
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
                started.set()
    return events


@pytest.fixture
async def procs():
    running: list[asyncio.subprocess.Process] = []
    yield running
    for p in running:
        if p.returncode is None:
            p.kill()
            await p.wait()


async def test_sigterm_fails_ready_then_drains_in_flight_streams(aiohttp_server, tmp_path, procs):
    node = await start_node(aiohttp_server, "n0", time_scale=2.0)
    cfg = config(
        free_port(), [str(node.make_url("")).rstrip("/")], drain_delay_s=0.5, shutdown_grace_s=20
    )
    proc, url, _ = await start_gateway(tmp_path, cfg)
    procs.append(proc)
    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_events(s, url, 60, started))
        await asyncio.wait_for(started.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        async with s.get(url + "/ready") as r:
            assert r.status == 503
        events = await asyncio.wait_for(stream, 30)
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert await asyncio.wait_for(proc.wait(), 15) == 0


async def test_sigterm_cancels_what_outlives_the_grace_period(aiohttp_server, tmp_path, procs):
    node = await start_node(aiohttp_server, "n0", time_scale=0.5)
    cfg = config(free_port(), [str(node.make_url("")).rstrip("/")], shutdown_grace_s=0.3)
    proc, url, _ = await start_gateway(tmp_path, cfg)
    procs.append(proc)
    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_events(s, url, 2000, started))
        await asyncio.wait_for(started.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        events = await asyncio.wait_for(stream, 15)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down"
    assert await asyncio.wait_for(proc.wait(), 15) == 0
    # The node saw the cancelled request go away and freed its blocks.
    async with aiohttp.ClientSession() as s:
        for _ in range(50):
            async with s.get(str(node.make_url("/sim/state"))) as r:
                st = await r.json()
            if st["used_blocks"] == 0:
                break
            await asyncio.sleep(0.05)
    assert st["used_blocks"] == 0


async def test_sighup_reloads_and_bad_config_keeps_serving(aiohttp_server, tmp_path, procs):
    a = await start_node(aiohttp_server, "a", time_scale=50)
    b = await start_node(aiohttp_server, "b", time_scale=50)
    port = free_port()
    urls = [str(a.make_url("")).rstrip("/"), str(b.make_url("")).rstrip("/")]
    proc, url, path = await start_gateway(tmp_path, config(port, urls[:1]))
    procs.append(proc)
    async with aiohttp.ClientSession() as s:
        path.write_text(yaml.safe_dump(config(port, urls)))
        proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            async with s.get(url + "/admin/backends") as r:
                names = [x["name"] for x in (await r.json())["backends"]]
            if names == ["n0", "n1"]:
                break
            await asyncio.sleep(0.05)
        assert names == ["n0", "n1"]
        path.write_text("tiers: [")
        proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.3)
        async with s.get(url + "/metrics") as r:
            assert 'gateway_config_reloads_total{result="invalid"} 1.0' in await r.text()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 15) == 0
    err = (await proc.stderr.read()).decode()
    assert "reload of" in err and "rejected" in err
