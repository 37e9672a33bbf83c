"""Failures on the path: nodes that die, hang, refuse, fill up; reloads; disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
import yaml

from kvgateway.server.app import KV_EVENTS, STATE
from kvgateway.server.reload import reload_config
from tests.support.eventually import eventually
from tests.support.fleet import MODEL, NodeSpec, StartFleet


def chat(
    tokens_text: str = "hello there", max_tokens: int = 32, stream: bool = False
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": tokens_text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


TWO_SMALL: list[NodeSpec] = [
    ("small-1", "small", "gpu24-8b", {}),
    ("small-2", "small", "gpu24-8b", {}),
]


async def test_node_dying_mid_stream_ends_stream_cleanly(start_fleet: StartFleet):
    fleet = await start_fleet(TWO_SMALL, time_scale=20)
    for node in fleet.nodes.values():
        await node.fault(drop_after_chunks=3, remaining=1)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            fleet.url + "/v1/chat/completions", json=chat(max_tokens=200, stream=True)
        ) as r:
            assert r.status == 200
            events = await read_sse(r)
        assert events[-1] == "[DONE]"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["type"] == "upstream_error"
        assert sum(1 for e in events if isinstance(e, dict) and "choices" in e) == 3
        # The fleet is unaffected: the next requests succeed.
        for _ in range(3):
            async with s.post(fleet.url + "/v1/chat/completions", json=chat()) as r2:
                assert r2.status == 200
    assert fleet.leaks() == {}


async def test_stopped_node_is_skipped_and_request_succeeds_elsewhere(start_fleet: StartFleet):
    fleet = await start_fleet(TWO_SMALL, time_scale=50)
    await fleet.nodes["small-1"].server.close()
    async with aiohttp.ClientSession() as s:
        tiers = []
        for _ in range(6):
            async with s.post(fleet.url + "/v1/chat/completions", json=chat()) as r:
                assert r.status == 200
                tiers.append(r.headers["x-gateway-backend"])
    assert set(tiers) == {"small-2"}
    assert fleet.leaks() == {}
    # The cause as documented and alerted on (the code is upstream_connect).
    retries = fleet.state.metrics.registry.get_sample_value(
        "gateway_upstream_retries_total", {"backend": "small-1", "cause": "connect"}
    )
    assert retries is not None and retries >= 1


async def test_node_503_before_first_byte_is_retried_on_another(start_fleet: StartFleet):
    fleet = await start_fleet(TWO_SMALL, time_scale=50)
    for node in fleet.nodes.values():
        await node.fault(status=503, remaining=1)
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=chat()) as r,
    ):
        # Both nodes refuse once: the third attempt (back on the first) succeeds.
        assert r.status == 200, await r.text()
    assert fleet.leaks() == {}
    failures = fleet.state.metrics.registry.get_sample_value(
        "gateway_upstream_failures_total", {"backend": "small-1", "cause": "status_5xx"}
    )
    assert failures == 1


async def test_hung_node_times_out_and_releases(start_fleet: StartFleet):
    fleet = await start_fleet(
        [("only", "small", "gpu24-8b", {})],
        time_scale=50,
        backend_extra={"only": {"timeouts": {"first_byte_s": 0.3, "total_s": 0.5}}},
    )
    await fleet.nodes["only"].fault(hang_s=5)
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            async with s.post(fleet.url + "/v1/chat/completions", json=chat(stream=stream)) as r:
                assert r.status == 504
                assert (await r.json())["error"]["code"] == "upstream_timeout"
    # Released once the node's abort has landed (abort_release_delay_s).
    await eventually(lambda: fleet.leaks() == {}, timeout=2)


async def test_idle_stream_timeout_ends_stream_with_error(start_fleet: StartFleet):
    fleet = await start_fleet(
        [("only", "offload", "offload-8b", {})],
        time_scale=1,
        backend_extra={"only": {"timeouts": {"idle_s": 0.1}}},
    )
    # An offload node takes ~250 ms per decode step: longer than the idle limit.
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=chat(max_tokens=50, stream=True)) as r,
    ):
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "upstream_timeout"
    await eventually(lambda: fleet.leaks() == {}, timeout=2)  # once the abort has landed


async def test_client_disconnect_cancels_upstream_promptly(start_fleet: StartFleet):
    fleet = await start_fleet([("only", "small", "gpu24-8b", {})], time_scale=1)
    node = fleet.nodes["only"]
    async with aiohttp.ClientSession() as s:
        for stream in (True, False):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    async with s.post(
                        fleet.url + "/v1/chat/completions",
                        json=chat(max_tokens=2000, stream=stream),
                    ) as r:
                        await r.read()
            for _ in range(50):
                st = await node.state()
                if st["running"] == 0 and st["used_blocks"] == 0 and not fleet.leaks():
                    break
                await asyncio.sleep(0.02)
            assert st["running"] == 0 and st["used_blocks"] == 0, st
            assert st["finished"].get("abort", 0) >= 1
            assert fleet.leaks() == {}


async def test_node_filled_by_outside_client_gets_no_gateway_traffic(start_fleet: StartFleet):
    fleet = await start_fleet(
        TWO_SMALL, time_scale=2, gateway={"load_feedback": {"interval_s": 0.1}}
    )
    hot = fleet.nodes["small-1"]
    # Someone else fills small-1 directly (not through the gateway), with distinct prompts:
    # identical ones would share their blocks in the node's prefix cache.
    async with aiohttp.ClientSession() as s:

        def body(i: int) -> dict[str, object]:
            return {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [{"role": "user", "content": f"client {i}: " + "hi " * 3000}],
                "max_tokens": 4000,
            }

        outside = [
            asyncio.create_task(s.post(hot.url + "/v1/chat/completions", json=body(i)))
            for i in range(12)
        ]
        b = fleet.backend("small-1")
        for _ in range(100):
            if b.paused:
                break
            await asyncio.sleep(0.05)
        assert b.paused and b.pause_reason in ("kv_full", "queueing", "preempting")
        assert b.reserved_tokens == 0  # the gateway's own accounting alone says "empty"
        for _ in range(5):
            async with s.post(fleet.url + "/v1/chat/completions", json=chat()) as r:
                assert r.status == 200
                assert r.headers["x-gateway-backend"] == "small-2"
        for t in outside:
            t.cancel()
        await asyncio.gather(*outside, return_exceptions=True)
    # Once the node drains, it takes work again.
    for _ in range(100):
        if not b.paused:
            break
        await asyncio.sleep(0.05)
    assert not b.paused


def write_config(path, fleet, names, **extra) -> None:
    backends = {n: {"name": n, "url": fleet.nodes[n].url, "model": MODEL} for n in names}
    tiers: dict[str, list[dict[str, str]]] = {}
    for n in names:
        tiers.setdefault(fleet.nodes[n].tier, []).append(backends[n])
    data = {
        "models": [{"name": MODEL, "served_name": "meta-llama/Llama-3.1-8B-Instruct"}],
        "health": {"interval_s": 0.2},
        "tiers": [{"name": t, "backends": bs} for t, bs in tiers.items()],
        **extra,
    }
    path.write_text(yaml.safe_dump(data))


async def test_reload_under_load_fails_nothing(start_fleet: StartFleet, tmp_path):
    nodes = [*TWO_SMALL, ("large-1", "large", "gpu80-8b", {})]
    fleet = await start_fleet(nodes, time_scale=20)
    app = fleet.gateway.app
    cfg = tmp_path / "gw.yaml"
    statuses: list[int] = []
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            async with s.post(
                fleet.url + "/v1/chat/completions", json=chat(max_tokens=64, stream=i % 2 == 0)
            ) as r:
                await r.read()
                statuses.append(r.status)

        load = [asyncio.create_task(one(i)) for i in range(150)]
        await asyncio.sleep(0.05)
        write_config(cfg, fleet, ["small-2", "large-1"])  # small-1 removed
        assert reload_config(app, str(cfg))
        await asyncio.sleep(0.05)
        write_config(cfg, fleet, ["small-1", "small-2", "large-1"])  # and back
        assert reload_config(app, str(cfg))
        await asyncio.gather(*load)
    assert statuses.count(200) == 150, statuses
    assert fleet.leaks() == {}
    assert [b.name for b in fleet.state.fleet.active] == ["small-1", "small-2", "large-1"]


async def test_invalid_reload_keeps_old_config(start_fleet: StartFleet, tmp_path):
    fleet = await start_fleet(TWO_SMALL, time_scale=50)
    app = fleet.gateway.app
    before = app[STATE].live()
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "models: [{name: x}]\ntiers: [{name: t, backends: [{name: a, url: nope, model: x}]}]\n"
    )
    assert reload_config(app, str(cfg)) is False
    assert app[STATE].live() is before
    assert app[STATE].metrics.reloads.labels(result="invalid")._value.get() == 1
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/chat/completions", json=chat()) as r,
    ):
        assert r.status == 200


async def test_node_restarted_with_new_limits_is_rediscovered(
    start_fleet: StartFleet, aiohttp_server
):
    import dataclasses

    from kvgateway.simulator.profiles import get_profile
    from kvgateway.simulator.server import create_node_app as create_node
    from tests.support.fleet import ENCODINGS, SERVED

    fleet = await start_fleet(
        TWO_SMALL, time_scale=50, gateway={"health": {"rediscover_interval_s": 0.3}}
    )
    b = fleet.backend("small-1")
    assert b.max_model_len == 8192
    port = fleet.nodes["small-1"].server.port
    await fleet.nodes["small-1"].server.close()
    settings = dataclasses.replace(
        get_profile("gpu24-8b"),
        name="small-1",
        model=SERVED,
        max_model_len=4096,
        num_gpu_blocks=1000,
        time_scale=50,
    )
    await aiohttp_server(create_node(settings, encodings=ENCODINGS), port=port)
    for _ in range(100):
        if b.max_model_len == 4096 and b.kv_cache_tokens == 999 * 16:
            break
        await asyncio.sleep(0.05)
    assert (b.max_model_len, b.kv_cache_tokens) == (4096, 999 * 16)
    assert b.limits.max_model_len.source == "discovered"


async def test_watch_reloads_on_file_change(start_fleet: StartFleet, tmp_path):
    """A file change goes through the same reload as SIGHUP: the fleet follows, and so do
    the KV-event subscriptions (a `kv_events:` the file adds is subscribed to)."""
    from kvgateway.server.reload import Reloader, watch_file

    fleet = await start_fleet(TWO_SMALL, time_scale=50)
    app = fleet.gateway.app
    cfg = tmp_path / "gw.yaml"
    write_config(cfg, fleet, ["small-1", "small-2"])
    reloader = Reloader(app, str(cfg))
    watcher = asyncio.create_task(watch_file(reloader.request, str(cfg), interval=0.05))
    try:
        await asyncio.sleep(0.1)
        write_config(cfg, fleet, ["small-2"])
        data = yaml.safe_load(cfg.read_text())
        data["tiers"][0]["backends"][0]["kv_events"] = "tcp://127.0.0.1:5599"
        cfg.write_text(yaml.safe_dump(data))
        for _ in range(100):
            if [x.name for x in fleet.state.fleet.active] == ["small-2"] and app[
                KV_EVENTS
            ].subscriber("small-2"):
                break
            await asyncio.sleep(0.05)
        assert [x.name for x in fleet.state.fleet.active] == ["small-2"]
        sub = app[KV_EVENTS].subscriber("small-2")
        assert sub is not None and sub.source.endpoint == "tcp://127.0.0.1:5599"
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await reloader.close()


async def test_a_reload_keeps_the_command_lines_settings_and_says_the_new_policy(
    start_fleet: StartFleet, tmp_path, caplog
):
    """`serve --port P` reloaded keeps the command line's port over the file's, with no
    warning that a port change needs a restart (else every SIGHUP would warn), and
    gateway_build_info says the reloaded policy, not the old one."""
    import argparse
    from dataclasses import replace

    from kvgateway import __version__
    from kvgateway.commands.serve import _with_overrides

    fleet = await start_fleet(TWO_SMALL, time_scale=50)
    app = fleet.gateway.app
    state = app[STATE]
    # As `serve --port 18093` started it (the file says another port).
    state.live.value = replace(state.live(), server=replace(state.live().server, port=18093))
    running = state.live().server
    args = argparse.Namespace(
        host=None, port=18093, drain_delay_s=None, ledger_url=None, worker_count=None
    )
    cfg = tmp_path / "gw.yaml"
    write_config(cfg, fleet, ["small-1", "small-2"], routing={"policy": "round_robin"})
    old_policy = app[STATE].live().routing.policy
    assert reload_config(app, str(cfg), lambda c: _with_overrides(args, replace(c)))
    assert app[STATE].live().server.port == running.port
    assert "need a restart" not in caplog.text
    build = app[STATE].metrics.build_info
    assert build.labels(version=__version__, policy="round_robin")._value.get() == 1
    assert build.labels(version=__version__, policy=old_policy)._value.get() == 0


async def test_what_was_learned_of_a_removed_backend_goes_with_it(
    start_fleet: StartFleet, tmp_path
):
    """DNS members come and go as new names: a gone backend's prefix view (up to its
    whole cache of block keys) and its calibration fit (read by every request) leave
    with it, or they would pile up for as long as the process runs."""
    fleet = await start_fleet(TWO_SMALL, time_scale=50, gateway={"routing": {"prefix_aware": True}})
    app = fleet.gateway.app
    state = app[STATE]
    async with aiohttp.ClientSession() as s:
        for i in range(8):
            body = chat(f"question {i} " + "about the depot ledger " * 40)
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
    assert state.prefix is not None

    def routed(name: str) -> int:
        assert state.prefix is not None
        return state.prefix.index.statistics(name, state.clock()).approximate_blocks

    gone = max(("small-1", "small-2"), key=routed)  # the one that took the traffic
    kept = "small-2" if gone == "small-1" else "small-1"
    assert routed(gone) > 0 and gone in state.calibration.backends()
    cfg = tmp_path / "gw.yaml"
    write_config(cfg, fleet, [kept], routing={"prefix_aware": True})
    assert reload_config(app, str(cfg))
    assert gone not in state.calibration.backends()
    assert routed(gone) == 0


async def test_a_node_that_cuts_every_stream_after_its_head_is_ejected(start_fleet: StartFleet):
    """``eject_after_failures`` (3) streams in a row cut after their heads take the node
    out: a head is not a served request, so it does not end the run of failures."""
    fleet = await start_fleet(
        [("small-1", "small", "gpu24-8b", {})],
        time_scale=20,
        gateway={"health": {"interval_s": 60}},
    )
    await fleet.nodes["small-1"].fault(drop_after_chunks=3, remaining=3)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            body = chat(max_tokens=200, stream=True)
            async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                events = await read_sse(r)
            assert any(isinstance(e, dict) and "error" in e for e in events)
    assert not fleet.backend("small-1").healthy
    assert fleet.leaks() == {}
