"""The gateway counts each prompt as a real vLLM node does.

With the model's tokenizer directory (``tokenizer.path``), the gateway's count (its
``x-gateway-prompt-tokens`` header) equals the node's ``usage`` for chats, completions
and Responses requests on Qwen 2.5's, Llama 3's and Mistral Tekken's vocabularies, with
either engine the gateway may run a vocabulary in (tiktoken where it is proven exact,
else the ``tokenizers`` library). With the stand-in (no path) it is never under the
node's count, prompts within 1% of a context are served without a node refusing one,
and one chat of numbers does not make the calibrated stand-in refuse the prompts after it.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from kvgateway.config.load import parse_config
from kvgateway.server.app import create_app
from tests.support.eventually import eventually
from tests.support.real_fleet import ENCODINGS, backend_entry, state_of, words
from tests.support.vllm_nodes import RealNode, http_json

pytestmark = pytest.mark.real_vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city (°C), with a 3-day outlook.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call00001",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 3}'},
}
CODE = 'def f(xs):\n    """Sum\tof squares."""\n    return sum(x * x for x in xs)  # O(n)\n'
NUMBERS = "Invoice 2024-07-31: 1,234,567.89 EUR; IDs 0x7F3A9C, 31415926535, 271828 and 161803."
CJK = "東京の天気は晴れです。今天北京有雨，气温二十三度。서울은 흐림."
EMOJI = "Launch 🚀🔥 done ✅ — thanks 🙏🏽 👩‍💻 🇫🇷"
NFD = unicodedata.normalize("NFD", "Crème brûlée, naïve café, Ångström, tiếng Việt, 한국어.")
CHATS: dict[str, list[dict[str, Any]]] = {
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "numbers": [{"role": "user", "content": NUMBERS * 3}],
    "code": [{"role": "user", "content": "Explain:\n```python\n" + CODE * 3 + "```"}],
    "cjk": [{"role": "user", "content": CJK * 3}],
    "emoji": [{"role": "user", "content": EMOJI * 3}],
    "nfd": [{"role": "user", "content": NFD * 3}],
    "developer": [
        {"role": "developer", "content": "Reply in French."},
        {"role": "user", "content": "Good morning"},
    ],
    "system-and-developer": [
        {"role": "system", "content": "Be kind."},
        {"role": "developer", "content": "No emoji."},
        {"role": "user", "content": "Hi"},
    ],
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "user", "content": "And tomorrow?"},
]
RESPONSES: dict[str, dict[str, Any]] = {
    "string": {"input": "Tell me a fact about 12345 and 😀."},
    "instructions": {"instructions": "Be brief.", "input": "Why is the sky blue?"},
    "developer": {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "No emoji."}]},
            {"role": "user", "content": [{"type": "input_text", "text": CJK}]},
        ],
    },
}


def _entry(node: RealNode) -> dict[str, Any]:
    """A backend without its KV event streams (counting needs none)."""
    entry = backend_entry(node)
    entry.pop("kv_events", None)
    entry.pop("kv_events_replay", None)
    return entry


def _config(
    tiers: list[list[RealNode]], tokenizer: Callable[[RealNode], dict[str, Any]]
) -> dict[str, Any]:
    """Each model once (its first node's directory), the nodes in tiers as given."""
    models: dict[str, dict[str, Any]] = {}
    for node in (n for tier in tiers for n in tier):
        name = node.spec.served_name
        models.setdefault(name, {"name": name, "tokenizer": tokenizer(node)})
    return {
        "models": list(models.values()),
        "health": {"interval_s": 0.5, "timeout_s": 2},
        "load_feedback": {"interval_s": 0.5},
        "tiers": [
            {"name": f"tier-{i}", "backends": [_entry(n) for n in tier]}
            for i, tier in enumerate(tiers)
        ],
    }


async def _gateway(aiohttp_server: Any, config: dict[str, Any], engine: str = "auto") -> TestServer:
    """A gateway for ``config``, its model tokenizers run by ``engine`` ("auto": tiktoken
    where proven exact, as the gateway loads them; "tokenizers": the library), once every
    backend's limits are known."""
    cfg = parse_config(config, encodings=ENCODINGS)
    if engine == "tokenizers":
        models = tuple(
            replace(
                m,
                tokenizer=replace(
                    m.tokenizer, model=ENCODINGS.model(str(m.tokenizer.path), engine="tokenizers")
                ),
            )
            for m in cfg.models
        )
        cfg = replace(cfg, models=models)
    server: TestServer = await aiohttp_server(create_app(cfg, encodings=ENCODINGS))
    fleet = state_of(server).fleet
    await eventually(
        lambda: all(
            (b := fleet.get(c.name)) and b.limits.known and b.healthy for c in cfg.backends
        ),
        timeout=30,
    )
    return server


def _client(server: TestServer) -> AsyncOpenAI:
    url = str(server.make_url("/v1"))
    return AsyncOpenAI(base_url=url, api_key="x", timeout=300, max_retries=0)


async def _counts(gw: TestServer, model: str) -> dict[str, tuple[int, int]]:
    """Every request kind: (the gateway's count, the node's) by name."""
    async with _client(gw) as oai:
        return await _counted(oai, model)


async def _counted(oai: AsyncOpenAI, model: str) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    # Any: these hand-written chats are OpenAI's message and tool params.
    chats: dict[str, Any] = {**CHATS, "tools": TOOL_CHAT}
    for name, messages in chats.items():
        tools: Any = TOOLS if name == "tools" else None
        raw = await oai.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=2,
            # "none": the nodes run no tool parser; the template still renders the tools.
            **({"tools": tools, "tool_choice": "none"} if tools else {}),
        )
        usage = raw.parse().usage
        assert usage is not None
        out[f"chat {name}"] = (int(raw.headers["x-gateway-prompt-tokens"]), usage.prompt_tokens)
    ids = [int(i) for i in range(1000, 1040)]
    completions: dict[str, Any] = {
        "string": NUMBERS + " " + CODE,
        "strings": [EMOJI, NFD, words(40)],
        "ids": ids,
    }
    for name, prompt in completions.items():
        raw_c = await oai.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=1
        )
        usage_c = raw_c.parse().usage
        assert usage_c is not None
        out[f"completion {name}"] = (
            int(raw_c.headers["x-gateway-prompt-tokens"]),
            usage_c.prompt_tokens,
        )
    for name, request in RESPONSES.items():
        raw_r = await oai.responses.with_raw_response.create(
            model=model, max_output_tokens=4, **request
        )
        usage_r = raw_r.parse().usage
        assert usage_r is not None
        out[f"responses {name}"] = (
            int(raw_r.headers["x-gateway-prompt-tokens"]),
            usage_r.input_tokens,
        )
    return out


