"""The rest of the OpenAI-compatible surface through the gateway to simulated vLLM nodes,
with the official `openai` SDK."""

from __future__ import annotations

from typing import Any, cast

import aiohttp
import openai
import pytest

from tests.support.fleet import MODEL, NodeSpec, StartFleet

SMALL: list[NodeSpec] = [("small-1", "small", "gpu24-8b", {}), ("small-2", "small", "gpu24-8b", {})]


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
        # A node without the route answers aiohttp's text/plain "404: Not Found": the
        # client gets an OpenAI error object, never the node's text as it is.
        body = {"model": MODEL, "query": "q", "documents": ["a"]}
        async with s.post(fleet.url + "/v2/rerank", json=body) as r:
            assert r.status == 404 and r.content_type == "application/json"
            err = (await r.json())["error"]
            assert err["code"] == "upstream_404" and "Not Found" in err["message"]
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
    message = cast("dict[str, Any]", err.value.body)["message"]
    assert message.startswith(
        "This model's maximum context length is 8192 tokens. However, you requested"
    )
    assert err.value.code == "context_length_exceeded"


@pytest.mark.parametrize("overflow", ["clamp", "reject"])
async def test_max_tokens_past_the_largest_context(
    start_fleet: StartFleet, client, overflow: str
) -> None:
    """A prompt that fits the largest context (8192) with a max_tokens that does not fit
    beside it: vLLM >= 0.32 serves it with max_tokens cut to what the context leaves, and
    so does the gateway by default (it sends the node the cut); with
    ``admission.context_overflow: reject`` it answers the 400 as vLLM <= 0.31."""
    fleet = await start_fleet(
        [("small-1", "small", "gpu24-8b", {"context_overflow": overflow})],
        time_scale=200,
        gateway={"admission": {"context_overflow": overflow}},
    )
    oai = client(fleet.url)
    messages = [{"role": "user", "content": "hello " * 5000}]
    if overflow == "reject":
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4000)
        assert err.value.code == "context_length_exceeded"
        return
    raw = await oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4000
    )
    reply = raw.parse()
    prompt = int(raw.headers["x-gateway-prompt-tokens"])
    assert int(raw.headers["x-gateway-max-tokens"]) == 8192 - prompt
    assert reply.usage.prompt_tokens <= prompt
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 8192
    # max_tokens past the context itself stays a 400, as on the node.
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=9000)


async def test_a_clamped_request_is_cut_by_the_nodes_count_not_the_stand_ins(
    start_fleet: StartFleet,
) -> None:
    """With the stand-in count (no tokenizer), a CJK prompt the node counts as fitting is
    served whatever its max_tokens: under the clamp any prompt with a token of room fits,
    so the gateway asks the node for its count whenever the bound passes the context."""
    fleet = await start_fleet([("only", "small", "tiny", {})], time_scale=200)  # 512 context
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "你好世界" * 100}],
        "max_tokens": 500,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=body) as r,
    ):
        data = await r.json()
        assert r.status == 200, data
        assert int(r.headers["x-gateway-max-tokens"]) == 512 - data["usage"]["prompt_tokens"]


async def test_opentelemetry_spans_for_admission_and_the_upstream_call(start_fleet: StartFleet):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    fleet = await start_fleet(
        SMALL[:1], time_scale=200, gateway={"tracing": {"enabled": True}}, tracer_provider=provider
    )
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.url + "/v1/chat/completions",
            json=body,
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        ) as r,
    ):
        assert r.status == 200
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    assert {"gateway.request", "gateway.admission", "gateway.upstream"} <= set(spans)
    assert all(format(sp.context.trace_id, "032x") == trace_id for sp in spans.values())
    admission = spans["gateway.admission"]
    assert admission.attributes is not None
    assert admission.parent is not None
    assert admission.attributes["backend"] == "small-1"
    assert admission.parent.span_id == spans["gateway.request"].context.span_id
    # The node sees the gateway's upstream span as the parent of its work.
    state = await fleet.nodes["small-1"].state()
    upstream_id = format(spans["gateway.upstream"].context.span_id, "016x")
    assert state["last_traceparent"] == f"00-{trace_id}-{upstream_id}-01"
    # Passthrough requests too: they make their spans and send the node a traceparent.
    exporter.clear()
    other = "0af7651916cd43dd8448eb211c80319c"
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.url + "/v1/embeddings",
            json={"model": MODEL, "input": ["hi"]},
            headers={"traceparent": f"00-{other}-00f067aa0ba902b7-01"},
        ) as r,
    ):
        assert r.status == 200
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    assert {"gateway.request", "gateway.upstream"} <= set(spans)
    state = await fleet.nodes["small-1"].state()
    upstream_id = format(spans["gateway.upstream"].context.span_id, "016x")
    assert state["last_traceparent"] == f"00-{other}-{upstream_id}-01"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")
