"""Admission against real vLLM nodes: what the gateway admits the node serves without
preempting or refusing, long prompts go to the larger node, and the gateway reads and
matches vLLM's own context rules."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import pytest
from openai import AsyncOpenAI
from openai.types import CompletionUsage

from kvgateway.tokens.node_count import parse_context_length_error
from tests.support.eventually import eventually
from tests.support.real_fleet import StartGateway, gateway_config, state_of, words
from tests.support.vllm_nodes import RealNode, http_json, post_status

pytestmark = pytest.mark.real_vllm


def node_count(node: RealNode, content: str) -> int:
    body = {"model": node.spec.served_name, "messages": [{"role": "user", "content": content}]}
    answer = http_json(node.url + "/tokenize", body)
    assert isinstance(answer, dict)
    return int(answer["count"])


def exactly(node: RealNode, tokens: int) -> str:
    """A chat message the node counts as exactly ``tokens`` prompt tokens (template
    included): words short of it, then a space and one digit per token left (Qwen
    splits digits one by one)."""
    content = words(tokens // 2)
    left = tokens - node_count(node, content) - 1
    assert left > 0
    content += " " + "7" * left
    assert node_count(node, content) == tokens
    return content


def client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=300, max_retries=0)


async def test_an_overflow_burst_is_served_without_preemption_or_node_400(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    """Twice what S's KV holds at once, all at once, through the gateway: every request
    is served, the node preempts nothing and refuses nothing."""
    node = qwen_fleet["S"]
    gw = await real_gateway(gateway_config([node]))
    b = state_of(gw).fleet.get("S")
    assert b is not None
    await eventually(lambda: b.limits.known and b.healthy, timeout=15)
    before = node.metric("vllm:num_preemptions_total")
    async with client(str(gw.make_url("")).rstrip("/")) as oai:

        async def one(i: int) -> int:
            r = await oai.chat.completions.create(
                model="qwen",
                messages=[{"role": "user", "content": words(300 + 20 * i, i)}],
                max_tokens=100 + 5 * i,
                stream=True,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            )
            out = 0
            async for chunk in r:
                if chunk.usage is not None:
                    out = chunk.usage.completion_tokens
            return out

        # ~(400 + 160) tokens each, 24 of them: ~13k tokens against S's 6,016.
        outs = await asyncio.gather(*(one(i) for i in range(24)))
        assert outs == [100 + 5 * i for i in range(24)]
        assert node.metric("vllm:num_preemptions_total") == before
        assert state_of(gw).metrics.registry.get_sample_value(
            "gateway_requests_total",
            {"model": "qwen", "tier": "tier-S", "backend": "S", "status": "400"},
        ) in (None, 0.0)


async def test_a_long_prompt_goes_to_the_larger_node(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    gw = await real_gateway(gateway_config([qwen_fleet["S"], qwen_fleet["L"]]))
    async with client(str(gw.make_url("")).rstrip("/")) as oai:
        for name in ("S", "L"):
            b = state_of(gw).fleet.get(name)
            assert b is not None
            await eventually(
                # mypy infers a lambda with defaults as one taking arguments.
                cast("Callable[[], bool]", lambda b=b: b.limits.known and b.healthy),
                timeout=15,
            )
        short = await oai.chat.completions.with_raw_response.create(
            model="qwen", messages=[{"role": "user", "content": words(500)}], max_tokens=4
        )
        assert short.headers["x-gateway-backend"] == "S"
        long = await oai.chat.completions.with_raw_response.create(
            model="qwen", messages=[{"role": "user", "content": words(6000)}], max_tokens=4
        )
        assert long.headers["x-gateway-backend"] == "L"
        assert cast(CompletionUsage, long.parse().usage).prompt_tokens == int(
            long.headers["x-gateway-prompt-tokens"]
        )


def test_vllms_own_context_refusals_carry_the_count_the_gateway_reads(
    qwen_fleet: dict[str, RealNode],
) -> None:
    """Each of vLLM 0.32's context refusals, parsed as the gateway parses it for
    re-admission: the count it reads never exceeds the node's own (/tokenize), and an
    exact count equals it."""
    node = qwen_fleet["S"]
    limit = node.spec.max_model_len
    chat = node.url + "/v1/chat/completions"
    cases = {
        "past the context": words(limit + 500),
        "at the limit": None,  # filled below: exactly max_model_len tokens
    }
    cases["at the limit"] = exactly(node, limit)
    for label, content in cases.items():
        assert content is not None
        status, answer = post_status(
            chat,
            {"model": "qwen", "messages": [{"role": "user", "content": content}], "max_tokens": 8},
        )
        assert status == 400, (label, answer)
        assert isinstance(answer, dict)
        message = answer["error"]["message"]
        parsed = parse_context_length_error(message, limit)
        assert parsed is not None, (label, message)
        assert parsed.max_model_len == limit
        truth = node_count(node, content)
        assert parsed.prompt_tokens <= truth, (label, message)
        if not parsed.at_least:
            assert parsed.prompt_tokens == truth, (label, message)


async def test_the_max_tokens_clamp_is_the_nodes(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway
) -> None:
    """A max_tokens that does not fit beside the prompt is cut to what the context
    leaves, by the gateway exactly as by the node (vLLM >= 0.32)."""
    node = qwen_fleet["S"]
    content = words(3000)
    prompt = node_count(node, content)
    ask: dict[str, Any] = {
        "model": "qwen",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    status, direct = post_status(node.url + "/v1/chat/completions", ask, timeout=300)
    assert status == 200 and isinstance(direct, dict)
    cut = direct["usage"]["completion_tokens"]
    assert cut == node.spec.max_model_len - prompt
    gw = await real_gateway(gateway_config([node]))
    async with client(str(gw.make_url("")).rstrip("/")) as oai:
        raw = await oai.chat.completions.with_raw_response.create(
            model="qwen",
            messages=ask["messages"],
            max_tokens=2000,
            extra_body={"ignore_eos": True},
        )
        assert int(raw.headers["x-gateway-max-tokens"]) == cut
        assert cast(CompletionUsage, raw.parse().usage).completion_tokens == cut
