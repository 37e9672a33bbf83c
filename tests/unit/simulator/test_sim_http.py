"""The node's vLLM-shaped HTTP surface, over real loopback sockets."""

from __future__ import annotations

import json
import math
import re

import openai
import pytest

from kvgateway.simulator.profiles import TINY
from tests.support.sim import SimFactory, chat

MODEL = TINY.model


async def test_health_models_and_tokenize(sim: SimFactory) -> None:
    node = await sim()
    async with node.session.get(node.url + "/health") as r:
        assert r.status == 200
        assert await r.read() == b""
    async with node.session.get(node.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    (entry,) = models["data"]
    assert entry["id"] == MODEL and entry["root"] == MODEL and entry["owned_by"] == "vllm"
    assert entry["object"] == "model" and entry["parent"] is None
    assert entry["max_model_len"] == TINY.max_model_len
    assert entry["permission"][0]["object"] == "model_permission"

    status, body = await node.post("/tokenize", {"model": MODEL, "prompt": "hello world"})
    assert status == 200
    assert body == {"count": 2, "max_model_len": 512, "tokens": [15339, 1917], "token_strs": None}
    status, body = await node.post(
        "/tokenize", {"messages": [{"role": "user", "content": "hello world"}]}
    )
    # cl100k count of the text + 5 template tokens per message + 3 per chat.
    assert status == 200 and body["count"] == 2 + 5 + 3 == len(body["tokens"])


async def test_tokenizer_can_differ_from_the_gateways(sim: SimFactory) -> None:
    node = await sim(
        tokenizer_bytes_per_token=2.0, chat_overhead_per_message=7, chat_overhead_fixed=0
    )
    text = "x" * 101
    _, body = await node.post("/tokenize", {"prompt": text})
    assert body["count"] == math.ceil(101 / 2) == len(body["tokens"])
    _, body = await node.post(
        "/tokenize",
        {"messages": [{"role": "system", "content": text}, {"role": "user", "content": ""}]},
    )
    assert body["count"] == 51 + 7 + 7
    scaled = await sim(tokenizer_scale=1.5)
    _, body = await scaled.post("/tokenize", {"prompt": "hello world"})
    assert body["count"] == 3


async def test_openai_client_non_streaming(sim: SimFactory) -> None:
    node = await sim(output_dist="fixed", output_mean=7)
    client = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello world"}], max_tokens=20
        )
        assert reply.object == "chat.completion" and reply.model == MODEL
        (choice,) = reply.choices
        assert choice.finish_reason == "stop"  # drew 7 < 20: an EOS
        assert choice.message.role == "assistant"
        assert choice.message.content == " the quick brown fox jumps over a"
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (10, 7)
        assert reply.usage.total_tokens == 17

        capped = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=3)
        assert capped.object == "text_completion"
        assert capped.choices[0].finish_reason == "length"
        assert capped.choices[0].text == " the quick brown"
        assert capped.usage is not None and capped.usage.prompt_tokens == 2
    finally:
        await client.close()


async def test_openai_client_streaming_with_usage(sim: SimFactory) -> None:
    node = await sim(output_dist="fixed", output_mean=5)
    client = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    # One chunk per decode step while the writer keeps up; what piled up goes as one
    # chunk when it does not (vLLM's API server merges outputs the same way).
    assert 1 <= len(content) <= 5
    assert (
        "".join(c.choices[0].delta.content or "" for c in content) == " the quick brown fox jumps"
    )
    assert content[-1].choices[0].finish_reason == "stop"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == 9


async def test_raw_sse_format_and_done(sim: SimFactory) -> None:
    node = await sim(output_dist="fixed", output_mean=3)
    async with node.session.post(
        node.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 10},
    ) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    # Three tokens, one chunk each unless they piled up (then merged, as vLLM does).
    assert 1 <= len(payloads) <= 3
    assert all(p["object"] == "text_completion" for p in payloads)
    reasons = [p["choices"][0]["finish_reason"] for p in payloads]
    assert reasons == [None] * (len(payloads) - 1) + ["stop"]
    assert all("usage" not in p for p in payloads)  # include_usage was not asked for


async def test_n_choices_share_the_prompt(sim: SimFactory) -> None:
    node = await sim(output_dist="fixed", output_mean=4)
    status, body = await node.post("/v1/chat/completions", chat("hi", n=3, max_tokens=8))
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 9  # counted once
    assert body["usage"]["completion_tokens"] == 12
    state = await node.state()
    assert state["finished"]["stop"] == 3  # three sequences in the engine


