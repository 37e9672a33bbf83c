"""A live gateway for the deploy tests: a simulated node and `gateway serve` as real
processes on free loopback ports, both started from one YAML (as compose does)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "deploy-test-key"
MODEL = "llama-3.1-8b"
START_DEADLINE_S = 30.0


@dataclass(frozen=True)
class LiveGateway:
    url: str
    node_url: str
    api_key: str
    workdir: Path


def free_ports(n: int) -> list[int]:
    """n distinct ports that were free a moment ago (held open together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_get(url: str, *, key: str | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until_ok(url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args!s} exited with {p.returncode}\n{_tails(logs)}")
        try:
            status, body = http_get(url, timeout=1.0)
            if status == 200:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise AssertionError(f"{url} not OK after {START_DEADLINE_S}s ({last})\n{_tails(logs)}")


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _config(gw_port: int, node_port: int, server_extra: str = "", admission: str = "") -> str:
    return f"""
server:
  host: 127.0.0.1
  port: {gw_port}
  api_keys: [{API_KEY}]
  shutdown_grace_s: 2{server_extra}
admission: {{{admission}}}
models:
  - name: {MODEL}
    served_name: meta-llama/Llama-3.1-8B-Instruct
    tokenizer: {{encoding: cl100k_base}}
health: {{interval_s: 0.5}}
load_feedback: {{interval_s: 0.5}}
tiers:
  - name: small
    backends:
      - name: sim-1
        url: http://127.0.0.1:{node_port}
        model: {MODEL}
        max_num_seqs: 16
        simulate: {{profile: gpu24-8b}}
"""


@contextlib.contextmanager
def running_gateway(
    work: Path, *, server_extra: str = "", admission: str = ""
) -> Iterator[tuple[LiveGateway, subprocess.Popen[bytes]]]:
    """A simulated node and `gateway serve` as processes; yields the gateway and its
    process (its log is ``work/gateway.log``)."""
    gw_port, node_port = free_ports(2)
    config = work / "gateway.yaml"
    config.write_text(_config(gw_port, node_port, server_extra, admission))
    url, node_url = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{node_port}"
    commands = {
        "fleet": ["simulate", "--config", str(config)],
        "gateway": ["serve", "--config", str(config), "--port", str(gw_port)],
    }
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for name, args in commands.items():
            log = work / f"{name}.log"
            logs.append(log)
            with log.open("wb") as fh:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "kvgateway", *args],
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
            if name == "fleet":
                wait_until_ok(node_url + "/health", procs, logs)
        wait_until_ok(url + "/ready", procs, logs)
        yield LiveGateway(url=url, node_url=node_url, api_key=API_KEY, workdir=work), procs[1]
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with running_gateway(tmp_path_factory.mktemp("live")) as (gw, _):
        _traffic(gw.url)
        yield gw


def _traffic(url: str) -> None:
    """One served request and one refused one, so labelled series exist on /metrics."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
    ).encode()
    for key, expected in ((API_KEY, 200), ("wrong-key", 401)):
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                status = resp.status
                resp.read()
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == expected, f"chat completion with {key!r}: HTTP {status}"
