"""Read a Hugging Face ``config.json`` (already decoded) into a :class:`ModelArch`.

Field resolution follows vLLM's ``ModelConfig`` (``vllm/config/model.py``):
``get_head_size`` (``head_dim``, else ``hidden_size // num_attention_heads``; MLA:
``kv_lora_rank + qk_rope_head_dim``), ``get_total_num_kv_heads``
(``num_key_value_heads``, else ``multi_query`` -> 1, else ``num_attention_heads``) and
``is_deepseek_mla``. Multimodal checkpoints keep the language model under
``text_config``; its keys win over the top level.

Sliding-window layers are found from ``layer_types`` (transformers >= 4.54), Gemma 3's
``sliding_window_pattern``, Gemma 2's alternation, Qwen2's ``max_window_layers`` or
Mistral's every-layer window. Layouts we cannot size correctly (Mamba / linear
attention hybrids, Llama 4 chunked attention, unknown sliding patterns) are refused
with a message instead of a wrong number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgateway.capacity.arch import DTYPE_BYTES, ModelArch
from kvgateway.capacity.errors import CapacityConfigError, show

_KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
_SSM_MODEL_TYPES = (
    "jamba", "mamba", "mamba2", "nemotron_h", "qwen3_next", "falcon_h1", "bamba",
    "zamba2", "granitemoehybrid", "lfm2", "minimax", "kimi_linear",
)  # fmt: skip
_EVERY_LAYER_WINDOW_TYPES = ("mistral", "mixtral", "mistral3", "ministral")
# transformers' class defaults for keys that released config.json files leave out
# (Gemma 3's text_config has no sliding_window_pattern, vocab_size or context length).
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "sliding_window_pattern": 6,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
}


def _merged(config: Mapping[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    merged = {**config, **text} if isinstance(text, Mapping) else dict(config)
    defaults = _TYPE_DEFAULTS.get(str(merged.get("model_type", "")), {})
    return {**defaults, **merged}


def _int(cfg: Mapping[str, Any], *keys: str, required: bool = True) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CapacityConfigError(key, f"expected a positive integer, got {show(value)}")
        return value
    if required:
        raise CapacityConfigError(keys[0], "missing (needed for the KV size)")
    return None


def _refuse_unsupported(cfg: Mapping[str, Any], model_type: str) -> None:
    if model_type in _SSM_MODEL_TYPES or any(k.startswith(("mamba", "ssm_")) for k in cfg):
        raise CapacityConfigError(
            "model_type",
            f"{model_type or 'this model'} mixes attention with Mamba/linear-attention "
            "state; vLLM pads and aligns those pages in ways a formula does not capture. "
            "Start the node once and use its logged numbers (--from-log, or "
            "kv_cache_tokens from the log's 'GPU KV cache size').",
        )
    if cfg.get("attention_chunk_size"):
        raise CapacityConfigError(
            "attention_chunk_size",
            "chunked local attention (Llama 4) is not modelled; use the node's logged "
            "'GPU KV cache size' as kv_cache_tokens.",
        )
    per_layer = [k for k in _PER_LAYER_SHAPES if k in cfg] or (
        ["model_type"] if model_type.startswith(("gemma4", "gemma3n")) else []
    )
    if per_layer:
        raise CapacityConfigError(
            per_layer[0],
            f"{model_type or 'this model'} gives its layers different KV shapes (or shares "
            "KV between layers), which vLLM pages per layer type; not modelled: use the "
            "node's logged 'GPU KV cache size' as kv_cache_tokens.",
        )


# Keys of configs whose layers differ in KV shape (Gemma 4's full layers) or share KV.
_PER_LAYER_SHAPES = ("global_head_dim", "num_global_key_value_heads", "num_kv_shared_layers")
# Where a config states its context, in vLLM's order (the smallest one given is the limit).
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def _context(cfg: Mapping[str, Any]) -> int | None:
    found = [v for k in _CONTEXT_KEYS if type(v := cfg.get(k)) is int and v > 0]
    return min(found, default=None)


def _sliding_layers(
    cfg: Mapping[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[int, ...], str | None]:
    """(window, sliding layer indices, note)."""
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or window in (None, 0, False):
        if isinstance(layer_types, list) and "sliding_attention" in layer_types:
            raise CapacityConfigError(
                "sliding_window", "layer_types names sliding layers but no sliding_window"
            )
        return None, (), None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise CapacityConfigError(
            "sliding_window", f"expected a positive integer, got {show(window)}"
        )
    if isinstance(layer_types, list):
        unknown = sorted({str(t) for t in layer_types} - set(_KNOWN_LAYER_TYPES))
        if unknown:
            raise CapacityConfigError(
                "layer_types",
                f"layer types {', '.join(unknown)} are not modelled (only full and "
                "sliding attention); use the node's logged 'GPU KV cache size'.",
            )
        if len(layer_types) != num_layers:
            raise CapacityConfigError(
                "layer_types", f"has {len(layer_types)} entries for {num_layers} layers"
            )
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        return window, layers, None
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        # Gemma 3: every pattern-th layer is global, the rest slide.
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)
        return window, layers, None
    if model_type == "gemma2":
        return window, tuple(range(0, num_layers, 2)), None
    if cfg.get("use_sliding_window") is True and isinstance(cfg.get("max_window_layers"), int):
        first = int(cfg["max_window_layers"])
        return window, tuple(range(first, num_layers)), None
    if model_type in _EVERY_LAYER_WINDOW_TYPES:
        note = f"every layer slides over {window} tokens (Mistral-style sliding window)"
        return window, tuple(range(num_layers)), note
    raise CapacityConfigError(
        "sliding_window",
        f"sliding_window={window} but neither layer_types nor a known pattern says which "
        "layers slide; add layer_types to the config, or size the node from its log.",
    )


def _weight_bytes(cfg: Mapping[str, Any], dtype_bytes: int) -> tuple[float, float, str | None]:
    """(bytes per dense param, bytes per expert param, note) from quantization_config."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping):
        return float(dtype_bytes), float(dtype_bytes), None
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8", "modelopt", "ptpc_fp8"):
        return 1.0, 1.0, None
    if method == "mxfp4":
        # gpt-oss: MoE experts in MXFP4 (4.25 bits with scales), the rest in 16-bit.
        return float(dtype_bytes), 4.25 / 8, None
    bits = quant.get("bits", quant.get("w_bit"))
    if method == "compressed-tensors":
        for group in (quant.get("config_groups") or {}).values():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and isinstance(weights.get("num_bits"), int):
                bits = weights["num_bits"]
                break
    if quant.get("load_in_4bit"):
        bits = 4
    if isinstance(bits, int) and 0 < bits <= 16:
        return bits / 8, bits / 8, None
    note = f"quantization {method or 'unknown'}: weights sized at the model dtype; pass weights_gib"
    return float(dtype_bytes), float(dtype_bytes), note


