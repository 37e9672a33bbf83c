"""Prefix caching seen from outside: /metrics counters and the node's state."""

from __future__ import annotations

from tests.support.sim import SimFactory, chat


async def test_a_repeated_prompt_counts_prefix_cache_hits(sim: SimFactory) -> None:
    node = await sim()
    long = "the same long question, asked twice " * 12
    for _ in range(2):
        status, body = await node.post("/v1/chat/completions", chat(long, max_tokens=4))
        assert status == 200
    await node.wait_idle()
    prompt = body["usage"]["prompt_tokens"]
    queries = await node.metric("vllm:prefix_cache_queries_total")
    hits = await node.metric("vllm:prefix_cache_hits_total")
    assert queries == 2 * prompt
    # The second request hits every full block of its prompt but the last token's.
    assert hits == (prompt - 1) // 16 * 16
    text = await node.metrics_text()
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert 'enable_prefix_caching="True"' in text
    state = await node.state()
    assert state["used_blocks"] == 0 and state["cached_blocks"] > 0


async def test_prefix_caching_can_be_turned_off(sim: SimFactory) -> None:
    node = await sim(enable_prefix_caching=False)
    for _ in range(2):
        status, _ = await node.post("/v1/chat/completions", chat("again " * 40, max_tokens=2))
        assert status == 200
    await node.wait_idle()
    assert await node.metric("vllm:prefix_cache_hits_total") == 0
    assert 'enable_prefix_caching="False"' in await node.metrics_text()