async def test_output_budget_defaults(sim: SimFactory) -> None:
    # Outputs that never stop on their own, so the budget decides the length.
    node = await sim(output_dist="fixed", output_mean=100_000, output_max=100_000, max_model_len=64)
    _, body = await node.post("/v1/chat/completions", chat("hi"))
    assert body["usage"]["prompt_tokens"] == 9
    assert body["usage"]["completion_tokens"] == 64 - 9  # max_model_len - prompt
    assert body["choices"][0]["finish_reason"] == "length"
    _, body = await node.post("/v1/completions", {"prompt": "hi"})
    assert body["usage"]["completion_tokens"] == 16  # vLLM's completions default
    _, body = await node.post(
        "/v1/chat/completions", chat("hi", max_completion_tokens=4, max_tokens=30)
    )
    assert body["usage"]["completion_tokens"] == 4  # max_completion_tokens wins
    _, body = await node.post("/v1/chat/completions", chat("hi", max_tokens=6, ignore_eos=True))
    assert body["usage"]["completion_tokens"] == 6


async def test_both_finish_reasons_occur_and_seed_repeats(sim: SimFactory) -> None:
    async def reasons(seed: int) -> list[tuple[str, int]]:
        node = await sim(seed=seed, output_dist="lognormal", output_mean=20, output_sigma=1.0)
        out = []
        for _ in range(12):
            _, body = await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 25})
            out.append((body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]))
        return out

    first = await reasons(3)
    assert {r for r, _ in first} == {"stop", "length"}
    assert all(n == 25 for r, n in first if r == "length")
    assert first == await reasons(3)


async def test_too_long_prompt_gets_vllms_400_before_0_32(sim: SimFactory) -> None:
    node = await sim(context_overflow="reject")  # max_model_len 512
    status, body = await node.post("/v1/chat/completions", chat("hello " * 600, max_tokens=100))
    assert status == 400
    assert body == {
        "error": {
            "message": (
                "This model's maximum context length is 512 tokens. However, you requested "
                "100 output tokens and your prompt contains at least 413 input tokens, for a "
                "total of at least 513 tokens. Please reduce the length of the input prompt or "
                "the number of requested output tokens. (parameter=input_tokens, value=413)"
            ),
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    # A prompt that fits alone but not with the requested output.
    status, body = await node.post("/v1/completions", {"prompt": "hello " * 500, "max_tokens": 100})
    assert status == 400 and body["error"]["param"] == "input_tokens"
    # The prompt alone at max_model_len, no output requested.
    status, body = await node.post("/v1/chat/completions", chat("hello " * 600))
    assert status == 400
    assert "requested 0 output tokens" in body["error"]["message"]
    # Token ids are checked at their full length (vLLM truncates only what it encodes):
    # "at least" only when that length happens to be max_input + 1.
    status, body = await node.post("/v1/completions", {"prompt": [7] * 600, "max_tokens": 10})
    assert (
        status == 400
        and "contains 600 input tokens, for a total of 610" in body["error"]["message"]
    )
    status, body = await node.post("/v1/completions", {"prompt": [7] * 503, "max_tokens": 10})
    assert "contains at least 503 input tokens" in body["error"]["message"]
    # max_tokens past the context alone, in vLLM's wording.
    status, body = await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 600})
    assert status == 400 and body["error"]["message"] == (
        "max_tokens=600 cannot be greater than max_model_len=max_total_tokens=512. "
        "Please request fewer output tokens."
    )
    # Exactly at the limit is fine.
    _, counted = await node.post("/tokenize", {"prompt": "hello " * 500})
    room = 512 - counted["count"]
    status, body = await node.post(
        "/v1/completions", {"prompt": "hello " * 500, "max_tokens": room}
    )
    assert status == 200 and body["usage"]["total_tokens"] == 512
    status, _ = await node.post(
        "/v1/completions", {"prompt": "hello " * 500, "max_tokens": room + 1}
    )
    assert status == 400