def _param_split(
    cfg: Mapping[str, Any], arch_bits: dict[str, int | None]
) -> tuple[int, int] | None:
    """(dense params, routed-expert params); None when the shape is incomplete."""
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model", required=False)
    vocab = _int(cfg, "vocab_size", required=False)
    inter = _int(cfg, "intermediate_size", "ffn_dim", required=False)
    layers = arch_bits["layers"]
    heads = arch_bits["heads"]
    if hidden is None or vocab is None or layers is None or heads is None:
        return None
    kv_lora = arch_bits["kv_lora_rank"]
    if kv_lora is not None:
        rope = arch_bits["rope"] or 0
        nope = _int(cfg, "qk_nope_head_dim", required=False) or 0
        v_dim = _int(cfg, "v_head_dim", required=False) or nope
        q_lora = _int(cfg, "q_lora_rank", required=False)
        q = (
            hidden * q_lora + q_lora * heads * (nope + rope)
            if q_lora
            else hidden * heads * (nope + rope)
        )
        attn = (
            q
            + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v_dim)
            + heads * v_dim * hidden
        )
    else:
        head_dim = arch_bits["head_dim"] or 0
        kv_heads = arch_bits["kv_heads"] or heads
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = _int(cfg, "n_routed_experts", "num_local_experts", "num_experts", required=False)
    dense_layers, expert_params = layers, 0
    mlp_dense = 3 * hidden * inter if inter else None
    if experts:
        moe_inter = _int(cfg, "moe_intermediate_size", required=False) or inter
        if moe_inter is None:
            return None
        dense_layers = min(layers, _int(cfg, "first_k_dense_replace", required=False) or 0)
        moe_layers = layers - dense_layers
        shared = (_int(cfg, "n_shared_experts", required=False) or 0) * 3 * hidden * moe_inter
        shared += 3 * hidden * (_int(cfg, "shared_expert_intermediate_size", required=False) or 0)
        expert_params = moe_layers * experts * 3 * hidden * moe_inter
        dense = moe_layers * (attn + shared + hidden * experts) + dense_layers * attn
        if dense_layers:
            if mlp_dense is None:
                return None
            dense += dense_layers * mlp_dense
    else:
        if mlp_dense is None:
            return None
        dense = layers * (attn + mlp_dense)
    tied = bool(cfg.get("tie_word_embeddings", False))
    dense += vocab * hidden * (1 if tied else 2)
    return dense, expert_params


