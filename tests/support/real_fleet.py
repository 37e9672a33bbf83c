"""The real-vLLM tier's nodes and gateways.

Nodes start once per run (:class:`Launcher`; at most three at once on these 2-core
machines): ``qwen_fleet`` is the two-node fleet S (4k context, 6,016 KV tokens) and L
(16k, 24,448), both publishing KV events; the other vocabularies and the hybrid model
start once S and L serve, the node publishing its KV events at a concrete host (whose
engine the last test kills) once the vocabularies stop: each ahead of its module. A gateway is started in the test's own
event loop in front of whichever nodes a test names.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestServer

from kvgateway.config.load import parse_config
from kvgateway.server.app import STATE, create_app
from kvgateway.server.state import GatewayState
from kvgateway.tokens.encoding import EncodingCache
from tests.support.live import free_ports
from tests.support.tools import in_ci
from tests.support.vllm_nodes import (
    START_TIMEOUT_S,
    NodeSpec,
    RealNode,
    kept_node,
    launch_node,
    vllm_missing,
)

S = NodeSpec("S", "qwen2", max_model_len=4096, num_blocks=48, kv_events=True)
L = NodeSpec("L", "qwen2", max_model_len=16384, num_blocks=192, kv_events=True)
HYBRID = NodeSpec("H", "gemma3", served_name="gemma", max_model_len=4096, num_blocks=64)
LLAMA = NodeSpec("llama", "llama3", served_name="llama", max_model_len=4096, num_blocks=40)
MISTRAL = NodeSpec("mistral", "mistral", served_name="mistral", max_model_len=4096, num_blocks=40)
# The benchmark's single node: 64 blocks (8,064 usable KV tokens), 16 sequences.
BENCH = NodeSpec("B", "qwen2", max_model_len=4096, num_blocks=64)
# S's twin, for two equal nodes (the multi-turn benchmark).
S2 = NodeSpec("S2", "qwen2", max_model_len=4096, num_blocks=48, kv_events=True)
ALL_SPECS: tuple[NodeSpec, ...] = (S, L, S2, HYBRID, LLAMA, MISTRAL, BENCH)
# Tokenizer directories load once per run (a Qwen vocabulary takes ~3 s).
ENCODINGS = EncodingCache()


def models_root() -> Path:
    """Model directories are kept between runs beside vLLM itself (rebuilt with it)."""
    from tests.support.real_models import MODELS_ROOT

    return MODELS_ROOT


def require_vllm() -> None:
    reason = vllm_missing()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"{reason}; CI must run the real-vLLM tier")
    pytest.skip(reason)


class Launcher:
    """The tier's nodes, each started once per run, and where the selected tests will use
    it, ahead of the module that needs it: a node's start-up (three processes importing
    vLLM one after another, mostly on one core) then overlaps the tests before it. At
    most three start at once; a module's own nodes stop when the module ends. Nodes
    left running by ``python -m tests.support.vllm_nodes`` (``KVGATEWAY_REAL_NODES``, one
    directory or several separated by ":") are used instead of starting any."""

    def __init__(self, workdir: Path, wanted: frozenset[str]) -> None:
        self._work = workdir
        self._wanted = wanted
        self._nodes: dict[str, RealNode] = {}
        kept = os.environ.get("KVGATEWAY_REAL_NODES", "")
        self._kept = [Path(d) for d in kept.split(os.pathsep) if d]

    def _kept_node(self, spec: NodeSpec) -> RealNode | None:
        return next((n for d in self._kept if (n := kept_node(d, spec)) is not None), None)

    def launch(self, *specs: NodeSpec) -> None:
        for spec in specs:
            if spec.name not in self._nodes:
                node = self._kept_node(spec)
                self._nodes[spec.name] = node or launch_node(spec, self._work, models_root())

    def ahead(self, fixture: str, *specs: NodeSpec) -> None:
        """Launch ``specs`` now if a selected test uses ``fixture``."""
        if fixture in self._wanted:
            self.launch(*specs)

    def ready(self, *specs: NodeSpec) -> dict[str, RealNode]:
        self.launch(*specs)
        deadline = time.monotonic() + START_TIMEOUT_S
        for spec in specs:
            node = self._nodes[spec.name]
            if node.proc is not None:
                node.wait_ready(deadline)
        return {spec.name: self._nodes[spec.name] for spec in specs}

    def stop(self, *specs: NodeSpec) -> None:
        for spec in specs:
            node = self._nodes.pop(spec.name, None)
            if node is not None:
                node.stop()  # a kept node (no process of ours) is left running

    @functools.cached_property
    def connecting(self) -> tuple[NodeSpec, int, int]:
        """A Qwen node told to publish its KV events at tcp://127.0.0.1:PORT (vLLM then
        connects its PUB socket there instead of binding it; its replay socket binds
        either way): the spec, the events port and the replay port."""
        events, replay = free_ports(2)
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        extra = ("--kv-events-config", json.dumps(cfg))
        return (
            NodeSpec("C", "qwen2", max_model_len=4096, num_blocks=48, extra=extra),
            events,
            replay,
        )

    def stop_all(self) -> None:
        for node in self._nodes.values():
            node.stop()
        self._nodes.clear()


@pytest.fixture(scope="session")
def launcher(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launcher]:
    require_vllm()
    wanted = frozenset(
        name
        for item in request.session.items
        for name in cast("pytest.Function", item).fixturenames
    )
    nodes = Launcher(tmp_path_factory.mktemp("vllm"), wanted)
    try:
        yield nodes
    finally:
        nodes.stop_all()


@pytest.fixture(scope="session")
def qwen_fleet(launcher: Launcher) -> dict[str, RealNode]:
    fleet = launcher.ready(S, L)
    launcher.ahead("vocab_nodes", LLAMA, MISTRAL)
    launcher.ahead("hybrid_node", HYBRID)
    return fleet


@pytest.fixture(scope="module")
def hybrid_node(launcher: Launcher) -> Iterator[RealNode]:
    yield launcher.ready(HYBRID)["H"]
    launcher.stop(HYBRID)


@pytest.fixture(scope="session")
def apart_node(launcher: Launcher) -> RealNode:
    """C (:attr:`Launcher.connecting`): a Qwen node that connects its KV-event publisher
    to the gateway. No test shares it with others; the test that kills its engine runs
    last (``kills_node``)."""
    spec, events, replay = launcher.connecting
    node = launcher.ready(spec)["C"]
    node.events_port, node.replay_port = events, replay
    return node


@pytest.fixture(scope="module")
def vocab_nodes(launcher: Launcher) -> Iterator[dict[str, RealNode]]:
    yield launcher.ready(LLAMA, MISTRAL)
    launcher.stop(LLAMA, MISTRAL)
    launcher.ahead("apart_node", launcher.connecting[0])


WORDS: tuple[str, ...] = (
    "harbor",
    "lantern",
    "meadow",
    "quartz",
    "summit",
    "willow",
    "anchor",
    "ember",
)
WORDS += ("falcon", "glacier")


def words(n: int, seed: int = 0) -> str:
    """``n`` words that Qwen's vocabulary counts about one token each (with the space)."""
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


