"""Fixtures shared across the suite live in ``tests/support``; pytest finds them here.

Every test under ``tests/integration`` (a fleet, processes, real Redis or DNS) is in the
slow tier: ``make check`` runs the rest."""

import pytest

from tests.support.capacity_data import data_dir
from tests.support.fleet import start_fleet
from tests.support.live import live_gateway
from tests.support.redis_server import redis_server
from tests.support.sim import encodings, sim
from tests.support.vocab import vocab_dirs

__all__ = [
    "data_dir",
    "encodings",
    "live_gateway",
    "redis_server",
    "sim",
    "start_fleet",
    "vocab_dirs",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/integration/" in str(item.path):
            item.add_marker(pytest.mark.slow)
