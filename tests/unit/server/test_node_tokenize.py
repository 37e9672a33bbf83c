"""Asking nodes for their own count: the longest context first, the next on failure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from kvgateway.server.node_tokenize import NodeTokenizer


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
