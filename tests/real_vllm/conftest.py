"""The real-vLLM tier: every test here runs against vLLM's own engine (CPU build)."""

from __future__ import annotations

import pytest

from tests.support.real_fleet import (
    apart_node,
    hybrid_node,
    launcher,
    qwen_fleet,
    real_gateway,
    vocab_nodes,
)

__all__ = ["apart_node", "hybrid_node", "launcher", "qwen_fleet", "real_gateway", "vocab_nodes"]

# A module's first test also starts its nodes (one to two minutes on 2 cores).
NODE_START_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(pytest.mark.timeout(NODE_START_TIMEOUT_S))
    # A test that kills its node's engine runs after every other user of that node.
    items.sort(key=lambda item: item.get_closest_marker("kills_node") is not None)
