"""Reading a vLLM node's ``/metrics`` page: pure parsing, no I/O.

A node's page is tens of kilobytes (histogram buckets), scraped every few seconds per
node, so lines are first filtered by name with plain string checks and only the few
families the gateway uses go through prometheus_client's parser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # removed in vLLM v0.12; older nodes still send it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions"  # counter family; samples end in _total
CACHE_INFO = "vllm:cache_config_info"

# Beyond any real node: vLLM's block sizes are 16-128 for attention, a few thousand
# where a hybrid model aligns them to its Mamba state; 10^8 blocks would be ~10^9 tokens.
MAX_BLOCK_SIZE = 16_384
MAX_GPU_BLOCKS = 100_000_000

_WANTED = (KV_USAGE, KV_USAGE_OLD, RUNNING, WAITING, PREEMPTIONS + "_total", CACHE_INFO)


@dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    # vLLM >= 0.32's own capacity: tokens of max_model_len requests the pool holds at
    # once (group-aware; its pool counted whole, the null block included).
    kv_cache_size_tokens: int | None = None


def _keep(line: str) -> bool:
    if line.startswith("#"):
        return line.startswith(("# TYPE vllm:", "# HELP vllm:")) and any(w in line for w in _WANTED)
    return line.startswith(_WANTED)


def parse_node_metrics(text: str) -> ScrapedMetrics:
    """Sum per-engine gauges/counters (data-parallel nodes expose one series per engine);
    KV usage is the highest engine's, since one full engine already queues work."""
    kept = "\n".join(line for line in text.splitlines() if _keep(line)) + "\n"
    sums: dict[str, float] = {}
    usage: float | None = None
    old_usage: float | None = None
    blocks: int | None = None
    block_size: int | None = None
    capacity: int | None = None
    for family in text_string_to_metric_families(kept):
        for s in family.samples:
            if s.name != CACHE_INFO and not 0.0 <= s.value < math.inf:
                continue  # NaN, infinite or negative: not a reading of anything
            if s.name == KV_USAGE:
                usage = s.value if usage is None else max(usage, s.value)
            elif s.name == KV_USAGE_OLD:
                old_usage = s.value if old_usage is None else max(old_usage, s.value)
            elif s.name in (RUNNING, WAITING, PREEMPTIONS + "_total"):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            elif s.name == CACHE_INFO:
                nb = _int_label(s.labels.get("num_gpu_blocks"), MAX_GPU_BLOCKS)
                if nb is not None:
                    blocks = nb if blocks is None else min(blocks, nb)
                block_size = _int_label(s.labels.get("block_size"), MAX_BLOCK_SIZE) or block_size
                capacity = (
                    _int_label(s.labels.get("kv_cache_size_tokens"), MAX_GPU_BLOCKS * 1024)
                    or capacity
                )
    kv = usage if usage is not None else old_usage
    return ScrapedMetrics(
        kv_usage=None if kv is None else min(kv, 1.0),
        running=sums.get(RUNNING),
        waiting=sums.get(WAITING),
        preemptions=sums.get(PREEMPTIONS + "_total"),
        num_gpu_blocks=blocks,
        block_size=block_size,
        kv_cache_size_tokens=capacity,
    )


def _int_label(value: str | None, most: int) -> int | None:
    """A plain decimal label from 1 to ``most``; anything else is not reported (one node
    claiming block_size="1000000" would otherwise set the whole model's block size)."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 12:
        return None
    n = int(value)
    return n if 1 <= n <= most else None
