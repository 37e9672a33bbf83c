"""`gateway plan --from-log` and `gateway round --log` read a real node's start-up log.

The nodes are vLLM 0.32's CPU build: KV blocks of 128, the pool set by
--num-gpu-blocks-override, KV memory set explicitly, and a ``non-default args`` line that
holds a ``KVEventsConfig(...)`` object. Nothing here sends the nodes load.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgateway.capacity.logparse import parse_vllm_log
from kvgateway.commands.roundstats import flags_from_log, log_summary
from tests.real_vllm.logs import logged_blocks, logged_kv_tokens, logged_max_model_len
from tests.support.vllm_nodes import CPU_BLOCK, RealNode

pytestmark = pytest.mark.real_vllm


def _plan(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgateway", "plan", *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["S", "L"])
def test_plan_from_log_explains_the_nodes_pool(qwen_fleet: dict[str, RealNode], name: str) -> None:
    """Tokens, blocks, block size and the gateway budget, as the node logged them, and
    every expected line found."""
    node = qwen_fleet[name]
    log = node.log_text()
    done = _plan("--from-log", str(node.log_path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    facts = report["log"]
    assert facts["kv_device"] == "CPU"
    assert facts["kv_cache_tokens"] == logged_kv_tokens(log)
    assert facts["num_blocks_override"] == logged_blocks(log) == node.spec.num_blocks
    assert facts["max_model_len"] == logged_max_model_len(log) == node.spec.max_model_len
    assert report["missing_lines"] == []
    assert report["pool"]["block_size"] == CPU_BLOCK
    assert report["kv_cache_tokens"] == node.spec.kv_tokens  # the null block left out
    titles = [r["title"] for r in report["recommendations"]]
    assert titles[2] == "Raise --num-gpu-blocks-override (it sets the pool)"
    assert not any("gpu-memory-utilization" in t for t in titles)
    text = " ".join(_plan("--from-log", str(node.log_path)).stdout.split())
    assert f"Use kv_cache_tokens: {node.spec.kv_tokens}" in text
    assert f"{node.spec.num_blocks} blocks of {CPU_BLOCK}" in text


def test_plan_from_log_with_the_models_config_checks_the_memory(
    qwen_fleet: dict[str, RealNode],
) -> None:
    """The architecture (2 layers x 1 KV head x 64, bf16: 512 B a token) over the node's
    KV memory gives the block count vLLM says the memory holds, and the plan runs on the
    override's blocks."""
    node = qwen_fleet["S"]
    config = node.model_dir / "config.json"
    done = _plan("--from-log", str(node.log_path), "--model-config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["cross_check"]["ok"], report["cross_check"]["detail"]
    assert report["plan"]["num_gpu_blocks"] == node.spec.num_blocks
    assert report["kv_cache_tokens"] == node.spec.kv_tokens


def test_round_reads_the_flags_and_the_log_summary(qwen_fleet: dict[str, RealNode]) -> None:
    """What `gateway round --log` records: every flag passed, beside the config object."""
    for node in qwen_fleet.values():
        log = node.log_text()
        flags = flags_from_log(log)
        assert flags["max_model_len"] == node.spec.max_model_len
        assert flags["num_gpu_blocks_override"] == node.spec.num_blocks
        assert flags["max_num_seqs"] == node.spec.max_num_seqs
        assert flags["served_model_name"] == [node.spec.served_name]
        assert str(flags["kv_events_config"]).startswith("KVEventsConfig(")
        summary = log_summary(parse_vllm_log(log))
        assert summary.device == "CPU" and summary.num_blocks_override == node.spec.num_blocks
        assert summary.kv_memory_source == "explicit" and summary.kv_cache_memory_gib
        assert summary.profiled_num_blocks and summary.profiled_num_blocks > node.spec.num_blocks
