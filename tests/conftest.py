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


# The parallel tier ends when its last worker does: its longest parts go out first (the
# vLLM oracle's module, one worker's minute; the modules that load and prove real
# vocabularies; the soak), so no worker is left with one of them at the end.
FIRST = (
    "/tests/unit/tokens/test_vs_transformers5.py",
    "/tests/integration/test_soak.py",
    "/tests/unit/tokens/",
    "/tests/unit/simulator/test_sim_tokenizer.py",
    "/tests/integration/test_counting_modes.py",
)


def _order(item: pytest.Item) -> int:
    path = str(item.path)
    return next((i for i, part in enumerate(FIRST) if part in path), len(FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/integration/" in str(item.path):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order)  # stable: the rest keep their order
