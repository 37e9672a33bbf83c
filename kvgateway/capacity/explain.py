"""Explain a vLLM start-up log, and check it against the model's architecture.

With only a log, the numbers come from the log itself: tokens, blocks (the
``num_gpu_blocks_override`` line, ``# GPU blocks``, or tokens over the block size), the
block size (passed, else vLLM's default: 128 on the CPU backend, 16 elsewhere), the
KV-cache groups (``kv cache group sizes``), the KV memory and the bytes per token it
implies. With a model as well (preset or config.json), the architecture predicts the
token count from the logged KV memory; for ordinary attention that prediction matches
vLLM's own count to well within 1% (the only slack is the log rounding GiB to two
decimals), so a larger gap means the log and the model do not describe the same
deployment. Under ``--num-gpu-blocks-override`` the pool is the override and the memory
is checked against the block count vLLM says it would have held.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvgateway.capacity import layout as lay
from kvgateway.capacity.advice import Plan, Recommendation, Settings, make_plan
from kvgateway.capacity.arch import DTYPE_BYTES, KV_CACHE_DTYPES
from kvgateway.capacity.estimate import CapacityEstimate, estimate
from kvgateway.capacity.loggedpool import (
    LoggedPool,
    hybrid_sign,
    log_recommendations,
    logged_block_size,
    logged_pool,
    logged_tokens,
    missing_lines,
    requests_fit,
    vllm_version,
)
from kvgateway.capacity.logparse import LogFacts
from kvgateway.capacity.memory import GIB
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.capacity.speculative import SPECULATIVE_METHODS, SpeculativeSpec

TOLERANCE = 0.01


@dataclass(frozen=True, slots=True)
class CrossCheck:
    predicted_tokens: int
    logged_tokens: int
    deviation: float  # (predicted - logged) / logged
    detail: str

    @property
    def ok(self) -> bool:
        return abs(self.deviation) <= TOLERANCE


@dataclass(frozen=True, slots=True)
class LogReport:
    facts: LogFacts
    findings: tuple[str, ...]
    cross_check: CrossCheck | None = None
    plan: Plan | None = None  # with a model: the full plan on the logged pool
    recommendations: tuple[Recommendation, ...] = ()  # log only
    settings: Settings | None = None  # log only
    missing: tuple[str, ...] = ()  # expected lines the log does not have
    pool: LoggedPool | None = None


def _failure_findings(facts: LogFacts, pool: LoggedPool) -> list[str]:
    bs, length = pool.block_size, facts.max_model_len
    need, have = facts.needed_kv_gib or 0.0, facts.available_kv_gib or 0.0
    if need >= 0.01:
        gib = f"needs {need:.2f} GiB of KV cache, but only {have:.2f} GiB was left"
        out = [f"vLLM refused to start: one request of max_model_len {length} {gib}."]
    else:
        out = [
            f"vLLM refused to start: one request of max_model_len {length} needs more KV "
            "cache than the pool has (vLLM prints both as 0.0 GiB: under its 0.01 GiB rounding)."
        ]
    if facts.num_blocks_override and length and pool.groups == 1:
        per_request = lay.cdiv(length, bs)
        out.append(
            f"--num-gpu-blocks-override {facts.num_blocks_override} gives the pool "
            f"{facts.num_blocks_override} blocks of {bs}; block 0 is vLLM's null block, so "
            f"{(facts.num_blocks_override - 1) * bs:,} tokens fit, and {length:,} tokens need "
            f"{per_request} blocks: an override of {per_request + 1} or more would start."
        )
    m = facts.estimated_max_model_len
    if m is not None and pool.null_block_excluded:
        out.append(
            f"vLLM's estimate of the longest context is {m}; vLLM {facts.vllm_version} leaves "
            "the null block out of it, so a request of that length can be scheduled."
        )
    elif m is not None:
        out.append(
            f"vLLM's estimate of the longest context is {m}. That figure may count the "
            f"reserved null block (releases before the 2026-08 fix), and a request of "
            f"exactly {m} tokens then waits forever: the schedulable maximum is {m - bs}."
        )
    return out


def _pool_findings(facts: LogFacts, pool: LoggedPool) -> list[str]:
    bs, tokens, usable = pool.block_size, logged_tokens(facts, pool.block_size), pool.usable
    if tokens is None:
        return []
    if pool.groups > 1 and usable is not None:
        sizes = ", ".join(map(str, facts.kv_group_block_sizes or ()))
        return [
            f"This model has {pool.groups} KV-cache groups (kv cache group sizes {sizes}): "
            f"every request takes a block in each group, from one pool of {pool.blocks} "
            f"blocks of which block 0 is the null block. Requests within every sliding "
            f"window hold {usable:,} tokens (({pool.blocks} - 1) // {pool.groups} x {bs}); the "
            f"logged {tokens:,} is vLLM's concurrency x max_model_len at full length, where "
            f"a windowed group holds fewer blocks. Use kv_cache_tokens: {usable} for this "
            "node in the gateway (exact for short requests, safe for long ones)."
        ]
    sign = hybrid_sign(facts, bs)
    if sign is not None or usable is None:
        return [
            f"This model has several KV-cache groups ({sign or 'kv cache group sizes'}): the "
            f"logged {tokens:,} tokens are not the pool's size for short requests, and the "
            "log alone cannot say what is. Give --preset or --model-config for the node's "
            "kv_cache_tokens."
        ]
    where = f"{pool.blocks:,} blocks of {bs}, " if pool.blocks else ""
    caveat = (
        "" if pool.null_block_excluded else " (for a model of one kind of attention; one "
        "that mixes in sliding-window or Mamba layers is logged at full-length concurrency "
        "by the newest vLLM: give --preset or --model-config)"
    )  # fmt: skip
    return [
        f"The KV pool holds {tokens:,} tokens as logged ({where}counting the null block vLLM "
        f"reserves): {usable:,} usable. Use kv_cache_tokens: {usable} for this node in the "
        f"gateway{caveat}."
    ]


def _memory_findings(facts: LogFacts, pool: LoggedPool) -> list[str]:
    out, bs, gib = [], pool.block_size, facts.available_kv_gib
    if facts.kv_device == "CPU" or facts.block_size:
        why = f"--block-size {bs}" if facts.block_size else "vLLM's CPU default; 16 on GPUs"
        dev = f"{facts.kv_device} " if facts.kv_device else ""
        out.append(f"The {dev}node's KV blocks hold {bs} tokens ({why}).")
    if facts.node_memory_gib is not None and gib is not None:
        how = (
            "set explicitly (--kv-cache-memory-bytes, or VLLM_CPU_KVCACHE_SPACE in GiB)"
            if facts.kv_memory_source == "explicit"
            else "from --gpu-memory-utilization, which on the CPU backend is the share of "
            "the node's memory vLLM takes, weights and activations included"
        )
        out.append(
            f"KV memory: {gib:.2f} GiB of the NUMA node's {facts.node_memory_gib:.2f} GiB, {how}."
        )
    profiled, override = facts.profiled_num_blocks, facts.num_blocks_override
    if override is not None and profiled and not facts.startup_failed:
        held = f"; the {gib:.2f} GiB of KV memory would hold {profiled:,}" if gib else ""
        per_block = f" ({gib * GIB / profiled:,.0f} B a block)" if gib else ""
        out.append(
            f"--num-gpu-blocks-override {override} sets the pool at {override} blocks{held}"
            f"{per_block}: the memory figure does not size this pool."
        )
    tokens = logged_tokens(facts, bs)
    if tokens and gib and override is None and pool.groups == 1 and not facts.startup_failed:
        where = "per GPU" if facts.kv_device in (None, "GPU") else f"on this {facts.kv_device}"
        out.append(
            f"{gib:.2f} GiB for {tokens:,} tokens: about {gib * GIB / tokens:,.0f} bytes of KV "
            f"per token {where}."
        )
    return out


def _concurrency_findings(facts: LogFacts, pool: LoggedPool) -> list[str]:
    c, length, tokens = facts.max_concurrency, facts.concurrency_len, pool.usable
    if c is None or not length or tokens is None:
        return []
    if pool.blocks:
        usable = c * (pool.blocks - 1) / pool.blocks
    else:
        usable = tokens / length
    return [
        f"'Maximum concurrency {c:.2f}x' for {length:,}-token requests includes the null "
        f"block; really {usable:.2f}x: at full length, {requests_fit(usable)}."
    ]


def _findings(facts: LogFacts, pool: LoggedPool, *, with_model: bool) -> list[str]:
    out: list[str] = []
    if facts.startup_failed and facts.v0_kv_token_capacity is None:
        out += _failure_findings(facts, pool)
    elif facts.v0_kv_token_capacity is not None:
        out.append(
            f"The V0 engine refused to start: max_model_len {facts.max_model_len} is more "
            f"than the {facts.v0_kv_token_capacity:,} tokens its KV cache holds"
            + (
                f" ({facts.num_gpu_blocks} blocks x {pool.block_size})."
                if facts.num_gpu_blocks
                else "."
            )
        )
    elif not with_model:  # with a model, explain_log reads the pool
        out += _pool_findings(facts, pool)
    if not with_model:
        out += _memory_findings(facts, pool)
        if not facts.startup_failed:
            out += _concurrency_findings(facts, pool)
    if facts.total_gpu_gib and facts.gpu_memory_utilization:
        parts = [f"{facts.total_gpu_gib:.2f} GiB x {facts.gpu_memory_utilization:.2f}"]
        for label, value in (
            ("weights", facts.weights_gib),
            ("activation peak", facts.activation_gib),
            ("CUDA graphs", facts.cuda_graph_gib),
        ):
            if value is not None:
                parts.append(f"{label} {value:.2f} GiB")
        out.append("Memory: " + ", ".join(parts) + ".")
    if facts.padding_layers:
        out.append(
            f"vLLM added {facts.padding_layers} padding layers: a hybrid model whose KV "
            "groups share one block pool, so tokens are not simply memory / bytes-per-token."
        )
    if facts.speculative_method:
        out.append(
            f"Speculative decoding ({facts.speculative_method}, "
            f"{facts.num_speculative_tokens or 1} tokens): a drafter's attention layers "
            "take blocks from the same pool as the model's, and every running request holds "
            "that many lookahead slots on top of its tokens."
        )
    if facts.pipeline_parallel_size and facts.pipeline_parallel_size > 1:
        out.append(
            f"pp {facts.pipeline_parallel_size}: each stage sizes KV for its own layers; the "
            "node runs on the smallest block count of any stage."
        )
    if facts.tensor_parallel_size and facts.tensor_parallel_size > 1:
        out.append(
            f"tp {facts.tensor_parallel_size}: each rank logs its own available KV memory; "
            "vLLM sizes the pool from the smallest rank."
        )
    return out


def logged_drafter(facts: LogFacts) -> SpeculativeSpec | None:
    """The drafter the engine's config line names (its default layer count).

    Older releases logged the model-specific MTP names (``deepseek_mtp``, ``mimo_mtp``,
    ...) that vLLM now folds into ``mtp``.
    """
    method = facts.speculative_method or ""
    if method.endswith("_mtp"):
        method = "mtp"
    if method not in SPECULATIVE_METHODS:
        return None
    return SpeculativeSpec(method, facts.num_speculative_tokens or 1)


def _cross_check(facts: LogFacts, spec: CapacitySpec) -> tuple[CrossCheck | None, CapacitySpec]:
    assert facts.available_kv_gib is not None
    dtype = facts.kv_cache_dtype if facts.kv_cache_dtype in KV_CACHE_DTYPES else None
    if facts.dtype in DTYPE_BYTES and facts.dtype != spec.model.dtype:
        # The node's --dtype, not the checkpoint's: kv_cache_dtype auto follows it (an fp32
        # cache only when the node runs in fp32, as this one does).
        spec = replace(spec, model=replace(spec.model, dtype=facts.dtype))
        if DTYPE_BYTES[facts.dtype] == 4 and dtype in (None, "auto"):
            dtype = "float32"
    logged_spec = replace(
        spec,
        kv_cache_memory_gib=facts.available_kv_gib,
        tp=facts.tensor_parallel_size or spec.tp,
        kv_cache_dtype=dtype or spec.kv_cache_dtype,
        max_model_len=facts.max_model_len or spec.max_model_len,
        pp=facts.pipeline_parallel_size or spec.pp,
        speculative=spec.speculative or logged_drafter(facts),
    )
    if spec.gpu_memory_gib is None and facts.total_gpu_gib:
        # Lets the what-ifs (utilization steps, bigger GPUs) use the node's real card.
        logged_spec = replace(
            logged_spec,
            gpu_memory_gib=facts.total_gpu_gib,
            gpu_memory_utilization=facts.gpu_memory_utilization or spec.gpu_memory_utilization,
        )
    est = estimate(logged_spec)
    override, profiled, bs = facts.num_blocks_override, facts.profiled_num_blocks, spec.block_size
    held = None
    if override and profiled:
        # The memory is checked against the blocks vLLM says it holds; the plan runs on the
        # override's blocks (half a block more memory: est floors it to exactly those).
        dev = (est.num_gpu_blocks - profiled) / profiled
        held = CrossCheck(est.num_gpu_blocks * bs, profiled * bs, dev, (
            f"architecture: {est.bytes_per_token:,} B/token x {facts.available_kv_gib:.2f} GiB "
            f"-> {est.num_gpu_blocks:,} blocks of {bs}; vLLM: {profiled:,} before "
            f"--num-gpu-blocks-override {override} ({dev:+.2%})"))  # fmt: skip
        gib = facts.available_kv_gib * (override + 0.5) / profiled
        logged_spec = replace(logged_spec, kv_cache_memory_gib=gib)
        est = estimate(logged_spec)
    tokens = logged_tokens(facts, bs)
    if facts.needed_kv_gib is not None and facts.max_model_len:
        page = lay.page_bytes(est.layout, spec.block_size) * est.kv_layers_per_gpu
        blocks = lay.blocks_per_request(
            est.layout, facts.max_model_len, spec.block_size, est.in_flight_tokens
        )
        # vLLM >= 0.32 estimates on the blocks beside the null block; older ones on all.
        usable_blocks = est.num_gpu_blocks - (1 if vllm_version(facts) >= (0, 32) else 0)
        vllm_max = lay.max_context_fitting(
            est.layout, usable_blocks, bs, est.in_flight_tokens, facts.max_model_len
        )
        predicted, logged = vllm_max, facts.estimated_max_model_len or vllm_max
        detail = (
            f"architecture: {est.bytes_per_token:,} B/token per GPU; a {facts.max_model_len}"
            f"-token request needs {page * blocks / GIB:.2f} GiB (log: "
            f"{facts.needed_kv_gib:.2f}); longest context {predicted} (log: {logged})"
        )
        return CrossCheck(predicted, logged, (predicted - logged) / max(1, logged), detail), (
            logged_spec
        )
    if tokens is None or held is not None:
        return held, logged_spec
    predicted, _ = _closest_logged(est, tokens)
    deviation = (predicted - tokens) / tokens
    detail = (
        f"architecture: {est.bytes_per_token:,} B/token per GPU x "
        f"{facts.available_kv_gib:.2f} GiB -> {predicted:,} tokens; vLLM logged {tokens:,} "
        f"({deviation:+.2%})"
    )
    if abs(deviation) > TOLERANCE:
        detail += (
            ". More than 1% apart: check the model, --kv-cache-dtype and --tp against the "
            "log; a TP rank with less free memory, speculative-decoding draft layers or a "
            "hybrid layout also change the count"
        )
    return CrossCheck(predicted, tokens, deviation, detail), logged_spec


# The tokens in flight a hybrid model's logged count may assume: vLLM's defaults for
# max_num_batched_tokens (API server: 2048, 8192 on >= 70 GiB GPUs; offline LLM: 8192 /
# 16384), once or twice (asynchronous scheduling): the log does not say which applied.
_DEFAULT_IN_FLIGHT = (2048, 4096, 8192, 16384, 32768)


def _logged_forms(est: CapacityEstimate) -> list[tuple[int, int | None]]:
    """What vLLM may log as ``GPU KV cache size`` for this pool, each with the
    max_num_batched_tokens it assumes (None: the older ``blocks // groups * block_size``,
    which does not depend on it). The newest releases log ``max_concurrency x
    max_model_len``: the same number for one-group models, more for hybrids."""
    forms: list[tuple[int, int | None]] = [(est.vllm_logged_tokens, None)]
    if est.layout.num_groups > 1:
        for mnbt in dict.fromkeys((est.in_flight_tokens, *_DEFAULT_IN_FLIGHT)):
            logged = lay.vllm_logged_tokens_at_length(
                est.layout, est.num_gpu_blocks, est.block_size, mnbt, est.target_len
            )
            forms.append((logged, mnbt))
    return forms


def _closest_logged(est: CapacityEstimate, tokens: int) -> tuple[int, int | None]:
    return min(_logged_forms(est), key=lambda form: abs(form[0] - tokens))


def _budget_from_logged(est: CapacityEstimate, tokens: int) -> int:
    """Usable KV tokens (the gateway's kv_cache_tokens) from the node's logged count, read
    in the wording it is closest to."""
    layout, bs = est.layout, est.block_size
    _, mnbt = _closest_logged(est, tokens)
    if mnbt is None:
        blocks = tokens // bs * layout.num_groups
    else:
        blocks = lay.blocks_from_logged_at_length(layout, tokens, bs, mnbt, est.target_len)
    return lay.kv_tokens_from_blocks(blocks, bs, layout.num_groups)


def explain_log(facts: LogFacts, spec: CapacitySpec | None = None) -> LogReport:
    bs = spec.block_size if spec is not None else logged_block_size(facts)
    pool = logged_pool(facts, bs)
    with_model = spec is not None and bool(facts.available_kv_gib)
    findings = _findings(facts, pool, with_model=with_model)
    missing = missing_lines(facts)
    if spec is not None and facts.available_kv_gib is not None and facts.available_kv_gib > 0:
        check, logged_spec = _cross_check(facts, spec)
        plan = make_plan(logged_spec)
        if facts.kv_device not in (None, "GPU") or facts.num_blocks_override is not None:
            # The model's steps 1-2 stand; memory steps 3-5 are the device's and override's.
            own = log_recommendations(facts, logged_pool(facts, bs))[0][2:]
            plan = replace(plan, recommendations=(*plan.recommendations[:2], *own))
        tokens = logged_tokens(facts, bs)
        if plan.settings is not None and tokens and not facts.startup_failed:
            # The node's own count beats our prediction from a GiB figure rounded to 0.01.
            budget = _budget_from_logged(plan.estimate, tokens)
            plan = replace(plan, settings=replace(plan.settings, kv_cache_tokens=budget))
            findings.append(
                f"The backend entry uses kv_cache_tokens {budget}: the node's own count "
                "less the null block; the plan's other figures are computed from the logged GiB."
            )
        return LogReport(facts, tuple(findings), check, plan=plan, missing=missing, pool=pool)
    if spec is not None:
        findings.append("the log has no KV memory line: nothing to cross-check")
    recs, settings = log_recommendations(facts, pool)
    return LogReport(facts, tuple(findings), None, recommendations=recs, settings=settings,
                     missing=missing, pool=pool)  # fmt: skip
