"""The Plan stage on its own: a Planner built with explicit collaborators (a fleet view,
a node counter) turns request bytes into what admission reserves, with no fleet and no
HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.model import GatewayConfig, ModelConfig
from kvgateway.errors import BadRequest, ModelNotFound
from kvgateway.plan.planner import Planner, upstream_body
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.node_count import NodeCount
from kvgateway.tokens.prompt_estimate import PromptCalibration

CONTEXT = 8_192
BLOCK = 16


class _Fleet:
    """One context and block size for every model."""

    def block_size(self, model: str) -> int:
        return BLOCK

    def largest_context(self, model: str) -> int:
        return CONTEXT


class _NodeCounter:
    """A node that counts every prompt as ``count`` and records what it was asked."""

    def __init__(self, count: int | None) -> None:
        self.count_as = count
        self.asked: list[dict[str, Any]] = []

    async def count(self, model: ModelConfig, body: dict[str, Any], *, chat: bool) -> int | None:
        self.asked.append(body)
        return self.count_as


def _config(**admission: Any) -> GatewayConfig:
    return parse_config(
        {
            "models": [{"name": "m"}],
            "admission": admission,
            "tiers": [
                {
                    "name": "t",
                    "backends": [{"name": "a", "url": "http://127.0.0.1:9", "model": "m"}],
                }
            ],
        }
    )


@pytest.fixture
def counters() -> Iterator[TokenCounters]:
    with ThreadPoolExecutor(1) as pool:
        yield TokenCounters(EncodingCache(), pool)


def _chat(text: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


async def test_a_short_prompt_is_planned_without_asking_a_node(counters: TokenCounters) -> None:
    node = _NodeCounter(10)
    planner = Planner(_config, counters, PromptCalibration(), _Fleet(), node_counter=node)
    plan = await planner.plan(_chat("Hello there", max_tokens=100), "chat")
    assert node.asked == []
    assert plan.output_tokens == 100 and plan.demand.output_tokens == 100
    # Prompt and output in whole blocks, as the node allocates them.
    need = plan.demand.longest_prompt + 100
    assert plan.demand.tokens == -(-need // BLOCK) * BLOCK
    assert upstream_body(plan) is None  # nothing to change: the client's bytes go as they are


async def test_a_bound_near_the_context_is_replaced_by_the_nodes_count(
    counters: TokenCounters,
) -> None:
    """Near the largest context the stand-in's bound would refuse a prompt the node may
    serve: the node's own count is asked once, and reserved exactly."""
    node = _NodeCounter(6_000)
    planner = Planner(_config, counters, PromptCalibration(), _Fleet(), node_counter=node)
    plan = await planner.plan(_chat("word " * 6_500, max_tokens=1_000), "chat")
    assert len(node.asked) == 1
    assert plan.prompt.exact and plan.demand.longest_prompt == 6_000
    # Without a node to ask, the bound stands: past the context with the output beside it.
    alone = Planner(_config, counters, PromptCalibration(), _Fleet())
    bound = await alone.plan(_chat("word " * 6_500, max_tokens=1_000), "chat")
    assert not bound.prompt.exact and bound.demand.longest_prompt > 6_000


async def test_an_open_output_budget_is_set_and_sent(counters: TokenCounters) -> None:
    """A chat without max_tokens reserves the configured default and the node is sent it,
    so the node never generates past what was reserved."""
    planner = Planner(
        lambda: _config(default_output_tokens=300), counters, PromptCalibration(), _Fleet()
    )
    plan = await planner.plan(_chat("Hello"), "chat")
    assert plan.injected_output == 300 and plan.output_tokens == 300
    sent = upstream_body(plan)
    assert sent is not None and json.loads(sent)[plan.parsed.output_field] == 300


async def test_the_config_is_read_per_request(counters: TokenCounters) -> None:
    """A reload swaps the config the planner reads: the next request sees it."""
    current = [_config(default_output_tokens=300)]
    planner = Planner(lambda: current[0], counters, PromptCalibration(), _Fleet())
    assert (await planner.plan(_chat("Hello"), "chat")).output_tokens == 300
    current[0] = _config(default_output_tokens=500)
    assert (await planner.plan(_chat("Hello"), "chat")).output_tokens == 500


async def test_bad_requests_are_refused_before_anything_is_reserved(
    counters: TokenCounters,
) -> None:
    planner = Planner(_config, counters, PromptCalibration(), _Fleet())
    with pytest.raises(ModelNotFound):
        await planner.plan(_chat("hi").replace(b'"m"', b'"x"'), "chat")
    with pytest.raises(BadRequest):
        await planner.plan(b"{not json", "chat")


async def test_a_nodes_exact_count_replans_and_teaches_calibration(
    counters: TokenCounters,
) -> None:
    calibration = PromptCalibration()
    planner = Planner(_config, counters, calibration, _Fleet())
    plan = await planner.plan(_chat("word " * 100, max_tokens=50), "chat")
    again = await planner.replan(plan, NodeCount(400, at_least=False, max_model_len=4_096), "a")
    assert again.prompt.exact and again.demand.longest_prompt == 400
    assert again.demand.tokens == -(-(400 + 50) // BLOCK) * BLOCK
    assert calibration.backends() == {"a"}


async def test_a_lower_bound_is_never_reserved_as_the_count(counters: TokenCounters) -> None:
    """ "At least N" from a node with a shorter context: a node of the longest context is
    asked; without an answer the most such a node can hold is reserved, and nothing is
    learned."""
    calibration = PromptCalibration()
    node = _NodeCounter(None)
    planner = Planner(_config, counters, calibration, _Fleet(), node_counter=node)
    plan = await planner.plan(_chat("word " * 100, max_tokens=50), "chat")
    refused = NodeCount(4_097, at_least=True, max_model_len=4_096)
    most = await planner.replan(plan, refused, "small")
    assert len(node.asked) == 1
    assert most.demand.longest_prompt == CONTEXT - 50
    assert calibration.backends() == set()
    node.count_as = 5_000
    asked = await planner.replan(plan, refused, "small")
    assert asked.demand.longest_prompt == 5_000 and calibration.backends() == {"small"}
