"""A real gateway in front of real simulated vLLM nodes, all on loopback."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvgateway.config.load import parse_config
from kvgateway.server.app import STATE, create_app
from kvgateway.server.state import GatewayState
from kvgateway.simulator.node import NODE_KEY
from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.server import create_node_app as create_node
from kvgateway.tokens.encoding import EncodingCache

MODEL = "llama"
SERVED = "meta-llama/Llama-3.1-8B-Instruct"
# One encoding cache for the whole test session: loading the BPE file costs ~0.2 s.
ENCODINGS = EncodingCache()


@dataclass
class Node:
    name: str
    tier: str
    server: TestServer

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def state(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/sim/state") as r:
            state: dict[str, Any] = await r.json()
            return state

    async def fault(self, **fault: Any) -> None:
        async with aiohttp.ClientSession() as s, s.post(self.url + "/sim/fault", json=fault) as r:
            assert r.status == 200, await r.text()


@dataclass
class RunningFleet:
    gateway: TestServer
    nodes: dict[str, Node]

    @property
    def url(self) -> str:
        return str(self.gateway.make_url("")).rstrip("/")

    @property
    def state(self) -> GatewayState:
        return self.gateway.app[STATE]

    def backend(self, name: str):
        b = self.state.fleet.get(name)
        assert b is not None
        return b

    def leaks(self) -> dict[str, tuple[int, int, int]]:
        return {
            b.name: (b.reserved_tokens, b.reserved_seqs, b.in_flight)
            for b in self.state.fleet.backends
            if (b.reserved_tokens, b.reserved_seqs, b.in_flight) != (0, 0, 0)
        }


NodeSpec = tuple[str, str, str, dict[str, Any]]  # name, tier, profile, overrides

DEFAULT_NODES: list[NodeSpec] = [
    ("small-1", "small", "gpu24-8b", {}),
    ("small-2", "small", "gpu24-8b", {}),
    ("large-1", "large", "gpu80-8b", {}),
    ("offload-1", "offload", "offload-8b", {}),
]

StartFleet = Callable[..., Awaitable[RunningFleet]]


@pytest.fixture
async def start_fleet(aiohttp_server: Any) -> StartFleet:
    async def start(
        nodes: list[NodeSpec] | None = None,
        *,
        time_scale: float = 50.0,
        gateway: dict[str, Any] | None = None,
        backend_extra: dict[str, dict[str, Any]] | None = None,
        tracer_provider: Any | None = None,
    ) -> RunningFleet:
        running: dict[str, Node] = {}
        tiers: dict[str, list[dict[str, Any]]] = {}
        for name, tier, profile, overrides in nodes or DEFAULT_NODES:
            settings = dataclasses.replace(
                get_profile(profile),
                **{"name": name, "model": SERVED, "time_scale": time_scale, "seed": 1, **overrides},
            )
            server = await aiohttp_server(create_node(settings, encodings=ENCODINGS))
            node = Node(name, tier, server)
            running[name] = node
            entry = {"name": name, "url": node.url, "model": MODEL}
            publisher = server.app[NODE_KEY].publisher
            if publisher is not None and publisher.endpoint:
                # A node publishing KV events (`kv_events_endpoint`): the gateway subscribes.
                entry["kv_events"] = publisher.endpoint
                if settings.kv_events_topic:
                    entry["kv_events_topic"] = settings.kv_events_topic
                if publisher.replay_endpoint:
                    entry["kv_events_replay"] = publisher.replay_endpoint
            entry.update((backend_extra or {}).get(name, {}))
            tiers.setdefault(tier, []).append(entry)
        config: dict[str, Any] = {
            "models": [{"name": MODEL, "served_name": SERVED, "aliases": ["gpt-4o-mini"]}],
            "admission": {"queue_timeout_s": 5, "default_output_tokens": 256},
            "health": {"interval_s": 0.5, "timeout_s": 1},
            "load_feedback": {"interval_s": 0.5},
            "tiers": [
                {"name": t, "offload": t == "offload", "backends": bs} for t, bs in tiers.items()
            ],
        }
        for key, value in (gateway or {}).items():
            if isinstance(value, dict):
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        app = create_app(parse_config(config), encodings=ENCODINGS, tracer_provider=tracer_provider)
        server = await aiohttp_server(app)
        return RunningFleet(server, running)

    return start
