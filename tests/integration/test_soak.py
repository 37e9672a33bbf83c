"""The soak from bench/soak.py, sized for the suite: 4,000 requests, random client
disconnects, a node restart every 200 requests; nothing may leak or go unexplained."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

from bench.soak import EXPECTED, soak


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.timeout(240)
# Nodes killed under load leave a few accepted sockets for the garbage collector to close
# (aiohttp's server teardown); the fd count below checks nothing really stays open.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_soak_leaves_nothing_reserved_and_explains_every_failure():
    before = open_fds()
    report = await soak(requests=4_000, concurrency=96, restart_every=200, disconnect_p=0.1)
    gc.collect()
    await asyncio.sleep(0.1)
    assert open_fds() - before < 20
    print(report.summary())
    assert report.requests == 4_000
    assert report.restarts == 20
    assert report.leaks == {}
    assert report.node_blocks == {}
    assert report.unexpected == {}
    assert set(report.outcomes) <= set(EXPECTED)
    assert report.outcomes["200"] > 3_000
    assert report.outcomes["disconnected"] > 200
    # Every request that reached the gateway got exactly one status; only these.
    assert set(report.gateway_statuses) <= {"200", "429", "499", "502", "503"}
    assert sum(report.gateway_statuses.values()) <= report.requests
    assert report.gateway_statuses["200"] >= report.outcomes["200"]
    # Restarts made the gateway retry elsewhere rather than fail requests.
    assert report.retries > 0
