"""Explain a vLLM start-up log, and check it against the model's architecture.

With only a log, the numbers come from the log itself (tokens, blocks, the KV memory)
and the bytes per token it implies. With a model as well (preset or config.json), the
architecture predicts the token count from the logged ``Available KV cache memory``;
for ordinary attention that prediction matches vLLM's own count to well within 1%
(the only slack is the log rounding GiB to two decimals), so a larger gap means the
log and the model do not describe the same deployment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvgateway.capacity import layout as lay
from kvgateway.capacity.advice import (
    Plan,
    Recommendation,
    Settings,
    make_plan,
    round_down,
    suggested_max_num_seqs,
)
from kvgateway.capacity.arch import DTYPE_BYTES, KV_CACHE_DTYPES
from kvgateway.capacity.estimate import CapacityEstimate, estimate
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


def logged_tokens(facts: LogFacts, block_size: int) -> int | None:
    if facts.kv_cache_tokens is not None:
        return facts.kv_cache_tokens
    if facts.num_gpu_blocks is not None:
        return facts.num_gpu_blocks * block_size
    return facts.v0_kv_token_capacity


def _findings(facts: LogFacts, bs: int, *, with_model: bool) -> list[str]:
    out: list[str] = []
    tokens = logged_tokens(facts, bs)
    if facts.needed_kv_gib is not None and facts.available_kv_gib is not None:
        out.append(
            f"vLLM refused to start: one request of max_model_len {facts.max_model_len} needs "
            f"{facts.needed_kv_gib:.2f} GiB of KV cache, but only "
            f"{facts.available_kv_gib:.2f} GiB was left after weights and activations."
        )
        if facts.estimated_max_model_len is not None:
            m = facts.estimated_max_model_len
            out.append(
                f"vLLM's estimate of the longest context is {m}. That figure may count the "
                f"reserved null block (releases before the 2026-08 fix), and a request of "
                f"exactly {m} tokens then waits forever: the schedulable maximum is {m - bs}."
            )
    elif facts.v0_kv_token_capacity is not None:
        out.append(
            f"The V0 engine refused to start: max_model_len {facts.max_model_len} is more "
            f"than the {facts.v0_kv_token_capacity:,} tokens its KV cache holds"
            + (f" ({facts.num_gpu_blocks} blocks x {bs})." if facts.num_gpu_blocks else ".")
        )
    elif tokens is not None and not with_model:  # with a model, explain_log reads it
        sign = _hybrid_sign(facts, tokens, bs)
        if sign is not None:
            out.append(
                f"This model has several KV-cache groups ({sign}): the logged {tokens:,} "
                "tokens are not the pool's size for short requests, and the log alone cannot "
                "say what is. Give --preset or --model-config for the node's kv_cache_tokens."
            )
        else:
            out.append(
                f"The KV pool holds {tokens:,} tokens as logged ({tokens // bs:,} blocks of "
                f"{bs}, counting the null block vLLM reserves): {tokens - bs:,} usable. Use "
                f"kv_cache_tokens: {tokens - bs} for this node in the gateway (for a model of "
                "one kind of attention; one that mixes in sliding-window or Mamba layers is "
                "logged at full-length concurrency by the newest vLLM: give --preset or "
                "--model-config)."
            )
    if tokens and not with_model and facts.available_kv_gib and facts.available_kv_gib > 0:
        implied = facts.available_kv_gib * GIB / tokens
        out.append(
            f"{facts.available_kv_gib:.2f} GiB for {tokens:,} tokens: about {implied:,.0f} "
            "bytes of KV per token per GPU."
        )
    if (
        facts.max_concurrency is not None
        and facts.concurrency_len
        and tokens
        and _hybrid_sign(facts, tokens, bs) is None
    ):
        usable = (tokens - bs) / facts.concurrency_len
        out.append(
            f"'Maximum concurrency {facts.max_concurrency:.2f}x' for "
            f"{facts.concurrency_len:,}-token requests includes the null block; really "
            f"{usable:.2f}x: at full length, {_requests(usable)}."
        )
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
    tokens = logged_tokens(facts, spec.block_size)
    if facts.needed_kv_gib is not None and facts.max_model_len:
        page = lay.page_bytes(est.layout, spec.block_size) * est.kv_layers_per_gpu
        blocks = lay.blocks_per_request(
            est.layout, facts.max_model_len, spec.block_size, est.max_num_batched_tokens
        )
        vllm_max = lay.max_context_fitting(
            est.layout, est.num_gpu_blocks, spec.block_size, est.max_num_batched_tokens,
            facts.max_model_len,
        )  # fmt: skip
        predicted, logged = vllm_max, facts.estimated_max_model_len or vllm_max
        detail = (
            f"architecture: {est.bytes_per_token:,} B/token per GPU; a {facts.max_model_len}"
            f"-token request needs {page * blocks / GIB:.2f} GiB (log: "
            f"{facts.needed_kv_gib:.2f}); longest context {predicted} (log: {logged})"
        )
        return CrossCheck(predicted, logged, (predicted - logged) / max(1, logged), detail), (
            logged_spec
        )
    if tokens is None:
        return None, logged_spec
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


# vLLM's defaults for max_num_batched_tokens (API server: 2048, 8192 on >= 70 GiB GPUs;
# offline LLM: 8192 / 16384): a hybrid model's logged count depends on it, and the log
# does not say which applied.
_DEFAULT_BATCHED = (2048, 8192, 16384)


def _logged_forms(est: CapacityEstimate) -> list[tuple[int, int | None]]:
    """What vLLM may log as ``GPU KV cache size`` for this pool, each with the
    max_num_batched_tokens it assumes (None: the older ``blocks // groups * block_size``,
    which does not depend on it). The newest releases log ``max_concurrency x
    max_model_len``: the same number for one-group models, more for hybrids."""
    forms: list[tuple[int, int | None]] = [(est.vllm_logged_tokens, None)]
    if est.layout.num_groups > 1:
        for mnbt in dict.fromkeys((est.max_num_batched_tokens, *_DEFAULT_BATCHED)):
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


def _hybrid_sign(facts: LogFacts, tokens: int | None, bs: int) -> str | None:
    """Why a log alone cannot give the pool: it shows a model of several KV-cache groups
    (padding layers, or a token count that is not concurrency x length)."""
    if facts.padding_layers:
        return f"vLLM added {facts.padding_layers} padding layers"
    c, length = facts.max_concurrency, facts.concurrency_len
    if not tokens or c is None or not length:
        return None
    # One group: the newest wording logs c x length, the older blocks x block_size, which
    # is c x length in whole blocks (c printed to two decimals either way).
    padded = -(-length // bs) * bs
    if all(abs(tokens - c * n) > 0.006 * n + bs for n in (length, padded)):
        return (
            f"{tokens:,} tokens is not {c:.2f}x {length:,} (it would be for one group of "
            "full attention)"
        )
    return None


def _requests(concurrency: float) -> str:
    n = math.floor(concurrency)
    return f"{n} concurrent request fits" if n == 1 else f"{n} concurrent requests fit"


def _log_only(facts: LogFacts, bs: int) -> tuple[tuple[Recommendation, ...], Settings | None]:
    tokens = logged_tokens(facts, bs)
    if _hybrid_sign(facts, tokens, bs) is not None:
        return (), None  # the pool is unknown: advice on it would be wrong
    if facts.estimated_max_model_len is not None:
        tokens = facts.estimated_max_model_len
    if not tokens or tokens <= bs:
        return (), None
    usable = tokens - bs
    target = facts.max_model_len or usable
    if target <= 0.8 * usable:
        length = target
    else:
        length = max(bs, round_down(0.7 * usable, 1024 if usable >= 4096 else bs))
    seqs = suggested_max_num_seqs(usable, length)
    per_token = facts.available_kv_gib * GIB / tokens if facts.available_kv_gib else None
    recs = [
        Recommendation(
            1,
            "Lower --max-model-len",
            f"the pool holds {usable:,} usable tokens; start at 60-80% of that "
            f"({round_down(0.6 * usable, bs)}-{round_down(0.8 * usable, bs)}): at "
            f"--max-model-len {length}, {_requests(usable / length)} ({usable / length:.2f}x)",
        ),
        Recommendation(
            2,
            "Cap --max-num-seqs and --max-num-batched-tokens",
            f"--max-num-seqs {seqs} (requests averaging {length // 4} tokens fill the pool); "
            "keep --max-num-batched-tokens small (2048): its activation peak comes out of KV",
        ),
    ]
    util_title = "Raise --gpu-memory-utilization in small steps (dedicated GPU only)"
    if per_token and facts.total_gpu_gib:
        extra = facts.total_gpu_gib * 0.02 * GIB / per_token
        util_detail = (
            f"+0.02 adds {facts.total_gpu_gib * 0.02:.2f} GiB, about {extra:,.0f} tokens; "
            "only if nothing else uses the GPU; stay at or below 0.95"
        )
    else:
        util_detail = (
            "each +0.01 adds 1% of the GPU's memory to the pool (the log does not say how "
            "much memory the GPU has); only if nothing else uses it; stay at or below 0.95"
        )
    recs.append(Recommendation(3, util_title, util_detail))
    if facts.kv_cache_dtype in (None, "auto", "bfloat16", "float16"):
        fp8 = (
            f"about {2 * usable:,} tokens (twice as many); some accuracy loss, needs fp8 "
            "attention support (native on Hopper/Ada/Blackwell) and calibrated k/v scales"
        )
    else:
        fp8 = f"already {facts.kv_cache_dtype}"
    recs.append(Recommendation(4, "fp8 KV cache (--kv-cache-dtype fp8)", fp8))
    gained = f"about {GIB / per_token:,.0f} tokens" if per_token else "tokens"
    recs.append(
        Recommendation(
            5,
            "Larger-memory node, or a CPU-offload node",
            f"each GiB freed (a bigger GPU, or --cpu-offload-gb moving weights to host RAM at "
            f"~20-40 ms more per decode step per GiB) adds {gained}",
        )
    )
    settings = Settings(length, min(seqs, 256), usable, usable / length)
    return tuple(recs), settings


def explain_log(facts: LogFacts, spec: CapacitySpec | None = None) -> LogReport:
    bs = spec.block_size if spec is not None else 16
    with_model = spec is not None and bool(facts.available_kv_gib)
    findings = _findings(facts, bs, with_model=with_model)
    if spec is not None and facts.available_kv_gib is not None and facts.available_kv_gib > 0:
        check, logged_spec = _cross_check(facts, spec)
        plan = make_plan(logged_spec)
        tokens = logged_tokens(facts, bs)
        if plan.settings is not None and tokens and not facts.startup_failed:
            # The node's own count beats our prediction from a GiB figure rounded to 0.01.
            budget = _budget_from_logged(plan.estimate, tokens)
            plan = replace(plan, settings=replace(plan.settings, kv_cache_tokens=budget))
            findings.append(
                f"The backend entry uses kv_cache_tokens {budget}: the node's own count "
                "less the null block; the plan's other figures are computed from the logged GiB."
            )
        return LogReport(facts, tuple(findings), check, plan=plan)
    if spec is not None:
        findings.append("the log has no 'Available KV cache memory': nothing to cross-check")
    recs, settings = _log_only(facts, bs)
    return LogReport(facts, tuple(findings), None, recommendations=recs, settings=settings)
