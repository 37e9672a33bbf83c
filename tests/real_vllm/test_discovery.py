"""The gateway knows a real node's limits exactly as the node states them at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.real_vllm.logs import (
    logged_blocks,
    logged_group_block_sizes,
    logged_kv_tokens,
    logged_max_model_len,
)
from tests.support.eventually import eventually
from tests.support.real_fleet import StartGateway, gateway_config, state_of
from tests.support.vllm_nodes import CPU_BLOCK, RealNode

pytestmark = pytest.mark.real_vllm


@pytest.mark.parametrize("name", ["S", "L"])
async def test_limits_equal_what_the_node_logged(
    qwen_fleet: dict[str, RealNode], real_gateway: StartGateway, name: str
) -> None:
    """max_model_len and KV tokens discovered live equal the node's start-up log: its
    whole pool less the block vLLM keeps back (the null block)."""
    node = qwen_fleet[name]
    log = node.log_text()
    gw = await real_gateway(gateway_config([node]))
    b = state_of(gw).fleet.get(name)
    assert b is not None
    await eventually(lambda: b.limits.known, timeout=15)
    assert b.max_model_len == logged_max_model_len(log) == node.spec.max_model_len
    assert logged_kv_tokens(log) == logged_blocks(log) * CPU_BLOCK
    assert b.kv_cache_tokens == logged_kv_tokens(log) - CPU_BLOCK == node.spec.kv_tokens
    assert b.limits.block_size == CPU_BLOCK


def test_gateway_check_shows_the_same_limits_as_text_and_json(
    qwen_fleet: dict[str, RealNode], tmp_path: Path
) -> None:
    """`gateway check` reads both nodes and prints the same limits in text and JSON."""
    config = gateway_config([qwen_fleet["S"], qwen_fleet["L"]])
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    run = [sys.executable, "-m", "kvgateway", "check", "--config", str(path)]
    text = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stdout
    doc = json.loads(
        subprocess.run(
            [*run, "--json"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    )
    rows = {r["name"]: r for r in doc["backends"]}
    for name in ("S", "L"):
        spec = qwen_fleet[name].spec
        row = rows[name]
        assert row["max_model_len"] == {"value": spec.max_model_len, "source": "discovered"}
        assert row["kv_cache_tokens"] == {"value": spec.kv_tokens, "source": "discovered"}
        assert f"{spec.kv_tokens:,}" in text
        assert f"{spec.max_model_len:,}" in text
    # Text and JSON name the same concurrency cap for every backend.
    for name, row in rows.items():
        seqs = row["max_num_seqs"]
        line = f"max_num_seqs     {seqs['value']:,} [{seqs['source']}]"
        assert line in text, (name, seqs, text)


@pytest.mark.parametrize("tokenizer", ["model directory", "stand-in"])
async def test_a_hybrid_nodes_groups_and_tokens_are_what_vllm_computed(
    hybrid_node: RealNode, real_gateway: StartGateway, tokenizer: str
) -> None:
    """Gemma 3's sliding-window and full-attention layers share one pool in two KV-cache
    groups (vLLM logs their block sizes); a short request takes a block in each, so the
    pool holds (blocks - 1) // 2 blocks of its tokens. The groups come from the model
    directory, or without it from the node's own group-aware capacity (vLLM 0.32's
    kv_cache_size_tokens, equal to the KV cache size it logged)."""
    node = hybrid_node
    log = node.log_text()
    groups = logged_group_block_sizes(log)
    assert groups == (CPU_BLOCK, CPU_BLOCK)
    tok = {"path": str(node.model_dir)} if tokenizer == "model directory" else {}
    gw = await real_gateway(gateway_config([node], tokenizer=tok or {"encoding": "cl100k_base"}))
    b = state_of(gw).fleet.get("H")
    assert b is not None
    await eventually(lambda: b.limits.known, timeout=15)
    assert b.limits.kv_groups == len(groups)
    assert b.kv_cache_tokens == (logged_blocks(log) - 1) // len(groups) * CPU_BLOCK
    assert b.limits.node_kv_tokens == logged_kv_tokens(log)
