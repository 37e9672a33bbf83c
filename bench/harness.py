"""Shared benchmark plumbing: a simulated fleet + a gateway on loopback, a load client.

Nodes run as separate processes (``processes=True``) so their engines do not share the
gateway's core; the gateway runs in this process on its own aiohttp runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from kvgateway.commands.demo import demo_config_path
from kvgateway.config.load import parse_config
from kvgateway.core.derived_limits import derive_all
from kvgateway.server.app import STATE, create_app
from kvgateway.simulator.fleet import SimulatedFleet, start_fleet
from kvgateway.simulator.fleetconfig import parse_fleet_config
from kvgateway.upstream.vllm_metrics import parse_node_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    url: str
    fleet: SimulatedFleet
    app: web.Application


def demo_data() -> dict[str, Any]:
    with open(demo_config_path(), encoding="utf-8") as fh:
        data: dict[str, Any] = yaml.safe_load(fh)
    return data


@contextlib.asynccontextmanager
async def fleet_and_gateway(
    policy: str,
    *,
    time_scale: float,
    seed: int = 1,
    data: dict[str, Any] | None = None,
    gateway_overrides: dict[str, Any] | None = None,
    sim_overrides: dict[str, Any] | None = None,
    processes: bool = True,
) -> AsyncIterator[Running]:
    """The demo fleet on free ports, and a gateway with ``policy`` in front of it."""
    data = json.loads(json.dumps(data or demo_data()))
    data["simulation"] = {"time_scale": time_scale, "seed": seed, **(sim_overrides or {})}
    for tier in data["tiers"]:
        for b in tier["backends"]:
            b["url"] = f"http://127.0.0.1:{free_port()}"
    specs = parse_fleet_config(data)
    async with start_fleet(specs, processes=processes) as fleet:
        data.pop("simulation")
        for tier in data["tiers"]:
            for b in tier["backends"]:
                b.pop("simulate", None)
                b["url"] = fleet.urls[b["name"]]
        data.setdefault("routing", {})["policy"] = policy
        data.setdefault("server", {})["access_log"] = False
        data.setdefault("health", {})["interval_s"] = 1.0
        for key, value in (gateway_overrides or {}).items():
            data.setdefault(key, {}).update(value)
        config = parse_config(data, source=demo_config_path())
        app = create_app(config, derived=derive_all(config))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
        await site.start()
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(app)
            yield Running(url, fleet, app)
        finally:
            await runner.cleanup()


async def _wait_ready(app: web.Application, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(b.usable for b in app[STATE].fleet.active):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the fleet did not become ready")


async def node_metrics(fleet: SimulatedFleet) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as s:
        for node in fleet:
            async with s.get(node.url + "/metrics") as r:
                text = await r.text()
            m = parse_node_metrics(text)
            out[node.name] = {"preemptions": m.preemptions or 0.0}
    return out


def words(n_tokens: int, rnd: random.Random) -> str:
    # A distinct prompt of ~n cl100k tokens: a random tag defeats any prefix or count cache.
    tag = f"{rnd.getrandbits(64):x}"
    return tag + " hello" * max(1, n_tokens - 4)


@dataclass
class Outcome:
    """What one request came back with."""

    status: int
    code: str | None
    tier: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    short: bool


@dataclass
class Tally:
    results: list[Outcome] = field(default_factory=list)

    def count(self, pred: Any) -> int:
        return sum(1 for r in self.results if pred(r))


async def send_chat(
    session: aiohttp.ClientSession,
    url: str,
    prompt_tokens: int,
    max_tokens: int,
    rnd: random.Random,
    *,
    short: bool,
    timeout: float = 600.0,
) -> Outcome:
    body = {
        "model": "llama-3.1-8b",
        "messages": [{"role": "user", "content": words(prompt_tokens, rnd)}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    ttft = None
    completion = 0
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                tier = r.headers.get("x-gateway-tier")
                if r.status != 200:
                    data = await r.json(content_type=None)
                    code = data.get("error", {}).get("code")
                    return Outcome(
                        r.status,
                        str(code),
                        tier,
                        prompt_tokens,
                        0,
                        None,
                        time.monotonic() - start,
                        short,
                    )
                error = None
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        error = chunk["error"].get("code") or "stream_error"
                        continue
                    if chunk.get("choices") and ttft is None:
                        ttft = time.monotonic() - start
                    usage = chunk.get("usage")
                    if usage:
                        completion = int(usage.get("completion_tokens") or 0)
                return Outcome(
                    200 if error is None else 502,
                    error,
                    tier,
                    prompt_tokens,
                    completion,
                    ttft,
                    time.monotonic() - start,
                    short,
                )
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(
            0, exc.__class__.__name__, None, prompt_tokens, 0, None, time.monotonic() - start, short
        )


def is_backend_400(o: Outcome) -> bool:
    # vLLM's own 400 (code 400), as opposed to the gateway's context_length_exceeded.
    return o.status == 400 and o.code != "context_length_exceeded"


def settings_note(time_scale: float) -> str:
    return (
        f"simulated nodes at time_scale={time_scale:g} (1 s of wall time = {time_scale:g} s of "
        "simulated GPU time); latencies below are in simulated seconds"
    )
