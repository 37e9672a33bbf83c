"""Counting as the node counts, against simulated nodes that count with a real model
vocabulary and chat template (issue #11): exact mode (the gateway has the tokenizer
directory), and the stand-in (cl100k) with its bound, the node's /tokenize near a limit,
and re-admission after a node's context-length 400."""

from __future__ import annotations

import random

import aiohttp

from tests.support.fleet import MODEL, SERVED, StartFleet


def corpus(rnd: random.Random, n: int) -> list[str]:
    kinds = [
        lambda: " ".join(
            rnd.choice(["the", "quick", "fox", "jumps", "over", "lazy", "dog"])
            for _ in range(rnd.randint(5, 400))
        ),
        lambda: " ".join(str(rnd.randint(0, 10**9)) for _ in range(rnd.randint(5, 300))),
        lambda: (
            f'{{"id": "{rnd.getrandbits(32):08x}-{rnd.getrandbits(16):04x}", '
            f'"values": [{",".join(str(rnd.random()) for _ in range(rnd.randint(1, 50)))}]}}'
        ),
        lambda: (
            f"def f(x):\n    return [i * x for i in range({rnd.randint(1, 100)})]\n"
            * rnd.randint(1, 20)
        ),
        lambda: "日本語のテキストと絵文字🙂" * rnd.randint(1, 40),
    ]
    return [rnd.choice(kinds)() for _ in range(n)]


async def test_exact_mode_counts_what_the_node_counts(start_fleet: StartFleet, vocab_dirs):
    qwen = str(vocab_dirs("qwen"))
    fleet = await start_fleet(
        [("q-1", "large", "gpu80-8b", {"tokenizer": qwen})],
        time_scale=200,
        gateway={"models": [{"name": MODEL, "served_name": SERVED, "tokenizer": {"path": qwen}}]},
    )
    rnd = random.Random(3)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a thing up",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    async with aiohttp.ClientSession() as s:
        for i, text in enumerate(corpus(rnd, 40)):
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": text},
            ]
            if i % 3 == 0:
                messages += [
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "and?"},
                ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            if i % 4 == 0:
                body["tools"] = tools
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                assert int(r.headers["x-gateway-prompt-tokens"]) == data["usage"]["prompt_tokens"]
            completion = {"model": MODEL, "prompt": text, "max_tokens": 2}
            async with s.post(fleet.url + "/v1/completions", json=completion) as r:
                data = await r.json()
                assert int(r.headers["x-gateway-prompt-tokens"]) == data["usage"]["prompt_tokens"]


async def test_standin_never_sends_a_node_a_prompt_it_must_refuse(
    start_fleet: StartFleet, vocab_dirs
):
    # Digits count one token per digit in Qwen's vocabulary, ~3 per token in cl100k: a
    # cl100k count of these prompts is ~half the node's. Near the 8k limit, the bound and
    # the node's /tokenize keep every prompt that does not fit away from the small node.
    qwen = str(vocab_dirs("qwen"))
    fleet = await start_fleet(
        [
            ("small-1", "small", "gpu24-8b", {"tokenizer": qwen}),
            ("large-1", "large", "gpu80-8b", {"tokenizer": qwen}),
        ],
        time_scale=200,
    )
    rnd = random.Random(5)
    served = 0
    async with aiohttp.ClientSession() as s:
        for n in range(3_000, 8_000, 250):
            digits = " ".join(str(rnd.randint(10**8, 10**9)) for _ in range(n // 5))
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": digits}],
                "max_tokens": 16,
            }
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                served += 1
    assert served == 20
    for name in ("small-1", "large-1"):
        state = await fleet.nodes[name].state()
        assert state["preemptions"] == 0
    small = fleet.backend("small-1")
    assert small.recent_rejections(fleet.state.clock()) == 0  # no node 400s


async def test_a_node_refusing_a_prompt_as_too_long_teaches_its_count(start_fleet: StartFleet):
    # The node's tokenizer counts twice what cl100k does, beyond the stand-in's bound and
    # below the /tokenize threshold: it refuses; the gateway reads its count from the 400
    # and admits the request again, to the node with room, before any byte is sent.
    fleet = await start_fleet(
        [
            ("small-1", "small", "gpu24-8b", {"tokenizer_scale": 2.0}),
            ("large-1", "large", "gpu80-8b", {"tokenizer_scale": 2.0}),
        ],
        time_scale=200,
    )
    body = {"model": MODEL, "prompt": "hello" + " hello" * 4_999, "max_tokens": 8}
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json=body) as r,
    ):
        data = await r.json()
        assert r.status == 200, data
        assert r.headers["x-gateway-backend"] == "large-1"
        assert data["usage"]["prompt_tokens"] > 8192
    # The small node was tried first (the stand-in's bound fit it) and refused.
    assert fleet.backend("small-1").recent_rejections(fleet.state.clock()) == 1
    assert fleet.leaks() == {}
