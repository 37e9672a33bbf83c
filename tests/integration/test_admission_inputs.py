"""Admission inputs a careless client gets wrong: open output budgets, echo, best_of, and a
node template that would skew the prompt estimate, against real simulated
vLLM nodes on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.support.fleet import MODEL, SERVED, NodeSpec, StartFleet

SMALL: list[NodeSpec] = [("small-1", "small", "gpu24-8b", {})]


def words(n_tokens: int) -> str:
    # " hello" is one cl100k token.
    return "hello" + " hello" * (n_tokens - 1)


async def _post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with s.post(url, json=body) as r:
        return r.status, dict(r.headers), await r.json()


async def test_completions_max_tokens_null_gets_the_reserved_budget_and_no_preemption(
    start_fleet: StartFleet,
):
    # vLLM reads an explicit null as "the rest of the context": 8 of them would generate
    # ~7k tokens each on an 8k node against 16 reserved, and preempt.
    fleet = await start_fleet(SMALL, time_scale=200)
    body = {"model": MODEL, "prompt": words(900), "max_tokens": None, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(
            *(_post(s, fleet.url + "/v1/completions", body) for _ in range(8))
        )
    for status, headers, data in got:
        assert status == 200, data
        assert headers["x-gateway-max-tokens"] == "16"
        assert data["usage"]["completion_tokens"] <= 16
    state = await fleet.nodes["small-1"].state()
    assert state["preemptions"] == 0
    assert fleet.leaks() == {}


async def test_injected_default_never_turns_a_servable_chat_into_a_400(start_fleet: StartFleet):
    # A 7,900-token chat with no max_tokens on an 8k node: the gateway's default (512)
    # would not fit, but the node alone answers it; the gateway injects what fits.
    fleet = await start_fleet(
        SMALL, time_scale=200, gateway={"admission": {"default_output_tokens": 512}}
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(7_900)}]}
    async with aiohttp.ClientSession() as s:
        status, headers, data = await _post(s, fleet.url + "/v1/chat/completions", body)
    assert status == 200, data
    injected = int(headers["x-gateway-max-tokens"])
    assert 1 <= injected < 512
    assert data["usage"]["prompt_tokens"] + injected <= 8192
    assert data["usage"]["completion_tokens"] <= injected


async def test_max_tokens_zero_is_an_echo_and_otherwise_a_clear_400(start_fleet: StartFleet):
    fleet = await start_fleet(SMALL, time_scale=200)
    async with aiohttp.ClientSession() as s:
        status, headers, data = await _post(
            s,
            fleet.url + "/v1/completions",
            {"model": MODEL, "prompt": "score me", "max_tokens": 0, "echo": True},
        )
        assert status == 200, data
        assert "x-gateway-max-tokens" not in headers  # forwarded as the client sent it
        status, _, data = await _post(
            s, fleet.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}
        )
        assert status == 400 and data["error"]["param"] == "max_tokens"
        status, _, data = await _post(
            s,
            fleet.url + "/v1/completions",
            {"model": MODEL, "prompt": "x", "n": 3, "best_of": 2},
        )
        assert status == 200 and len(data["choices"]) == 3  # best_of: not read, as vLLM


async def test_a_request_reserves_the_n_sequences_the_node_runs_not_best_of(
    start_fleet: StartFleet,
):
    """vLLM 0.32 ignores ``best_of``: a completion with ``n`` 3 and ``best_of`` 5 runs 3
    sequences, and holds 3 sequence slots and the projection of 3 sequences."""
    # Counted as the node counts (the stand-in's count as it is), to check the arithmetic.
    fleet = await start_fleet(
        SMALL,
        time_scale=5,
        gateway={
            "models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"upper_bound": False}}]
        },
    )
    node = fleet.backend("small-1")
    body = {
        "model": MODEL,
        "prompt": words(100),
        "max_tokens": 200,
        "n": 3,
        "best_of": 5,
        "stream": True,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as s, s.post(fleet.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()
        # Three sequences of 100 + 200 tokens each: the flight of one request with 3
        # sequences, projected at most at 3 x (100 + 200 + 2) tokens in 16-token blocks.
        assert node.reserved_seqs == 3
        (flight,) = node.projection.flights
        assert (flight.n, flight.prompt, flight.bound) == (3, 100, 200)
        assert node.projection.peak(16, 0.0).blocks == 3 * 19
        async for _ in r.content:
            pass
    assert fleet.leaks() == {}


async def test_tiny_chats_on_a_fixed_template_do_not_poison_a_long_prompt(
    start_fleet: StartFleet,
):
    # The node's template adds 30 fixed tokens to every chat. Twenty tiny chats must not
    # drive the estimate ratio to its 2x cap: the next 26k prompt, which the node serves,
    # is admitted, not refused with a gateway 400.
    fleet = await start_fleet(
        [("big-1", "large", "gpu80-8b", {"chat_overhead_fixed": 30})], time_scale=200
    )
    big = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": words(26_000)}],
    }
    async with aiohttp.ClientSession() as s:
        status, _, data = await _post(s, fleet.url + "/v1/chat/completions", big)
        assert status == 200, data
        for i in range(20):
            tiny = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": f"hi {i}"}],
            }
            status, _, _ = await _post(s, fleet.url + "/v1/chat/completions", tiny)
            assert status == 200
        status, _, data = await _post(s, fleet.url + "/v1/chat/completions", big)
    assert status == 200, data
    assert fleet.state.calibration.ratio(MODEL) < 1.05
    state = await fleet.nodes["big-1"].state()
    assert state["preemptions"] == 0


async def test_a_hybrid_node_is_budgeted_by_its_kv_groups_and_never_preempted(
    start_fleet: StartFleet,
):
    # gpt-oss: full-attention and sliding-window layers in two KV-cache groups sharing the
    # pool. The node reports num_gpu_blocks for the whole pool; counting it as one group
    # would give a budget 2x too large for short requests. With the architecture known (the
    # capacity block), the discovered pool is divided by its groups.
    fleet = await start_fleet(
        [("oss-1", "small", "gpu24-gptoss-20b", {})],
        time_scale=100,
        backend_extra={"oss-1": {"capacity": {"preset": "gpt-oss-20b", "gpu_memory_gib": 24}}},
        gateway={"admission": {"queue_timeout_s": 60}},
    )
    node = fleet.backend("oss-1")
    assert node.limits.kv_cache_tokens.source == "discovered"
    assert node.kv_cache_tokens == (21_110 - 1) // 2 * 16
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": words(12_000),
        "max_tokens": 1_000,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(
            *(
                _post(
                    s, fleet.url + "/v1/completions", {**body, "prompt": f"{i} " + body["prompt"]}
                )
                for i in range(16)
            )
        )
    assert [g[0] for g in got] == [200] * 16
    state = await fleet.nodes["oss-1"].state()
    assert state["preemptions"] == 0
    assert fleet.leaks() == {}
