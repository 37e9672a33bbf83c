"""`gateway serve` as its own process, as a user runs it: a YAML file, a free port, its
log kept beside the file, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.support.live import free_ports

START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def serve_process(
    config: dict[str, Any], work: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The gateway serving ``config`` (its ``server`` section gets the host and a free
    port); yields its URL once /ready answers, and its process."""
    (port,) = free_ports(1)
    config = {**config, "server": {**config.get("server", {}), "host": "127.0.0.1", "port": port}}
    work.mkdir(parents=True, exist_ok=True)
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (work / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgateway", "serve", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/ready", timeout=1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"gateway did not start:\n{(work / 'gateway.log').read_text()}")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
