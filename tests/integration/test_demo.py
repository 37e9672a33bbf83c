"""`gateway demo --port-offset N` runs beside another demo; a port clash says how."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.support.live import http_get, stop, wait_until_ok

NODE_PORTS = (9101, 9102, 9103, 9201, 9202, 9301)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_offset() -> int:
    """An offset that puts the demo's gateway and nodes on ports free right now."""
    for _ in range(200):
        # Below Linux's ephemeral range (32768-60999): a port the check found free there
        # can be taken by another test's outgoing connection before the demo binds it.
        offset = random.randrange(10000, 23000, 7)
        if all(_free(p + offset) for p in (8080, *NODE_PORTS)):
            return offset
    raise AssertionError("no free offset found")


@contextlib.contextmanager
def demo(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path / f"demo{len(list(tmp_path.iterdir()))}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgateway", "demo", *args], stdout=out, stderr=out
        )
    try:
        yield proc
    finally:
        stop([proc])


def test_demo_moves_its_nodes_and_gateway_by_the_offset(tmp_path: Path) -> None:
    offset = free_offset()
    url = f"http://127.0.0.1:{8080 + offset}"
    with demo(tmp_path, "--port-offset", str(offset)) as proc:
        wait_until_ok(f"{url}/ready", [proc], list(tmp_path.glob("*.log")))
        for port in NODE_PORTS:
            status, _ = http_get(f"http://127.0.0.1:{port + offset}/health")
            assert status == 200, port
        body = json.dumps(
            {
                "model": "llama-3.1-8b",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
        ).encode()
        req = urllib.request.Request(
            f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["choices"][0]["message"]["content"]
        _, backends = http_get(f"{url}/admin/backends")
        urls = {b["url"] for b in json.loads(backends)["backends"]}
        assert urls == {f"http://127.0.0.1:{p + offset}" for p in NODE_PORTS}


def test_a_port_clash_names_the_flag_that_avoids_it(tmp_path: Path) -> None:
    offset = free_offset()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 9201 + offset))
        taken.listen()
        res = subprocess.run(
            [sys.executable, "-m", "kvgateway", "demo", "--port-offset", str(offset)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert res.returncode == 1
    assert f"gateway demo --port-offset {offset + 1000}" in res.stderr, res.stderr
