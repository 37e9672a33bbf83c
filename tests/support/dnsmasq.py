"""A real DNS server on loopback for discovery tests: dnsmasq answering from a hosts file
(A/AAAA) and from ``--srv-host`` options (SRV).

``set_addresses`` rewrites the hosts file and sends SIGHUP; dnsmasq re-reads it and (its
local TTL being 0) the next lookup sees the change. dnsmasq does not re-read SRV options
on SIGHUP, so ``set_srv`` restarts it on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tests.support.live import free_ports
from tests.support.tools import require_tool

# Names under this domain are answered locally only (NXDOMAIN otherwise).
DOMAIN = "kvgw.test"


class Dnsmasq:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.hosts = workdir / "hosts"
        self.hosts.write_text("", encoding="utf-8")
        self.log_path = workdir / "dnsmasq.log"
        (self.port,) = free_ports(1)
        self.srv: Mapping[str, Sequence[tuple[str, int]]] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_addresses(self, records: Mapping[str, Sequence[str]]) -> None:
        lines = [f"{addr} {name}" for name, addrs in records.items() for addr in addrs]
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(self.hosts)
        assert self.proc is not None
        # SIGHUP is asynchronous: wait for the "read <hosts>" line it logs once reloaded,
        # so a lookup right after this call sees the new records.
        before = self._reads()
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while self._reads() == before:
            assert time.monotonic() < deadline, "dnsmasq did not reload its hosts file"
            time.sleep(0.01)

    def _reads(self) -> int:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return text.count(f"read {self.hosts}")

    def set_srv(self, records: Mapping[str, Sequence[tuple[str, int]]]) -> None:
        """SRV records: name -> (target, port) pairs."""
        self.srv = records
        self.stop()
        self.start()

    def start(self) -> None:
        user = (
            os.environ.get("USER")
            or subprocess.run(
                ["id", "-un"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
        srv = [f"--srv-host={n},{t},{p}" for n, pairs in self.srv.items() for t, p in pairs]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--keep-in-foreground",
                    "--conf-file=/dev/null",
                    "--no-resolv",
                    "--no-hosts",
                    f"--addn-hosts={self.hosts}",
                    f"--local=/{DOMAIN}/",
                    "--listen-address=127.0.0.1",
                    "--bind-interfaces",
                    f"--port={self.port}",
                    "--pid-file=",
                    f"--user={user}",
                    "--log-facility=-",
                    "--log-queries",
                    *srv,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        _wait_listening(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def run_dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(require_tool("dnsmasq"), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dnsmasq exited with {proc.returncode} (port {port} taken?)")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError("dnsmasq did not start listening within 10 s")
