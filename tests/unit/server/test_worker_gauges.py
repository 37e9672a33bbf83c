"""With `serve --workers`, each worker's view of a backend's health reaches /metrics as
the lowest of the workers' (never the view of whichever worker answers the scrape), and
their reservations as the sum: two processes write their gauges, a third reads them as
/metrics does (prometheus-client multiprocess mode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

_WORKER = """
import sys
from prometheus_client import CollectorRegistry
from kvgateway.server.worker_gauges import WorkerGauges
from tests.support.backends import backend

healthy, paused, reserved = sys.argv[1] == "1", sys.argv[2] == "1", int(sys.argv[3])
b = backend("n0", healthy=healthy)
b.reserved_tokens = reserved
if paused:
    b.paused = True
WorkerGauges(CollectorRegistry()).publish([b], None, [], now=0.0)
"""


def _worker(tmp: Path, healthy: bool, paused: bool, reserved: int) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp)}
    args = [str(int(healthy)), str(int(paused)), str(reserved)]
    subprocess.run([sys.executable, "-c", _WORKER, *args], env=env, check=True, timeout=60)


def _scrape(tmp: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp))
    return {
        s.name: s.value
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("backend") == "n0"
    }


def test_a_backend_is_healthy_in_the_metrics_only_while_every_worker_finds_it_so(
    tmp_path: Path,
) -> None:
    _worker(tmp_path, healthy=True, paused=False, reserved=300)
    _worker(tmp_path, healthy=False, paused=False, reserved=200)
    got = _scrape(tmp_path)
    assert got["gateway_backend_healthy"] == 0.0
    assert got["gateway_backend_accepting"] == 0.0
    assert got["gateway_backend_reserved_tokens"] == 500.0


def test_a_backend_one_worker_paused_is_not_accepting(tmp_path: Path) -> None:
    _worker(tmp_path, healthy=True, paused=False, reserved=0)
    _worker(tmp_path, healthy=True, paused=True, reserved=0)
    got = _scrape(tmp_path)
    assert got["gateway_backend_healthy"] == 1.0
    assert got["gateway_backend_accepting"] == 0.0
