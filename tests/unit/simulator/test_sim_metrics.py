"""/metrics against vLLM's own page, and the engine's behaviour under load as it shows there."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvgateway.simulator.driver import EngineDriver
from kvgateway.simulator.metrics import NodeMetrics
from kvgateway.simulator.profiles import TINY
from kvgateway.simulator.settings import NodeSettings
from tests.support.sim import SimClient, SimFactory, chat

SAMPLE = Path(__file__).parents[2] / "data" / "vllm_metrics_sample.txt"

# Family names as the parser reports them (counters without `_total`).
FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:inter_token_latency_seconds",
)
# The labels the gateway reads; the sample predates vLLM 0.32, whose whole label set
# tests/real_vllm/test_simulator_parity.py holds against a real node.
CACHE_LABELS = {"num_gpu_blocks", "block_size", "engine"}


def shape(text: str) -> dict[str, tuple[str, str, frozenset[str], tuple[float, ...]]]:
    """family -> (type, help, label names, histogram bucket bounds)."""
    out = {}
    for family in text_string_to_metric_families(text):
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        bounds = tuple(
            sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        )
        out[family.name] = (family.type, family.documentation, labels, bounds)
    return out


async def test_metric_families_match_vllms_page(sim: SimFactory) -> None:
    node = await sim()
    await node.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
    ours = shape(await node.metrics_text())
    theirs = shape(SAMPLE.read_text())
    for name in FAMILIES:
        assert name in theirs, name  # the sample really has it
        assert name in ours, name
        assert ours[name] == theirs[name], name
    info = "vllm:cache_config_info"
    assert ours[info][:2] == theirs[info][:2]
    assert ours[info][2] & theirs[info][2] >= CACHE_LABELS
    assert "vllm:gpu_cache_usage_perc" not in ours


async def test_labels_and_cache_config(sim: SimFactory) -> None:
    node = await sim()
    families = {f.name: f for f in text_string_to_metric_families(await node.metrics_text())}
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": TINY.model, "engine": "0"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels["num_gpu_blocks"] == "65" and info.labels["block_size"] == "16"
    assert info.labels["cache_dtype"] == "auto"
    assert info.labels["kv_cache_memory_bytes"] == "None"
    assert {"gpu_memory_utilization", "enable_prefix_caching"} <= set(info.labels)
    # vLLM 0.32's capacity labels: all 65 blocks over the 32 one 512-token request takes.
    assert info.labels["kv_cache_max_concurrency"] == str(65 / 32)
    assert info.labels["kv_cache_size_tokens"] == str(int(65 / 32 * 512))


async def test_hybrid_capacity_labels(sim: SimFactory) -> None:
    """A sliding-window group holds at most window + a batch per request (vLLM's
    get_max_concurrency_for_kv_cache_config), so the pool holds more full contexts."""
    node = await sim(sliding_window=128, num_sliding_window_groups=1)
    families = {f.name: f for f in text_string_to_metric_families(await node.metrics_text())}
    (info,) = families["vllm:cache_config_info"].samples
    s = node.node.settings
    per_request = 512 // 16 + -(-min(128 - 1 + s.max_num_batched_tokens, 512) // 16) + 1
    assert info.labels["kv_cache_max_concurrency"] == str(65 / per_request)
    assert info.labels["sliding_window"] == "128"


async def test_legacy_kv_usage_name(sim: SimFactory) -> None:
    node = await sim(legacy_metric_names=True)
    names = {f.name for f in text_string_to_metric_families(await node.metrics_text())}
    assert "vllm:gpu_cache_usage_perc" in names
    assert "vllm:kv_cache_usage_perc" not in names


async def test_counters_and_histograms_follow_requests(sim: SimFactory) -> None:
    node = await sim(output_dist="fixed", output_mean=6)
    for _ in range(3):
        status, _ = await node.post("/v1/completions", {"prompt": "hello world", "max_tokens": 6})
        assert status == 200
    assert await node.metric("vllm:prompt_tokens_total") == 6
    assert await node.metric("vllm:generation_tokens_total") == 18
    assert await node.metric("vllm:request_success_total", finished_reason="length") == 3
    assert await node.metric("vllm:time_to_first_token_seconds_count") == 3
    assert await node.metric("vllm:inter_token_latency_seconds_count") == 15
    assert await node.metric("vllm:e2e_request_latency_seconds_count") == 3
    assert await node.metric("vllm:request_queue_time_seconds_count") == 3
    # Simulated seconds: six steps of ~10 ms each (tiny profile), whatever the time_scale.
    e2e = await node.metric("vllm:e2e_request_latency_seconds_sum") / 3
    assert 0.05 < e2e < 0.2


async def _long_requests(node: SimClient, count: int, body: dict[str, Any]) -> list[Any]:
    async def one() -> Any:
        status, reply = await node.post("/v1/chat/completions", body)
        assert status == 200, reply
        return reply

    return await asyncio.gather(*(one() for _ in range(count)))


async def test_overcommitted_pool_preempts_and_recovers(sim: SimFactory) -> None:
    # 64 usable blocks; 8 sequences growing to ~100 + 200 tokens (19 blocks) each.
    node = await sim(time_scale=10.0)  # slow enough for the watcher to see the peak
    body = chat("hello " * 90, max_tokens=200, ignore_eos=True)
    peak = 0.0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, await node.metric("vllm:kv_cache_usage_perc"))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch(), name="kv-watch")
    try:
        replies = await _long_requests(node, 8, body)
    finally:
        watcher.cancel()
    assert all(r["usage"]["completion_tokens"] == 200 for r in replies)
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    preemptions = await node.metric("vllm:num_preemptions_total")
    assert preemptions > 0
    state = await node.wait_idle()
    assert state["preemptions"] == preemptions
    assert peak > 0.8
    assert await node.metric("vllm:kv_cache_usage_perc") == 0.0
    assert state["used_blocks"] == 0 and state["kv_usage"] == 0.0
    # Recomputation shows in latency: the slowest request waited through preemptions.
    assert await node.metric("vllm:generation_tokens_total") == 1600


async def test_waiting_and_running_gauges_under_load(sim: SimFactory) -> None:
    node = await sim(max_num_seqs=2, time_scale=5.0)  # ~0.3 s per request
    body = chat("hi", max_tokens=150, ignore_eos=True)
    load = asyncio.create_task(_long_requests(node, 5, body), name="load")
    try:
        for _ in range(200):
            running = await node.metric("vllm:num_requests_running")
            waiting = await node.metric("vllm:num_requests_waiting")
            if running == 2 and waiting == 3:
                break
            await asyncio.sleep(0.005)
        assert (running, waiting) == (2, 3)
    finally:
        await load
    assert (await node.wait_idle())["finished"]["length"] == 5
    # Queued requests spent simulated time waiting.
    assert await node.metric("vllm:request_queue_time_seconds_sum") > 0.5


async def test_a_preemption_is_counted_once_its_request_produces_output_again() -> None:
    """vLLM records a preemption on the request and counts it in
    ``vllm:num_preemptions_total`` when the request next produces output (after its
    recompute): a node's counter rises after the preempted work is back, not while it
    waits; the engine's own count (``/sim/state``) rises at once."""
    settings = NodeSettings(name="n", model="m", num_gpu_blocks=9, block_size=16, max_num_seqs=4)
    metrics = NodeMetrics(settings)
    driver = EngineDriver(settings, metrics, clock=lambda: 0.0)
    for _ in range(2):  # each grows to 8 of the 8 usable blocks
        driver.submit(list(range(16)), 100, ignore_eos=True)
    labels = {"model_name": "m", "engine": settings.engine_label}

    def counted() -> float:
        value = metrics.registry.get_sample_value("vllm:num_preemptions_total", labels)
        return value or 0.0

    seen: list[tuple[int, float]] = []
    while (step := driver.core.step(float("-inf"))) is not None:
        driver._deliver([step])
        seen.append((driver.core.num_preemptions, counted()))
    assert any(engine > node for engine, node in seen)  # preempted, not yet counted
    assert seen[-1][0] == seen[-1][1] >= 1  # counted once its request ran again
