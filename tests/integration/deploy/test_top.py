"""`gateway top`: the pure renderer on admin JSON, and the I/O loop against a loopback
admin API (auth, errors, live redraw with preemption deltas)."""

from __future__ import annotations

import asyncio
import copy
import socket
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvgateway.cli import build_parser
from kvgateway.commands.top import CLEAR, backend_state, render, run
from tests.support.eventually import eventually


def _backend(name: str, tier: str, **over: Any) -> dict[str, Any]:
    """One entry shaped like GET /admin/backends."""
    b: dict[str, Any] = {
        "name": name,
        "tier": tier,
        "url": "http://127.0.0.1:9101",
        "models": ["llama-3.1-8b"],
        "offload": False,
        "healthy": True,
        "accepting": True,
        "pause_reason": "",
        "draining": False,
        "max_model_len": 8192,
        "kv_cache_tokens": 30000,
        "budget_tokens": 28500,
        "max_num_seqs": 16,
        "reserved_tokens": 12000,
        "in_flight": 3,
        "limits": {"max_model_len": {"value": 8192, "source": "discovered"}},
        "load": {"kv_usage": 0.41, "waiting": 0, "running": 3, "preemptions": 2, "age_s": 0.8},
        "recent_rejections": 1,
    }
    b.update(over)
    return b


STATE: dict[str, Any] = {
    "backends": [
        _backend("small-1", "small"),
        _backend(
            "large-1",
            "large",
            accepting=False,
            pause_reason="preempting",
            budget_tokens=380000,
            reserved_tokens=0,
            in_flight=0,
            max_num_seqs=256,
            load={"kv_usage": 0.97, "waiting": 4, "running": 9, "preemptions": 12, "age_s": 1},
            recent_rejections=0,
        ),
        _backend("offload-1", "offload", offload=True, healthy=False, accepting=False, load=None),
    ],
    "queue_depth": 3,
    "policy": "kv_aware",
}


def _line(frame: str, name: str) -> str:
    (line,) = [ln for ln in frame.splitlines() if ln.startswith(name + " ")]
    return line


def test_render_one_line_per_backend() -> None:
    frame = render(STATE, url="http://gw:8080")
    header = frame.splitlines()[0]
    assert "http://gw:8080" in header and "policy kv_aware" in header and "queue 3" in header
    assert "accepting 1/3" in header
    small = _line(frame, "small-1")
    assert small.split()[:3] == ["small-1", "small", "ok"]
    assert "[########............]  42% 12.0k/28.5k" in small  # 12000 / 28500 reserved
    assert "41%" in small and "3/16" in small
    large = _line(frame, "large-1")
    assert "paused:preempting" in large and "97%" in large and large.endswith("12")
    assert "0/380k" in large
    offload = _line(frame, "offload-1")
    assert offload.split()[2] == "down" and offload.endswith(" -")  # no load scraped


def test_render_unknown_budget() -> None:
    state = {"backends": [_backend("new-1", "small", budget_tokens=0, reserved_tokens=0)]}
    assert "[????????????????????]    - 0/0" in _line(render(state), "new-1")


def test_render_tier_totals() -> None:
    frame = render(STATE)
    tiers = [ln for ln in frame.splitlines() if ln.startswith("tier ")]
    assert [t.split()[1] for t in tiers] == ["small", "large", "offload"]
    assert "1/1 accepting" in tiers[0]
    assert tiers[2].endswith("0/1 accepting offload")


def test_render_shows_new_preemptions_since_last_frame() -> None:
    before = copy.deepcopy(STATE)
    before["backends"][1]["load"]["preemptions"] = 9
    frame = render(STATE, previous=before)
    assert _line(frame, "large-1").endswith("12 (+3)")
    assert _line(frame, "small-1").endswith("2")  # unchanged: no delta


def test_render_truncates_to_width() -> None:
    assert max(len(ln) for ln in render(STATE, width=60).splitlines()) <= 60


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"backends": "nope", "queue_depth": "x"},
        {"backends": [None, 3, {"name": 5, "load": [], "budget_tokens": True}]},
        {"backends": [{"name": "n", "reserved_tokens": 10, "budget_tokens": 0}]},
    ],
)
def test_render_survives_malformed_state(state: dict[str, Any]) -> None:
    frame = render(state)
    assert frame.startswith("gateway ")


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({}, "ok"),
        ({"healthy": False}, "down"),
        ({"draining": True, "accepting": False}, "draining"),
        ({"accepting": False, "pause_reason": "kv_full"}, "paused:kv_full"),
        ({"accepting": False}, "held"),
    ],
)
def test_backend_state(over: dict[str, Any], expected: str) -> None:
    assert backend_state(_backend("b", "t", **over)) == expected