async def test_max_tokens_past_the_context_is_cut_as_vllm_0_32_does(sim: SimFactory) -> None:
    """vLLM >= 0.32 (renderers/params.py max_input_tokens is the whole context;
    get_max_tokens cuts max_tokens to what the prompt leaves) serves a prompt that fits
    whatever max_tokens asks, up to max_model_len itself."""
    node = await sim(output_dist="fixed", output_mean=4096.0)  # max_model_len 512
    _, counted = await node.post("/tokenize", {"prompt": "hello " * 500})
    room = 512 - counted["count"]
    status, body = await node.post("/v1/completions", {"prompt": "hello " * 500, "max_tokens": 100})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == room
    assert body["usage"]["total_tokens"] == 512
    assert body["choices"][0]["finish_reason"] == "length"
    # max_tokens past the context alone: still vLLM's 400.
    status, body = await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 600})
    assert status == 400 and "cannot be greater than max_model_len" in body["error"]["message"]
    # A prompt past the context even without output, in the new wording: text is counted
    # to max_model_len + 1 ("at least"), token ids at their length.
    status, body = await node.post("/v1/chat/completions", chat("hello " * 600, max_tokens=10))
    assert status == 400 and body["error"]["message"] == (
        "This model's maximum context length is 512 tokens. However, your prompt contains "
        "at least 513 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        "value=513)"
    )
    status, body = await node.post("/v1/completions", {"prompt": [7] * 600, "max_tokens": 10})
    assert status == 400 and "contains 600 input tokens, which exceeds" in body["error"]["message"]
    # Exactly at the limit: max_tokens is cut to 0, which SamplingParams refuses.
    status, body = await node.post("/v1/completions", {"prompt": [7] * 512, "max_tokens": 10})
    assert status == 400 and body["error"] == {
        "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    status, body = await node.post("/v1/completions", {"prompt": [7] * 511, "max_tokens": 10})
    assert status == 200 and body["usage"]["completion_tokens"] == 1


async def test_unknown_model_and_malformed_bodies(sim: SimFactory) -> None:
    node = await sim()
    status, body = await node.post("/v1/chat/completions", {**chat(), "model": "gpt-x"})
    assert status == 404
    assert body == {
        "error": {
            # vLLM >= 0.32's _check_model names the served models.
            "message": f"The model `gpt-x` does not exist. Valid aliases: {node.node.settings.model}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    async with node.session.post(
        node.url + "/v1/chat/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    ) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    # FastAPI's validation error, as vLLM renders it.
    assert error == {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': "
        "'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting "
        "property name enclosed in double quotes'}}",
        "type": "Bad Request",
        "param": "body.1",
        "code": 400,
    }
    for bad, kind, param in (
        ({"messages": "hi"}, "Bad Request", "body.messages"),
        (chat(n="two"), "Bad Request", "body.n"),
        (chat(max_tokens=0), "BadRequestError", "max_tokens"),
        (chat(n=0), "BadRequestError", None),
        (chat(stream_options={"include_usage": True}), "BadRequestError", "stream_options"),
    ):
        status, body = await node.post("/v1/chat/completions", bad)
        assert status == 400, bad
        assert (body["error"]["type"], body["error"]["param"]) == (kind, param), bad
    # The model is checked before the sampling parameters, after the fields' types.
    status, _ = await node.post("/v1/chat/completions", chat(model="gpt-x", n=0))
    assert status == 404
    status, _ = await node.post("/v1/chat/completions", chat(model="gpt-x", n="x"))
    assert status == 400
    status, _ = await node.post("/v1/completions", {"prompt": ["a", "b"]})
    assert status == 400


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_openai_client_sees_bad_request(sim: SimFactory, path: str) -> None:
    node = await sim()
    client = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as info:
            if path.endswith("chat/completions"):
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a " * 600}], max_tokens=10
                )
            else:
                await client.completions.create(model=MODEL, prompt="a " * 600, max_tokens=10)
    finally:
        await client.close()
    assert info.value.status_code == 400
    assert "maximum context length is 512 tokens" in info.value.message


async def test_chat_chunks_are_exactly_vllms_shape(sim: SimFactory) -> None:
    node = await sim(output_dist="fixed", output_mean=2)
    async with node.session.post(
        node.url + "/v1/chat/completions", json=chat("hi", stream=True, max_tokens=9)
    ) as r:
        raw = (await r.read()).decode()
    events = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n")[:-2]]
    head = {k: events[0][k] for k in ("id", "created")}
    assert head["id"].startswith("chatcmpl-")
    common = {**head, "object": "chat.completion.chunk", "model": MODEL}
    assert events[0] == {
        **common,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": None,
        "prompt_text": None,
    }
    # " the", " quick": a chunk each, or one chunk if they piled up (vLLM merges them).
    content = events[1:]
    assert 1 <= len(content) <= 2
    texts = [e["choices"][0]["delta"]["content"] for e in content]
    assert "".join(texts) == " the quick"
    # The last chunk carries the fingerprint (no usage chunk follows).
    assert content[-1] == {
        **common,
        "choices": [
            {
                "index": 0,
                "delta": {"content": texts[-1]},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "system_fingerprint": node.node.fingerprint,
    }
    for e in content[:-1]:
        assert e == {
            **common,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": texts[0]},
                    "logprobs": None,
                    "finish_reason": None,
                    "token_ids": None,
                }
            ],
        }
    assert all(e["id"] == head["id"] for e in events)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", head["id"])
    assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", node.node.fingerprint)


async def test_continuous_usage_only_with_include_usage(sim: SimFactory) -> None:
    """vLLM's should_include_usage: per-chunk usage needs include_usage as well."""
    node = await sim(output_dist="fixed", output_mean=5.0)
    for options, per_chunk, final in (
        ({"continuous_usage_stats": True}, False, False),
        ({"include_usage": True}, False, True),
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ):
        body = chat("hi", max_tokens=5, stream=True, stream_options=options)
        async with node.session.post(node.url + "/v1/chat/completions", json=body) as r:
            text = await r.text()
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        with_choices = [e for e in events if e["choices"]]
        assert all(("usage" in e and e["usage"] is not None) == per_chunk for e in with_choices)
        assert any(not e["choices"] and e.get("usage") for e in events) == final, options
