"""KV bytes per token per GPU: the worked examples and the dtype rules."""

from __future__ import annotations

import pytest

from kvgateway.capacity.arch import ModelArch, kv_bytes_per_token, kv_dtype_bytes
from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.presets import preset_arch


def test_qwen3_8b_bf16_is_147456_bytes_per_token() -> None:
    # 2 (K and V) x 8 KV heads x 128 head_dim x 2 bytes x 36 layers
    assert kv_bytes_per_token(preset_arch("qwen3-8b"), 1, "auto") == 147_456


def test_llama31_70b_tp4_is_80_kib_per_gpu() -> None:
    arch = preset_arch("llama-3.1-70b")
    assert kv_bytes_per_token(arch, 1, "auto") == 327_680
    assert kv_bytes_per_token(arch, 4, "auto") == 81_920  # 2 KV heads per GPU


def test_kv_heads_are_replicated_once_tp_exceeds_them() -> None:
    arch = preset_arch("llama-3.1-70b")  # 8 KV heads
    assert kv_bytes_per_token(arch, 8, "auto") == 40_960
    # max(1, 8 // 16) = 1: TP 16 stops saving KV memory per GPU.
    assert kv_bytes_per_token(arch, 16, "auto") == 40_960


def test_deepseek_v3_mla_latent_no_factor_two_not_split_by_tp() -> None:
    arch = preset_arch("deepseek-v3")
    assert kv_bytes_per_token(arch, 1, "auto") == (512 + 64) * 2 * 61 == 70_272
    assert kv_bytes_per_token(arch, 8, "auto") == 70_272


def test_deepseek_v2_lite_mla() -> None:
    assert kv_bytes_per_token(preset_arch("deepseek-v2-lite"), 2, "auto") == 576 * 2 * 27


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"])
@pytest.mark.parametrize("preset", ["qwen3-8b", "llama-3.1-70b", "deepseek-v3", "gpt-oss-20b"])
def test_fp8_halves_bytes_per_token(preset: str, dtype: str) -> None:
    arch = preset_arch(preset)
    assert kv_bytes_per_token(arch, 1, dtype) * 2 == kv_bytes_per_token(arch, 1, "auto")


def test_fp8_ds_mla_is_656_bytes_per_token_per_layer() -> None:
    assert kv_bytes_per_token(preset_arch("deepseek-v3"), 1, "fp8_ds_mla") == 656 * 61
    with pytest.raises(CapacityConfigError, match="only for MLA"):
        kv_bytes_per_token(preset_arch("qwen3-8b"), 1, "fp8_ds_mla")


def test_per_token_head_quantisation_adds_fp32_scales() -> None:
    arch = preset_arch("qwen3-8b")
    # 1 byte per element plus a 4-byte scale per head, for K and V, per layer
    expected = (2 * 8 * 128 * 1 + 2 * 8 * 4) * 36
    assert kv_bytes_per_token(arch, 1, "int8_per_token_head") == expected


def test_dtype_bytes() -> None:
    assert kv_dtype_bytes("auto", "bfloat16") == 2
    assert kv_dtype_bytes("auto", "float16") == 2
    # vLLM's --dtype auto serves fp32 checkpoints in 16-bit; fp32 KV must be asked for.
    assert kv_dtype_bytes("auto", "float32") == 2
    assert kv_dtype_bytes("float32", "bfloat16") == 4
    assert kv_dtype_bytes("fp8", "bfloat16") == 1
    with pytest.raises(CapacityConfigError, match="unknown KV cache dtype"):
        kv_dtype_bytes("int3", "bfloat16")


def test_fp32_kv_doubles_bf16() -> None:
    arch = ModelArch(name="x", num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    assert kv_bytes_per_token(arch, 1, "float32") == 2 * 4 * 64 * 4 * 2
    assert kv_bytes_per_token(arch, 1, "auto") == 2 * 4 * 64 * 2 * 2
