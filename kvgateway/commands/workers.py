"""`gateway serve --workers N`: N worker processes on one port.

Each worker is a whole gateway (`serve` with a hidden ``--worker-index``) listening with
SO_REUSEPORT, so the kernel spreads connections across them. They share reservations
through the Redis ledger (required: N in-process ledgers would each reserve the whole
budget) and their metrics through prometheus-client's multiprocess mode, in a directory
this supervisor creates and removes. SIGTERM / SIGINT / SIGHUP are passed on; a worker
that dies is started again.

Workers die with their supervisor: each asks the kernel for SIGTERM when its parent goes
(``PR_SET_PDEATHSIG``; elsewhere it polls its parent), and drains as on any SIGTERM. Left
running, a killed supervisor's workers would go on serving the port while a new
supervisor's workers took their ledger identities (``host:port/wN``) and wrote their
holdings as zero. For the same reason a new supervisor first waits, bounded, for the
workers of a previous run on its port that are still draining, and removes the metrics
directories that dead runs left behind; a run whose supervisor lives (it holds a lock in
its directory) is left alone; on the same port, a second supervisor is refused (the
port's lock).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal

from prometheus_client import multiprocess

log = logging.getLogger("kvgateway.server")

# A worker that dies is restarted after this, twice as long each time it dies again
# within _STEADY_S of its start, up to _RESTART_BACKOFF_MAX_S.
_RESTART_BACKOFF_S = 1.0
_RESTART_BACKOFF_MAX_S = 60.0
_STEADY_S = 30.0
# In a run's metrics directory: held (flock) by its supervisor while it lives.
_LOCK = "supervisor.lock"
# In TMPDIR, one per port: held by the supervisor that serves the port, from before it
# waits for a previous run's workers until its own have ended.
_PORT_LOCK = "kvgateway-supervisor-{port}.lock"
# <prefix><port>-<supervisor pid>-<mkdtemp's random part, no '-'>
_RUN_PREFIX = "kvgateway-metrics-"
_RUN_DIR = re.compile(rf"{_RUN_PREFIX}(\d+)-(\d+)-[a-z0-9_]+")
# prometheus-client's files: <type>_<pid>.db, gauge_<mode>_<pid>.db
_METRICS_FILE = re.compile(r"[a-z_]+_(\d+)\.db")
# From <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1
# Where the kernel cannot signal a worker, it looks for its parent this often.
PARENT_POLL_S = 1.0
# A previous run's worker ends within its drain delay and grace plus this (the ends of
# requests past the grace, the runner's own close).
DRAIN_MARGIN_S = 5.0


def worker_args(
    args: argparse.Namespace,
    index: int,
    metrics_dir: str,
    *,
    workers: int | None = None,
    supervisor: int | None = None,
) -> list[str]:
    out = ["serve", "--config", args.config, "--log-level", args.log_level]
    if args.host:
        out += ["--host", args.host]
    if args.port is not None:
        out += ["--port", str(args.port)]
    if args.watch:
        out.append("--watch")
    if args.ledger_url:
        out += ["--ledger-url", args.ledger_url]
    if args.drain_delay_s is not None:
        out += ["--drain-delay-s", str(args.drain_delay_s)]
    if workers is not None:
        out += ["--worker-count", str(workers)]
    if supervisor is not None:
        out += ["--supervisor-pid", str(supervisor)]
    return [*out, "--worker-index", str(index), "--metrics-dir", metrics_dir]


def bind_to_supervisor(supervisor: int) -> Literal["kernel", "poll", "orphaned"]:
    """Make this worker end when ``supervisor`` does: "kernel" (SIGTERM will come),
    "poll" (no PR_SET_PDEATHSIG here: the caller must watch ``os.getppid()``), or
    "orphaned" (the supervisor was already gone: nobody will ever signal us)."""
    how: Literal["kernel", "poll"] = "poll"
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
            how = "kernel"
    # Asked after the prctl: a parent that died before it reparented us already.
    return how if os.getppid() == supervisor else "orphaned"


@dataclass(frozen=True, slots=True)
class PreviousRun:
    """A metrics directory some supervisor made: its port, its pid, and the pids of the
    workers that wrote metrics in it."""

    path: Path
    port: int
    supervisor: int
    workers: frozenset[int]


def parse_run_dir(name: str) -> tuple[int, int] | None:
    """(port, supervisor pid) of a metrics directory's name; None: not one of ours."""
    m = _RUN_DIR.fullmatch(name)
    return (int(m[1]), int(m[2])) if m else None


