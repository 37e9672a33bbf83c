"""What to do about a node's KV capacity, in the order operators should try it.

1. lower ``--max-model-len`` (start at 60-80% of the longest context that fits);
2. cap ``--max-num-seqs`` and ``--max-num-batched-tokens``;
3. raise ``--gpu-memory-utilization`` in small steps, only on a GPU nothing else uses;
4. an fp8 KV cache (accuracy, hardware support and scales caveats);
5. last, a larger-memory node or a CPU-offload node (``--cpu-offload-gb``).

Each step is computed for the case at hand by re-running :func:`estimate` on a
modified spec, so every sentence carries numbers. Pure: no printing here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvgateway.capacity.alternatives import Alternative, does_not_fit, what_would_fit
from kvgateway.capacity.estimate import CapacityEstimate, estimate
from kvgateway.capacity.layout import blocks_per_request
from kvgateway.capacity.memory import GIB, activation_bytes
from kvgateway.capacity.spec import CapacitySpec

MAX_SAFE_UTILIZATION = 0.95
_LARGER_GPUS_GIB = (24.0, 48.0, 79.25, 139.8, 178.4)  # 24 GB, 48 GB, H100, H200, B200


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One step of the order above: its title and the vLLM flags it changes."""

    step: int
    title: str
    flags: tuple[str, ...]


# The order of the module docstring, one definition for the planner and `gateway rounds`.
PLAN_ORDER: tuple[PlanStep, ...] = (
    PlanStep(1, "Lower --max-model-len", ("--max-model-len",)),
    PlanStep(
        2,
        "Cap --max-num-seqs and --max-num-batched-tokens",
        ("--max-num-seqs", "--max-num-batched-tokens"),
    ),
    PlanStep(
        3,
        "Raise --gpu-memory-utilization in small steps (dedicated GPU only)",
        ("--gpu-memory-utilization",),
    ),
    PlanStep(4, "fp8 KV cache (--kv-cache-dtype fp8)", ("--kv-cache-dtype",)),
    PlanStep(5, "Larger-memory node, or a CPU-offload node", ("--cpu-offload-gb",)),
)


@dataclass(frozen=True, slots=True)
class Recommendation:
    step: int
    title: str
    detail: str


@dataclass(frozen=True, slots=True)
class Settings:
    """The flags to serve with, and the gateway budget they give."""

    max_model_len: int
    max_num_seqs: int
    kv_cache_tokens: int
    concurrency: float  # full-length requests at max_model_len


@dataclass(frozen=True, slots=True)
class Plan:
    spec: CapacitySpec
    estimate: CapacityEstimate
    recommendations: tuple[Recommendation, ...]
    settings: Settings | None  # None when no context fits at all
    # The model does not fit the node at all; then what would (re-estimated), best first.
    fits: bool = True
    alternatives: tuple[Alternative, ...] = ()