def arch_from_hf_config(
    config: Mapping[str, Any],
    *,
    name: str,
    hf_id: str | None = None,
    param_count: int | None = None,
    weight_bytes_per_param: float | None = None,
) -> ModelArch:
    """Errors carry the config.json key as ``path``; re-root them with ``.under()``."""
    if not isinstance(config, Mapping):
        raise CapacityConfigError("", f"expected a JSON object, got {show(config)}")
    cfg = _merged(config)
    model_type = str(cfg.get("model_type", ""))
    _refuse_unsupported(cfg, model_type)
    num_layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    assert num_layers is not None
    heads = _int(cfg, "num_attention_heads", "n_head", required=False)
    # In vLLM's order (model_arch_config_convertor): Falcon's, Llama's, ChatGLM's, Step's.
    kv_heads = _int(
        cfg,
        "n_head_kv",
        "num_kv_heads",
        "num_key_value_heads",
        "multi_query_group_num",
        "num_attention_groups",
        required=False,
    )
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    kv_lora = _int(cfg, "kv_lora_rank", required=False)
    rope = _int(cfg, "qk_rope_head_dim", required=kv_lora is not None)
    head_dim = _int(cfg, "head_dim", required=False)
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model", required=False)
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    if kv_lora is None and (head_dim is None or kv_heads is None):
        raise CapacityConfigError(
            "num_key_value_heads" if kv_heads is None else "head_dim",
            "missing: need num_key_value_heads (or num_attention_heads) and head_dim "
            "(or hidden_size / num_attention_heads)",
        )
    raw_dtype = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))
    dtype = str(raw_dtype).removeprefix("torch.").lower()
    if dtype not in DTYPE_BYTES:
        raise CapacityConfigError("torch_dtype", f"unknown dtype {show(raw_dtype)}")
    notes: list[str] = []
    if not (cfg.get("torch_dtype") or cfg.get("dtype")):
        notes.append("config has no torch_dtype; assumed bfloat16")
    if kv_lora is not None and model_type and not model_type.startswith(("deepseek", "kimi")):
        notes.append(f"kv_lora_rank present: treated {model_type} as an MLA model")
    window, sliding, note = _sliding_layers(cfg, model_type, num_layers)
    if note:
        notes.append(note)
    dense_bytes, expert_bytes, qnote = _weight_bytes(cfg, DTYPE_BYTES[dtype])
    if qnote:
        notes.append(qnote)
    bits: dict[str, int | None] = {
        "layers": num_layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "kv_lora_rank": kv_lora, "rope": rope,
    }  # fmt: skip
    split = _param_split(cfg, bits)
    if param_count is None and split is not None:
        param_count = split[0] + split[1]
        if weight_bytes_per_param is None and param_count:
            weight_bytes_per_param = (
                split[0] * dense_bytes + split[1] * expert_bytes
            ) / param_count
    intermediate = _int(cfg, "moe_intermediate_size", "intermediate_size", required=False)
    return ModelArch(
        name=name,
        hf_id=hf_id or (str(cfg["_name_or_path"]) if cfg.get("_name_or_path") else None),
        num_layers=num_layers,
        num_kv_heads=kv_heads or 1,
        head_dim=head_dim or 0,
        dtype=dtype,
        num_attention_heads=heads,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope if kv_lora is not None else None,
        sliding_window=window,
        sliding_layers=sliding,
        max_position_embeddings=_context(cfg),
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=_int(cfg, "vocab_size", required=False),
        param_count=param_count,
        weight_bytes_per_param=weight_bytes_per_param or dense_bytes,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=_int(cfg, "num_nextn_predict_layers", required=False) or 0,
        kv_cache_quant=_kv_cache_quant(cfg),
        notes=tuple(notes),
    )


def _kv_cache_quant(cfg: Mapping[str, Any]) -> str | None:
    """The KV-cache quantization a checkpoint declares, as vLLM's ``kv_cache_dtype auto``
    resolves it: compressed-tensors ``kv_cache_scheme`` of 8-bit floats, or ModelOpt's
    ``kv_cache_quant_algo: FP8``, is an fp8 cache."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    scheme = quant.get("kv_cache_scheme")
    if (
        isinstance(scheme, Mapping)
        and scheme.get("num_bits") == 8
        and str(scheme.get("type", "float")).lower() == "float"
    ):
        return "fp8"
    algo = quant.get("kv_cache_quant_algo")
    if isinstance(algo, str) and algo.upper() == "FP8":
        return "fp8"
    return None
