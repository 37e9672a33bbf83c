"""The rest of the OpenAI-compatible surface through the gateway to simulated vLLM nodes,
with the official `openai` SDK (issue #16)."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.support.fleet import MODEL, StartFleet

SMALL = [("small-1", "small", "gpu24-8b", {}), ("small-2", "small", "gpu24-8b", {})]


@pytest.fixture
async def client():
    made = []

    def make(url: str) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def test_models_retrieve_embeddings_and_responses(start_fleet: StartFleet, client):
    fleet = await start_fleet(SMALL, time_scale=200)
    oai = client(fleet.url)
    model = await oai.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_extra["max_model_len"] == 8192
    alias = await oai.models.retrieve("gpt-4o-mini")
    assert alias.model_extra["parent"] == MODEL
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve("no-such-model")
    emb = await oai.embeddings.create(model=MODEL, input=["hello there", "general kenobi"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    resp = await oai.responses.create(
        model=MODEL, input="Say something", instructions="Be brief.", max_output_tokens=12
    )
    # max_output_tokens reached is "incomplete" in the Responses API.
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens <= 12
    chunks = []
    stream = await oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "stream please"}],
        max_output_tokens=8,
        stream=True,
    )
    async for event in stream:
        chunks.append(event.type)
    assert chunks[-1] in ("response.completed", "response.incomplete")
    assert fleet.leaks() == {}


async def test_tokenize_detokenize_and_rerank_are_load_balanced(start_fleet: StartFleet):
    fleet = await start_fleet(SMALL, time_scale=200)
    backends = set()
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.post(
                fleet.url + "/tokenize", json={"model": MODEL, "prompt": "hi there"}
            ) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
                assert data["count"] == len(data["tokens"]) > 0
                backends.add(r.headers["x-gateway-backend"])
        async with s.post(
            fleet.url + "/detokenize", json={"model": MODEL, "tokens": data["tokens"]}
        ) as r:
            assert r.status == 200
        async with s.post(
            fleet.url + "/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a", "b"]}
        ) as r:
            assert r.status == 200, await r.text()
        async with s.post(fleet.url + "/v1/embeddings", json={"model": "nope", "input": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    assert backends == {"small-1", "small-2"}  # both nodes took some
    assert fleet.leaks() == {}


async def test_trace_context_reaches_the_node(start_fleet: StartFleet):
    fleet = await start_fleet(SMALL[:1], time_scale=200)
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.url + "/v1/chat/completions",
            json=body,
            headers={"traceparent": trace, "tracestate": "vendor=1"},
        ) as r,
    ):
        assert r.status == 200
    state = await fleet.nodes["small-1"].state()
    assert state["last_traceparent"] == trace


async def test_context_error_uses_the_wording_clients_recognise(start_fleet: StartFleet, client):
    fleet = await start_fleet(SMALL[:1], time_scale=200)
    oai = client(fleet.url)
    with pytest.raises(openai.BadRequestError) as err:
        await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=10
        )
    message = err.value.body["message"]
    assert message.startswith(
        "This model's maximum context length is 8192 tokens. However, you requested"
    )
    assert err.value.code == "context_length_exceeded"
