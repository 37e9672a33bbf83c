from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parents[1] / "unit" / "capacity" / "data"


@pytest.fixture
def data_dir() -> Path:
    return DATA


def read_data(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")
