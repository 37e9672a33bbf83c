"""Tenant keys, quotas and their headers over HTTP (real gateway, one simulated node)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from tests.support.fleet import MODEL, RunningFleet, StartFleet

AUTH = {
    "classes": [{"name": "interactive"}, {"name": "batch"}],
    "keys": [
        {
            "name": "app",
            "key": "k-app",
            "class": "interactive",
            "limits": {"requests_per_minute": 2, "prompt_tokens_per_minute": 100_000},
        },
        {"name": "etl", "key_env": "ETL_KEYS", "limits": {"output_tokens_per_minute": 1000}},
    ],
}


async def chat(fleet: RunningFleet, key: str, max_tokens: int = 5) -> tuple[int, Any, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {key}"}
        async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, r.headers, await r.json()


async def admin(fleet: RunningFleet, key: str) -> Any:
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {key}"}
        async with s.get(fleet.url + "/admin/backends", headers=headers) as r:
            assert r.status == 200
            return await r.json()


async def test_keys_name_tenants_and_requests_per_minute_give_429_with_headers(
    start_fleet: StartFleet, monkeypatch, caplog
):
    monkeypatch.setenv("ETL_KEYS", "k-etl-1,k-etl-2")
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        gateway={"auth": AUTH, "server": {"access_log": True}},
    )
    caplog.set_level(logging.INFO, logger="kvgateway.access")
    status, _, _ = await chat(fleet, "k-nobody")
    assert status == 401
    status, headers, _ = await chat(fleet, "k-app")
    assert status == 200
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert (await chat(fleet, "k-app"))[0] == 200
    status, headers, body = await chat(fleet, "k-app")
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["param"] == "requests_per_minute"
    assert "'app'" in body["error"]["message"] and "requests_per_minute" in body["error"]["message"]
    assert 55 <= int(headers["Retry-After"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # Another tenant (a key from the environment) has its own limits.
    status, headers, _ = await chat(fleet, "k-etl-2")
    assert status == 200 and "x-ratelimit-limit-requests" not in headers
    assert headers["x-ratelimit-limit-output-tokens"] == "1000"
    lines = [r.access for r in caplog.records if r.name == "kvgateway.access"]
    assert [a["tenant"] for a in lines] == ["-", "app", "app", "app", "etl"]
    # The refused key has a line too, naming no tenant, its outcome the error's code.
    assert (lines[0]["status"], lines[0]["outcome"]) == (401, "invalid_api_key")
    async with aiohttp.ClientSession() as s, s.get(fleet.url + "/metrics") as r:
        text = await r.text()
    assert 'gateway_tenant_requests_total{status="200",tenant="app"} 2.0' in text
    assert 'gateway_tenant_rate_limited_total{limit="requests_per_minute",tenant="app"} 1.0' in text
    assert 'gateway_tenant_kv_tokens{tenant="etl"} 0.0' in text
    assert 'tenant="k-' not in text  # labels are tenant names, never keys


async def test_output_is_settled_with_the_usage(start_fleet: StartFleet, monkeypatch):
    monkeypatch.setenv("ETL_KEYS", "k-etl")
    fleet = await start_fleet([("only", "small", "gpu24-8b", {})], gateway={"auth": AUTH})
    status, headers, body = await chat(fleet, "k-etl", max_tokens=400)
    assert status == 200
    # Charged 400 at admission; what is left after settling is what was generated.
    produced = body["usage"]["completion_tokens"]
    view = {t["name"]: t for t in (await admin(fleet, "k-etl"))["tenants"]}
    assert view["etl"]["output_tokens_last_minute"] == produced
    assert view["etl"]["class"] == "batch" and view["app"]["class"] == "interactive"
    assert view["etl"]["requests_last_minute"] == 1 and view["etl"]["kv_tokens"] == 0
    assert int(headers["x-ratelimit-remaining-output-tokens"]) == 1000 - 400
    # A request whose reservation alone is over the limit can never run: said so, no retry.
    status, headers, body = await chat(fleet, "k-etl", max_tokens=1200)
    assert status == 429 and body["error"]["param"] == "output_tokens_per_minute"
    assert "never fit" in body["error"]["message"] and "Retry-After" not in headers


async def test_passthrough_endpoints_count_against_the_tenants_limits(
    start_fleet: StartFleet, monkeypatch
):
    # Embeddings, tokenize, score and rerank hold no KV reservation, but they are requests
    # of a tenant: its requests_per_minute refuses them (they are not unlimited), they
    # carry the x-ratelimit-* headers, and the prompt tokens the node reports count.
    monkeypatch.setenv("ETL_KEYS", "k-etl")
    fleet = await start_fleet([("only", "small", "gpu24-8b", {})], gateway={"auth": AUTH})
    headers = {"Authorization": "Bearer k-app"}
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "input": "hello world " * 50}
        async with s.post(fleet.url + "/v1/embeddings", json=body, headers=headers) as r:
            assert r.status == 200
            assert r.headers["x-ratelimit-remaining-requests"] == "1"
            reported = (await r.json())["usage"]["prompt_tokens"]
        async with s.post(fleet.url + "/tokenize", json={"prompt": "hi"}, headers=headers) as r:
            assert r.status == 200 and r.headers["x-ratelimit-remaining-requests"] == "0"
        async with s.post(fleet.url + "/v1/embeddings", json=body, headers=headers) as r:
            assert r.status == 429
            err = (await r.json())["error"]
            assert err["param"] == "requests_per_minute" and "Retry-After" in r.headers
    view = {t["name"]: t for t in (await admin(fleet, "k-app"))["tenants"]}
    assert view["app"]["requests_last_minute"] == 2
    assert view["app"]["prompt_tokens_last_minute"] == reported > 0


async def test_responses_api_output_is_settled_with_its_usage(start_fleet: StartFleet, monkeypatch):
    # The Responses API names its usage input_tokens / output_tokens: read, it settles a
    # /v1/responses request at what it generated, not its whole max_output_tokens.
    monkeypatch.setenv("ETL_KEYS", "k-etl")
    fleet = await start_fleet([("only", "small", "gpu24-8b", {})], gateway={"auth": AUTH})
    headers = {"Authorization": "Bearer k-etl"}
    produced = 0
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 300}
        async with s.post(fleet.url + "/v1/responses", json=body, headers=headers) as r:
            assert r.status == 200
            produced += (await r.json())["usage"]["output_tokens"]
        async with s.post(
            fleet.url + "/v1/responses", json={**body, "stream": True}, headers=headers
        ) as r:
            assert r.status == 200
            text = (await r.read()).decode()
    done = [line for line in text.splitlines() if '"response.completed"' in line]
    produced += json.loads(done[-1].removeprefix("data: "))["response"]["usage"]["output_tokens"]
    view = {t["name"]: t for t in (await admin(fleet, "k-etl"))["tenants"]}
    assert view["etl"]["output_tokens_last_minute"] == produced < 600


async def test_score_pairs_are_charged_what_the_node_counted(start_fleet: StartFleet, monkeypatch):
    # The node counts the query once per document: a legitimate count can exceed the
    # request's bytes many times (a cap at the bytes would charge 2,027 of 18,050).
    monkeypatch.setenv("ETL_KEYS", "k-etl")
    fleet = await start_fleet([("only", "small", "gpu24-8b", {})], gateway={"auth": AUTH})
    body = {"model": MODEL, "text_1": "the quick brown fox jumps " * 40, "text_2": ["a"] * 50}
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": "Bearer k-etl"}
        async with s.post(fleet.url + "/v1/score", json=body, headers=headers) as r:
            assert r.status == 200
            reported = (await r.json())["usage"]["prompt_tokens"]
    assert reported > len(json.dumps(body))
    view = {t["name"]: t for t in (await admin(fleet, "k-etl"))["tenants"]}
    assert view["etl"]["prompt_tokens_last_minute"] == reported


async def test_a_refused_request_is_refunded_in_its_own_rate_limit_headers(
    start_fleet: StartFleet,
) -> None:
    """A 429 for a full queue refunds the request, and its x-ratelimit headers are those
    of the refund (1 of 3 left, 2 used), not of its charge (remaining 0 and a minute to
    wait). Its Retry-After, for a refusal made at once, is 1 s, not the whole queue
    timeout (8 s)."""
    auth = {"keys": [{"name": "app", "key": "k-app", "limits": {"requests_per_minute": 3}}]}
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        time_scale=1.0,
        gateway={"auth": auth, "admission": {"queue_size": 1, "queue_timeout_s": 8}},
        backend_extra={"only": {"max_num_seqs": 1}},
    )

    async def post(max_tokens: int) -> tuple[int, dict[str, str]]:
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = max_tokens
        async with aiohttp.ClientSession() as s:
            headers = {"Authorization": "Bearer k-app"}
            async with s.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status, dict(r.headers)

    running = asyncio.create_task(post(2000))
    await asyncio.sleep(0.5)
    queued = asyncio.create_task(post(5))
    await asyncio.sleep(0.5)
    status, headers = await post(5)
    assert status == 429
    assert headers["x-ratelimit-remaining-requests"] == "1", headers
    assert headers["Retry-After"] == "1"
    running.cancel()
    queued.cancel()
    await asyncio.gather(running, queued, return_exceptions=True)
