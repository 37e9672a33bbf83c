"""``estimate(spec)``: a node's KV capacity, as vLLM would compute it at start-up.

``kv_cache_tokens`` is the gateway's budget: tokens requests can actually hold, i.e.
vLLM's logged ``GPU KV cache size`` minus the reserved null block
(``(num_gpu_blocks - 1) * block_size`` for one-group models). ``vllm_logged_tokens`` is
the figure vLLM itself prints, for comparing with a log. ``max_model_len_fit`` is the
longest request that can really be scheduled (also without the null block; vLLM
releases before the 2026-08 fix accepted one block more and then stalled such a
request forever).

A drafter (``spec.speculative``) adds its KV layers to the model's groups and its weights
to the last stage; with ``pp`` stages every stage gets its own pool and block count and
the node takes the smallest (``pipeline``). ``pool`` is then the limiting stage's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvgateway.capacity import layout as lay
from kvgateway.capacity.arch import kv_bytes_per_token_per_layer
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
from kvgateway.capacity.pipeline import StageShare, stage_shares
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.capacity.speculative import draft_kv, draft_weights_bytes

# Search ceiling when neither the spec nor the model says how long a context may be.
_UNBOUNDED_CONTEXT = 10_000_000


@dataclass(frozen=True, slots=True)
class CapacityEstimate:
    model_name: str
    bytes_per_token: int  # per GPU, its layers + drafter's (hybrid: as if all were full)
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
    # Tokens scheduled but not yet freed, what a sliding-window group holds beyond its
    # window (vLLM's max_in_flight_tokens): one batch per concurrent step.
    in_flight_tokens: int
    tp: int
    pool: PoolBreakdown  # the limiting stage's, per GPU
    layout: lay.KVLayout  # model-wide, drafter layers included
    notes: tuple[str, ...] = ()
    pp: int = 1
    draft_layers: int = 0  # drafter KV layers, in layers of the target's shape
    stages: tuple[StageShare, ...] = ()  # per pipeline stage; one entry without PP

    def concurrency_at(self, context_len: int) -> float:
        """Requests of ``context_len`` tokens that fit at once in the usable blocks."""
        return lay.concurrency(
            self.layout,
            self.num_gpu_blocks - 1,
            context_len,
            self.block_size,
            self.in_flight_tokens,
        )

    @property
    def kv_layers_per_gpu(self) -> int:
        """What the limiting GPU divides its pool by: its stage's share of the groups."""
        if not self.stages:
            return self.layout.group_size
        return min(self.stages, key=lambda st: st.num_blocks).kv_layers

    @property
    def fits_target(self) -> bool:
        return self.max_model_len_fit >= self.target_len


def _weights(spec: CapacitySpec, stage: StageShare, notes: list[str]) -> int:
    """Per GPU of one stage: a measured figure as given, else the estimate plus the drafter."""
    if spec.weights_gib is not None:
        return gib_to_bytes(spec.weights_gib)
    model = spec.model
    if spec.pp == 1:
        estimated = weights_bytes_per_gpu(model, spec.tp)
    else:
        estimated = stage.weights_bytes
    assert estimated is not None  # spec validation guarantees a parameter count
    if stage.stage == spec.pp - 1:
        notes.append(
            f"weights estimated at {estimated / GIB:.2f} GiB per GPU"
            + (f" on the last of {spec.pp} stages" if spec.pp > 1 else "")
            + f" ({(model.param_count or 0) / 1e9:.2f}B params x "
            f"{model.weight_bytes_per_param:.2f} B / tp {spec.tp}"
            + (", layers at their average size" if spec.pp > 1 else "")
            + "); override with weights_gib"
        )
    drafter = spec.speculative
    if drafter is not None and stage.stage == spec.pp - 1:
        draft = draft_weights_bytes(drafter, model, spec.tp, spec.pp)
        if draft is None:
            notes.append("the drafter's weights are unknown: pass speculative.draft_weights_gib")
        elif draft:
            notes.append(
                f"{drafter.method} drafter weights: {draft / GIB:.2f} GiB per GPU"
                + ("" if drafter.draft_weights_gib is not None else " (estimated)")
            )
            estimated += draft
    return estimated


def _pool(spec: CapacitySpec, stage: StageShare, mnbt: int, notes: list[str]) -> PoolBreakdown:
    if spec.kv_cache_memory_gib is not None:
        if stage.stage == spec.pp - 1:
            notes.append(
                f"KV pool taken as given: {spec.kv_cache_memory_gib:.2f} GiB per GPU "
                "(vLLM's 'Available KV cache memory')"
                + (", the same on every pipeline stage" if spec.pp > 1 else "")
            )
        return measured_pool(spec.kv_cache_memory_gib)
    assert spec.gpu_memory_gib is not None  # spec validation guarantees one of the two
    model = spec.model
    weights = _weights(spec, stage, notes)
    if spec.overhead_gib is not None:
        activation, overhead = 0, gib_to_bytes(spec.overhead_gib)
    else:
        seqs = spec.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        # Only the last stage computes logits.
        shape = model if stage.stage == spec.pp - 1 else replace(model, vocab_size=0)
        activation = activation_bytes(shape, spec.tp, mnbt, seqs)
        overhead = gib_to_bytes(DEFAULT_OVERHEAD_GIB)
        if stage.stage == spec.pp - 1:
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


