"""Prefix caching seen from outside: /metrics counters and the node's state."""

from __future__ import annotations

from kvgateway.simulator.tokenizer import ChatMessage
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


async def test_an_answer_sent_back_hits_the_blocks_its_generation_cached(sim: SimFactory) -> None:
    # The node's output ids are those of the text it streams, so a prompt that repeats
    # the answer (the next turn of a conversation) finds the answer's blocks cached.
    node = await sim()
    model = node.node.settings.model
    first = "Tell me a story about a fox. " * 6
    status, body = await node.post(
        "/v1/completions", {"model": model, "prompt": first, "max_tokens": 40, "ignore_eos": True}
    )
    assert status == 200
    answer = body["choices"][0]["text"]
    tok = node.node.tokenizer
    ids1 = tok.encode_prompt(first)
    assert tok.encode_prompt(first + answer) == ids1 + tok.encode_prompt(answer)
    await node.wait_idle()
    before = await node.metric("vllm:prefix_cache_hits_total")
    status, _ = await node.post(
        "/v1/completions",
        {"model": model, "prompt": first + answer + " And then?", "max_tokens": 2},
    )
    assert status == 200
    await node.wait_idle()
    # The first request computed its prompt and 39 of its 40 output tokens.
    cached = (len(ids1) + 39) // 16 * 16
    assert cached > len(ids1) // 16 * 16  # the answer adds blocks beyond the prompt's
    assert await node.metric("vllm:prefix_cache_hits_total") - before == cached


async def test_a_chat_follow_up_hits_the_previous_answer_s_blocks(sim: SimFactory) -> None:
    # vLLM renders a chat so that the prompt of turn N ends with the assistant's header
    # (the generation prompt) and turn N+1 repeats it, the answer and its end-of-turn
    # after it: the blocks the answer's generation cached are hit by the next turn.
    node = await sim()
    model = node.node.settings.model
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Tell me a story about a fox. " * 6},
    ]
    body = {"model": model, "messages": messages, "max_tokens": 40, "ignore_eos": True}
    status, first = await node.post("/v1/chat/completions", body)
    assert status == 200
    answer = first["choices"][0]["message"]["content"]
    prompt1 = first["usage"]["prompt_tokens"]
    await node.wait_idle()
    before = await node.metric("vllm:prefix_cache_hits_total")
    follow = [*messages, {"role": "assistant", "content": answer}]
    follow.append({"role": "user", "content": "And then?"})
    status, second = await node.post(
        "/v1/chat/completions", {"model": model, "messages": follow, "max_tokens": 2}
    )
    assert status == 200
    await node.wait_idle()
    # The first request computed its prompt and 39 of its 40 output tokens.
    cached = (prompt1 + 39) // 16 * 16
    assert cached > prompt1 // 16 * 16
    assert await node.metric("vllm:prefix_cache_hits_total") - before == cached
    # Counting is unchanged: one template overhead per message plus a fixed one.
    assert second["usage"]["prompt_tokens"] == node.node.tokenizer.count_chat(
        [ChatMessage(m["role"], m["content"]) for m in follow]
    )