def round_down(value: float, step: int) -> int:
    return int(value // step * step)


def suggested_len(est: CapacityEstimate) -> int:
    """Keep the target when the KV pool has 20% headroom over it; else 70% of the
    longest context the pool holds, rounded down to 1024 (and within the model's limit).
    """
    kv_max, target = est.kv_limited_len, est.target_len
    if kv_max <= 0:
        return 0
    if target <= 0.8 * kv_max:
        return min(target, est.max_model_len_fit)
    step = 1024 if kv_max >= 4096 else est.block_size
    return min(est.max_model_len_fit, max(est.block_size, round_down(0.7 * kv_max, step)))


def suggested_max_num_seqs(kv_cache_tokens: int, max_model_len: int) -> int:
    """Enough slots for requests averaging a quarter of max_model_len, at most 256."""
    if max_model_len <= 0:
        return 1
    return max(1, min(256, kv_cache_tokens // max(1, max_model_len // 4)))


def _fmt_tokens(n: int) -> str:
    return f"{n:,}"


def _fits_sentence(est: CapacityEstimate, length: int) -> str:
    conc = est.concurrency_at(length)
    n = math.floor(conc)
    noun = "request fits" if n == 1 else "requests fit"
    return f"at --max-model-len {length}, {n} concurrent {noun} ({conc:.2f}x)"


def len_for_concurrency(est: CapacityEstimate, requests: int) -> int:
    """Longest --max-model-len at which ``requests`` full-length requests fit at once."""
    lo, hi = 0, max(0, est.max_model_len_fit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if est.concurrency_at(mid) >= requests:
            lo = mid
        else:
            hi = mid - 1
    return round_down(lo, est.block_size)


def _more_sentence(est: CapacityEstimate, length: int) -> str:
    more = math.floor(est.concurrency_at(length)) + 1
    shorter = len_for_concurrency(est, more)
    if shorter <= 0:
        return ""
    return f"; to run {more} at once, --max-model-len {shorter}"


def _step_max_model_len(spec: CapacitySpec, est: CapacityEstimate, length: int) -> Recommendation:
    fit, target = est.max_model_len_fit, est.target_len
    kv_max = est.kv_limited_len
    lo, hi = round_down(0.6 * kv_max, spec.block_size), round_down(0.8 * kv_max, spec.block_size)
    if fit <= 0:
        detail = (
            "no context fits in the KV pool at all; nothing to trim here: free memory "
            "with the steps below first"
        )
    elif target > fit:
        need = (
            est.layout.group_size
            * (est.bytes_per_token_per_layer * est.block_size)
            * _blocks(est, target)
        )
        detail = (
            f"--max-model-len {target} does not fit: one such request needs "
            f"{need / GIB:.2f} GiB of KV but the pool is {est.kv_pool_bytes / GIB:.2f} GiB, "
            f"so vLLM refuses to start. The longest context that fits is {fit}; start at "
            f"60-80% of it ({lo}-{hi}): {_fits_sentence(est, length)}"
            f"{_more_sentence(est, length)}"
        )
    elif length < target:
        detail = (
            f"--max-model-len {target} fits, but {_fits_sentence(est, target)}; "
            f"start at 60-80% of the {kv_max}-token maximum ({lo}-{hi}): "
            f"{_fits_sentence(est, length)}{_more_sentence(est, length)}"
        )
    else:
        detail = (
            f"--max-model-len {target} leaves headroom (the pool holds one request of "
            f"up to {kv_max} tokens): {_fits_sentence(est, target)}; keep it"
        )
    return Recommendation(1, PLAN_ORDER[0].title, detail)


def _blocks(est: CapacityEstimate, length: int) -> int:
    return blocks_per_request(est.layout, length, est.block_size, est.in_flight_tokens)


def _step_caps(spec: CapacitySpec, est: CapacityEstimate, length: int) -> Recommendation:
    title = PLAN_ORDER[1].title
    if est.kv_cache_tokens <= 0:
        return Recommendation(2, title, "nothing to cap until the model fits (steps 4-5)")
    seqs = suggested_max_num_seqs(est.kv_cache_tokens, length)
    parts = [
        f"cap --max-num-seqs at {seqs}: {seqs} requests averaging {length // 4} tokens "
        f"(a quarter of --max-model-len {length}) fill the {_fmt_tokens(est.kv_cache_tokens)}"
        "-token pool; more running sequences only cause preemption (recompute storms)"
    ]
    if spec.max_num_seqs and spec.max_num_seqs > seqs:
        parts.append(
            f"your --max-num-seqs {spec.max_num_seqs} would oversubscribe the pool "
            f"{spec.max_num_seqs * (length // 4) / max(1, est.kv_cache_tokens):.1f}x"
        )
    mnbt = est.max_num_batched_tokens
    smaller = 2048 if mnbt > 2048 else None
    if smaller and not est.pool.measured and spec.overhead_gib is None:
        seqs_ = spec.max_num_seqs or 256
        freed = activation_bytes(spec.model, spec.tp, mnbt, seqs_) - activation_bytes(
            spec.model, spec.tp, smaller, seqs_
        )
        gained = estimate(replace(spec, max_num_batched_tokens=smaller)).kv_cache_tokens
        parts.append(
            f"--max-num-batched-tokens {smaller} (now {mnbt}) shrinks the profiled "
            f"activation peak by ~{freed / GIB:.2f} GiB: {_fmt_tokens(gained)} KV tokens "
            f"instead of {_fmt_tokens(est.kv_cache_tokens)}, at some prefill throughput"
        )
    else:
        parts.append(
            f"keep --max-num-batched-tokens at {mnbt}: larger prefill chunks raise the "
            "activation peak vLLM profiles, and that memory comes out of the KV pool"
        )
    return Recommendation(2, title, "; ".join(parts))


def _step_utilization(spec: CapacitySpec, est: CapacityEstimate, length: int) -> Recommendation:
    util = spec.gpu_memory_utilization
    title = PLAN_ORDER[2].title
    if spec.gpu_memory_gib is None:
        detail = (
            f"each +0.01 adds 1% of the GPU to the pool; give --gpu-memory-gib to quantify. "
            f"Only when nothing else shares the GPU; stay at or below {MAX_SAFE_UTILIZATION}"
        )
        return Recommendation(3, title, detail)
    if util >= MAX_SAFE_UTILIZATION:
        detail = (
            f"already at {util:.2f}: higher leaves too little for CUDA-graph capture and "
            "sampler warm-up, which are not all in the profile"
        )
        return Recommendation(3, title, detail)
    steps = []
    for new in sorted({round(min(util + d, MAX_SAFE_UTILIZATION), 2) for d in (0.02, 0.03)}):
        extra_gib = spec.gpu_memory_gib * (new - util)
        if spec.kv_cache_memory_gib is not None:
            bumped = replace(spec, kv_cache_memory_gib=spec.kv_cache_memory_gib + extra_gib)
        else:
            bumped = replace(spec, gpu_memory_utilization=new)
        alt = estimate(bumped)
        steps.append(
            f"{new:.2f} adds {extra_gib:.2f} GiB: {_fmt_tokens(alt.kv_cache_tokens)} tokens, "
            f"longest context {alt.max_model_len_fit}, {_fits_sentence(alt, length)}"
        )
    detail = (
        f"from {util:.2f}: " + "; ".join(steps) + ". Only when nothing else (another vLLM, "
        "a desktop, a monitoring agent) uses this GPU: vLLM takes total x utilization "
        f"regardless of what is already resident. Stay at or below {MAX_SAFE_UTILIZATION}"
    )
    return Recommendation(3, title, detail)


def _step_fp8(spec: CapacitySpec, est: CapacityEstimate, length: int) -> Recommendation:
    title = PLAN_ORDER[3].title
    if spec.kv_cache_dtype.startswith("fp8") or spec.kv_cache_dtype.endswith("per_token_head"):
        detail = f"already {spec.kv_cache_dtype}: {est.bytes_per_token:,} B/token"
        return Recommendation(4, title, detail)
    if spec.kv_cache_dtype == "auto" and spec.model.kv_cache_quant is not None:
        quant = spec.model.kv_cache_quant
        detail = f"already {quant} (from the checkpoint): {est.bytes_per_token:,} B/token"
        return Recommendation(4, title, detail)
    alt = estimate(replace(spec, kv_cache_dtype="fp8"))
    detail = (
        f"{est.bytes_per_token:,} -> {alt.bytes_per_token:,} B/token: "
        f"{_fmt_tokens(alt.kv_cache_tokens)} tokens, longest context {alt.max_model_len_fit}, "
        f"{_fits_sentence(alt, length)}. Caveats: some accuracy loss (run your evals; "
        "long-context recall degrades first); needs an attention backend with fp8 KV "
        "(native on Hopper, Ada and Blackwell; older GPUs may switch backend and lose "
        "speed); without calibrated k/v scales in the checkpoint vLLM uses scale 1.0 "
        "(calibrate with llm-compressor, or --calculate-kv-scales)"
    )
    return Recommendation(4, title, detail)


def _offload_gib(spec: CapacitySpec, est: CapacityEstimate) -> int:
    if est.fits_target:
        return 4
    need = est.kv_layers_per_gpu * est.bytes_per_token_per_layer * est.block_size
    # pool_bytes, not kv_pool_bytes: when the weights alone overflow it is negative.
    missing = need * (_blocks(est, est.target_len) + 1) - est.pool.pool_bytes
    return max(1, math.ceil(missing / GIB))


def _step_bigger(spec: CapacitySpec, est: CapacityEstimate, length: int) -> Recommendation:
    parts = []
    current = spec.gpu_memory_gib
    bigger = next((g for g in _LARGER_GPUS_GIB if current is None or g > current * 1.2), None)
    if bigger is not None and current is not None:
        grown = replace(spec, gpu_memory_gib=bigger)
        if spec.kv_cache_memory_gib is not None:
            grown = replace(grown, kv_cache_memory_gib=spec.kv_cache_memory_gib + bigger - current)
        alt = estimate(grown)
        parts.append(
            f"a {bigger:g} GiB GPU: {_fmt_tokens(alt.kv_cache_tokens)} tokens, longest "
            f"context {alt.max_model_len_fit}, {_fits_sentence(alt, length)}"
        )
    else:
        per_gib = GIB // max(1, est.bytes_per_token)
        parts.append(
            f"a larger-memory GPU: each extra GiB of KV memory adds about {per_gib:,} tokens "
            "(give --gpu-memory-gib to size a specific card)"
        )
    if not est.fits_target and spec.kv_cache_memory_gib is None and spec.tp < 8:
        # The smallest TP that fits the target, else the widest one tried.
        wider = est
        for tp in (t for t in (2, 4, 8) if t > spec.tp):
            wider = estimate(replace(spec, tp=tp))
            if wider.fits_target:
                break
        parts.append(
            f"--tensor-parallel-size {wider.tp} over {wider.tp} such GPUs (weights and KV "
            f"heads split): {_fmt_tokens(wider.kv_cache_tokens)} tokens, longest context "
            f"{wider.max_model_len_fit}, {_fits_sentence(wider, est.target_len)}"
        )
    offload = _offload_gib(spec, est)
    if spec.kv_cache_memory_gib is not None:
        moved = replace(spec, kv_cache_memory_gib=spec.kv_cache_memory_gib + offload)
    else:
        weights = spec.weights_gib
        if weights is None:
            weights = est.pool.weights_bytes / GIB
        offload = max(1, min(offload, math.floor(weights)))  # cannot offload more than all
        moved = replace(spec, weights_gib=max(0.0, weights - offload))
    alt = estimate(moved)
    parts.append(
        f"or a CPU-offload node: --cpu-offload-gb {offload} moves {offload} GiB of weights "
        f"per GPU to host RAM: {_fmt_tokens(alt.kv_cache_tokens)} tokens, longest context "
        f"{alt.max_model_len_fit}; but the offloaded weights cross PCIe on every decode "
        f"step (~{20 * offload}-{40 * offload} ms more per step at 25-50 GB/s), so use it "
        "for a slow long-context tier, not for interactive traffic"
    )
    return Recommendation(5, PLAN_ORDER[4].title, "; ".join(parts))


def make_plan(spec: CapacitySpec) -> Plan:
    est = estimate(spec)
    length = suggested_len(est)
    shown = length or est.target_len
    recs = (
        _step_max_model_len(spec, est, length),
        _step_caps(spec, est, shown),
        _step_utilization(spec, est, shown),
        _step_fp8(spec, est, shown),
        _step_bigger(spec, est, shown),
    )
    settings = None
    if length > 0:
        settings = Settings(
            max_model_len=length,
            max_num_seqs=min(
                spec.max_num_seqs or 256, suggested_max_num_seqs(est.kv_cache_tokens, length)
            ),
            kv_cache_tokens=est.kv_cache_tokens,
            concurrency=est.concurrency_at(length),
        )
    fits = not does_not_fit(spec, est)
    return Plan(
        spec=spec,
        estimate=est,
        recommendations=recs,
        settings=settings,
        fits=fits,
        alternatives=() if fits else what_would_fit(spec, est),
    )
