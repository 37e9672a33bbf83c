"""A real DNS server on loopback for discovery tests: dnsmasq answering from a hosts file.

``set_addresses`` rewrites the file and sends SIGHUP; dnsmasq re-reads it and (its
local TTL being 0) the next lookup sees the change.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.live import free_ports
from tests.support.tools import require_tool

# Names under this domain are answered from the hosts file only (NXDOMAIN otherwise).
DOMAIN = "kvgw.test"


@dataclass
class Dnsmasq:
    port: int
    hosts: Path
    proc: subprocess.Popen[bytes]

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_addresses(self, records: Mapping[str, Sequence[str]]) -> None:
        lines = [f"{addr} {name}" for name, addrs in records.items() for addr in addrs]
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(self.hosts)
        self.proc.send_signal(signal.SIGHUP)


@contextlib.contextmanager
def run_dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    binary = require_tool("dnsmasq")
    hosts = tmp_path / "hosts"
    hosts.write_text("", encoding="utf-8")
    (port,) = free_ports(1)
    user = (
        os.environ.get("USER")
        or subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    )
    log = (tmp_path / "dnsmasq.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={hosts}",
            f"--local=/{DOMAIN}/",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--port={port}",
            "--pid-file=",
            f"--user={user}",
            "--log-facility=-",
            "--log-queries",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_listening(port, proc)
        yield Dnsmasq(port=port, hosts=hosts, proc=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dnsmasq exited with {proc.returncode} (port {port} taken?)")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError("dnsmasq did not start listening within 10 s")