def backend_entry(node: RealNode, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": node.spec.name,
        "url": node.url,
        "model": node.spec.served_name,
    }
    if node.events_endpoint:
        entry["kv_events"] = node.events_endpoint
        entry["kv_events_replay"] = node.replay_endpoint
    entry.update(extra)
    return entry


def gateway_config(
    nodes: list[RealNode], *, tokenizer: dict[str, Any] | None = None, **sections: Any
) -> dict[str, Any]:
    """A gateway in front of ``nodes`` (one tier each, in the order given), counting with
    the model's own tokenizer directory unless ``tokenizer`` says otherwise."""
    served = nodes[0].spec.served_name
    config: dict[str, Any] = {
        "models": [{"name": served, "tokenizer": tokenizer or {"path": str(nodes[0].model_dir)}}],
        "health": {"interval_s": 0.5, "timeout_s": 2},
        "load_feedback": {"interval_s": 0.5},
        "tiers": [{"name": f"tier-{n.spec.name}", "backends": [backend_entry(n)]} for n in nodes],
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


StartGateway = Callable[..., Awaitable[TestServer]]


@pytest.fixture
async def real_gateway(aiohttp_server: Any) -> StartGateway:
    """``await real_gateway(config)``: a gateway serving ``config`` (a dict), its limits
    discovered from the nodes before it returns."""

    async def start(config: dict[str, Any]) -> TestServer:
        app = create_app(parse_config(config, encodings=ENCODINGS), encodings=ENCODINGS)
        server: TestServer = await aiohttp_server(app)
        return server

    return start


def state_of(server: TestServer) -> GatewayState:
    return server.app[STATE]
