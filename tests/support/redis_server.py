"""A real Redis on loopback for the shared-ledger tests: Debian's ``redis-server`` on a
free port, no persistence, stoppable and restartable on the same port (to test the
gateway's fallback and its return to the shared ledger)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.live import free_ports
from tests.support.tools import require_tool


class RedisServer:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        (self.port,) = free_ports(1)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def command(self, *args: str) -> bytes:
        """One command through redis-cli's wire format, for assertions from test code."""
        parts = [f"*{len(args)}\r\n".encode()]
        for a in args:
            raw = a.encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
        with socket.create_connection(("127.0.0.1", self.port), 2.0) as s:
            s.sendall(b"".join(parts))
            return s.recv(65536)


@contextlib.contextmanager
def run_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(require_tool("redis-server"), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with run_redis(tmp_path) as server:
        yield server