def test_cli_registration() -> None:
    args = build_parser().parse_args(["top", "--once", "--url", "http://x:1", "--api-key", "k"])
    assert args.command == "top" and args.once and args.api_key == "k"
    assert callable(args.func)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["top", "--interval", "0"])


# --- the I/O loop against a loopback admin API ---------------------------------------------


class FakeAdmin:
    def __init__(self, key: str | None = None) -> None:
        self.key = key
        self.state = copy.deepcopy(STATE)
        self.polls = 0

    async def handle(self, request: web.Request) -> web.Response:
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        self.polls += 1
        return web.json_response(self.state)


async def _serve(admin: FakeAdmin, body: str | None = None) -> TestServer:
    app = web.Application()
    if body is None:
        app.router.add_get("/admin/backends", admin.handle)
    else:

        async def fixed(_: web.Request) -> web.Response:
            return web.Response(text=body)

        app.router.add_get("/admin/backends", fixed)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def test_once_prints_one_plain_frame(capsys: pytest.CaptureFixture[str]) -> None:
    admin = FakeAdmin(key="s3cret")
    server = await _serve(admin)
    url = _url(server)
    try:
        rc = await run(url, interval=1, once=True, api_key="s3cret", poll_timeout_s=5)
    finally:
        await server.close()
    out = capsys.readouterr().out
    assert rc == 0 and admin.polls == 1
    assert "\x1b" not in out
    assert out == render(STATE, url=url, width=10_000)


async def test_once_without_key_explains(capsys: pytest.CaptureFixture[str]) -> None:
    server = await _serve(FakeAdmin(key="s3cret"))
    try:
        rc = await run(_url(server), interval=1, once=True, api_key=None, poll_timeout_s=5)
    finally:
        await server.close()
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    assert "HTTP 401" in captured.err and "--api-key" in captured.err


async def test_once_rejects_non_json(capsys: pytest.CaptureFixture[str]) -> None:
    server = await _serve(FakeAdmin(), body="<html>proxy error</html>")
    try:
        rc = await run(_url(server), interval=1, once=True, api_key=None, poll_timeout_s=5)
    finally:
        await server.close()
    assert rc == 1 and "not JSON" in capsys.readouterr().err


async def test_once_unreachable_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = await asyncio.wait_for(
        run(f"http://127.0.0.1:{port}", interval=1, once=True, api_key=None, poll_timeout_s=2),
        timeout=10,
    )
    assert rc == 1 and f"127.0.0.1:{port}/admin/backends" in capsys.readouterr().err


async def test_live_loop_redraws_and_shows_preemption_deltas(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the frame is cut to the terminal's width
    admin = FakeAdmin()
    server = await _serve(admin)
    task = asyncio.create_task(
        run(_url(server), interval=0.05, once=False, api_key=None, poll_timeout_s=2),
        name="top-under-test",
    )
    try:
        await eventually(lambda: admin.polls >= 1, timeout=10, interval=0.01)
        admin.state["backends"][1]["load"]["preemptions"] = 20
        await eventually(lambda: admin.polls >= 3, timeout=10, interval=0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await server.close()
    frames = capsys.readouterr().out.split(CLEAR)[1:]
    assert len(frames) >= 2
    assert any("20 (+8)" in f for f in frames)
    assert all("refresh 0.05s" in f for f in frames)


def test_render_usage_by_tenant() -> None:
    tenants = [
        {
            "name": "chat-app",
            "class": "interactive",
            "kv_tokens": 20500,
            "in_flight": 7,
            "requests_last_minute": 1234,
            "prompt_tokens_last_minute": 250_000,
            "output_tokens_last_minute": 4200,
        },
        {"name": "etl", "class": "batch", "kv_tokens": 0, "in_flight": 0},
    ]
    frame = render({**STATE, "tenants": tenants}, width=200)
    app = _line(frame, "chat-app")
    # The fleet budget in STATE is 28.5k + 380k + 0: 20.5k of it is 5%.
    assert app.split()[:2] == ["chat-app", "interactive"] and "   5% 20.5k" in app
    assert app.split()[-4:] == ["7", "1.2k", "250k", "4.2k"]
    assert _line(frame, "etl").split()[-4:] == ["0", "-", "-", "-"]
    assert "TENANT" in frame and "TENANT" not in render(STATE)