@pytest.mark.parametrize("engine", ["auto", "tokenizers"])
async def test_the_gateway_counts_every_prompt_as_the_node(
    qwen_fleet: dict[str, RealNode],
    vocab_nodes: dict[str, RealNode],
    aiohttp_server: Any,
    engine: str,
) -> None:
    """Equal, request by request, on all three vocabularies ("auto" runs each in tiktoken:
    all three are byte-level BPE it reproduces)."""
    nodes = [qwen_fleet["S"], vocab_nodes["llama"], vocab_nodes["mistral"]]
    config = _config([nodes], lambda n: {"path": str(n.model_dir)})
    gw = await _gateway(aiohttp_server, config, engine)
    state = state_of(gw)
    wrong: dict[str, dict[str, tuple[int, int]]] = {}
    for node in nodes:
        model = node.spec.served_name
        tok = state.live().resolve_model(model)
        assert tok is not None and tok.tokenizer.model is not None
        want = "tiktoken:" if engine == "auto" else "tokenizers:"
        assert tok.tokenizer.model.name.startswith(want), tok.tokenizer.model.engine_note
        counts = await _counts(gw, model)
        bad = {k: v for k, v in counts.items() if v[0] != v[1]}
        if bad:
            wrong[model] = bad
    assert not wrong, json.dumps(wrong, indent=1)


async def test_the_standin_never_counts_under_the_node(
    qwen_fleet: dict[str, RealNode], vocab_nodes: dict[str, RealNode], aiohttp_server: Any
) -> None:
    """Without the model's tokenizer the gateway reserves cl100k's count raised to a
    bound the measured vocabularies stay under: never below what the node counts."""
    nodes = [qwen_fleet["S"], vocab_nodes["llama"], vocab_nodes["mistral"]]
    gw = await _gateway(aiohttp_server, _config([nodes], lambda n: {}))
    under: dict[str, dict[str, tuple[int, int]]] = {}
    for node in nodes:
        counts = await _counts(gw, node.spec.served_name)
        bad = {k: v for k, v in counts.items() if v[0] < v[1]}
        if bad:
            under[node.spec.served_name] = bad
    assert not under, json.dumps(under, indent=1)


def _node_count(node: RealNode, content: str) -> int:
    body = {"model": node.spec.served_name, "messages": [{"role": "user", "content": content}]}
    answer = http_json(node.url + "/tokenize", body)
    assert isinstance(answer, dict)
    return int(answer["count"])


def _near_context(node: RealNode, text: str) -> str:
    """The longest prefix of ``text`` whose chat the node counts within 1% below its
    context (a binary search over characters with the node's /tokenize)."""
    limit = node.spec.max_model_len
    low, high = 0, len(text)
    while low < high:
        mid = (low + high + 1) // 2
        if _node_count(node, text[:mid]) <= limit - 1:
            low = mid
        else:
            high = mid - 1
    count = _node_count(node, text[:low])
    assert 0.99 * limit <= count < limit, count
    return text[:low]