def writer_pids(files: Iterable[str]) -> frozenset[int]:
    return frozenset(int(m[1]) for f in files if (m := _METRICS_FILE.fullmatch(f)))


def previous_runs(tmp: Path) -> list[PreviousRun]:
    runs = []
    for d in tmp.glob(_RUN_PREFIX + "*"):
        parsed = parse_run_dir(d.name)
        if parsed is None or not d.is_dir():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            runs.append(PreviousRun(d, *parsed, writer_pids(os.listdir(d))))
    return runs


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    # A zombie has ended; its parent has not collected it yet.
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _ignore_sighup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _held(lock: Path) -> bool:
    """Is ``lock`` held by a live supervisor? (Its flock goes with its process: a run
    whose supervisor is gone, even killed with -9, holds nothing.)"""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _runs(pid: int, marker: bytes) -> bool:
    """``pid`` is alive and (where /proc tells) its command line holds ``marker``: a pid
    the kernel gave to some other program since is not waited for. An empty command line
    is a process the kernel is still tearing down (its sockets may be open yet)."""
    if not alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return not cmdline or marker in cmdline


def settle_previous_runs(tmp: Path, port: int, wait_s: float) -> None:
    """Wait (at most ``wait_s``) for the workers of earlier runs on ``port`` whose
    supervisor is gone, then remove the metrics directories of runs that have ended.

    Workers still draining hold streams and ledger holdings under the identities ours
    are about to take: started beside them, ours would write those holdings as zero.
    A directory of a run that ended is never read again (each run makes its own); it
    is removed so that kills do not pile them up."""
    me = os.getpid()
    deadline = time.monotonic() + wait_s
    for run in previous_runs(tmp):
        marker = str(run.path).encode()
        if run.supervisor != me and _held(run.path / _LOCK):
            continue  # a live run (on another port: the port's lock is ours)
        if run.supervisor != me and not (run.path / _LOCK).exists() and alive(run.supervisor):
            continue  # being made this instant (the lock comes next), or an older release's
        waiting = {p for p in run.workers - {me} if _runs(p, marker)}
        if waiting and run.port == port:
            log.warning(
                "workers %s of a previous run on port %d are still ending; waiting up to %.0fs",
                sorted(waiting),
                port,
                max(0.0, deadline - time.monotonic()),
            )
            while waiting and time.monotonic() < deadline:
                time.sleep(0.05)
                waiting = {p for p in waiting if _runs(p, marker)}
            if waiting:
                log.error(
                    "workers %s of a previous run on port %d did not end; starting anyway",
                    sorted(waiting),
                    port,
                )
        if not waiting:
            shutil.rmtree(run.path, ignore_errors=True)


