"""Processes under measurement: start, wait for, and read CPU time and memory from /proc.

CPU is ``utime + stime`` of every process in a tree (a process's own figure already
sums its threads); children that already exited are not counted, so measure trees whose
processes live for the whole window (nginx workers, the router's threads do).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int = 65_536) -> int:
    """Raise this process's open-file limit (children inherit it); root may raise the
    hard limit too. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, want)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(hard, target)))
        return target
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [
                    int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                ]
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    seen = [pid]
    i = 0
    while i < len(seen):
        seen.extend(c for c in children(seen[i]) if c not in seen)
        i += 1
    return seen


def cpu_times(pids: Sequence[int]) -> tuple[float, float]:
    """(utime, stime) summed over the given processes (threads included), in seconds."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            user += int(fields[11])
            system += int(fields[12])
    return user / CLK_TCK, system / CLK_TCK


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of each given process (threads included), in seconds."""
    return sum(cpu_times(pids))


def rss_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    return total


def wait_port(
    port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:g}s")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    port: int

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        return tree(self.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pids())

    def rss(self) -> int:
        return rss_bytes(self.pids())

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start(
    name: str,
    argv: Sequence[str],
    port: int,
    *,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Proc:
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    popen = subprocess.Popen(
        list(argv),
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    proc = Proc(name, popen, port)
    try:
        wait_port(port, popen, timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


def fake_upstream_cmd(port: int, *extra: str) -> list[str]:
    """The fake vLLM upstream (bench/fake_upstream.py) on ``port``, with extra flags."""
    return [PYTHON, "-m", "bench.fake_upstream", "--port", str(port), *extra]


def gateway_cmd(config: Path) -> list[str]:
    """`gateway serve` on ``config``, quiet but for warnings (every part runs it this way)."""
    return [PYTHON, "-m", "kvgateway", "serve", "--config", str(config), "--log-level", "WARNING"]


@contextlib.contextmanager
def running(name: str, argv: Sequence[str], port: int, **kw: object) -> Iterator[Proc]:
    proc = start(name, argv, port, **kw)  # type: ignore[arg-type]
    try:
        yield proc
    finally:
        proc.stop()
