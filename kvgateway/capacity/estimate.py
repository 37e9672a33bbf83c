"""``estimate(spec)``: a node's KV capacity, as vLLM would compute it at start-up.

``kv_cache_tokens`` is the gateway's budget: tokens requests can actually hold, i.e.
vLLM's logged ``GPU KV cache size`` minus the reserved null block
(``(num_gpu_blocks - 1) * block_size`` for one-group models). ``vllm_logged_tokens`` is
the figure vLLM itself prints, for comparing with a log. ``max_model_len_fit`` is the
longest request that can really be scheduled (also without the null block; vLLM
releases before the 2026-08 fix accepted one block more and then stalled such a
request forever).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvgateway.capacity import layout as lay
from kvgateway.capacity.arch import kv_bytes_per_token
from kvgateway.capacity.memory import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_OVERHEAD_GIB,
    GIB,
    PoolBreakdown,
    activation_bytes,
    default_max_num_batched_tokens,
    estimate_pool,
    gib_to_bytes,
    measured_pool,
    weights_bytes_per_gpu,
)
from kvgateway.capacity.spec import CapacitySpec

# Search ceiling when neither the spec nor the model says how long a context may be.
_UNBOUNDED_CONTEXT = 10_000_000


@dataclass(frozen=True, slots=True)
class CapacityEstimate:
    model_name: str
    bytes_per_token: int  # per GPU, all layers (hybrid: as if every layer were full)
    bytes_per_token_per_layer: int
    kv_pool_bytes: int  # per GPU
    num_gpu_blocks: int
    block_size: int
    kv_cache_tokens: int  # usable: reserved null block excluded
    vllm_logged_tokens: int  # what "GPU KV cache size: N tokens" would say
    max_model_len_fit: int  # longest single request that can be scheduled
    kv_limited_len: int  # the same, ignoring the model's max_position_embeddings
    target_len: int  # the context the concurrency figure is for
    max_concurrency: float  # requests of target_len that fit at once (null block excluded)
    vllm_logged_concurrency: float  # what "Maximum concurrency for ..." would say
    max_num_batched_tokens: int
    tp: int
    pool: PoolBreakdown
    layout: lay.KVLayout
    notes: tuple[str, ...] = ()

    def concurrency_at(self, context_len: int) -> float:
        """Requests of ``context_len`` tokens that fit at once in the usable blocks."""
        return lay.concurrency(
            self.layout,
            self.num_gpu_blocks - 1,
            context_len,
            self.block_size,
            self.max_num_batched_tokens,
        )

    @property
    def fits_target(self) -> bool:
        return self.max_model_len_fit >= self.target_len


def _pool(spec: CapacitySpec, mnbt: int, notes: list[str]) -> PoolBreakdown:
    if spec.kv_cache_memory_gib is not None:
        notes.append(
            f"KV pool taken as given: {spec.kv_cache_memory_gib:.2f} GiB per GPU "
            "(vLLM's 'Available KV cache memory')"
        )
        return measured_pool(spec.kv_cache_memory_gib)
    assert spec.gpu_memory_gib is not None  # spec validation guarantees one of the two
    model = spec.model
    if spec.weights_gib is not None:
        weights = gib_to_bytes(spec.weights_gib)
    else:
        estimated = weights_bytes_per_gpu(model, spec.tp)
        assert estimated is not None  # spec validation guarantees a parameter count
        weights = estimated
        notes.append(
            f"weights estimated at {weights / GIB:.2f} GiB per GPU "
            f"({(model.param_count or 0) / 1e9:.2f}B params x "
            f"{model.weight_bytes_per_param:.2f} B / tp {spec.tp}); override with weights_gib"
        )
    if spec.overhead_gib is not None:
        activation, overhead = 0, gib_to_bytes(spec.overhead_gib)
    else:
        seqs = spec.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        activation = activation_bytes(model, spec.tp, mnbt, seqs)
        overhead = gib_to_bytes(DEFAULT_OVERHEAD_GIB)
        notes.append(
            f"activation peak estimated at {activation / GIB:.2f} GiB "
            f"(max_num_batched_tokens {mnbt}) plus {DEFAULT_OVERHEAD_GIB:.1f} GiB for "
            "non-torch memory and CUDA graphs; override with overhead_gib"
        )
    return estimate_pool(
        total_gib=spec.gpu_memory_gib,
        utilization=spec.gpu_memory_utilization,
        weights_bytes=weights,
        activation=activation,
        overhead=overhead,
    )


def _layout_notes(spec: CapacitySpec, layout: lay.KVLayout) -> list[str]:
    notes: list[str] = []
    model = spec.model
    if spec.kv_cache_dtype == "float32" and spec.weights_gib is None and model.dtype != "float32":
        notes.append(
            "an fp32 KV cache means serving with --dtype float32, which also doubles the "
            f"{model.dtype} weights; the weight estimate does not: pass weights_gib"
        )
    if model.is_mla:
        notes.append(
            "MLA: one latent of kv_lora_rank + qk_rope_head_dim per token per layer, "
            "replicated on every TP rank (TP does not shrink it); vLLM's MLA backends "
            "often run with block size 64 (FlashMLA) or 128: pass the one your log shows"
        )
    elif model.num_kv_heads < spec.tp:
        notes.append(
            f"{model.num_kv_heads} KV heads over tp {spec.tp}: vLLM replicates a head on "
            "several ranks (max(1, kv_heads // tp) per GPU), so TP stops saving KV memory"
        )
    if layout.is_hybrid:
        notes.append(
            f"hybrid layout as vLLM groups it: {layout.num_groups} KV groups of "
            f"{layout.group_size} layers ({layout.padding_layers} padding layers); "
            "kv_cache_tokens counts a request in every group, exact below the "
            f"{model.sliding_window}-token window and conservative above it"
        )
    elif model.all_sliding:
        notes.append(
            f"every layer keeps only the last {model.sliding_window} tokens; long requests "
            "cost less than kv_cache_tokens suggests"
        )
    return notes


def estimate(spec: CapacitySpec) -> CapacityEstimate:
    notes = [*spec.model.notes]
    mnbt = spec.max_num_batched_tokens or default_max_num_batched_tokens(spec.gpu_memory_gib)
    layout = lay.kv_layout(spec.model, spec.tp, spec.kv_cache_dtype)
    notes.extend(_layout_notes(spec, layout))
    pool = _pool(spec, mnbt, notes)
    blocks = lay.num_gpu_blocks(layout, pool.pool_bytes, spec.block_size)
    if pool.pool_bytes < 0 and not pool.measured:
        notes.append(
            f"the weights ({pool.weights_bytes / GIB:.2f} GiB per GPU) and overheads exceed "
            f"the {pool.requested_bytes / GIB:.2f} GiB vLLM may use: the model does not load "
            "on this GPU with these settings"
        )
    elif blocks <= 1:
        notes.append("no KV blocks fit: the model does not run with these settings")
    kv_limit = lay.max_context_fitting(
        layout, blocks - 1, spec.block_size, mnbt, _UNBOUNDED_CONTEXT
    )
    # An explicit max_model_len above the config's limit (rope scaling) raises the cap.
    model_limit = max(spec.model.max_position_embeddings or 0, spec.max_model_len or 0)
    fit = min(kv_limit, model_limit or kv_limit)
    target = spec.max_model_len or spec.model.max_position_embeddings or max(fit, 1)
    limit = spec.model.max_position_embeddings
    if spec.max_model_len and limit and spec.max_model_len > limit:
        notes.append(
            f"max_model_len {spec.max_model_len} exceeds the model's "
            f"max_position_embeddings {limit}; vLLM refuses that unless rope scaling is "
            "configured"
        )
    logged_concurrency = lay.concurrency(layout, blocks, target, spec.block_size, mnbt)
    result = CapacityEstimate(
        model_name=spec.model.name,
        bytes_per_token=kv_bytes_per_token(spec.model, spec.tp, spec.kv_cache_dtype),
        bytes_per_token_per_layer=layout.bytes_per_token_per_layer,
        kv_pool_bytes=max(0, pool.pool_bytes),
        num_gpu_blocks=blocks,
        block_size=spec.block_size,
        kv_cache_tokens=lay.usable_tokens(layout, blocks, spec.block_size),
        vllm_logged_tokens=lay.vllm_logged_tokens(layout, blocks, spec.block_size),
        max_model_len_fit=fit,
        kv_limited_len=kv_limit,
        target_len=target,
        max_concurrency=0.0,
        vllm_logged_concurrency=logged_concurrency,
        max_num_batched_tokens=mnbt,
        tp=spec.tp,
        pool=pool,
        layout=layout,
        notes=tuple(notes),
    )
    return replace(result, max_concurrency=result.concurrency_at(target))