def take_port(tmp: Path, port: int) -> bool:
    """Take the port's lock for as long as this process lives (the kernel lets an flock
    go with its holder); False when another live supervisor holds it. Taken before the
    wait for a previous run: two supervisors started together on one port would
    otherwise both wait, then both start workers under the same ledger identities."""
    fd = os.open(tmp / _PORT_LOCK.format(port=port), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    return True


def supervise(args: argparse.Namespace, workers: int, port: int, drain_wait_s: float) -> int:
    """Run ``workers`` workers on ``port`` until told to stop. ``drain_wait_s``: how long
    a worker takes at most to end once told (its drain delay and grace, and a margin);
    a previous run's draining workers on the port are waited for as long, and one of
    ours still running after it at our stop is killed."""
    stopping: list[int] = []
    procs: dict[int, subprocess.Popen[bytes]] = {}

    told: set[int] = set()  # workers sent SIGTERM (once: a second one ends them at exit)

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGHUP:
            stopping.append(signum)
        for p in procs.values():
            if p.poll() is not None:
                continue
            if signum == signal.SIGHUP:
                p.send_signal(signal.SIGHUP)
            elif p.pid not in told:
                told.add(p.pid)
                p.send_signal(signal.SIGTERM)

    # Before anything that takes time: a signal in the first seconds must not kill us
    # with the default action (SIGHUP's is to end the process).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    tmp = Path(tempfile.gettempdir())
    if not take_port(tmp, port):
        # Beside its workers ours would take their ledger identities and write their
        # holdings as zero.
        log.error(
            "gateway: another supervisor runs workers on port %d: stop it first "
            "(theirs and ours would share ledger identities)",
            port,
        )
        return 1
    settle_previous_runs(tmp, port, drain_wait_s)
    me = os.getpid()
    with tempfile.TemporaryDirectory(prefix=f"{_RUN_PREFIX}{port}-{me}-", dir=tmp) as metrics_dir:
        # Held while this run lives: how the next supervisor tells a live run (a pid alone
        # cannot say; a command line depends on how we were started).
        # Held before it shows under its name (renamed into place), so a lock seen there
        # that is not held is a dead run's.
        taking = Path(metrics_dir) / (_LOCK + ".new")
        lock = os.open(taking, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        taking.rename(Path(metrics_dir) / _LOCK)
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}

        def start(i: int) -> subprocess.Popen[bytes]:
            argv = worker_args(args, i, metrics_dir, workers=workers, supervisor=me)
            cmd = [sys.executable, "-m", "kvgateway", *argv]
            # SIGHUP ignored from the start (inherited across exec): one passed on while
            # the worker still imports would end it; it reloads once its loop handles it.
            return subprocess.Popen(  # the supervisor runs no threads
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                preexec_fn=_ignore_sighup,  # noqa: PLW1509
            )

        for i in range(workers):
            if not stopping:
                procs[i] = start(i)
        log.info("gateway: %d workers started (pids %s)", workers, [p.pid for p in procs.values()])
        backoff = {i: _RESTART_BACKOFF_S for i in procs}
        started = {i: time.monotonic() for i in procs}
        # Dead workers and when each starts again: every worker is watched on its own
        # (one waiting out its backoff holds no other up).
        restart_at: dict[int, float] = {}
        while not stopping:
            time.sleep(0.05)
            for i, p in list(procs.items()):
                if stopping:
                    break
                if i in restart_at:
                    if time.monotonic() >= restart_at[i]:
                        del restart_at[i]
                        procs[i] = start(i)
                        started[i] = time.monotonic()
                    continue
                code = p.poll()
                if code is None:
                    continue
                # Removes its gauges (live modes: see server/telemetry.py); its counters
                # and histograms stay in the sums.
                multiprocess.mark_process_dead(p.pid, metrics_dir)  # type: ignore[no-untyped-call]
                # One that keeps dying (an invalid config on disk: a restarted worker
                # reads the file) is retried less and less often, up to a minute apart.
                lived = time.monotonic() - started[i]
                wait = _RESTART_BACKOFF_S if lived > _STEADY_S else backoff[i]
                backoff[i] = min(_RESTART_BACKOFF_MAX_S, wait * 2)
                log.error(
                    "gateway worker %d (pid %d) exited with %d after %.0fs; restarting in %.0fs",
                    i, p.pid, code, lived, wait,
                )  # fmt: skip
                restart_at[i] = time.monotonic() + wait
        # Told to stop: every worker is told, one started after the signal too.
        forward(signal.SIGTERM, None)
        ended = [p for i, p in procs.items() if i not in restart_at]  # the dead were said
        deadline = time.monotonic() + drain_wait_s
        for p in ended:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "gateway worker (pid %d) did not end within %.0fs of the stop; killing it",
                    p.pid,
                    drain_wait_s,
                )
                p.kill()
                p.wait()
        os.close(lock)
    # A worker our SIGTERM ended before it could handle one (still starting) stopped
    # as told.
    told_ok = {p.pid for p in ended if p.returncode == -signal.SIGTERM and p.pid in told}
    return 0 if all(p.returncode == 0 or p.pid in told_ok for p in ended) else 1
