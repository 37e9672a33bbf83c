"""Simulated nodes on real loopback sockets for the simulator's own tests."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from kvgateway.simulator.node import NODE_KEY, SimNode
from kvgateway.simulator.profiles import TINY
from kvgateway.simulator.server import create_node_app
from kvgateway.tokens.encoding import EncodingCache
from tests.support.eventually import eventually

# Tests run the tiny profile fast: 10 ms simulated steps take 0.1-0.2 ms of wall time.
FAST = 60.0


@dataclass
class SimClient:
    server: TestServer
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def node(self) -> SimNode:
        return self.server.app[NODE_KEY]

    async def state(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/sim/state") as r:
            assert r.status == 200
            body: dict[str, Any] = await r.json()
            return body

    async def metrics_text(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        total = 0.0
        found = False
        for family in text_string_to_metric_families(await self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
                    found = True
        assert found, f"no sample {name} {labels}"
        return total

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    async def wait_idle(self, timeout: float = 5.0) -> dict[str, Any]:
        """Poll /sim/state until nothing runs or waits; returns that state."""

        async def idle() -> dict[str, Any]:
            state = await self.state()
            assert state["running"] == 0 and state["waiting"] == 0, f"node not idle: {state}"
            return state

        return await eventually(idle, timeout=timeout, interval=0.02)


@pytest.fixture(scope="session")
def encodings() -> EncodingCache:
    return EncodingCache()


SimFactory = Callable[..., Awaitable[SimClient]]


@pytest.fixture
async def sim(
    aiohttp_server: Callable[..., Awaitable[TestServer]], encodings: EncodingCache
) -> AsyncIterator[SimFactory]:
    """``await sim(**overrides)``: a tiny-profile node with settings overridden."""
    sessions: list[aiohttp.ClientSession] = []

    async def make(**overrides: Any) -> SimClient:
        settings = dataclasses.replace(TINY, **{"time_scale": FAST, "seed": 1, **overrides})
        server = await aiohttp_server(create_node_app(settings, encodings=encodings))
        session = aiohttp.ClientSession()
        sessions.append(session)
        return SimClient(server, session)

    yield make
    for session in sessions:
        await session.close()


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": TINY.model, "messages": [{"role": "user", "content": content}], **extra}