# Each past 4k tokens on every vocabulary.
NEAR_TEXTS = {
    "words": words(6_000),
    "numbers": NUMBERS * 250,
    "cjk": CJK * 250,
    "code": CODE * 300,
}


async def test_the_standin_serves_prompts_within_one_percent_of_the_context(
    qwen_fleet: dict[str, RealNode], vocab_nodes: dict[str, RealNode], aiohttp_server: Any
) -> None:
    """Prompts the node counts within 1% of its 4k context: the bound passes the context,
    so the gateway asks the node (/tokenize) and admits what it says, with max_tokens
    cut to what is left. Every one is served, and no node refuses one."""
    nodes = [qwen_fleet["S"], vocab_nodes["llama"], vocab_nodes["mistral"]]
    gw = await _gateway(aiohttp_server, _config([nodes], lambda n: {}))
    served: dict[str, tuple[int, int]] = {}
    async with _client(gw) as oai:
        for node in nodes:
            kinds = ("numbers", "cjk") if node.spec.name == "S" else tuple(NEAR_TEXTS)
            for kind in kinds:
                content = _near_context(node, NEAR_TEXTS[kind])
                raw = await oai.chat.completions.with_raw_response.create(
                    model=node.spec.served_name,
                    messages=[{"role": "user", "content": content}],
                    max_tokens=4,
                )
                usage = raw.parse().usage
                assert usage is not None
                gateway = int(raw.headers["x-gateway-prompt-tokens"])
                served[f"{node.spec.name} {kind}"] = (gateway, usage.prompt_tokens)
    limit = {n.spec.name: n.spec.max_model_len for n in nodes}
    assert all(n >= 0.99 * limit[k.split()[0]] for k, (_, n) in served.items()), served
    assert all(g >= n for g, n in served.values()), served
    fleet = state_of(gw).fleet
    refused = {n.spec.name: list(b.rejection_times) for n in nodes if (b := fleet.get(n.spec.name))}
    assert not any(refused.values()), refused


async def test_chats_of_numbers_do_not_make_the_calibrated_standin_refuse_prose(
    vocab_nodes: dict[str, RealNode], aiohttp_server: Any
) -> None:
    """upper_bound false: the stand-in's count, scaled by what the nodes report. Tekken
    spends a token per digit where cl100k spends one per three, so a chat of numbers
    shows a 3x ratio. One such chat teaches nothing: prose after it is served, where
    that ratio would predict it past the 4k context and the gateway refuse it. After
    several (a ratio the nodes agree on), prose predicted past the context is asked of
    the node, which serves it."""
    node = vocab_nodes["mistral"]
    gw = await _gateway(aiohttp_server, _config([[node]], lambda n: {"upper_bound": False}))
    model = node.spec.served_name
    digits: list[ChatCompletionMessageParam] = [{"role": "user", "content": "0123456789" * 300}]
    prose: list[list[ChatCompletionMessageParam]] = [
        [{"role": "user", "content": words(n)}] for n in (1_400, 2_200)
    ]
    state = state_of(gw)
    async with _client(gw) as oai:
        await oai.chat.completions.create(model=model, messages=digits, max_tokens=1)
        for messages in prose:  # served: one chat of numbers teaches no ratio
            await oai.chat.completions.create(model=model, messages=messages, max_tokens=2)
        for _ in range(3):
            await oai.chat.completions.create(model=model, messages=digits, max_tokens=1)
        assert state.calibration.ratio(model) > 2.5
        raw = await oai.chat.completions.with_raw_response.create(
            model=model, messages=prose[1], max_tokens=2
        )
    usage = raw.parse().usage
    assert usage is not None
    assert int(raw.headers["x-gateway-prompt-tokens"]) == usage.prompt_tokens  # asked
    b = state.fleet.get(node.spec.name)
    assert b is not None and not b.rejection_times


async def test_a_prompt_refused_as_at_least_n_is_readmitted_with_its_own_count(
    qwen_fleet: dict[str, RealNode], aiohttp_server: Any
) -> None:
    """9,000 digits: cl100k counts ~3k, Qwen one token per digit. The stand-in without
    its bound sends it to S (4k), which refuses it as "at least 4097" input tokens (vLLM
    stops counting past the context). The gateway asks L (16k) for its count and admits
    it there with it, not with the 4,097 that undercounts a 9,000-token prompt."""
    small, large = qwen_fleet["S"], qwen_fleet["L"]
    gw = await _gateway(
        aiohttp_server, _config([[small], [large]], lambda n: {"upper_bound": False})
    )
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "0123456789" * 900}]
    async with _client(gw) as oai:
        raw = await oai.chat.completions.with_raw_response.create(
            model="qwen", messages=messages, max_tokens=1
        )
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens > 9_000
    assert raw.headers["x-gateway-backend"] == "L"
    assert int(raw.headers["x-gateway-prompt-tokens"]) == usage.prompt_tokens
    s = state_of(gw).fleet.get("S")
    assert s is not None and len(s.rejection_times) == 1