async def test_litellm_raises_its_context_window_error(start_fleet: StartFleet, monkeypatch):
    # LiteLLM (1.80.5, pinned in the dev extra) falls back to larger-context models on
    # ContextWindowExceededError, which it recognises by OpenAI's wording of the message.
    # Its model price map is read from the package, never fetched.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_TELEMETRY", "False")
    import litellm

    fleet = await start_fleet(SMALL[:1], time_scale=200)
    # litellm's __init__ imports its exceptions without re-exporting them (no __all__, no
    # "as" alias), so strict mypy calls this public name private.
    with pytest.raises(litellm.ContextWindowExceededError):  # type: ignore[attr-defined]
        await litellm.acompletion(
            model=f"openai/{MODEL}",
            api_base=fleet.url + "/v1",
            api_key="unused",
            messages=[{"role": "user", "content": "hello " * 9000}],
            max_tokens=10,
            num_retries=0,
        )
    ok = await litellm.acompletion(
        model=f"openai/{MODEL}",
        api_base=fleet.url + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        num_retries=0,
    )
    assert ok.choices[0].message.content


async def test_a_long_responses_stream_ends_cleanly(start_fleet: StartFleet, client):
    """The final event of a 1,500-token stream carries the whole response: past 4 KB
    (~1,000 tokens, or less with tools echoed) a complete stream is still not taken for
    one cut short, so no error event follows response.completed for the SDK to raise."""
    fixed = {"output_dist": "fixed", "output_mean": 1500.0, "output_max": 1500}
    fleet = await start_fleet([("small-1", "small", "gpu24-8b", fixed)], time_scale=500)
    oai = client(fleet.url)
    stream = await oai.responses.create(
        model=MODEL, input="Tell a long story", max_output_tokens=1500, stream=True
    )
    events = [event async for event in stream]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == 1500
    assert fleet.leaks() == {}


async def test_passthrough_requests_are_in_the_access_log_and_the_metrics(
    start_fleet: StartFleet, client, caplog
):
    """Embeddings, tokenize and the rest each write an access line and count in the
    metrics, their 404s included: the README promises one access line per request."""
    import logging

    fleet = await start_fleet(SMALL, time_scale=200, gateway={"server": {"access_log": True}})
    caplog.set_level(logging.INFO, logger="kvgateway.access")
    oai = client(fleet.url)
    await oai.embeddings.create(model=MODEL, input=["hello there"])
    with pytest.raises(openai.NotFoundError):
        await oai.embeddings.create(model="no-such-model", input=["x"])
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as r,
    ):
        assert r.status == 200
    lines = [r.access for r in caplog.records if r.name == "kvgateway.access"]
    assert [(a["path"], a["status"]) for a in lines] == [
        ("/v1/embeddings", 200),
        ("/v1/embeddings", 404),
        ("/tokenize", 200),
    ]
    assert lines[0]["model"] == MODEL and lines[0]["backend"].startswith("small-")
    registry = fleet.state.metrics.registry
    ok = registry.get_sample_value(
        "gateway_requests_total",
        {"model": MODEL, "tier": "small", "backend": lines[0]["backend"], "status": "200"},
    )
    assert ok is not None and ok >= 1
    refused = registry.get_sample_value("gateway_rejections_total", {"reason": "unknown_model"})
    assert refused == 1
