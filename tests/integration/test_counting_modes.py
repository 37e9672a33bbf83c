"""Counting as the node counts, against simulated nodes that count with a real model
vocabulary and chat template: exact mode (the gateway has the tokenizer
directory), and the stand-in (cl100k) with its bound, the node's /tokenize near a limit,
and re-admission after a node's context-length 400."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from bench.counting_workload import (
    MIX,
    is_gateway_refusal,
    judge,
    node_counts,
    send,
    workload,
)
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.exact import ExactCounter
from tests.support import vocab
from tests.support.fleet import MODEL, SERVED, StartFleet
from tests.unit.tokens.test_vs_transformers import THINKING


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
        # Shapes and values vLLM's lax request models take, which the gateway takes and
        # reads as vLLM does: a string content part, a media part without a type, any role,
        # 2.0 and "2" for an integer, "true" for a boolean (add_special_tokens adds BOS).
        image = {"image_url": {"url": "data:image/png;base64,AAAA"}}
        for shape in (
            {
                "messages": [
                    {"role": "user", "content": ["a string part", {"type": "text", "text": "b"}]}
                ]
            },
            {"messages": [{"role": "user", "content": [image, "what is it?"]}]},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.0},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "2"},
            {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": "true"},
        ):
            body = {"model": MODEL, "max_tokens": 2, **shape}
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, (shape, data)
                assert int(r.headers["x-gateway-prompt-tokens"]) == data["usage"]["prompt_tokens"]
        # truncate_prompt_tokens: the node keeps the prompt's last tokens; a prompt past
        # every context then fits (it is not refused), and reserves only what is kept.
        digits = "".join(str(i % 10) for i in range(40_000))  # 40k tokens in Qwen's
        for path, prompt in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": digits}]}),
            ("/v1/completions", {"prompt": digits}),
        ):
            body = {"model": MODEL, "max_tokens": 2, "truncate_prompt_tokens": 1000, **prompt}
            async with s.post(fleet.url + path, json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                assert int(r.headers["x-gateway-prompt-tokens"]) == 1000
                assert data["usage"]["prompt_tokens"] == 1000
            # -1: all but one token of the context (32,768 - 1 on this node), and
            # max_tokens cut to the one left, as vLLM >= 0.32 does.
            body["truncate_prompt_tokens"] = -1
            async with s.post(fleet.url + path, json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                assert int(r.headers["x-gateway-prompt-tokens"]) == 32_767
                assert data["usage"]["prompt_tokens"] == 32_767
                assert int(r.headers["x-gateway-max-tokens"]) == 1
                assert data["usage"]["completion_tokens"] <= 1
        # -1 without max_tokens: the same cut; the output the context leaves is one.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": digits}]}
        async with s.post(
            fleet.url + "/v1/chat/completions", json={**chat, "truncate_prompt_tokens": -1}
        ) as r:
            data = await r.json()
            assert r.status == 200, data
            assert int(r.headers["x-gateway-max-tokens"]) == 1
            assert data["usage"]["prompt_tokens"] == 32_767
        # A batch is cut prompt by prompt: eight sequences of 32,767 (the simulated node
        # serves one prompt per request and refuses it; the gateway's count is the point).
        batch = {"model": MODEL, "prompt": [digits] * 8, "max_tokens": 2}
        async with s.post(
            fleet.url + "/v1/completions", json={**batch, "truncate_prompt_tokens": -1}
        ) as r:
            assert int(r.headers["x-gateway-prompt-tokens"]) == 8 * 32_767
        # Any role goes to the node, whose template decides (this one knows no "ipython").
        body = {"model": MODEL, "messages": [{"role": "ipython", "content": "42"}]}
        async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 400 and "Unknown role" in (await r.json())["error"]["message"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "true"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert b"data: [DONE]" in await r.read()
        # A tool call carrying a key nested 600 deep (vLLM drops unknown keys) is counted
        # and served: deep-copied to render, it would pass Python's recursion limit (a 500).
        deep = "1"
        for _ in range(600):
            deep = '{"a":' + deep + "}"
        call = '{"id":"c","type":"function","function":{"name":"f","arguments":"{}"},"x":DEEP}'
        raw = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": ["CALL"]},
                ],
            }
        ).replace('"CALL"', call.replace("DEEP", deep))
        headers = {"Content-Type": "application/json"}
        async with s.post(fleet.url + "/v1/chat/completions", data=raw, headers=headers) as r:
            data = await r.json()
            assert r.status == 200, data
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


MIXED = {kind: 1.0 for kind in MIX}  # every content class of the benchmark, alike


@pytest.mark.parametrize("vocabulary", ["qwen", "sentencepiece"])
@pytest.mark.parametrize("mode", ["exact", "standin"])
async def test_mixed_workload_against_a_real_vocabulary(
    start_fleet: StartFleet,
    vocab_dirs,
    mode: str,
    vocabulary: str,
    encodings: EncodingCache,
):
    """A small run of bench.counting_modes: numbers, code, JSON, CJK, other scripts,
    white-space layout, tools, images, long prompts and prompts within 5% of a node's
    context, through the gateway to nodes counting with a real vocabulary."""
    directory = str(vocab_dirs(vocabulary))
    gateway: dict[str, Any] = {"models": [{"name": MODEL, "served_name": SERVED}]}
    if mode == "exact":
        gateway["models"][0]["tokenizer"] = {"path": directory}
    fleet = await start_fleet(
        [
            ("small-1", "small", "gpu24-8b", {"tokenizer": directory}),
            ("large-1", "large", "gpu80-8b", {"tokenizer": directory}),
        ],
        time_scale=200,
        gateway=gateway,
    )
    counter = ExactCounter(encodings.model(directory))
    probes = workload(MODEL, counter, 26, seed=7, contexts=(8_192, 32_768), mix=MIXED)
    assert {p.kind.split("/")[0] for p in probes} >= {"near_limit", "layout", "tools", "images"}
    todo = iter(probes)
    async with aiohttp.ClientSession() as s:

        async def client() -> None:
            for p in todo:
                await send(s, fleet.url, p, timeout=30)

        await asyncio.gather(*(client() for _ in range(4)))
        await node_counts(s, probes, lambda _: (fleet.nodes["large-1"].url, SERVED))
    v = judge(probes, 32_768)
    assert v.under == 0 and v.node_400 == 0, [p for p in probes if p.status not in (200, 400)]
    assert v.wrongly_refused == 0, [p.kind for p in probes if is_gateway_refusal(p)]
    assert v.served == v.servable  # every request that fits the large node was served
    if mode == "exact":
        assert v.exact == v.served
    for name in ("small-1", "large-1"):
        assert (await fleet.nodes[name].state())["preemptions"] == 0
        assert fleet.backend(name).recent_rejections(fleet.state.clock()) == 0
    assert fleet.leaks() == {}


async def test_the_nodes_default_template_kwargs_are_counted_when_configured(
    start_fleet: StartFleet, vocab_dirs, tmp_path
):
    # A Qwen3-style node started with --default-chat-template-kwargs
    # '{"enable_thinking": false}' adds an empty think block to every prompt: the gateway
    # counts it once its model says so (models[].tokenizer.chat_template_kwargs).
    directory = vocab.variant(vocab_dirs("qwen"), tmp_path / "thinking", chat_template=THINKING)
    defaults = {"enable_thinking": False}
    node = {"tokenizer": str(directory), "default_chat_template_kwargs": json.dumps(defaults)}
    tok = {"path": str(directory), "chat_template_kwargs": defaults}
    fleet = await start_fleet(
        [("q-1", "large", "gpu80-8b", node)],
        time_scale=200,
        gateway={"models": [{"name": MODEL, "served_name": SERVED, "tokenizer": tok}]},
    )
    asks: list[dict[str, Any]] = [
        {},
        {"reasoning_effort": "high"},  # the request's own field wins over the default
        {"chat_template_kwargs": {"enable_thinking": True}},
    ]
    async with aiohttp.ClientSession() as s:
        counts = []
        for extra in asks:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Which block size?"}],
                "max_tokens": 2,
                **extra,
            }
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                counted = int(r.headers["x-gateway-prompt-tokens"])
                assert counted == data["usage"]["prompt_tokens"], extra
                counts.append(counted)
    assert counts[0] > counts[2]  # the empty think block, only by default


async def test_images_cost_what_the_models_processor_makes_of_their_size(
    start_fleet: StartFleet, vocab_dirs, tmp_path
):
    # A Qwen2-VL-style processor config beside the tokenizer: a 1920x1080 picture is
    # 2,691 tokens on the node, and counted so, not at a flat 765.
    import base64
    import io

    from PIL import Image

    processor = vocab.QWEN2_VL_PROCESSOR
    directory = vocab.variant(vocab_dirs("qwen"), tmp_path / "vl", processor=processor)
    fleet = await start_fleet(
        [("q-1", "large", "gpu80-8b", {"tokenizer": str(directory)})],
        time_scale=200,
        gateway={
            "models": [
                {"name": MODEL, "served_name": SERVED, "tokenizer": {"path": str(directory)}}
            ]
        },
    )
    buf = io.BytesIO()
    Image.new("RGB", (1920, 1080)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [part, "?"]}]}
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=body) as r,
    ):
        data = await r.json()
        assert r.status == 200, data
        counted = int(r.headers["x-gateway-prompt-tokens"])
        assert counted == data["usage"]["prompt_tokens"] and counted > 2691
