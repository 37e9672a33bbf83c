"""The real-vLLM tier's nodes and gateways.

Nodes start once per run (session fixtures; at most three at once on these 2-core
machines): ``qwen_fleet`` is the two-node fleet S (4k context, 6,016 KV tokens) and L
(16k, 24,448), both publishing KV events; other vocabularies and the hybrid model come
up one at a time for the modules that need them. A gateway is started in the test's own
event loop in front of whichever nodes a test names.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from kvgateway.config.load import parse_config
from kvgateway.server.app import STATE, create_app
from kvgateway.server.state import GatewayState
from kvgateway.tokens.encoding import EncodingCache
from tests.support.tools import in_ci
from tests.support.vllm_nodes import NodeSpec, RealNode, kept_node, running, vllm_missing

S = NodeSpec("S", "qwen2", max_model_len=4096, num_blocks=48, kv_events=True)
L = NodeSpec("L", "qwen2", max_model_len=16384, num_blocks=192, kv_events=True)
HYBRID = NodeSpec("H", "gemma3", served_name="gemma", max_model_len=4096, num_blocks=64)
LLAMA = NodeSpec("llama", "llama3", served_name="llama", max_model_len=4096, num_blocks=40)
MISTRAL = NodeSpec("mistral", "mistral", served_name="mistral", max_model_len=4096, num_blocks=40)
# The benchmark's single node: 64 blocks (8,064 usable KV tokens), 16 sequences.
BENCH = NodeSpec("B", "qwen2", max_model_len=4096, num_blocks=64)
# S's twin, for two equal nodes (the multi-turn benchmark).
S2 = NodeSpec("S2", "qwen2", max_model_len=4096, num_blocks=48, kv_events=True)
# A node whose engine a test kills.
VICTIM = NodeSpec("V", "qwen2", max_model_len=2048, num_blocks=24)
ALL_SPECS = (S, L, S2, HYBRID, LLAMA, MISTRAL, BENCH, VICTIM)
# Tokenizer directories load once per run (a Qwen vocabulary takes ~3 s).
ENCODINGS = EncodingCache()


def models_root() -> Path:
    """Model directories are kept between runs beside vLLM itself (rebuilt with it)."""
    from tests.support.real_models import VLLM_VENV

    return Path(os.environ.get("KVGATEWAY_REAL_MODELS", VLLM_VENV / "tiny-models"))


def require_vllm() -> None:
    reason = vllm_missing()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"{reason}; CI must run the real-vLLM tier")
    pytest.skip(reason)


def _nodes(factory: pytest.TempPathFactory, *specs: NodeSpec) -> Iterator[dict[str, RealNode]]:
    require_vllm()
    kept = os.environ.get("KVGATEWAY_REAL_NODES")
    if kept:
        # Nodes left running by `python -m tests.support.vllm_nodes` (while developing),
        # described in one directory or several (separated by ":").
        dirs = [Path(d) for d in kept.split(os.pathsep) if d]
        found = {
            s.name: next((n for d in dirs if (n := kept_node(d, s)) is not None), None)
            for s in specs
        }
        if all(found.values()):
            yield {name: node for name, node in found.items() if node is not None}
            return
    work = factory.mktemp("vllm")
    with running(specs, work, models_root()) as nodes:
        yield {n.spec.name: n for n in nodes}


@pytest.fixture(scope="session")
def qwen_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RealNode]]:
    yield from _nodes(tmp_path_factory, S, L)


@pytest.fixture(scope="module")
def hybrid_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    for nodes in _nodes(tmp_path_factory, HYBRID):
        yield nodes["H"]


@pytest.fixture(scope="module")
def victim_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    for nodes in _nodes(tmp_path_factory, VICTIM):
        yield nodes["V"]


@pytest.fixture(scope="module")
def vocab_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RealNode]]:
    yield from _nodes(tmp_path_factory, LLAMA, MISTRAL)


WORDS = ("harbor", "lantern", "meadow", "quartz", "summit", "willow", "anchor", "ember")
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
