"""Speculative decoding: what a drafter adds to the KV pool and to the weights.

vLLM builds the drafter inside the same ``VllmConfig`` as the target, so its attention
layers register in the same static forward context and ``GPUModelRunner.get_kv_cache_spec``
returns them beside the target's. ``get_kv_cache_groups`` then treats them as more
layers of the model: a drafter whose layers have the target's KV shape joins the
target's full-attention group (EAGLE's proposer even checks that all its layers sit in
one group), so the pool is divided by ``target + draft`` layers instead of ``target``.

Per method (``vllm/config/speculative.py``, ``vllm/v1/spec_decode/``):

* ``eagle`` / ``eagle3``: a small head (one decoder layer for the public Llama-3.1 and
  Qwen3 drafters) reused for every speculative token; its attention has the target's
  KV heads and head size. It shares the target's embedding (and, for EAGLE-1, the LM
  head), so its weights are one layer plus an input projection (``fc``: 2 x hidden
  inputs for EAGLE, 3 x hidden for EAGLE-3's fused hidden states).
* ``mtp``: the checkpoint's own next-token-prediction layers
  (``num_nextn_predict_layers``, DeepSeek V3: 1), same attention (MLA) as the target.
* ``draft_model``: a separate smaller model; every one of its layers takes KV, sized by
  its own heads and head size.
* ``ngram``: no drafter network: no KV layers, no weights.

``num_speculative_tokens`` does not change the number of KV layers (an EAGLE or MTP
layer is run k times); it sets the lookahead slots each running request holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgateway.capacity.arch import ModelArch, kv_bytes_per_token_per_layer
from kvgateway.capacity.errors import CapacityConfigError, show

SPECULATIVE_METHODS = ("eagle", "eagle3", "mtp", "draft_model", "ngram")
SPECULATIVE_KEYS = (
    "method", "num_speculative_tokens", "draft_layers", "draft_model_config",
    "draft_preset", "draft_weights_gib",
)  # fmt: skip
# EAGLE's input projection: concatenated (embedding, hidden) for EAGLE-1, three fused
# hidden states plus the embedding for EAGLE-3 (``fc`` in vLLM's llama_eagle*.py).
_FC_INPUTS = {"eagle": 2, "eagle3": 3, "mtp": 2}


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """The ``speculative:`` part of a ``capacity:`` block.

    ``draft_layers`` overrides the layer count (default: 1 for EAGLE, the model's
    ``num_nextn_predict_layers`` for MTP, the draft model's layers); ``draft_model`` is
    the drafter's architecture when a config was given; ``draft_weights_gib`` is the
    drafter's weights per GPU (vLLM's ``Model loading took`` includes them).
    """

    method: str
    num_speculative_tokens: int = 1
    draft_layers: int | None = None
    draft_model: ModelArch | None = None
    draft_weights_gib: float | None = None


@dataclass(frozen=True, slots=True)
class DraftKV:
    """The drafter's KV, counted in layers of the target's shape.

    ``exact`` is False when the drafter's layers have another shape and were converted
    to target-layer equivalents by bytes (vLLM would unify page sizes and may pad).
    """

    layers: int
    exact: bool = True


def parse_speculative(data: Any, draft_model: ModelArch | None) -> SpeculativeSpec:
    """Validate a ``speculative:`` mapping; ``draft_model`` was resolved by the caller."""
    if not isinstance(data, Mapping):
        raise CapacityConfigError("", f"expected a mapping, got {show(data)}")
    for key in data:
        if key not in SPECULATIVE_KEYS:
            raise CapacityConfigError(
                str(key), f"unknown key; expected one of {', '.join(SPECULATIVE_KEYS)}"
            )
    method = data.get("method")
    if method not in SPECULATIVE_METHODS:
        raise CapacityConfigError(
            "method", f"expected one of {', '.join(SPECULATIVE_METHODS)}, got {show(method)}"
        )
    tokens = _positive_int(data, "num_speculative_tokens") or 1
    layers = data.get("draft_layers")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)):
        raise CapacityConfigError("draft_layers", f"expected an integer >= 0, got {show(layers)}")
    if layers is not None and layers < 0:
        raise CapacityConfigError("draft_layers", f"expected an integer >= 0, got {show(layers)}")
    weights = data.get("draft_weights_gib")
    if weights is not None and (
        isinstance(weights, bool)
        or not isinstance(weights, int | float)
        or not math.isfinite(weights)
        or weights < 0
    ):
        raise CapacityConfigError(
            "draft_weights_gib", f"expected a number >= 0, got {show(weights)}"
        )
    if method == "draft_model" and draft_model is None:
        raise CapacityConfigError(
            "draft_model_config",
            "missing: draft_model needs the drafter's config (draft_model_config or draft_preset)",
        )
    if method == "ngram" and (layers or draft_model is not None or weights):
        raise CapacityConfigError("method", "ngram has no drafter: drop the draft_* keys")
    return SpeculativeSpec(
        method=method,
        num_speculative_tokens=tokens,
        draft_layers=layers,
        draft_model=draft_model,
        draft_weights_gib=None if weights is None else float(weights),
    )


def _positive_int(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CapacityConfigError(key, f"expected a positive integer, got {show(value)}")
    return value


def draft_layer_count(spec: SpeculativeSpec, target: ModelArch) -> int:
    """Attention layers the drafter registers (before any shape conversion)."""
    if spec.draft_layers is not None:
        return spec.draft_layers
    if spec.method == "ngram":
        return 0
    if spec.draft_model is not None:
        return spec.draft_model.num_layers
    if spec.method == "mtp":
        return target.num_nextn_predict_layers or 1
    return 1


def draft_kv(
    spec: SpeculativeSpec | None, target: ModelArch, tp: int, kv_cache_dtype: str
) -> DraftKV:
    if spec is None:
        return DraftKV(0)
    count = draft_layer_count(spec, target)
    if spec.draft_model is None or count == 0:
        return DraftKV(count)
    own = kv_bytes_per_token_per_layer(spec.draft_model, tp, kv_cache_dtype)
    per_layer = kv_bytes_per_token_per_layer(target, tp, kv_cache_dtype)
    if own == per_layer:
        return DraftKV(count)
    return DraftKV(math.ceil(count * own / per_layer), exact=False)


def draft_weights_bytes(
    spec: SpeculativeSpec | None, target: ModelArch, tp: int, pp: int = 1
) -> int | None:
    """The drafter's weights per GPU; None when nothing says how large they are.

    EAGLE/MTP heads borrow the target's embedding only without PP (under PP the drafter
    sits on the last stage, away from the embedding, and loads its own: eagle.py
    ``load_model``); EAGLE-1 and MTP borrow the LM head, EAGLE-3 has its own over a draft
    vocabulary, counted when the drafter's config gives it.
    """
    if spec is None or spec.method == "ngram":
        return 0
    if spec.draft_weights_gib is not None:
        return int(spec.draft_weights_gib * (1 << 30))
    draft = spec.draft_model
    if draft is not None and draft.param_count is not None and spec.method == "draft_model":
        return int(draft.param_count * draft.weight_bytes_per_param / tp)
    shape = draft or target
    layer = average_layer_params(shape)
    if layer is None or shape.hidden_size is None:
        return None
    params = draft_layer_count(spec, target) * layer
    params += _FC_INPUTS.get(spec.method, 0) * shape.hidden_size * shape.hidden_size
    if pp > 1:
        params += embedding_params(target)
    if spec.method == "eagle3" and draft is not None:
        params += embedding_params(draft)
    return int(params * shape.weight_bytes_per_param / tp)


def embedding_params(arch: ModelArch) -> int:
    """One vocabulary x hidden matrix (the input embedding, or the LM head)."""
    return (arch.vocab_size or 0) * (arch.hidden_size or 0)


def average_layer_params(arch: ModelArch) -> float | None:
    """Parameters of one decoder layer, averaged (MoE models mix dense and MoE layers)."""
    if arch.param_count is None:
        return None
    matrices = 1 if arch.tied_embeddings else 2
    return max(0, arch.param_count - matrices * embedding_params(arch)) / arch.num_layers
