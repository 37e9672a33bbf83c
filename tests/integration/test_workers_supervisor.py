"""`gateway serve --workers N` whose supervisor is killed with -9: its workers drain and
exit (they must not serve on, orphaned, beside a new supervisor's workers under the same
ledger identities), a new supervisor on the port waits for those still draining, and the
metrics directory the killed one left is removed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvgateway.cli import build_parser
from kvgateway.commands.workers import DRAIN_MARGIN_S, parse_run_dir, worker_args, writer_pids
from tests.support.eventually import eventually
from tests.support.ledger_fleet import (
    chat,
    gateway_config,
    get_json,
    ledger_holds,
    running_node,
)
from tests.support.live import free_ports
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Supervisors:
    """`gateway serve --workers 2` processes on one port, one config, one TMPDIR (where
    their metrics directories go); every process they leave is ended by pid."""

    def __init__(self, work: Path, node: str, redis_url: str, grace_s: float) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = gateway_config(self.port, node, redis_url, 2.0)
        cfg["server"]["shutdown_grace_s"] = grace_s
        self.config = work / "gw.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.tmp = work / "tmp"
        self.tmp.mkdir()
        self.work = work
        self.procs: list[asyncio.subprocess.Process] = []
        self.workers: set[int] = set()

    async def start(self, *extra: str, console: bool = False) -> asyncio.subprocess.Process:
        """``console``: as the `gateway` command starts it (its command line then has no
        "kvgateway" in it), not `python -m kvgateway`."""
        log = self.work / f"sup{len(self.procs)}.log"
        cmd = [str(Path(sys.executable).with_name("gateway"))] if console else [
            sys.executable, "-m", "kvgateway"
        ]  # fmt: skip
        with log.open("wb") as fh:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                *("serve", "--config", str(self.config), *extra),
                "--workers",
                "2",
                stdout=fh,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": str(self.tmp)},
            )
        self.procs.append(proc)
        return proc

    async def ready(self, proc: asyncio.subprocess.Process) -> list[int]:
        """Both workers answer /ready; their pids."""
        ids: set[str] = set()

        async def both_answered() -> bool:
            assert proc.returncode is None, self.log()
            ids.add((await get_json(self.url + "/ready"))["ledger"]["replica_id"])
            return len(ids) == 2

        await eventually(
            both_answered, timeout=40, what="both workers ready", not_yet=(aiohttp.ClientError,)
        )
        pids = _children(proc.pid)
        self.workers |= set(pids)
        return pids

    def runs(self) -> list[str]:
        """The metrics directories in their TMPDIR."""
        return sorted(p.name for p in self.tmp.glob("kvgateway-metrics-*"))

    def log(self) -> str:
        return "".join(p.read_text()[-2000:] for p in sorted(self.work.glob("sup*.log")))

    async def close(self) -> None:
        for p in self.procs:
            self.workers |= set(_children(p.pid))
            if p.returncode is None:
                p.terminate()
                try:
                    await asyncio.wait_for(p.wait(), 15)
                except TimeoutError:
                    p.kill()
                    await p.wait()
        for pid in self.workers:
            # Only a process of these supervisors: a recorded pid may have been reused since
            # (pids wrap at 32768; the suite's other processes, vLLM nodes among them, run).
            with contextlib.suppress(OSError):
                if str(self.config).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def node() -> AsyncIterator[str]:
    async with running_node(time_scale=2) as url:
        yield url


async def _gone(pids: list[int], within_s: float) -> None:
    await eventually(
        lambda: not any(_running(p) for p in pids),
        timeout=within_s,
        what=f"workers {pids} gone with their supervisor",
    )


async def test_workers_drain_and_exit_when_their_supervisor_is_killed(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        sup = await sups.start()
        workers = await sups.ready(sup)
        assert len(workers) == 2
        sup.kill()
        await sup.wait()
        # Their SIGTERM path: no drain delay, 1 s of grace, the runner's close.
        await _gone(workers, within_s=8.0)
        assert _port_free(sups.port)
        assert sups.log().count("gateway stopped") == 2, sups.log()
    finally:
        await sups.close()


async def test_a_new_supervisor_waits_for_the_old_workers_and_clears_their_metrics(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    # The grace outlasts the new supervisor's own start: old workers are still draining
    # streams (holding ledger holdings under host:port/wN) when it is ready to start.
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=4.0)
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        first = await sups.start()
        old = await sups.ready(first)
        (old_dir,) = sups.runs()
        async with aiohttp.ClientSession(timeout=timeout) as s:
            held = [asyncio.create_task(chat(s, sups.url, 1000, 6000)) for _ in range(3)]
            await eventually(
                lambda: ledger_holds(redis_server.url, 3 * 6000),
                timeout=10,
                what="the streams in the ledger",
            )
            first.kill()
            await first.wait()
            # Two started together while the old workers drain: one waits and serves, the
            # other is refused at once (both would start workers under one identity).
            pair = [await sups.start(), await sups.start()]
            done, _ = await asyncio.wait(
                [asyncio.create_task(p.wait()) for p in pair],
                timeout=20,
                return_when=asyncio.FIRST_COMPLETED,
            )
            assert [t.result() for t in done] == [1], sups.log()
            (second,) = [p for p in pair if p.returncode is None]
            assert "another supervisor" in sups.log(), sups.log()

            def started() -> list[int]:
                assert second.returncode is None, sups.log()
                return _children(second.pid)

            new = await eventually(started, timeout=30, interval=0.01, what="new workers")
            # No new worker before every old one has ended: they share identities.
            assert not [p for p in old if _running(p)], "new workers started beside old ones"
            sups.workers |= set(new)
            # The killed run's metrics directory is gone; the new run has its own.
            (new_dir,) = sups.runs()
            assert new_dir != old_dir
            assert parse_run_dir(new_dir) == (sups.port, second.pid)
            # The old streams ended with an answer (not a reset), within the grace.
            assert all(st == 503 for st in await asyncio.gather(*held)), held
    finally:
        await sups.close()
    assert sups.runs() == []  # a clean stop removes its own directory


def test_workers_are_told_their_supervisor_and_their_number() -> None:
    args = build_parser().parse_args(
        ["serve", "--config", "g.yaml", "--ledger-url", "redis://r/0", "--workers", "3"]
    )
    got = build_parser().parse_args(worker_args(args, 1, "/tmp/m", workers=3, supervisor=4242))
    assert (got.worker_index, got.worker_count, got.supervisor_pid) == (1, 3, 4242)
    assert got.workers == 1


def test_metrics_directories_name_their_run_and_files_their_writers() -> None:
    assert parse_run_dir("kvgateway-metrics-8080-123-ab_c9x1z") == (8080, 123)
    assert parse_run_dir("kvgateway-metrics-ab_c9x1z") is None  # an older run's name
    assert parse_run_dir("kvgateway-metrics-8080-123-") is None
    files = ["counter_11.db", "gauge_livemax_12.db", "histogram_11.db", "notes.txt"]
    assert writer_pids(files) == {11, 12}


async def test_a_running_supervisor_is_never_taken_for_a_dead_one(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """Started as `gateway serve` (the console script), a live supervisor is never taken
    for a dead run: its run is marked by a lock it holds. One started on the same port
    refuses to start workers beside its own under the same ledger identities; one on
    another port leaves its metrics directory alone (without it its workers would crash
    in a loop)."""
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        first = await sups.start(console=True)
        workers = await sups.ready(first)
        (run,) = sups.runs()
        same_port = await sups.start()
        assert await asyncio.wait_for(same_port.wait(), 30) == 1
        assert "another supervisor" in sups.log(), sups.log()
        (other_port,) = free_ports(1)
        elsewhere = await sups.start("--port", str(other_port))

        def both_running() -> bool:
            assert elsewhere.returncode is None, sups.log()
            return len(sups.runs()) >= 2

        await eventually(both_running, timeout=40, what="two supervisors' runs")
        await asyncio.sleep(1.0)
        assert run in sups.runs() and all(_running(p) for p in workers), sups.log()
        assert (await get_json(sups.url + "/ready"))["ready"] is True
    finally:
        await sups.close()


async def test_a_stop_during_a_restarts_backoff_ends_every_worker(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """SIGTERM while a crashed worker waits out its restart backoff ends the supervisor
    and every worker: the worker is not started again behind the stop's back (to be
    waited for until a second SIGTERM), so one SIGTERM is enough."""
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        sup = await sups.start()
        workers = await sups.ready(sup)
        os.kill(workers[0], signal.SIGKILL)
        fresh = await eventually(
            lambda: set(_children(sup.pid)) - set(workers),
            timeout=20,
            interval=0.02,
            what="a worker restarted",
        )
        sups.workers |= fresh
        for pid in fresh:  # dies again at once: the next start waits out a backoff
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.4)
        sup.terminate()
        assert await asyncio.wait_for(sup.wait(), 20) is not None
        await _gone([*workers, *fresh], within_s=5.0)
        assert not _children(sup.pid)
    finally:
        await sups.close()


def test_a_run_directory_is_removed_only_once_its_supervisor_is_gone(tmp_path: Path) -> None:
    """A directory made this instant has no lock yet, so another supervisor sharing
    TMPDIR judges it by the pid its name gives: it is left while that supervisor lives
    (removed, its workers would have no metrics directory) and removed once it is gone."""
    from kvgateway.commands.workers import settle_previous_runs

    live = subprocess.Popen(["sleep", "30"])
    try:
        young = tmp_path / f"kvgateway-metrics-9001-{live.pid}-abc"
        young.mkdir()
        settle_previous_runs(tmp_path, 9002, wait_s=0.0)
        assert young.exists()
        live.kill()
        live.wait()
        settle_previous_runs(tmp_path, 9002, wait_s=0.0)
        assert not young.exists()
    finally:
        live.kill()
        live.wait()


async def test_a_worker_restarted_after_the_file_changed_serves_where_the_others_do(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """The file's port changed and was reloaded (a port change waits for a restart);
    then a worker dies: its replacement listens on the port its siblings serve, not on
    the file's new one."""
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        sup = await sups.start()
        workers = await sups.ready(sup)
        (new_port,) = free_ports(1)
        cfg = yaml.safe_load(sups.config.read_text())
        cfg["server"]["port"] = new_port
        sups.config.write_text(yaml.safe_dump(cfg))
        os.kill(sup.pid, signal.SIGHUP)
        await asyncio.sleep(1.0)
        os.kill(workers[0], signal.SIGKILL)
        fresh = await eventually(
            lambda: set(_children(sup.pid)) - set(workers), timeout=20, what="a restart"
        )
        sups.workers |= fresh
        await eventually(lambda: _serves(sups.port, 2), timeout=20, what="two listeners")
        assert _port_free(new_port)
    finally:
        await sups.close()


