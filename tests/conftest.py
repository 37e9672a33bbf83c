"""Fixtures shared across the suite live in ``tests/support``; pytest finds them here."""

from tests.support.capacity_data import data_dir
from tests.support.fleet import start_fleet
from tests.support.live import live_gateway
from tests.support.sim import encodings, sim
from tests.support.vocab import vocab_dirs

__all__ = ["data_dir", "encodings", "live_gateway", "sim", "start_fleet", "vocab_dirs"]
