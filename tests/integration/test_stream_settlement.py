"""What a stream is settled at: the node's usage chunk wherever it falls in the stream,
and what was relayed when the client leaves (real gateway, a vLLM-shaped node on
loopback that writes the way vLLM's generator yields)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.eventually import eventually
from tests.support.fleet import MODEL, SERVED, StartFleet

AUTH = {
    "classes": [{"name": "batch"}],
    "keys": [{"name": "etl", "key": "k-etl", "limits": {"output_tokens_per_minute": 100_000}}],
}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def node_app(posts: dict[str, Handler]) -> web.Application:
    """A vLLM-shaped node: the given POST routes, /v1/models (8k context) and /health."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": SERVED, "max_model_len": 8192}]}
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def _chunk(delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "c", "object": "chat.completion.chunk", "model": SERVED, "choices": choices}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def vllm_like_node(tokens: int, pause_s: float, reported: int | None = None) -> web.Application:
    """Streams ``tokens`` one per write, then (include_usage) the usage chunk, a pause, and
    [DONE]: vLLM yields them apart, so a proxy reads them apart."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        for i in range(tokens):
            await resp.write(_chunk({"content": " w"}, "length" if i == tokens - 1 else None))
            await asyncio.sleep(0.002)
        if (body.get("stream_options") or {}).get("include_usage"):
            said = tokens if reported is None else reported
            usage = {"prompt_tokens": 9, "completion_tokens": said, "total_tokens": 9 + said}
            final = json.loads(_chunk(None)[6:])
            final["usage"] = usage
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await asyncio.sleep(pause_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return node_app({"/v1/chat/completions": chat})


def slow_prefill_node(prefill_s: float) -> web.Application:
    """Sends a stream's head at once and its first event after ``prefill_s``, as vLLM
    does; a body's ``hold`` (seconds) is a long decode before the last token."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(prefill_s)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        await asyncio.sleep(body.get("hold", 0))
        await resp.write(_chunk({"content": " w"}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return node_app({"/v1/chat/completions": chat})


async def gateway_over(start_fleet: StartFleet, url: str) -> Any:
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        gateway={"auth": AUTH},
        backend_extra={"only": {"url": url, "max_model_len": 8192, "kv_cache_tokens": 100_000}},
    )
    await eventually(lambda: fleet.backend("only").usable, timeout=5, what="the node healthy")
    return fleet


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A one-message chat request body."""
    messages = [{"role": "user", "content": "hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}


async def etl_stream(url: str) -> bytes:
    """A streamed chat (``max_tokens`` 500) as the ``etl`` tenant: the whole body."""
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        body = chat(500, stream=True)
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            return await r.read()


def failed_once(fleet: Any, cause: str) -> None:
    """The node ``only`` failed once with ``cause``: counted in the metrics, and in its
    run of failures (health)."""
    labels = {"backend": "only", "cause": cause}
    assert fleet.state.metrics.registry.get_sample_value("gateway_upstream_failures_total", labels)
    assert fleet.backend("only").consecutive_failures == 1


async def tenant_view(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.get(url + "/admin/backends", headers=headers) as r:
            assert r.status == 200
            view: dict[str, Any] = {t["name"]: t for t in (await r.json())["tenants"]}["etl"]
            return view


async def test_usage_read_apart_from_done_settles_the_stream(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    node = await aiohttp_server(vllm_like_node(tokens=20, pause_s=0.05))
    url = str(node.make_url("")).rstrip("/")
    fleet = await gateway_over(start_fleet, url)
    body = chat(500, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            text = (await r.read()).decode()
    assert '"completion_tokens": 20' in text and text.endswith("data: [DONE]\n\n")
    # Charged 500 at admission, settled at the node's 20, though the usage chunk and
    # [DONE] come in different reads (the usage chunk is not in the last one).
    assert (await tenant_view(fleet.url))["output_tokens_last_minute"] == 20
    assert fleet.leaks() == {}


async def test_a_client_leaving_mid_stream_is_charged_what_it_was_sent(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    node = await aiohttp_server(vllm_like_node(tokens=300, pause_s=0.0))
    url = str(node.make_url("")).rstrip("/")
    fleet = await gateway_over(start_fleet, url)
    body = chat(900, stream=True)
    got = 0
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {") and b'"content": " w"' in line:
                    got += 1
                    if got == 100:
                        break  # leave: the connection is closed with the session
    for _ in range(100):  # the gateway notices the client is gone and settles
        view = await tenant_view(fleet.url)
        if view["kv_tokens"] == 0:
            break
        await asyncio.sleep(0.05)
    charged = view["output_tokens_last_minute"]
    # Never 0: a client could read 880 of 900 tokens and leave, again and again, free.
    assert 100 <= charged <= 900, charged
    assert fleet.leaks() == {}


async def test_a_node_reporting_more_than_max_tokens_is_not_believed(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    # A broken or hostile node says 10**9 completion tokens: charged that, the tenant
    # would be refused for a minute. It is charged at most max_tokens x n.
    node = await aiohttp_server(vllm_like_node(tokens=20, pause_s=0.0, reported=10**9))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    body = chat(500, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            await r.read()
    assert (await tenant_view(fleet.url))["output_tokens_last_minute"] == 500


def responses_node(tokens: int) -> web.Application:
    """A /v1/responses stream: one output_text.delta event per token, as vLLM's."""

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def event(kind: str, **fields: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

        await resp.write(event("response.created", response={"id": "r"}))
        for i in range(tokens):
            delta = {"sequence_number": i, "output_index": 0, "content_index": 0, "delta": " w"}
            await resp.write(event("response.output_text.delta", **delta))
            await asyncio.sleep(0.002)
        usage = {"input_tokens": 9, "output_tokens": tokens, "total_tokens": 9 + tokens}
        await resp.write(event("response.completed", response={"id": "r", "usage": usage}))
        return resp

    return node_app({"/v1/responses": responses})


async def test_a_responses_client_leaving_mid_stream_is_charged_what_it_was_sent(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    # Its deltas count as tokens though they carry no choice index: it is not charged 0.
    node = await aiohttp_server(responses_node(300))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 900, "stream": True}
    got = 0
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/responses", json=body, headers=headers) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data:") and b"output_text.delta" in line:
                    got += 1
                    if got == 100:
                        break
    for _ in range(100):
        view = await tenant_view(fleet.url)
        if view["kv_tokens"] == 0:
            break
        await asyncio.sleep(0.05)
    assert 100 <= view["output_tokens_last_minute"] <= 900
    assert fleet.leaks() == {}


def odd_node() -> web.Application:
    """Answers chat with a 200 in plain text, and embeddings with a usage of 10^9."""

    async def chat(request: web.Request) -> web.Response:
        await request.json()
        return web.Response(text="hello plain text", content_type="text/plain")

    async def embeddings(request: web.Request) -> web.Response:
        await request.json()
        usage = {"prompt_tokens": 10**9, "total_tokens": 10**9}
        data = [{"object": "embedding", "index": 0, "embedding": [0.0]}]
        return web.json_response({"object": "list", "data": data, "usage": usage})

    return node_app({"/v1/chat/completions": chat, "/v1/embeddings": embeddings})


async def test_answers_no_client_can_read_are_a_bad_gateway_and_cost_nothing(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    # A 200 in plain text is no answer (relayed, the SDK would return a bare string): a
    # 502 that charges no output. A node's 10^9 prompt tokens on embeddings are not
    # believed: charged, they would lock the tenant out.
    node = await aiohttp_server(odd_node())
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    headers = {"Authorization": "Bearer k-etl"}
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            body = chat(50, stream=stream)
            async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 502 and r.content_type == "application/json"
                err = (await r.json())["error"]
                assert err["code"] == "upstream_invalid_answer"
                assert "x-ratelimit-limit-output-tokens" in r.headers  # charged: its limits
        body = {"model": MODEL, "input": "hello"}
        async with s.post(fleet.url + "/v1/embeddings", json=body, headers=headers) as r:
            assert r.status == 200
    view = await tenant_view(fleet.url)
    assert view["output_tokens_last_minute"] == 0
    assert view["prompt_tokens_last_minute"] < 10_000  # at most one input at 8k context
    assert fleet.leaks() == {}


async def test_a_stream_the_node_cuts_is_charged_what_it_was_sent(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """The node dies after 100 of 900 tokens: the tenant is charged the 100 it was sent,
    not its reservation (the failure is the node's, not the tenant's)."""

    async def chat_dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        for _ in range(100):
            await resp.write(_chunk({"content": " w"}))
        assert request.transport is not None
        request.transport.close()  # the node process died
        return resp

    node = await aiohttp_server(node_app({"/v1/chat/completions": chat_dies}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    body = chat(900, stream=True)
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            text = (await r.read()).decode()
    assert '"error"' in text  # the client was told
    view = await tenant_view(fleet.url)
    assert view["output_tokens_last_minute"] == 100, view
    assert fleet.leaks() == {}


async def test_a_stream_without_include_usage_is_charged_what_it_relayed(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """The OpenAI SDKs stream without include_usage by default: such a stream of 20
    tokens is charged the 20 it relayed against the tenant's output quota, not its
    max_tokens (500)."""
    node = await aiohttp_server(vllm_like_node(tokens=20, pause_s=0.0))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    text = (await etl_stream(fleet.url)).decode()
    assert '"usage"' not in text and text.endswith("data: [DONE]\n\n")
    assert (await tenant_view(fleet.url))["output_tokens_last_minute"] == 20
    assert fleet.leaks() == {}


async def test_a_nodes_error_in_its_own_shape_is_relayed_with_one_content_type(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """uvicorn sends header names in lower case: a FastAPI 404 ({"detail": ...}) comes
    back as OpenAI's error with one Content-Type, whatever the case of the node's."""

    async def not_found(request: web.Request) -> web.Response:
        body = b'{"detail":"Not Found"}'
        return web.Response(status=404, body=body, headers={"content-type": "text/html"})

    node = await aiohttp_server(node_app({"/v1/chat/completions": not_found}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=chat(5), headers=headers) as r:
            assert r.status == 404
            assert r.headers.getall("Content-Type") == ["application/json"]
            assert (await r.json())["error"]["code"]
    assert fleet.leaks() == {}


async def test_streams_reuse_their_connection_to_the_node(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """The node ends its body (the chunked terminator) in a write of its own after
    [DONE]: the gateway still reuses the connection for the next stream to that node."""
    peers: set[Any] = set()

    async def chat_stream(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.add(request.transport.get_extra_info("peername"))
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        await resp.write(_chunk({"content": " w"}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.01)  # the body's end comes apart, as uvicorn writes it
        return resp

    node = await aiohttp_server(node_app({"/v1/chat/completions": chat_stream}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        for _ in range(5):
            body = chat(50, stream=True)
            async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            await asyncio.sleep(0.03)  # the next request comes after the body's end
    assert len(peers) == 1, peers
    assert fleet.leaks() == {}


async def test_a_streams_prefill_is_bounded_by_first_byte_s_not_idle_s(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """vLLM sends a stream's head at once and its first event after the prefill: the
    wait for that event is bounded by first_byte_s, not idle_s (a long prefill on an
    offload node is not cut at idle_s)."""

    node = await aiohttp_server(slow_prefill_node(0.6))
    url = str(node.make_url("")).rstrip("/")
    extra = {"max_model_len": 8192, "kv_cache_tokens": 100_000}
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        backend_extra={"only": {"url": url, **extra, "timeouts": {"idle_s": 0.3}}},
    )
    body = chat(5, stream=True)
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        text = await r.read()
    assert b'"error"' not in text and text.endswith(b"data: [DONE]\n\n")
    assert fleet.leaks() == {}


async def test_a_stream_the_gateways_shutdown_ends_is_charged_what_it_relayed(
    start_fleet: StartFleet,
) -> None:
    """A stream cut by the gateway's own shutdown is charged what it relayed, not its
    whole max_tokens."""
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})], time_scale=1.0, gateway={"auth": AUTH}
    )
    body = chat(500, stream=True, ignore_eos=True)
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200
            got = b""
            while got.count(b"data: ") < 6:  # a few tokens relayed
                got += await r.content.readany()
            for ex in list(fleet.state.active.values()):
                ex.end_now()
            got += await r.read()
    assert b"shutting down" in got.lower() or b'"error"' in got
    charged = (await tenant_view(fleet.url))["output_tokens_last_minute"]
    assert 0 < charged < 100, charged
    await asyncio.sleep(0.5)  # the node's abort lands (abort_release_delay_s)
    assert fleet.leaks() == {}


async def test_a_whole_answer_the_gateways_shutdown_cuts_is_answered_once(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """A whole (non-streamed) answer still being written to a client that reads slowly
    when shutdown ends its request is the answer: the client reads it intact, and it is
    counted as the 200 it was, with no second answer on the connection."""
    text = "w " * 4_000_000  # 8 MB: more than the sockets' buffers hold

    async def big(request: web.Request) -> web.Response:
        usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "length"}
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "model": SERVED,
                "choices": [choice],
                "usage": usage,
            }
        )

    node = await aiohttp_server(node_app({"/v1/chat/completions": big}))
    url = str(node.make_url("")).rstrip("/")
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        backend_extra={"only": {"url": url, "max_model_len": 8192, "kv_cache_tokens": 8192}},
    )
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=chat(5)) as r,
    ):
        assert r.status == 200
        await eventually(lambda: any(ex.answer is not None for ex in fleet.state.active.values()))
        await asyncio.sleep(0.3)  # the write waits for the client to read
        for ex in list(fleet.state.active.values()):
            ex.end_now()
        await eventually(lambda: not fleet.state.active)
        answer = await r.json()
    assert answer["choices"][0]["message"]["content"] == text
    async with aiohttp.ClientSession() as s, s.get(fleet.url + "/metrics") as m:
        exposed = await m.text()
    served = [line for line in exposed.splitlines() if line.startswith("gateway_requests_total")]
    assert len(served) == 1 and 'status="200"' in served[0], served


async def test_an_answer_cut_while_its_body_is_read_is_the_nodes_failure(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """A node that breaks the connection half-way through a whole answer failed the
    request: the client gets a 502, and the failure counts in the metrics and towards
    the node's health, as a failure before the head does."""

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 10_000
        await resp.prepare(request)
        await resp.write(b'{"id": "c", "object": "chat.completion", "choices": [')
        assert request.transport is not None
        request.transport.close()
        return resp

    node = await aiohttp_server(node_app({"/v1/chat/completions": cut}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/chat/completions", json=chat(5), headers=headers) as r:
            assert r.status == 502
            assert (await r.json())["error"]["code"] == "upstream_reset"
    failed_once(fleet, "reset")


async def test_a_stream_that_ends_without_its_last_event_is_the_nodes_failure(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """A stream the node ends cleanly but before ``[DONE]`` is cut short: the client gets
    an error event, and the failure counts in the metrics and towards the node's health."""

    async def short(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        await resp.write(_chunk({"content": " w"}))
        return resp

    node = await aiohttp_server(node_app({"/v1/chat/completions": short}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    got = await etl_stream(fleet.url)
    assert b"ended the stream early" in got and got.endswith(b"data: [DONE]\n\n")
    failed_once(fleet, "mid_stream")


async def test_a_queued_streams_first_event_wait_counts_from_when_it_was_sent(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """The first event's wait counts from when the request is sent to the node, not from
    its arrival: one that waits ~2 s in the queue still has the whole first_byte_s (2 s)
    for a 0.3 s prefill, not the 0.1 s its arrival would leave."""

    node = await aiohttp_server(slow_prefill_node(0.3))
    url = str(node.make_url("")).rstrip("/")
    timeouts = {"first_byte_s": 2.0, "idle_s": 5}
    extra = {"url": url, "max_model_len": 8192, "kv_cache_tokens": 1200, "timeouts": timeouts}
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        gateway={"admission": {"queue_timeout_s": 10}},
        backend_extra={"only": extra},
    )
    msg = chat(300, stream=True)
    msg["messages"][0]["content"] = "hi " * 300  # two of them do not fit the node's budget

    async def one(s: aiohttp.ClientSession, hold: float) -> bytes:
        async with s.post(fleet.url + "/v1/chat/completions", json={**msg, "hold": hold}) as r:
            assert r.status == 200
            return await r.read()

    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(one(s, 2.0))
        await asyncio.sleep(0.2)
        second = await one(s, 0.0)  # queued ~2 s behind the first
        await first
    assert b'"error"' not in second and second.endswith(b"data: [DONE]\n\n")
    assert fleet.leaks() == {}


async def test_a_passthrough_failure_with_nowhere_else_to_go_is_not_counted_as_retried(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=503)

    node = await aiohttp_server(node_app({"/v1/embeddings": failing}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        body = {"model": MODEL, "input": ["hi"]}
        async with s.post(fleet.url + "/v1/embeddings", json=body, headers=headers) as r:
            assert r.status >= 500
    registry = fleet.state.metrics.registry
    labels = {"backend": "only", "cause": "status_5xx"}
    assert registry.get_sample_value("gateway_upstream_failures_total", labels) == 1
    assert registry.get_sample_value("gateway_upstream_retries_total", labels) is None


async def test_a_passthrough_answer_that_stalls_after_its_head_ends_at_total_s(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"object": "list", ')
        await asyncio.sleep(30)
        return resp

    node = await aiohttp_server(node_app({"/v1/embeddings": stalls}))
    url = str(node.make_url("")).rstrip("/")
    extra = {"max_model_len": 8192, "kv_cache_tokens": 100_000}
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        backend_extra={"only": {"url": url, **extra, "timeouts": {"total_s": 0.5}}},
    )
    only = fleet.backend("only")
    await eventually(lambda: only.usable)
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s,
        s.post(fleet.url + "/v1/embeddings", json={"model": MODEL, "input": ["hi"]}) as r,
    ):
        assert r.status == 504, await r.text()
    assert only.in_flight == 0


async def test_room_of_a_stream_the_gateway_gave_up_on_is_held_until_the_abort_lands(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    """An idle timeout closes the node's stream while the node still decodes it: the
    room stays held for ``abort_release_delay_s``, as for a client that left."""
    node = await aiohttp_server(slow_prefill_node(0.05))
    url = str(node.make_url("")).rstrip("/")
    extra = {"max_model_len": 8192, "kv_cache_tokens": 100_000}
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        gateway={"admission": {"abort_release_delay_s": 1.0}},
        backend_extra={"only": {"url": url, **extra, "timeouts": {"idle_s": 0.3}}},
    )
    only = fleet.backend("only")
    await eventually(lambda: only.usable)
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json={**chat(5, stream=True), "hold": 3}) as r,
    ):
        assert r.status == 200
        text = await r.read()
    assert b'"error"' in text  # the idle timeout's event
    assert only.reserved_tokens > 0
    await eventually(lambda: only.reserved_tokens == 0, timeout=3)
    assert fleet.leaks() == {}


async def test_a_stream_the_node_ends_with_an_error_is_charged_what_it_relayed(
    start_fleet: StartFleet, aiohttp_server: Any
) -> None:
    async def chat_fails(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        await resp.write(_chunk({"content": " w"}))
        await resp.write(_chunk({"content": " w"}))
        error = {"error": {"message": "engine failed", "type": "InternalServerError"}}
        await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    node = await aiohttp_server(node_app({"/v1/chat/completions": chat_fails}))
    fleet = await gateway_over(start_fleet, str(node.make_url("")).rstrip("/"))
    assert b"engine failed" in await etl_stream(fleet.url)
    charged = (await tenant_view(fleet.url))["output_tokens_last_minute"]
    assert 0 < charged < 10, charged  # what it relayed, not its max_tokens
    assert fleet.leaks() == {}
