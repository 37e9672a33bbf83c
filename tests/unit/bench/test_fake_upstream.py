"""The overhead benchmarks' fake node: a bare asyncio HTTP/1.x server, so it must speak
HTTP as the clients in front of it expect (the gateway's own client, aiohttp, nginx with
upstream keep-alive, the official `openai` client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from bench.fake_upstream import parse_args, start


async def _node(*flags: str) -> AsyncIterator[int]:
    server = await start(parse_args(["--port", "0", *flags]))
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async for p in _node():
        yield p


@pytest.fixture
async def split_port() -> AsyncIterator[int]:
    async for p in _node("--stream-split", "--stream-events", "3", "--delay-ms", "5"):
        yield p


async def _raw(port: int, data: bytes, until_close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if until_close:
            return await asyncio.wait_for(reader.read(), 5)
        await asyncio.sleep(0.2)
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


async def test_the_openai_client_gets_an_answer_and_a_stream_with_usage(port: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    msgs: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hello " * 20}
    ]
    answer = await client.chat.completions.create(model="m", messages=msgs)
    assert answer.usage is not None and answer.usage.completion_tokens == 16
    assert answer.usage.prompt_tokens > 0
    chunks = [
        c async for c in await client.chat.completions.create(model="m", messages=msgs, stream=True)
    ]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content == "ok ") == 20
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    await client.close()


async def test_keep_alive_pipelining_and_a_chunked_body(port: int) -> None:
    body = b'{"model":"m","messages":[]}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    out = await _raw(
        port,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked
        + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert b'"prompt_tokens":%d' % (len(body) // 8) in out
    assert b'"max_model_len": 131072' in out


async def test_http10_and_close_end_the_connection(port: int, split_port: int) -> None:
    out = await _raw(port, b"GET /health HTTP/1.0\r\n\r\n", until_close=True)
    assert out.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in out
    # A split stream to an HTTP/1.0 client is not chunked: it ends with the connection.
    body = b'{"stream":true}'
    out = await _raw(
        split_port,
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        until_close=True,
    )
    head, _, events = out.partition(b"\r\n\r\n")
    assert b"chunked" not in head and events.endswith(b"data: [DONE]\n\n")
    assert events.count(b"data: ") == 3 + 4  # role, 3 contents, finish, usage, [DONE]


async def test_a_split_stream_is_chunked_and_the_connection_reused(split_port: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(
                f"http://127.0.0.1:{split_port}/v1/chat/completions", json={"stream": True}
            ) as r:
                assert r.headers["Transfer-Encoding"] == "chunked"
                events = [line async for line in r.content if line.startswith(b"data: {")]
            usage = json.loads(events[-1][6:])["usage"]
            assert usage["completion_tokens"] == 3
        async with s.get(f"http://127.0.0.1:{split_port}/metrics") as r:
            assert "vllm:cache_config_info" in await r.text()
        async with s.get(f"http://127.0.0.1:{split_port}/nope") as r:
            assert r.status == 404
