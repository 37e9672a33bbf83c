"""`gateway round` against simulated nodes on loopback: limits, log, ladder, the file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from kvgateway.cli import main
from kvgateway.commands.roundload import measure_round
from kvgateway.commands.roundstats import rounds_from_json
from kvgateway.simulator.profiles import TINY
from kvgateway.simulator.server import create_node_app as create_app
from kvgateway.simulator.settings import NodeSettings
from kvgateway.simulator.sizing import ServeFlags, size_node
from kvgateway.tokens.encoding import EncodingCache

Server = Callable[..., Awaitable[TestServer]]


async def _serve(aiohttp_server: Server, settings: NodeSettings, enc: EncodingCache) -> str:
    server = await aiohttp_server(create_app(settings, encodings=enc))
    return str(server.make_url("")).rstrip("/")


async def test_round_reads_the_nodes_own_kv_tokens_and_log(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    sized = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624, max_num_seqs=12))
    settings = dataclasses.replace(sized.settings, time_scale=200.0, seed=1)
    url = await _serve(aiohttp_server, settings, encodings)
    lines: list[str] = []
    r = await measure_round(
        url,
        "r1",
        ladder=(1, 2),
        prompt_tokens=256,
        output_tokens=16,
        duration_s=4.0,
        timeout_s=30.0,
        time_scale=200.0,
        log_text="\n".join(sized.log),
        progress=lines.append,
    )
    # The node's own figure, which is also the planner's for these flags.
    assert r.limits.kv_tokens == settings.kv_tokens == sized.estimate.kv_cache_tokens
    assert r.limits.kv_tokens == (settings.num_gpu_blocks - 1) * settings.block_size
    assert r.limits.max_model_len == 26624
    assert r.flags["max_num_seqs"] == 12 and r.passed_flags == {
        "max_model_len": 26624,
        "max_num_seqs": 12,
    }
    assert r.log is not None and r.log.kv_cache_memory_gib == round(
        sized.estimate.kv_pool_bytes / 2**30, 2
    )
    pool = sized.estimate.pool
    peak = (pool.weights_bytes + pool.activation_bytes + pool.overhead_bytes) / 2**30
    assert r.log.peak_memory_gib is not None and abs(r.log.peak_memory_gib - peak) < 0.02
    assert [s.concurrency for s in r.steps] == [1, 2] and r.stopped is None
    assert r.time_scale == 200.0 and r.prompt_tokens == 256 and r.output_tokens == 16
    for step in r.steps:
        assert step.completed > 0 and step.preemptions == 0
        assert step.ttft_p50_s is not None and step.ttft_p50_s > 0
        assert step.tokens_per_s > 0
        assert step.bad_requests == step.errors == step.timeouts == 0
    assert "KV 40,240 tokens" in lines[0]


async def test_ladder_stops_at_the_first_preempting_step(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    # 1,024 usable KV tokens: four 100+100 requests fit, eight do not once they decode.
    settings = dataclasses.replace(TINY, time_scale=20.0, seed=1)
    url = await _serve(aiohttp_server, settings, encodings)
    r = await measure_round(
        url,
        "tiny",
        ladder=(1, 2, 4, 8, 16),
        prompt_tokens=100,
        output_tokens=100,
        # Simulated seconds: 0.5 s wall a step. Eight requests outgrow the pool after ~30
        # decode steps; at 3 s (0.15 s wall) a busy machine sometimes ran fewer.
        duration_s=10.0,
        timeout_s=30.0,
        time_scale=20.0,
    )
    assert [s.concurrency for s in r.steps] == [1, 2, 4, 8]
    assert [s.preemptions > 0 for s in r.steps] == [False, False, False, True]
    assert r.stopped is not None and "at 8 concurrent" in r.stopped
    assert r.first_preempting == 8
    assert r.steps[2].peak_kv_usage is not None and r.steps[2].peak_kv_usage < 1.0


async def test_too_long_requests_are_counted_as_400s_and_stop_the_ladder(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    settings = dataclasses.replace(TINY, time_scale=20.0)
    url = await _serve(aiohttp_server, settings, encodings)
    r = await measure_round(
        url,
        "too-long",
        ladder=(1, 2),
        prompt_tokens=600,  # > max_model_len 512 even without output (vLLM >= 0.32 cuts
        output_tokens=100,  # max_tokens to what a prompt that fits leaves)
        duration_s=0.5,
        timeout_s=30.0,
        time_scale=20.0,
    )
    step = r.steps[0]
    assert len(r.steps) == 1 and step.bad_requests > 0 and step.completed == 0
    assert step.ttft_p50_s is None and step.tokens_per_s == 0
    assert r.stopped is not None and "no request succeeded at 1 concurrent" in r.stopped


async def test_cli_appends_rounds_and_replaces_a_round_of_the_same_name(
    aiohttp_server: Server, encodings: EncodingCache, tmp_path, capsys
) -> None:
    url = await _serve(aiohttp_server, dataclasses.replace(TINY, time_scale=50.0), encodings)
    out = tmp_path / "rounds.json"
    base = ["round", "--url", url, "--ladder", "1", "--prompt-tokens", "32"]
    base += ["--output-tokens", "8", "--duration", "1", "--time-scale", "50", "--out", str(out)]

    # main() runs its own event loop: run it in a thread beside the test's loop.
    import asyncio

    for name in ("a", "b", "a"):
        assert await asyncio.to_thread(main, [*base, "--name", name]) == 0
    rounds = rounds_from_json(json.loads(out.read_text()))
    assert [r.name for r in rounds] == ["a", "b"]
    err = capsys.readouterr().err
    assert "round a added as round 1" in err and "round a replaced as round 1" in err
    assert "1 concurrent:" in err


async def test_an_unreachable_node_is_an_error_not_a_hang(tmp_path, capsys) -> None:
    import asyncio
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rounds.json"
    argv = ["round", "--url", f"http://127.0.0.1:{port}", "--name", "x", "--out", str(out)]
    assert await asyncio.to_thread(main, argv) == 1
    assert f"gateway round: error: http://127.0.0.1:{port}/v1/models:" in capsys.readouterr().err
    assert not out.exists()


async def test_a_long_step_shows_a_heartbeat(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    url = await _serve(aiohttp_server, dataclasses.replace(TINY, time_scale=20.0), encodings)
    lines: list[str] = []
    await measure_round(
        url, "hb", ladder=(2,), prompt_tokens=32, output_tokens=8, duration_s=6.0,
        timeout_s=30.0, time_scale=20.0, progress=lines.append, heartbeat_s=0.1,
    )  # fmt: skip
    beats = [line for line in lines if " of 6s, " in line]
    # 0.3 s of wall time: a beat every 0.1 s while more than 0.1 s is left.
    assert 1 <= len(beats) <= 3 and all(b.startswith("   2 concurrent: ") for b in beats)
    assert "TTFT p50" in lines[-1] and "TTFT" not in " ".join(beats)  # then the step's result


async def test_the_api_key_is_sent_to_a_node_that_needs_one(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    from aiohttp import web

    from kvgateway.commands.nodeclient import RoundError

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        # Like vLLM's --api-key: /v1 routes need the bearer token, /metrics does not.
        if request.path.startswith("/v1") and request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    app = create_app(dataclasses.replace(TINY, time_scale=50.0), encodings=encodings)
    app.middlewares.append(require_key)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    kw: dict[str, Any] = dict(ladder=(1,), prompt_tokens=16, output_tokens=4, duration_s=1.0,
                              timeout_s=30.0, time_scale=50.0)  # fmt: skip
    with pytest.raises(RoundError, match="/v1/models: HTTP 401"):
        await measure_round(url, "no-key", **kw)
    r = await measure_round(url, "key", api_key="k", **kw)
    assert r.steps[0].completed > 0 and r.steps[0].errors == 0


async def test_started_at_is_when_the_round_started(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    import datetime as dt

    url = await _serve(aiohttp_server, dataclasses.replace(TINY, time_scale=50.0), encodings)
    start = dt.datetime(2026, 12, 2, 16, 14, 9, tzinfo=dt.UTC)
    calls: list[dt.datetime] = []

    def clock() -> dt.datetime:  # each reading a minute after the last
        calls.append(start + dt.timedelta(minutes=len(calls)))
        return calls[-1]

    r = await measure_round(
        url, "t", ladder=(1, 2), prompt_tokens=16, output_tokens=4, duration_s=1.0,
        timeout_s=30.0, time_scale=50.0, clock=clock,
    )  # fmt: skip
    assert r.started_at == "2026-12-02T16:14:09+00:00" and len(calls) == 1


async def test_a_real_start_up_log_with_a_config_object_keeps_its_flags(
    aiohttp_server: Server, encodings: EncodingCache
) -> None:
    from tests.support.capacity_data import read_data

    url = await _serve(aiohttp_server, dataclasses.replace(TINY, time_scale=50.0), encodings)
    r = await measure_round(
        url, "cpu", ladder=(1,), prompt_tokens=16, output_tokens=4, duration_s=1.0,
        timeout_s=30.0, time_scale=50.0, log_text=read_data("v1_032_cpu_gemma3_hybrid.log"),
    )  # fmt: skip
    assert r.passed_flags["num_gpu_blocks_override"] == 64
    assert r.passed_flags["max_num_seqs"] == 16
    assert str(r.passed_flags["kv_events_config"]).startswith("KVEventsConfig(")
    assert r.flags["max_num_seqs"] == 16
    assert r.log is not None and r.log.device == "CPU" and r.log.num_blocks_override == 64
    assert r.log.kv_cache_memory_gib == 1.0 and r.log.node_memory_gib == 9.46
