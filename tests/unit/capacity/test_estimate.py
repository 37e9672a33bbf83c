"""estimate(): pool, blocks, usable tokens, longest context, concurrency."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvgateway.capacity import CapacitySpec, estimate
from kvgateway.capacity.layout import vllm_logged_tokens_at_length
from kvgateway.capacity.memory import GIB


def spec(**data: object) -> CapacitySpec:
    return CapacitySpec.from_mapping(data, "capacity")


def test_pool_estimate_is_requested_minus_weights_activation_overhead() -> None:
    est = estimate(spec(preset="qwen3-8b", gpu_memory_gib=80, weights_gib=15.25,
                        overhead_gib=2.0, gpu_memory_utilization=0.9))  # fmt: skip
    assert est.pool.requested_bytes == math.ceil(80 * GIB * 0.9)
    expected = math.ceil(80 * GIB * 0.9) - int(15.25 * GIB) - int(2.0 * GIB)
    assert est.kv_pool_bytes == expected
    assert est.num_gpu_blocks == expected // (16 * 4096) // 36
    assert not est.pool.measured


def test_default_estimate_names_its_assumptions() -> None:
    est = estimate(spec(preset="llama-3.1-8b", gpu_memory_gib=79.25))
    # weights = 8.03B x 2 B: vLLM logs 'Model loading took 14.99 GiB' for this model
    assert est.pool.weights_bytes / GIB == pytest.approx(14.96, abs=0.01)
    # activation on an H100 with 8192 batched tokens: vLLM measured 1.44 GiB
    assert est.max_num_batched_tokens == 8192
    assert est.pool.activation_bytes / GIB == pytest.approx(1.44, abs=0.1)
    assert any("override with weights_gib" in n for n in est.notes)
    assert any("override with overhead_gib" in n for n in est.notes)
    # the field log for this node says 56.21 GiB: the estimate lands within 1 GiB of it
    assert est.kv_pool_bytes / GIB == pytest.approx(56.21, abs=1.0)


def test_measured_pool_skips_the_estimate() -> None:
    est = estimate(spec(preset="qwen3-8b", kv_cache_memory_gib=39.84))
    assert est.pool.measured and est.kv_pool_bytes == int(39.84 * GIB)
    assert est.num_gpu_blocks == 18_131
    assert est.vllm_logged_tokens == 290_096
    assert est.kv_cache_tokens == 290_096 - 16  # the null block is not usable
    assert est.max_model_len_fit == 40_960  # capped by the model's context
    assert est.kv_limited_len == 290_080
    assert est.target_len == 40_960
    assert est.vllm_logged_concurrency == pytest.approx(18_131 / 2560)
    assert est.max_concurrency == pytest.approx(18_130 / 2560)
    assert est.concurrency_at(4096) == pytest.approx(18_130 / 256)


def test_target_that_does_not_fit() -> None:
    est = estimate(spec(preset="qwen2.5-14b", kv_cache_memory_gib=10.91, max_model_len=131072))
    # 10.91 GiB (the log's rounding) holds 3,723 blocks; the first is the null block.
    # (vLLM, with the unrounded bytes, found 3,724 blocks and suggested 59,584.)
    assert est.num_gpu_blocks == 3723
    assert est.max_model_len_fit == (3723 - 1) * 16
    assert not est.fits_target
    assert est.max_concurrency < 1
    assert any("max_position_embeddings" in n for n in est.notes)


def test_fp8_doubles_tokens_on_the_same_pool() -> None:
    base = spec(preset="llama-3.1-70b", kv_cache_memory_gib=40, tp=4)
    bf16, fp8 = estimate(base), estimate(replace(base, kv_cache_dtype="fp8"))
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token == 81_920
    assert fp8.num_gpu_blocks in (2 * bf16.num_gpu_blocks, 2 * bf16.num_gpu_blocks + 1)


def test_mla_tokens_do_not_grow_with_tp() -> None:
    one = estimate(spec(preset="deepseek-v2-lite", kv_cache_memory_gib=20))
    four = estimate(spec(preset="deepseek-v2-lite", kv_cache_memory_gib=20, tp=4))
    assert one.kv_cache_tokens == four.kv_cache_tokens
    assert one.bytes_per_token == 31_104
    assert any("MLA" in n for n in one.notes)


def test_weights_shrink_per_gpu_with_tp() -> None:
    one = estimate(spec(preset="qwen3-32b", gpu_memory_gib=79.25))
    two = estimate(spec(preset="qwen3-32b", gpu_memory_gib=79.25, tp=2))
    assert two.pool.weights_bytes == pytest.approx(one.pool.weights_bytes / 2, abs=1)
    assert two.kv_cache_tokens > 2 * one.kv_cache_tokens


def test_model_that_does_not_load() -> None:
    est = estimate(spec(preset="llama-3.1-70b", gpu_memory_gib=24))
    assert est.num_gpu_blocks == 0 and est.kv_cache_tokens == 0 and est.max_model_len_fit == 0
    assert est.max_concurrency == 0
    assert any("does not load" in n for n in est.notes)


def test_hybrid_counts_every_group_conservatively() -> None:
    est = estimate(spec(preset="gpt-oss-20b", kv_cache_memory_gib=10))
    blocks = est.num_gpu_blocks
    assert blocks == int(10 * GIB) // (16 * 2048) // 12
    assert est.vllm_logged_tokens == blocks // 2 * 16
    assert est.kv_cache_tokens == (blocks - 1) // 2 * 16
    # a full-context request costs far less than two full copies: sliding layers stop at 128
    assert est.max_model_len_fit == 131_072
    assert est.max_concurrency > est.kv_cache_tokens / 131_072
    assert any("hybrid layout" in n for n in est.notes)


def test_a_sliding_window_group_holds_the_tokens_in_flight_of_two_batches() -> None:
    """A sliding-window layer keeps its window plus the tokens scheduled but not yet
    freed: with asynchronous scheduling (vLLM 0.32's GPU default) two batches of
    max_num_batched_tokens. The figures are vLLM 0.32's own (get_kv_cache_configs and
    get_kv_cache_capacity, run on these inputs): gemma-3-27b with 16 GiB of KV refuses a
    131,072-token context (it fits 105,152), and with 40 GiB its 32,768 blocks hold 2.225
    such requests, logged as 291,658 tokens."""
    gemma = {"preset": "gemma-3-27b", "max_model_len": 131_072, "max_num_batched_tokens": 8192}
    small = estimate(spec(**gemma, kv_cache_memory_gib=16.0))
    assert (small.max_model_len_fit, small.fits_target) == (105_152, False)
    large = estimate(spec(**gemma, kv_cache_memory_gib=40.0))
    assert large.num_gpu_blocks == 32_768 and large.in_flight_tokens == 16_384
    assert large.vllm_logged_concurrency == pytest.approx(2.22518, abs=1e-4)
    logged = vllm_logged_tokens_at_length(
        large.layout, large.num_gpu_blocks, large.block_size, large.in_flight_tokens, 131_072
    )
    assert logged == 291_658
