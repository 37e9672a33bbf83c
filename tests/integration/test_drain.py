"""SIGTERM drain against a real `gateway serve` process: while
/ready fails requests are still served; then idle keep-alive connections close at once,
new connections are refused, and the stream in flight finishes."""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest

from tests.support.live import MODEL, running_gateway

OPEN: list[socket.socket] = []


def _request(port: int, raw: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    OPEN.append(s)
    s.sendall(raw)
    return s


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(rest) < length:
        rest += s.recv(65536)
    return head


def test_sigterm_drains_in_order(tmp_path) -> None:
    try:
        _drain(tmp_path)
    finally:
        while OPEN:
            OPEN.pop().close()


def _drain(tmp_path) -> None:
    extra = "\n  drain_delay_s: 0.6"
    with running_gateway(tmp_path, server_extra=extra) as (gw, proc):
        port = int(gw.url.rsplit(":", 1)[1])
        auth = f"Authorization: Bearer {gw.api_key}\r\n".encode()
        idle = _request(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 200 " in _read_response(idle)
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 60,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "drain probe"}],
            }
        ).encode()
        stream = _request(
            port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + auth
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body,
        )
        first = stream.recv(65536)
        assert b" 200 " in first
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        # Signals during the drain (systemd's SIGTERM to the group beside a supervisor's,
        # a second Ctrl-C, a reload) are ignored: ending the process at once, they would
        # cut the stream the grace period is for.
        for again in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            proc.send_signal(again)
        time.sleep(0.1)
        # drain_delay: /ready fails, requests are still served.
        ready = _request(port, b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b" 503 " in _read_response(ready)
        chat = json.dumps(
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        during = _request(
            port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + auth
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(chat)
            + chat,
        )
        assert b" 200 " in _read_response(during)
        # After the delay: the idle keep-alive connection is closed at once, new ones refused.
        idle.settimeout(3)
        assert idle.recv(1) == b""
        time.sleep(0.2)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        # The stream in flight ends properly.
        stream.settimeout(20)
        rest = first
        while not rest.endswith(b"0\r\n\r\n") and b"data: [DONE]" not in rest:
            chunk = stream.recv(65536)
            if not chunk:
                break
            rest += chunk
        assert b"data: [DONE]" in rest and b"shutting_down" not in rest
        assert proc.wait(timeout=20) == 0


def test_sigterm_after_a_reload_drains_with_the_reloaded_settings(tmp_path) -> None:
    """The drain after a reload waits shutdown_grace_s and drain_delay_s as reloaded,
    not as the gateway started with."""
    with running_gateway(tmp_path) as (_, proc):  # shutdown_grace_s: 2
        config = tmp_path / "gateway.yaml"
        config.write_text(
            config.read_text().replace(
                "shutdown_grace_s: 2", "shutdown_grace_s: 0.5\n  drain_delay_s: 0.2"
            )
        )
        log = tmp_path / "gateway.log"
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reloaded" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "reloaded" in log.read_text(), log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        text = log.read_text()
        assert "/ready fails for 0.2s first" in text
        assert "waiting up to 0.5s" in text and "waiting up to 2s" not in text
