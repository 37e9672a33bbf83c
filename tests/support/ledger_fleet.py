"""Gateway processes sharing one simulated node through a real Redis ledger: the node runs
in the test process (so its engine state can be read), each gateway is `gateway serve`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.server import create_node_app as create_node
from tests.support.fleet import ENCODINGS, MODEL, SERVED
from tests.support.live import free_ports

NODE = "n0"


async def start_node(time_scale: float) -> TestServer:
    settings = dataclasses.replace(
        get_profile("gpu24-8b"), name=NODE, model=SERVED, time_scale=time_scale, seed=1
    )
    server = TestServer(create_node(settings, encodings=ENCODINGS), host="127.0.0.1")
    await server.start_server()
    return server


@contextlib.asynccontextmanager
async def running_node(time_scale: float) -> AsyncIterator[str]:
    """The simulated node for the block; yields its base URL."""
    server = await start_node(time_scale)
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def gateway_config(
    port: int, node_url: str, redis_url: str | None, lease_s: float
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 1},
        "models": [{"name": MODEL, "served_name": SERVED}],
        "admission": {"queue_timeout_s": 30},
        "health": {"interval_s": 0.2},
        # The node's own KV scrape must not be what keeps it safe here: the ledger must.
        "load_feedback": {"enabled": False},
        "tiers": [
            {
                "name": "small",
                "backends": [{"name": NODE, "url": node_url, "model": MODEL}],
            }
        ],
    }
    if redis_url is not None:
        cfg["ledger"] = {"url": redis_url, "lease_s": lease_s, "timeout_s": 0.5}
    return cfg


@dataclasses.dataclass
class GatewayProc:
    url: str
    proc: asyncio.subprocess.Process
    log: Path


async def start_gateway(
    work: Path,
    name: str,
    node_url: str,
    redis_url: str | None,
    *extra: str,
    lease_s: float = 2.0,
    config: dict[str, Any] | None = None,
) -> GatewayProc:
    """``gateway serve`` with :func:`gateway_config`, ``config``'s top-level keys added."""
    (port,) = free_ports(1)
    path = work / f"{name}.yaml"
    cfg = {**gateway_config(port, node_url, redis_url, lease_s), **(config or {})}
    path.write_text(yaml.safe_dump(cfg))
    log = work / f"{name}.log"
    with log.open("wb") as fh:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvgateway",
            "serve",
            "--config",
            str(path),
            *extra,
            stdout=fh,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            if proc.returncode is not None:
                break
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return GatewayProc(url, proc, log)
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    raise AssertionError(f"gateway {name} did not become ready:\n{log.read_text()[-3000:]}")


async def stop_gateway(g: GatewayProc) -> None:
    if g.proc.returncode is None:
        g.proc.terminate()
        try:
            await asyncio.wait_for(g.proc.wait(), 10)
        except TimeoutError:
            g.proc.kill()
            await g.proc.wait()


async def chat(s: aiohttp.ClientSession, url: str, prompt_words: int, max_tokens: int) -> int:
    """One long completion (ignore_eos: it really generates max_tokens); the status."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * prompt_words}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


async def get_json(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        doc: dict[str, Any] = json.loads(await r.text())
        return doc


async def ledger_says(url: str, key: str, want: object) -> bool:
    """The replica at ``url`` says ``ledger.<key>`` is ``want`` on ``/ready``."""
    return bool((await get_json(url + "/ready"))["ledger"][key] == want)


async def node_view(gateway_url: str) -> dict[str, Any]:
    """The gateway's /admin/backends entry for the node (fleet-wide reservations)."""
    data = await get_json(gateway_url + "/admin/backends")
    b: dict[str, Any]
    (b,) = [b for b in data["backends"] if b["name"] == NODE]
    return b


async def ledger_sum(redis_url: str) -> int:
    """The sum of every replica's recorded tokens on the node, as stored (dead replicas'
    fields included until a script purges them: an upper bound of the live sum)."""
    client = Redis.from_url(redis_url, socket_timeout=1)
    try:
        held = await client.hgetall("{kvgw}:tok:" + NODE)
        return sum(int(v) for v in held.values())
    finally:
        await client.aclose()


async def ledger_holds(redis_url: str, at_least: int) -> bool:
    """:func:`ledger_sum` has reached ``at_least``."""
    return await ledger_sum(redis_url) >= at_least


class Sampler:
    """Samples the ledger sum every few ms while a load runs; remembers the peak."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.peak = 0
        self.samples = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.peak = max(self.peak, await ledger_sum(self.redis_url))
                self.samples += 1
            except OSError:
                pass  # Redis stopped on purpose in some tests
            except Exception as exc:  # redis errors while Redis is down
                if "Connection" not in type(exc).__name__:
                    raise
            await asyncio.sleep(0.01)
