"""A model's attention architecture, and what one token of KV costs on one GPU.

Mirrors vLLM's per-layer KV specs (``vllm/v1/kv_cache_interface.py``):

* ordinary attention (MHA/GQA), ``AttentionSpec.real_page_size_bytes``:
  ``2 * block_size * num_kv_heads * head_size * dtype_bytes`` per layer, where
  ``num_kv_heads = max(1, total_kv_heads // tensor_parallel_size)``
  (``ModelConfig.get_num_kv_heads``) and ``head_size`` is config ``head_dim`` or
  ``hidden_size // num_attention_heads`` (``get_head_size``);
* MLA (DeepSeek V2/V3, Kimi K2, ...), ``MLAAttentionSpec.real_page_size_bytes``:
  ``block_size * 1 * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``: one latent, no
  K/V factor 2 and replicated on every TP rank (``get_num_kv_heads`` is 1 for MLA);
  ``fp8_ds_mla`` (DeepSeek V3.2 sparse) is a fixed 656 bytes per token;
* per-token-head quantised caches (``int8_per_token_head``, ``fp8_per_token_head``)
  add ``2 * num_kv_heads * 4`` bytes of fp32 scales per token (``page_size_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgateway.capacity.errors import CapacityConfigError

# Bytes per element of the model's own dtype, as config.json's torch_dtype spells it.
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
}

# vLLM's --kv-cache-dtype spellings that store one byte per element.
_ONE_BYTE_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
_PER_TOKEN_HEAD_KV = ("int8_per_token_head", "fp8_per_token_head")
# DeepSeek V3.2's sparse-MLA cache: 512 fp8 latent + scales + 64 bf16 rope = 656 B/token.
FP8_DS_MLA_BYTES_PER_TOKEN = 656

# Short spellings accepted in YAML and on the command line.
KV_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
}

KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    *_ONE_BYTE_KV,
    *_PER_TOKEN_HEAD_KV,
    "fp8_ds_mla",
)


@dataclass(frozen=True, slots=True)
class ModelArch:
    """What the KV maths needs to know about a model; built from config.json or a preset.

    ``sliding_layers`` are the indices of sliding-window layers (window
    ``sliding_window``); every other layer is full attention. ``param_count`` and
    ``weight_bytes_per_param`` size the weights when no measured figure is given.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    hf_id: str | None = None
    num_attention_heads: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    max_position_embeddings: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    param_count: int | None = None
    weight_bytes_per_param: float = 2.0
    # Shared input/output embedding (sizes the weights of each pipeline stage).
    tied_embeddings: bool = False
    # DeepSeek-style multi-token-prediction layers shipped with the checkpoint.
    num_nextn_predict_layers: int = 0
    # A KV-cache quantization the checkpoint carries ("fp8"): vLLM's kv_cache_dtype "auto"
    # then resolves to it, not to the model dtype.
    kv_cache_quant: str | None = None
    # What the config parser had to assume; shown with every estimate.
    notes: tuple[str, ...] = ()

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_hybrid(self) -> bool:
        """Mixes full and sliding-window layers (vLLM's hybrid KV cache manager)."""
        return 0 < len(self.sliding_layers) < self.num_layers

    @property
    def all_sliding(self) -> bool:
        return self.sliding_window is not None and len(self.sliding_layers) == self.num_layers


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per stored K/V element for vLLM's ``--kv-cache-dtype``.

    ``auto`` follows the model dtype, except that vLLM's ``--dtype auto`` serves fp32
    checkpoints in 16-bit (``ModelConfig`` dtype resolution), so an fp32 KV cache only
    happens when asked for (``float32``, i.e. ``--dtype float32``).
    """
    dtype = kv_cache_dtype.lower()
    if dtype == "auto":
        model_bytes = DTYPE_BYTES.get(model_dtype.lower())
        if model_bytes is None:
            raise CapacityConfigError(
                "torch_dtype",
                f"unknown model dtype {model_dtype!r}; expected one of bfloat16, float16, "
                "float32 (or set kv_cache_dtype explicitly)",
            )
        return min(model_bytes, 2)
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    if dtype in _ONE_BYTE_KV or dtype in _PER_TOKEN_HEAD_KV or dtype == "fp8_ds_mla":
        return 1
    raise CapacityConfigError(
        "kv_cache_dtype",
        f"unknown KV cache dtype {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}",
    )


def kv_heads_per_gpu(arch: ModelArch, tp: int) -> int:
    if arch.is_mla:
        return 1
    return max(1, arch.num_kv_heads // tp)


def kv_bytes_per_token_per_layer(arch: ModelArch, tp: int, kv_cache_dtype: str) -> int:
    """One token's K+V (or MLA latent) in one layer on one GPU, in bytes."""
    dtype = kv_cache_dtype.lower()
    if dtype == "auto" and arch.kv_cache_quant is not None:
        dtype = arch.kv_cache_quant
    if arch.is_mla:
        if dtype == "fp8_ds_mla":
            return FP8_DS_MLA_BYTES_PER_TOKEN
        if dtype in _PER_TOKEN_HEAD_KV:
            raise CapacityConfigError(
                "kv_cache_dtype", f"{kv_cache_dtype} applies to ordinary attention, not MLA"
            )
        latent = (arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0)
        return latent * kv_dtype_bytes(dtype, arch.dtype)
    if dtype == "fp8_ds_mla":
        raise CapacityConfigError(
            "kv_cache_dtype", "fp8_ds_mla is only for MLA models (DeepSeek V3.2 family)"
        )
    heads = kv_heads_per_gpu(arch, tp)
    per_token = 2 * heads * arch.head_dim * kv_dtype_bytes(dtype, arch.dtype)
    if dtype in _PER_TOKEN_HEAD_KV:
        per_token += 2 * heads * 4  # fp32 scale per token per head, for K and for V
    return per_token


def kv_bytes_per_token(arch: ModelArch, tp: int, kv_cache_dtype: str) -> int:
    """Per GPU, all layers: the figure people quote (Qwen3-8B bf16 = 147,456 B)."""
    return kv_bytes_per_token_per_layer(arch, tp, kv_cache_dtype) * arch.num_layers
