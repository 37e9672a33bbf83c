"""A node whose engine dies mid-stream: vLLM ends the stream with an in-band error event
and ``[DONE]``; the gateway relays both, records the node's failure (not an ``ok``), and
counts it toward the node's ejection."""

from __future__ import annotations

import json
import logging
import os
import signal

import aiohttp
import pytest

from tests.support.eventually import eventually
from tests.support.real_fleet import StartGateway, gateway_config, state_of
from tests.support.vllm_nodes import RealNode

pytestmark = pytest.mark.real_vllm


def _engine_pids(node: RealNode) -> list[int]:
    """The node's engine-core and worker processes (children of its API server)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if cmd.startswith((b"VLLM::EngineCore", b"VLLM::Worker")):
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            out.append((int(pid), ppid))
    api = _api_pid(node)
    engines = {pid for pid, ppid in out if ppid == api}
    return [pid for pid, ppid in out if pid in engines or ppid in engines]


def _api_pid(node: RealNode) -> int:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and str(node.port).encode() in cmd:
            return int(pid)
    raise AssertionError(f"no API server for port {node.port}")


@pytest.mark.kills_node
async def test_an_engine_dying_mid_stream_is_the_nodes_failure(
    apart_node: RealNode, real_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    node = apart_node
    config = gateway_config([node])
    for entry in config["tiers"][0]["backends"]:  # its KV events are another test's
        entry.pop("kv_events", None)
        entry.pop("kv_events_replay", None)
    gw = await real_gateway(config)
    b = state_of(gw).fleet.get("C")
    assert b is not None
    await eventually(lambda: b.limits.known and b.healthy, timeout=30)
    url = str(gw.make_url("")).rstrip("/")
    body = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "run until the engine dies"}],
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    events: list[bytes] = []
    caplog.set_level(logging.INFO, logger="kvgateway.access")
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        killed = False
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line.strip())
            if len(events) == 5 and not killed:
                for pid in _engine_pids(node):
                    os.kill(pid, signal.SIGKILL)
                killed = True
    assert killed
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])
    assert "error" in error, events[-3:]
    failures = state_of(gw).metrics.registry.get_sample_value(
        "gateway_upstream_failures_total", {"backend": "C", "cause": "mid_stream"}
    )
    assert failures == 1.0
    assert b.consecutive_failures == 1
    assert "error event" in b.last_error
    access = [getattr(r, "access", {}) for r in caplog.records if r.name == "kvgateway.access"]
    assert [(a["status"], a["outcome"]) for a in access] == [(200, "mid_stream_node_error")]
