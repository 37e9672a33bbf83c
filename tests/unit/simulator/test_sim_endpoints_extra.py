"""The simulator's embeddings, rerank, score and responses endpoints, driven with the
official openai SDK where it has a call for them."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import openai
import pytest

from kvgateway.simulator.profiles import TINY
from tests.support.sim import SimClient, SimFactory


@pytest.fixture
async def node(sim: SimFactory) -> SimClient:
    return await sim()


@pytest.fixture
async def oai(node: SimClient) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


async def test_no_model_card_route_as_vllm(oai: openai.AsyncOpenAI, node: SimClient) -> None:
    """vLLM serves the model list only (no /v1/models/{id}); an unrouted path is
    FastAPI's JSON 404, a wrong method its 405."""
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve(TINY.model)
    async with node.session.get(node.url + f"/v1/models/{TINY.model}") as r:
        assert r.status == 404 and await r.json() == {"detail": "Not Found"}
    async with node.session.get(node.url + "/v1/completions") as r:
        assert r.status == 405 and await r.json() == {"detail": "Method Not Allowed"}


async def test_embeddings_base64_and_float(oai: openai.AsyncOpenAI, node: SimClient) -> None:
    # The SDK asks for base64 and decodes it; floats on request.
    resp = await oai.embeddings.create(model=TINY.model, input=["hello world", "bye"])
    assert [d.index for d in resp.data] == [0, 1]
    first = resp.data[0].embedding
    assert len(first) == 384 and math.isclose(sum(v * v for v in first), 1.0, rel_tol=1e-4)
    assert resp.usage.prompt_tokens == 3 and resp.usage.total_tokens == 3
    again = await oai.embeddings.create(
        model=TINY.model, input="hello world", encoding_format="float", dimensions=384
    )
    assert again.data[0].embedding == pytest.approx(first, abs=1e-6)
    short = await oai.embeddings.create(model=TINY.model, input="hello world", dimensions=8)
    assert len(short.data[0].embedding) == 8
    status, body = await node.post("/v1/embeddings", {"input": "x " * (TINY.max_model_len + 5)})
    assert status == 400
    assert body["error"]["message"].startswith("This model's maximum context length is")


async def test_rerank_and_score(node: SimClient) -> None:
    docs = ["alpha", "beta", "gamma"]
    status, body = await node.post("/v1/rerank", {"query": "alpha", "documents": docs, "top_n": 2})
    assert status == 200 and len(body["results"]) == 2
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert body["results"][0]["document"]["text"] in docs and body["usage"]["total_tokens"] > 0
    status, body = await node.post("/score", {"text_1": "alpha", "text_2": docs})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2]
    by_doc = {r["document"]["text"]: r["relevance_score"] for r in (await node.post(
        "/rerank", {"query": "alpha", "documents": docs}))[1]["results"]}  # fmt: skip
    assert [d["score"] for d in body["data"]] == [by_doc[d] for d in docs]
    status, body = await node.post("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]})
    assert status == 400


async def test_responses_non_streaming(oai: openai.AsyncOpenAI, node: SimClient) -> None:
    resp = await oai.responses.create(
        model=TINY.model, input="Say hi", instructions="Be brief", max_output_tokens=5
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete")
    assert resp.output_text and resp.usage is not None
    assert 0 < resp.usage.output_tokens <= 5
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if resp.status == "incomplete":
        assert resp.incomplete_details and resp.incomplete_details.reason == "max_output_tokens"
    listed = await oai.responses.create(
        model=TINY.model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
        max_output_tokens=5,
    )
    # The same prompt without the instructions' system message: fewer input tokens.
    assert listed.output_text and listed.usage is not None
    assert 0 < listed.usage.input_tokens < resp.usage.input_tokens
    await node.wait_idle()


async def test_responses_streaming_event_sequence(oai: openai.AsyncOpenAI, node: SimClient) -> None:
    stream = await oai.responses.create(
        model=TINY.model, input="Say hi", max_output_tokens=8, stream=True
    )
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    # vLLM ends every stream with response.completed; a cut one says so in its status.
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas and final.output_text == deltas
    assert final.status in {"completed", "incomplete"}
    # A delta per engine output: one token each while the writer keeps up, several
    # merged when they piled up (as vLLM's API server merges them).
    assert final.usage is not None
    assert 1 <= kinds.count("response.output_text.delta") <= final.usage.output_tokens
    await node.wait_idle()


async def test_responses_too_long_is_vllms_context_error(node: SimClient) -> None:
    status, body = await node.post(
        "/v1/responses",
        {"input": "hello " * TINY.max_model_len, "max_output_tokens": 10},
    )
    assert status == 400
    assert body["error"]["message"].startswith("This model's maximum context length is")


async def test_a_responses_prompt_of_the_whole_context_is_vllms_engine_error(
    node: SimClient,
) -> None:
    """A prompt that fits the context but leaves no room for output: vLLM's Responses
    API refuses it as "the engine prompt length" (its renderer passes it)."""

    async def length(words: int) -> int:
        messages = [{"role": "user", "content": "hello " * words}]
        _, body = await node.post("/tokenize", {"model": TINY.model, "messages": messages})
        return int(body["count"])

    per_word = await length(11) - await length(10)
    words = 10 + (TINY.max_model_len - await length(10)) // per_word
    assert await length(words) == TINY.max_model_len  # the whole context, exactly
    status, body = await node.post("/v1/responses", {"input": "hello " * words})
    assert status == 400 and body["error"]["param"] == "input"
    assert body["error"]["message"] == (
        f"The engine prompt length {TINY.max_model_len} exceeds the max_model_len "
        f"{TINY.max_model_len}. Please reduce prompt."
    )


async def test_responses_client_gone_frees_the_engine(sim: SimFactory) -> None:
    # Real-time steps and long fixed outputs: the stream is still going when the client leaves.
    node = await sim(time_scale=1.0, output_dist="fixed", output_mean=500, output_max=500)
    body = {"input": "hi", "max_output_tokens": 500, "stream": True}
    async with node.session.post(node.url + "/v1/responses", json=body) as resp:
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"event: response.created")
        assert (await node.state())["running"] == 1
    await node.wait_idle()


async def test_detokenize_inverts_tokenize(node: SimClient) -> None:
    status, body = await node.post("/tokenize", {"prompt": "hello world, again"})
    assert status == 200
    status, back = await node.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "hello world, again"}
    status, bad = await node.post("/detokenize", {"tokens": ["x"]})
    assert status == 400 and bad["error"]["param"] == "tokens"
