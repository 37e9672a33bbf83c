"""Blocks, the reserved null block, hybrid grouping: vLLM's kv_cache_utils arithmetic."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from kvgateway.capacity import layout as lay
from kvgateway.capacity.arch import ModelArch
from kvgateway.capacity.presets import preset_arch

GIB = 1 << 30


def test_num_blocks_is_memory_floor_divided_by_page_then_layers() -> None:
    layout = lay.kv_layout(preset_arch("qwen3-8b"), 1, "auto")
    assert layout.group_size == 36 and layout.num_groups == 1
    page = lay.page_bytes(layout, 16)
    assert page == 16 * 4096  # one block of one layer
    pool = int(39.84 * GIB)
    assert lay.num_gpu_blocks(layout, pool, 16) == pool // page // 36 == 18_131


def test_block_rounding_drops_a_partial_block() -> None:
    layout = lay.kv_layout(preset_arch("llama-3.1-8b"), 1, "auto")
    one_block = 16 * 131_072  # 16 tokens x 131,072 B/token
    assert lay.num_gpu_blocks(layout, 10 * one_block, 16) == 10
    assert lay.num_gpu_blocks(layout, 11 * one_block - 1, 16) == 10
    assert lay.num_gpu_blocks(layout, 0, 16) == 0
    assert lay.num_gpu_blocks(layout, -5, 16) == 0


def test_reserved_null_block_is_logged_but_not_usable() -> None:
    layout = lay.kv_layout(preset_arch("llama-3.1-8b"), 1, "auto")
    assert lay.vllm_logged_tokens(layout, 9853, 16) == 157_648  # what vLLM prints
    assert lay.usable_tokens(layout, 9853, 16) == 157_632  # block 0 is the null block
    assert lay.usable_tokens(layout, 0, 16) == 0


def test_concurrency_matches_vllm_formula() -> None:
    layout = lay.kv_layout(preset_arch("llama-3.1-8b"), 1, "auto")
    # vLLM: num_blocks / cdiv(max_model_len, block_size) = 9853 / 8192
    assert round(lay.concurrency(layout, 9853, 131_072, 16, 2048), 2) == 1.20
    assert lay.blocks_per_request(layout, 131_073, 16, 2048) == 8193


def test_max_context_is_usable_blocks_times_block_size() -> None:
    layout = lay.kv_layout(preset_arch("qwen2.5-14b"), 1, "auto")
    assert lay.max_context_fitting(layout, 3724, 16, 2048, 10**7) == 59_584
    assert lay.max_context_fitting(layout, 0, 16, 2048, 10**7) == 0
    assert lay.max_context_fitting(layout, 3724, 16, 2048, 40_000) == 40_000


def test_gpt_oss_groups_12_sliding_and_12_full_layers() -> None:
    layout = lay.kv_layout(preset_arch("gpt-oss-20b"), 1, "auto")
    assert layout.group_size == 12 and layout.num_groups == 2 and layout.padding_layers == 0
    windows = sorted(str(g.sliding_window) for g in layout.groups)
    assert windows == ["128", "None"]
    # full group: cdiv(L, 16); sliding group: cdiv(min(127 + 2048, L), 16) + 1
    assert lay.blocks_per_request(layout, 131_072, 16, 2048) == 8192 + 136 + 1
    assert lay.blocks_per_request(layout, 64, 16, 2048) == 4 + 4 + 1
    assert lay.vllm_logged_tokens(layout, 1001, 16) == 500 * 16


def test_gemma3_groups_by_the_smaller_type_with_padding() -> None:
    layout = lay.kv_layout(preset_arch("gemma-3-27b"), 1, "auto")
    # 52 sliding + 10 full: groups of 10 -> 6 sliding groups (8 padding layers) + 1 full
    assert layout.group_size == 10
    assert layout.num_groups == 7
    assert layout.padding_layers == 8
    assert sum(1 for g in layout.groups if g.sliding_window == 1024) == 6


def test_near_equal_types_pad_to_the_larger_count() -> None:
    # gpt-oss + an EAGLE drafter layer: 12 sliding + 13 full -> (13, 13), not (12, 24).
    base = preset_arch("gpt-oss-20b")
    arch = replace(base, num_layers=25, sliding_layers=tuple(range(0, 24, 2)))
    layout = lay.kv_layout(arch, 1, "auto")
    assert layout.group_size == 13 and layout.num_groups == 2 and layout.padding_layers == 1


def test_every_layer_sliding_is_one_group() -> None:
    arch = ModelArch(
        name="mistral-v0.1", num_layers=32, num_kv_heads=8, head_dim=128,
        sliding_window=4096, sliding_layers=tuple(range(32)),
    )  # fmt: skip
    layout = lay.kv_layout(arch, 1, "auto")
    assert layout.num_groups == 1 and layout.groups[0].sliding_window == 4096
    # cost stops growing past the window (plus one prefill chunk)
    assert lay.blocks_per_request(layout, 100_000, 16, 2048) == lay.blocks_per_request(
        layout, 50_000, 16, 2048
    )


@given(
    kv_heads=st.integers(1, 16),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]),
    layers=st.integers(1, 96),
    tp=st.sampled_from([1, 2, 4, 8]),
    pool=st.integers(0, 200 * GIB),
    block_size=st.sampled_from([16, 32, 64]),
)
def test_uniform_tokens_follow_blocks(
    kv_heads: int, head_dim: int, layers: int, tp: int, pool: int, block_size: int
) -> None:
    arch = ModelArch(name="x", num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    layout = lay.kv_layout(arch, tp, "auto")
    blocks = lay.num_gpu_blocks(layout, pool, block_size)
    per_token = layout.bytes_per_token_per_layer * layers
    # never more memory than the pool, and less than one block left over
    assert blocks * block_size * per_token <= pool
    assert pool - blocks * block_size * per_token < block_size * per_token
    logged = lay.vllm_logged_tokens(layout, blocks, block_size)
    assert logged == blocks * block_size
    if blocks >= 1:
        assert lay.usable_tokens(layout, blocks, block_size) == logged - block_size
        fit = lay.max_context_fitting(layout, blocks - 1, block_size, 2048, 10**9)
        assert fit == (blocks - 1) * block_size


@given(
    blocks=st.integers(1, 100_000),
    sliding_every=st.sampled_from([2, 3, 6]),
    window=st.sampled_from([128, 512, 1024, 4096]),
    mnbt=st.sampled_from([512, 2048, 8192]),
)
def test_max_context_is_the_largest_that_fits(
    blocks: int, sliding_every: int, window: int, mnbt: int
) -> None:
    arch = ModelArch(
        name="hybrid", num_layers=24, num_kv_heads=8, head_dim=64, sliding_window=window,
        sliding_layers=tuple(i for i in range(24) if (i + 1) % sliding_every),
    )  # fmt: skip
    layout = lay.kv_layout(arch, 1, "auto")
    fit = lay.max_context_fitting(layout, blocks, 16, mnbt, 10**7)
    if fit:
        assert lay.blocks_per_request(layout, fit, 16, mnbt) <= blocks
    if fit < 10**7:
        assert lay.blocks_per_request(layout, fit + 1, 16, mnbt) > blocks
