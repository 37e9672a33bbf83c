"""The node's own output count on every stream (plan/stream_usage.py), with a
simulated vLLM node that streams the way vLLM does with ``--stream-interval 4``: several
tokens per chunk. The client, the official SDK, sees only the usage it asked for; the
gateway settles what the node generated, not one token per chunk."""

from __future__ import annotations

from typing import Any

import aiohttp
from openai import AsyncOpenAI

from tests.support.fleet import MODEL, StartFleet

AUTH = {
    "classes": [{"name": "batch"}],
    "keys": [{"name": "etl", "key": "k-etl", "limits": {"output_tokens_per_minute": 100_000}}],
}
TOKENS = 41  # generated exactly (ignore_eos): the first, then ten chunks of four


async def _fleet(start_fleet: StartFleet, gateway: dict[str, Any] | None = None) -> Any:
    return await start_fleet(
        [("only", "small", "gpu24-8b", {"stream_interval": 4})],
        gateway={"auth": AUTH, **(gateway or {})},
    )


async def _stream(url: str, **options: Any) -> list[Any]:
    oai = AsyncOpenAI(base_url=url + "/v1", api_key="k-etl", max_retries=0, timeout=30)
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to a hundred"}],
        max_tokens=TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
        **options,
    )
    chunks = [chunk async for chunk in stream]
    await oai.close()
    return chunks


async def _charged(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.get(url + "/admin/backends", headers=headers) as r:
            assert r.status == 200
            tenants = {t["name"]: t for t in (await r.json())["tenants"]}
    return int(tenants["etl"]["output_tokens_last_minute"])


async def test_sdk_default_stream_sees_no_usage_and_is_charged_what_the_node_generated(
    start_fleet: StartFleet,
) -> None:
    """The SDK's default stream sees no usage, yet is charged the node's 41 tokens:
    counting chunks would charge one per chunk, a fraction of that (several tokens each).
    Its last chunk carries the node's system_fingerprint, as from the node alone."""
    fleet = await _fleet(start_fleet)
    chunks = await _stream(fleet.url)
    assert all(c.usage is None and c.choices for c in chunks)
    assert len(chunks) < TOKENS // 2  # several tokens per chunk, as the node sent them
    assert chunks[-1].choices[0].finish_reason == "length"
    # The fingerprint where the node alone puts it on such a stream: the last chunk.
    assert [bool(c.system_fingerprint) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].system_fingerprint.startswith("vllm-0.32.0-")
    assert await _charged(fleet.url) == TOKENS
    assert fleet.leaks() == {}


async def test_include_usage_gets_the_final_usage_chunk_only(start_fleet: StartFleet) -> None:
    fleet = await _fleet(start_fleet)
    chunks = await _stream(fleet.url, stream_options={"include_usage": True})
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    assert await _charged(fleet.url) == TOKENS


async def test_continuous_usage_asked_by_the_client_passes_through(
    start_fleet: StartFleet,
) -> None:
    fleet = await _fleet(start_fleet)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await _stream(fleet.url, stream_options=options)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == TOKENS
    assert await _charged(fleet.url) == TOKENS


async def test_switched_off_the_client_options_go_unchanged_and_chunks_are_counted(
    start_fleet: StartFleet,
) -> None:
    """`admission.node_stream_usage: false`: the client's stream options go unchanged
    and each chunk counts one token (an under-count against this node, which is why the
    setting is on by default)."""
    fleet = await _fleet(start_fleet, {"admission": {"node_stream_usage": False}})
    chunks = await _stream(fleet.url)
    assert all(c.usage is None for c in chunks)
    assert await _charged(fleet.url) < TOKENS // 2