def _stages(
    spec: CapacitySpec, layout: lay.KVLayout, draft_layers: int, mnbt: int, notes: list[str]
) -> tuple[tuple[StageShare, ...], PoolBreakdown]:
    """Every stage's pool and blocks, and the pool of the stage with the fewest blocks."""
    page = lay.page_bytes(layout, spec.block_size)
    stages: list[StageShare] = []
    pools: list[PoolBreakdown] = []
    for share in stage_shares(spec.model, layout, spec.tp, spec.pp, draft_layers):
        pool = _pool(spec, share, mnbt, notes)
        if spec.pp == 1:  # the model-wide grouping, padding included
            blocks = lay.num_gpu_blocks(layout, pool.pool_bytes, spec.block_size)
        else:
            blocks = max(0, pool.pool_bytes) // page // max(1, share.kv_layers)
        stages.append(replace(share, pool_bytes=pool.pool_bytes, num_blocks=blocks))
        pools.append(pool)
    limiting = min(range(len(stages)), key=lambda i: stages[i].num_blocks)
    return tuple(stages), pools[limiting]


def _parallel_notes(spec: CapacitySpec, draft_layers: int, exact: bool) -> list[str]:
    notes: list[str] = []
    sd = spec.speculative
    if sd is not None and draft_layers:
        notes.append(
            f"{sd.method} drafter: {draft_layers} KV layer(s) share the pool with the "
            f"model's {spec.model.num_layers}"
            + ("" if exact else " (its layers converted to target-shaped layers by bytes)")
            + f"; each running request also holds {sd.num_speculative_tokens} lookahead "
            + ("slot" if sd.num_speculative_tokens == 1 else "slots")
        )
    if spec.pp > 1:
        notes.append(
            f"pipeline parallel {spec.pp}: each stage holds its own layers' KV; the node "
            "runs on the smallest block count of any stage"
            + ("; a drafter runs on the last stage" if draft_layers else "")
        )
    return notes


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


def in_flight_tokens(max_num_batched_tokens: int, pp: int = 1) -> int:
    """vLLM's ``max_in_flight_tokens``: a batch per concurrent step, 2 with asynchronous
    scheduling (vLLM >= 0.32's default on GPUs), ``pp`` with pipeline parallelism (the
    V1 runner schedules PP without it)."""
    return max_num_batched_tokens * (2 if pp <= 1 else pp)


def estimate(spec: CapacitySpec) -> CapacityEstimate:
    notes = [*spec.model.notes]
    mnbt = spec.max_num_batched_tokens or default_max_num_batched_tokens(spec.gpu_memory_gib)
    draft = draft_kv(spec.speculative, spec.model, spec.tp, spec.kv_cache_dtype)
    # The drafter's layers are full attention and join the target's KV groups.
    kv_model = replace(spec.model, num_layers=spec.model.num_layers + draft.layers)
    layout = lay.kv_layout(kv_model, spec.tp, spec.kv_cache_dtype)
    notes.extend(_layout_notes(spec, layout))
    notes.extend(_parallel_notes(spec, draft.layers, draft.exact))
    stages, pool = _stages(spec, layout, draft.layers, mnbt, notes)
    blocks = min(stage.num_blocks for stage in stages)
    per_layer = kv_bytes_per_token_per_layer(spec.model, spec.tp, spec.kv_cache_dtype)
    if pool.pool_bytes < 0 and not pool.measured:
        notes.append(
            f"the weights ({pool.weights_bytes / GIB:.2f} GiB per GPU) and overheads exceed "
            f"the {pool.requested_bytes / GIB:.2f} GiB vLLM may use: the model does not load "
            "on this GPU with these settings"
        )
    elif blocks <= 1:
        notes.append("no KV blocks fit: the model does not run with these settings")
    in_flight = in_flight_tokens(mnbt, spec.pp)
    kv_limit = lay.max_context_fitting(
        layout, blocks - 1, spec.block_size, in_flight, _UNBOUNDED_CONTEXT
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
    logged_concurrency = lay.concurrency(layout, blocks, target, spec.block_size, in_flight)
    result = CapacityEstimate(
        model_name=spec.model.name,
        bytes_per_token=per_layer * max(st.model_layers + st.draft_layers for st in stages),
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
        in_flight_tokens=in_flight,
        tp=spec.tp,
        pool=pool,
        layout=layout,
        notes=tuple(notes),
        pp=spec.pp,
        draft_layers=draft.layers,
        stages=stages,
    )
    return replace(result, max_concurrency=result.concurrency_at(target))
