"""config.json parsing: nesting, sliding patterns, MLA, and refusals with reasons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgateway.capacity.arch import kv_bytes_per_token
from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.hf_config import arch_from_hf_config
from kvgateway.capacity.presets import find_preset, preset_arch, presets


def load(data_dir: Path, name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((data_dir / name).read_text())
    return loaded


def test_qwen3_config_file_matches_preset(data_dir: Path) -> None:
    arch = arch_from_hf_config(load(data_dir, "qwen3_8b_config.json"), name="qwen3")
    assert kv_bytes_per_token(arch, 1, "auto") == 147_456
    assert arch.max_position_embeddings == 40_960
    assert arch.sliding_layers == ()  # use_sliding_window: false
    # parameter count from the shape alone is within 0.1% of the published 8.19B
    assert arch.param_count == pytest.approx(find_preset("qwen3-8b").param_count, rel=1e-3)


def test_llama_head_dim_falls_back_to_hidden_over_heads(data_dir: Path) -> None:
    arch = arch_from_hf_config(load(data_dir, "llama31_70b_config.json"), name="llama")
    assert arch.head_dim == 8192 // 64 == 128
    assert kv_bytes_per_token(arch, 4, "auto") == 81_920


def test_multimodal_text_config_and_gemma3_defaults(data_dir: Path) -> None:
    arch = arch_from_hf_config(load(data_dir, "gemma3_27b_config.json"), name="gemma")
    assert arch.num_layers == 62 and arch.num_kv_heads == 16 and arch.head_dim == 128
    assert arch.dtype == "bfloat16"  # from the top level
    # released config has no sliding_window_pattern: transformers' default 6 applies
    assert len(arch.sliding_layers) == 52 and arch.sliding_window == 1024
    assert 5 not in arch.sliding_layers and 0 in arch.sliding_layers


def test_gpt_oss_layer_types_and_mxfp4_weights(data_dir: Path) -> None:
    arch = arch_from_hf_config(load(data_dir, "gpt_oss_20b_config.json"), name="gpt-oss")
    assert arch.sliding_layers == tuple(range(0, 24, 2)) and arch.sliding_window == 128
    assert arch.param_count == pytest.approx(20.9e9, rel=0.01)
    assert 0.6 < arch.weight_bytes_per_param < 0.7  # MXFP4 experts, bf16 attention


def test_deepseek_v3_is_mla_with_fp8_weights(data_dir: Path) -> None:
    arch = arch_from_hf_config(load(data_dir, "deepseek_v3_config.json"), name="dsv3")
    assert arch.is_mla and arch.kv_lora_rank == 512 and arch.qk_rope_head_dim == 64
    assert kv_bytes_per_token(arch, 8, "auto") == 70_272
    assert arch.weight_bytes_per_param == 1.0
    assert arch.param_count == pytest.approx(671e9, rel=0.005)


def test_mamba_hybrid_is_refused_with_a_reason(data_dir: Path) -> None:
    with pytest.raises(CapacityConfigError, match="Mamba") as info:
        arch_from_hf_config(load(data_dir, "nemotron_h_config.json"), name="nh")
    assert info.value.path == "model_type"


def test_unknown_sliding_pattern_is_refused() -> None:
    config = {"model_type": "newmodel", "num_hidden_layers": 8, "num_key_value_heads": 2,
              "head_dim": 64, "sliding_window": 4096}  # fmt: skip
    with pytest.raises(CapacityConfigError, match="which layers slide") as info:
        arch_from_hf_config(config, name="x")
    assert info.value.path == "sliding_window"


def test_chunked_local_attention_is_refused() -> None:
    config = {"model_type": "llama4_text", "num_hidden_layers": 48, "num_key_value_heads": 8,
              "head_dim": 128, "attention_chunk_size": 8192}  # fmt: skip
    with pytest.raises(CapacityConfigError, match="chunked local attention"):
        arch_from_hf_config(config, name="x")


def test_linear_attention_layer_types_are_refused() -> None:
    config = {"model_type": "x", "num_hidden_layers": 2, "num_key_value_heads": 2,
              "head_dim": 64, "sliding_window": 512,
              "layer_types": ["linear_attention", "full_attention"]}  # fmt: skip
    with pytest.raises(CapacityConfigError, match="linear_attention"):
        arch_from_hf_config(config, name="x")


def test_mistral_v01_slides_every_layer() -> None:
    config = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096}  # fmt: skip
    arch = arch_from_hf_config(config, name="m")
    assert arch.all_sliding and any("Mistral-style" in n for n in arch.notes)


def test_missing_and_bad_fields_name_the_key() -> None:
    with pytest.raises(CapacityConfigError) as info:
        arch_from_hf_config({"num_key_value_heads": 8, "head_dim": 128}, name="x")
    assert info.value.path == "num_hidden_layers"
    with pytest.raises(CapacityConfigError, match='got "four"') as info:
        arch_from_hf_config({"num_hidden_layers": "four"}, name="x")
    assert info.value.path == "num_hidden_layers"
    with pytest.raises(CapacityConfigError) as info:
        arch_from_hf_config({"num_hidden_layers": 2}, name="x")
    assert "num_key_value_heads" in str(info.value)
    with pytest.raises(CapacityConfigError, match="unknown dtype"):
        arch_from_hf_config(
            {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8,
             "torch_dtype": "int4"}, name="x",
        )  # fmt: skip


def test_multi_query_and_mha_fallbacks() -> None:
    mqa = arch_from_hf_config(
        {"num_hidden_layers": 2, "n_head": 16, "hidden_size": 1024, "multi_query": True}, name="q"
    )
    assert mqa.num_kv_heads == 1 and mqa.head_dim == 64
    mha = arch_from_hf_config(
        {"num_hidden_layers": 2, "num_attention_heads": 16, "hidden_size": 1024}, name="m"
    )
    assert mha.num_kv_heads == 16
    assert any("assumed bfloat16" in n for n in mha.notes)


def test_awq_weights_are_half_a_byte() -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000,
              "torch_dtype": "float16",
              "quantization_config": {"quant_method": "awq", "bits": 4}}  # fmt: skip
    assert arch_from_hf_config(config, name="a").weight_bytes_per_param == 0.5


@pytest.mark.parametrize("preset", [p.name for p in presets()])
def test_every_preset_parses(preset: str) -> None:
    arch = preset_arch(preset)
    assert arch.param_count and kv_bytes_per_token(arch, 1, "auto") > 0
    assert find_preset(arch.hf_id or "").name == preset


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(CapacityConfigError, match="qwen3-8b"):
        preset_arch("llama-9")


def test_a_checkpoint_with_an_fp8_kv_cache_halves_the_bytes_under_auto() -> None:
    """vLLM resolves --kv-cache-dtype auto to fp8 when the checkpoint quantizes its KV
    cache (compressed-tensors kv_cache_scheme, ModelOpt kv_cache_quant_algo): the pool
    holds twice the tokens the model dtype would give (163,824 planned, 327,664 served)."""
    from kvgateway.capacity.arch import kv_bytes_per_token_per_layer
    from kvgateway.capacity.hf_config import arch_from_hf_config

    base = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
    }  # fmt: skip
    plain = arch_from_hf_config(base, name="m")
    assert kv_bytes_per_token_per_layer(plain, 1, "auto") == 4096
    for quant in (
        {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
        {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"},
    ):
        arch = arch_from_hf_config({**base, "quantization_config": quant}, name="m")
        assert kv_bytes_per_token_per_layer(arch, 1, "auto") == 2048, quant
        assert kv_bytes_per_token_per_layer(arch, 1, "bfloat16") == 4096  # asked for: kept


GLM4_9B = {  # THUDM/glm-4-9b-chat's config.json, the fields the KV size reads
    "model_type": "chatglm",
    "num_layers": 40,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "kv_channels": 128,
    "multi_query_attention": True,
    "multi_query_group_num": 2,
    "seq_length": 131072,
    "padded_vocab_size": 151552,
}


def test_a_chatglm_config_reads_its_kv_groups_and_context_as_vllm_does() -> None:
    """ChatGLM states its KV heads as ``multi_query_group_num`` and its context as
    ``seq_length`` (vLLM's config convertor reads both): 2 KV heads, not the 32 query
    heads (16x the KV bytes per token), and a 131,072-token context."""
    arch = arch_from_hf_config(GLM4_9B, name="glm-4-9b-chat")
    assert arch.num_kv_heads == 2 and arch.max_position_embeddings == 131_072


@pytest.mark.parametrize(
    "extra",
    [{"global_head_dim": 512}, {"num_global_key_value_heads": 2}, {"num_kv_shared_layers": 10}],
)
def test_layers_of_different_kv_shapes_are_refused_not_sized_as_one(
    extra: dict[str, Any],
) -> None:
    """Gemma 4 gives its full-attention layers another head size (and KV heads) than its
    sliding ones, and some configs share KV between layers: vLLM pages those per layer
    type; sizing every layer alike would admit up to twice what the node holds."""
    config = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 512,
        **extra,
    }
    with pytest.raises(CapacityConfigError) as err:
        arch_from_hf_config(config, name="gemma-4")
    assert err.value.path == next(iter(extra))
