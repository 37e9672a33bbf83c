"""`gateway serve --workers N`: N worker processes on one port.

Each worker is a whole gateway (`serve` with a hidden ``--worker-index``) listening with
SO_REUSEPORT, so the kernel spreads connections across them. They share reservations
through the Redis ledger (required: N in-process ledgers would each reserve the whole
budget) and their metrics through prometheus-client's multiprocess mode, in a directory
this supervisor creates and removes. SIGTERM / SIGINT / SIGHUP are passed on; a worker
that dies is started again.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

from prometheus_client import multiprocess

log = logging.getLogger("kvgateway.server")

# A worker that keeps dying is restarted at most this often.
_RESTART_BACKOFF_S = 1.0


def worker_args(args: argparse.Namespace, index: int, metrics_dir: str) -> list[str]:
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
    return [*out, "--worker-index", str(index), "--metrics-dir", metrics_dir]


def supervise(args: argparse.Namespace, workers: int) -> int:
    stopping: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGHUP:
            stopping.append(signum)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if signum != signal.SIGHUP else signal.SIGHUP)

    with tempfile.TemporaryDirectory(prefix="kvgateway-metrics-") as metrics_dir:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}

        def start(i: int) -> subprocess.Popen[bytes]:
            cmd = [sys.executable, "-m", "kvgateway", *worker_args(args, i, metrics_dir)]
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

        procs = {i: start(i) for i in range(workers)}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        log.info("gateway: %d workers started (pids %s)", workers, [p.pid for p in procs.values()])
        last_restart = 0.0
        while not stopping:
            time.sleep(0.2)
            for i, p in list(procs.items()):
                code = p.poll()
                if code is None or stopping:
                    continue
                multiprocess.mark_process_dead(p.pid, metrics_dir)  # type: ignore[no-untyped-call]
                log.error("gateway worker %d (pid %d) exited with %d; restarting", i, p.pid, code)
                wait = last_restart + _RESTART_BACKOFF_S - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                last_restart = time.monotonic()
                procs[i] = start(i)
        codes = [p.wait() for p in procs.values()]
    return 0 if all(c == 0 for c in codes) else 1
