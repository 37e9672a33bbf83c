"""Asking nodes for their own count: the longest context first, the next on failure."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from kvgateway.config.load import parse_config
from kvgateway.plan.planner import Planner
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.prompt_estimate import PromptCalibration
from kvgateway.upstream.node_tokenize import NodeTokenizer


class _Fleet:
    def __init__(self, backends: list[Any]) -> None:
        self._backends = backends

    def for_model(self, model: str) -> list[Any]:
        return self._backends


def _backend(name: str, url: str, context: int) -> Any:
    return SimpleNamespace(
        name=name, usable=True, context_limit=context, in_flight=0, config=SimpleNamespace(url=url)
    )


async def test_a_failing_node_is_followed_by_the_next(aiohttp_server: Any) -> None:
    asked: list[str] = []

    def app(name: str, status: int) -> web.Application:
        async def tokenize(request: web.Request) -> web.Response:
            asked.append(name)
            return web.json_response({"count": 42}, status=status)

        a = web.Application()
        a.router.add_post("/tokenize", tokenize)
        return a

    broken = await aiohttp_server(app("broken", 500))
    working = await aiohttp_server(app("working", 200))
    fleet = _Fleet(
        [
            _backend("small", str(working.make_url("")).rstrip("/"), 8_192),
            _backend("large", str(broken.make_url("")).rstrip("/"), 32_768),
        ]
    )
    model = SimpleNamespace(name="m", served_name="served")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        tokenizer = NodeTokenizer(session, fleet)  # type: ignore[arg-type]
        assert await tokenizer.count(model, body, chat=True) == 42  # type: ignore[arg-type]
        assert asked == ["broken", "working"]  # the longest context first
        assert await tokenizer.count(model, body, chat=True) == 42  # type: ignore[arg-type]
        assert asked == ["broken", "working"]  # cached


class _Contexts:
    """What planning reads of the fleet: one 8k node of blocks of 16."""

    def block_size(self, model: str) -> int:
        return 16

    def largest_context(self, model: str) -> int:
        return 8_192


async def test_a_count_the_nodes_reports_scale_near_the_context_is_asked_of_a_node(
    aiohttp_server: Any,
) -> None:
    """upper_bound false: the stand-in's count is reserved as the nodes' reports scale it
    (2.5x here, taught by chats of numbers). An English prompt of ~3.5k tokens scaled past
    an 8k context is asked of the node, whose own count decides: the ask goes by the
    scaled count (by the unscaled one the prompt would be refused without asking)."""
    asked: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response({"count": 3_600})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    config = parse_config(
        {
            "models": [{"name": "m", "tokenizer": {"upper_bound": False}}],
            "tiers": [{"name": "t", "backends": [{"name": "a", "url": url, "model": "m"}]}],
        }
    )
    calibration = PromptCalibration()
    for _ in range(3):
        calibration.observe("a", "m", 2_807, 7_028)
    text = "The quick brown fox jumps over the lazy dog. " * 350
    raw = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    ).encode()
    with ThreadPoolExecutor(1) as pool:
        counters = TokenCounters(EncodingCache(), pool)
        async with aiohttp.ClientSession() as session:
            node = NodeTokenizer(session, _Fleet([_backend("a", url, 8_192)]))  # type: ignore[arg-type]
            planner = Planner(lambda: config, counters, calibration, _Contexts(), node_counter=node)
            counted = await planner.plan(raw, "chat")
    assert 3_400 < counted.prompt.standin < 3_600
    assert len(asked) == 1 and asked[0]["messages"][0]["content"] == text
    assert counted.prompt.exact and counted.demand.longest_prompt == 3_600
