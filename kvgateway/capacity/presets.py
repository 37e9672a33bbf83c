"""Built-in presets: excerpts of real Hugging Face ``config.json`` files.

Each preset is the checkpoint's own config fields (the ones the KV and weight maths
read), its published parameter count and the effective bytes per parameter of the
checkpoint as shipped, and goes through the same parser as a user's config.json, so a
preset and the file it came from give the same numbers. Parameter counts are the
model cards' / safetensors totals; they size the weights only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgateway.capacity.arch import ModelArch
from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.hf_config import arch_from_hf_config


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    hf_id: str
    summary: str
    param_count: int
    weight_bytes_per_param: float
    config: Mapping[str, Any] = field(default_factory=dict)


def _llama(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }  # fmt: skip


def _qwen3(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }  # fmt: skip


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv: int) -> dict[str, Any]:
    return {
        "model_type": "qwen2", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": 152064, "max_position_embeddings": 32768, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": layers, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }  # fmt: skip


_DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1, "vocab_size": 129280, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
}  # fmt: skip

_DEEPSEEK_V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "vocab_size": 102400, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
}  # fmt: skip

_GPT_OSS_20B: dict[str, Any] = {
    "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "vocab_size": 201088,
    "max_position_embeddings": 131072, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"},
}  # fmt: skip

_GEMMA3_27B: dict[str, Any] = {
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072,
        "sliding_window": 1024, "sliding_window_pattern": 6,
    },
}  # fmt: skip

_PRESETS: tuple[Preset, ...] = (
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
           "32 layers, 8 KV heads x 128, bf16, GQA", 8_030_261_248, 2.0,
           _llama(4096, 14336, 32, 32)),
    Preset("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct",
           "80 layers, 8 KV heads x 128, bf16, GQA", 70_553_706_496, 2.0,
           _llama(8192, 28672, 80, 64)),
    Preset("qwen3-8b", "Qwen/Qwen3-8B",
           "36 layers, 8 KV heads x 128, bf16, 40,960 context", 8_190_735_360, 2.0,
           _qwen3(4096, 12288, 36, 32)),
    Preset("qwen3-32b", "Qwen/Qwen3-32B",
           "64 layers, 8 KV heads x 128, bf16, 40,960 context", 32_762_123_264, 2.0,
           _qwen3(5120, 25600, 64, 64)),
    Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct",
           "28 layers, 4 KV heads x 128, bf16", 7_615_616_512, 2.0,
           _qwen25(3584, 18944, 28, 28, 4)),
    Preset("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct",
           "48 layers, 8 KV heads x 128, bf16", 14_770_033_664, 2.0,
           _qwen25(5120, 13824, 48, 40, 8)),
    Preset("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3",
           "32 layers, 8 KV heads x 128, bf16, no sliding window (v0.3)", 7_248_023_552, 2.0,
           {**_llama(4096, 14336, 32, 32), "model_type": "mistral", "vocab_size": 32768,
            "max_position_embeddings": 32768, "head_dim": 128, "sliding_window": None}),
    Preset("deepseek-v3", "deepseek-ai/DeepSeek-V3",
           "MLA (kv_lora_rank 512 + rope 64), 61 layers, fp8 weights, 671B MoE",
           671_026_419_200, 1.0, _DEEPSEEK_V3),
    Preset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite-Chat",
           "MLA (kv_lora_rank 512 + rope 64), 27 layers, bf16, 15.7B MoE",
           15_706_484_224, 2.0, _DEEPSEEK_V2_LITE),
    Preset("gpt-oss-20b", "openai/gpt-oss-20b",
           "hybrid: 12 sliding (128) + 12 full layers, 8 KV heads x 64, MXFP4 experts",
           20_914_757_184, 0.66, _GPT_OSS_20B),
    Preset("gemma-3-27b", "google/gemma-3-27b-it",
           "hybrid: 52 sliding (1024) + 10 full layers, 16 KV heads x 128, bf16",
           27_432_406_640, 2.0, _GEMMA3_27B),
)  # fmt: skip


def presets() -> tuple[Preset, ...]:
    return _PRESETS


def preset_names() -> tuple[str, ...]:
    return tuple(p.name for p in _PRESETS)


def find_preset(name: str) -> Preset:
    wanted = name.strip().lower()
    for preset in _PRESETS:
        if wanted in (preset.name, preset.hf_id.lower()):
            return preset
    raise CapacityConfigError(
        "preset", f"unknown preset {name!r}; known presets: {', '.join(preset_names())}"
    )


def preset_arch(name: str) -> ModelArch:
    preset = find_preset(name)
    return arch_from_hf_config(
        preset.config,
        name=preset.name,
        hf_id=preset.hf_id,
        param_count=preset.param_count,
        weight_bytes_per_param=preset.weight_bytes_per_param,
    )