def _serves(port: int, listeners: int) -> bool:
    """``port`` has ``listeners`` sockets listening on it (SO_REUSEPORT workers)."""
    hexport = f":{port:04X} "
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if hexport in line and line.split()[3] == "0A") == listeners


async def test_one_workers_backoff_holds_no_other_worker_up(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """Worker 0 has died four times in a row (its next start 8 s away); worker 1 dies
    once: it is started again after its own 1 s, not after worker 0's wait."""
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        sup = await sups.start()
        workers = await sups.ready(sup)
        known, current = set(workers), workers[0]
        for _ in range(3):  # worker 0's backoff: 1, 2, 4 s, so 8 s next
            os.kill(current, signal.SIGKILL)
            (current,) = await eventually(
                lambda: set(_children(sup.pid)) - known, timeout=30, what="worker 0 back"
            )
            known.add(current)
            sups.workers.add(current)
        os.kill(current, signal.SIGKILL)
        await asyncio.sleep(0.5)
        os.kill(workers[1], signal.SIGKILL)
        started = asyncio.get_running_loop().time()
        fresh = await eventually(
            lambda: set(_children(sup.pid)) - known, timeout=30, what="worker 1 back"
        )
        sups.workers |= fresh
        assert asyncio.get_running_loop().time() - started < 3.0, sups.log()
    finally:
        await sups.close()


async def test_a_plain_stop_soon_after_the_start_exits_zero(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """SIGTERM while the workers still start (before they handle one themselves) is a
    clean stop: the supervisor exits 0, as service managers expect."""
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        sup = await sups.start()
        await eventually(lambda: len(_children(sup.pid)) == 2, timeout=20, interval=0.02)
        await asyncio.sleep(0.3)
        sup.terminate()
        assert await asyncio.wait_for(sup.wait(), 30) == 0, sups.log()[-1500:]
    finally:
        await sups.close()


async def test_a_worker_that_never_ends_is_killed_after_the_drain_bound(
    tmp_path: Path, node: str, redis_server: RedisServer
) -> None:
    """A worker that does not end once told (stopped here) is killed when the drain delay,
    the grace and the margin have passed: the supervisor's stop is bounded, and it exits
    1 (a worker did not stop as told)."""
    sups = Supervisors(tmp_path, node, redis_server.url, grace_s=1.0)
    try:
        sup = await sups.start()
        workers = await sups.ready(sup)
        os.kill(workers[0], signal.SIGSTOP)
        sup.terminate()
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(sup.wait(), 30) == 1, sups.log()[-1500:]
        took = asyncio.get_running_loop().time() - started
        assert 1.0 + DRAIN_MARGIN_S - 0.5 < took < 1.0 + DRAIN_MARGIN_S + 5, took
        assert "did not end" in sups.log(), sups.log()
        await _gone(workers, within_s=5.0)
    finally:
        await sups.close()
