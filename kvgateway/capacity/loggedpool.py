"""The KV pool a vLLM start-up log gives by itself, the lines it lacks, and what to do.

The block size is the one passed (``--block-size``), else a hybrid model's group sizes,
else vLLM's default: 128 on the CPU backend (``platforms/cpu.py``), 16 elsewhere. The
block count is the ``num_gpu_blocks_override`` line's, ``# GPU blocks``, or for one
KV-cache group the logged tokens over the block size (vLLM logs whole blocks, the null
block included). Usable tokens then come from the one formula,
:func:`~kvgateway.capacity.layout.kv_tokens_from_blocks`. The advice follows
``gateway plan``'s order with the device's own flags: a CPU node's KV memory is
``--kv-cache-memory-bytes``, and under ``--num-gpu-blocks-override`` only the override
changes the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgateway.capacity import layout as lay
from kvgateway.capacity.advice import (
    PLAN_ORDER,
    Recommendation,
    Settings,
    round_down,
    suggested_max_num_seqs,
)
from kvgateway.capacity.logparse import LogFacts
from kvgateway.capacity.memory import GIB

# vLLM's default --block-size: 128 on the CPU backend, 16 elsewhere.
CPU_BLOCK_SIZE, DEFAULT_BLOCK_SIZE = 128, 16


@dataclass(frozen=True, slots=True)
class LoggedPool:
    block_size: int
    groups: int  # KV-cache groups: 1 unless "kv cache group sizes" names more
    blocks: int | None  # the pool's blocks, the null block included
    usable: int | None  # tokens requests can hold (kv_cache_tokens); None: the log cannot say
    null_block_excluded: bool  # vLLM >= 0.32: its estimated max length already leaves it out


def logged_block_size(facts: LogFacts) -> int:
    if facts.block_size:
        return facts.block_size
    if facts.kv_group_block_sizes:
        return min(facts.kv_group_block_sizes)
    return CPU_BLOCK_SIZE if facts.kv_device == "CPU" else DEFAULT_BLOCK_SIZE


def logged_tokens(facts: LogFacts, block_size: int) -> int | None:
    if facts.kv_cache_tokens is not None:
        return facts.kv_cache_tokens
    if facts.num_gpu_blocks is not None:
        return facts.num_gpu_blocks * block_size
    return facts.v0_kv_token_capacity


def vllm_version(facts: LogFacts) -> tuple[int, ...]:
    """(0, 32, 0) from "0.32.0" ("0.6.4.post1": (0, 6, 4)); () when the log does not say."""
    parts = []
    for part in (facts.vllm_version or "").split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def hybrid_sign(facts: LogFacts, bs: int) -> str | None:
    """Why the log shows a model of several KV-cache groups: their sizes, padding layers,
    or a token count that is not concurrency x length."""
    if len(facts.kv_group_block_sizes or ()) > 1:
        return "kv cache group sizes " + str(facts.kv_group_block_sizes)
    if facts.padding_layers:
        return f"vLLM added {facts.padding_layers} padding layers"
    tokens = logged_tokens(facts, bs)
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


def logged_pool(facts: LogFacts, bs: int) -> LoggedPool:
    groups = len(facts.kv_group_block_sizes or ()) or 1
    excluded = vllm_version(facts) >= (0, 32)
    blocks, tokens = facts.num_gpu_blocks, logged_tokens(facts, bs)
    if groups == 1 and hybrid_sign(facts, bs) is not None:
        return LoggedPool(bs, groups, blocks, None, excluded)  # groups unknown
    if blocks is None and groups == 1 and facts.kv_cache_tokens:
        blocks = facts.kv_cache_tokens // bs
    if blocks:
        usable: int | None = lay.kv_tokens_from_blocks(blocks, bs, groups)
    else:
        usable = tokens - bs if tokens and groups == 1 else None  # V0's whole blocks
    return LoggedPool(bs, groups, blocks, usable, excluded)


def missing_lines(facts: LogFacts) -> tuple[str, ...]:
    """The KV lines a whole vLLM start-up log holds and this one does not, in vLLM's words."""
    out = []
    if facts.vllm_version is None:
        out.append("'Initializing a V1 LLM engine (vX.Y.Z) with config: ...' (version, model)")
    if facts.available_kv_gib is None:
        out.append(
            "the KV memory: 'Available KV cache memory: X GiB' (GPU), or 'Explicitly set "
            "(X/Y) GiB for KV cache' / 'Auto set (X/Y) GiB for KV cache' (CPU)"
        )
    if not facts.startup_failed and facts.kv_cache_tokens is None:
        out.append("'GPU KV cache size: N tokens' (or CPU, XPU, 'GPU + host'; V0: '# GPU blocks')")
    if not facts.startup_failed and facts.max_concurrency is None:
        out.append("'Maximum concurrency for N tokens per request: X.XXx'")
    return tuple(out)


def requests_fit(concurrency: float) -> str:
    n = math.floor(concurrency)
    return f"{n} concurrent request fits" if n == 1 else f"{n} concurrent requests fit"


def per_token_bytes(facts: LogFacts, pool: LoggedPool) -> float | None:
    """KV bytes one token takes (in every group), from the memory and what it holds."""
    gib, bs = facts.available_kv_gib, pool.block_size
    if not gib:
        return None
    if facts.profiled_num_blocks:
        return gib * GIB * pool.groups / (facts.profiled_num_blocks * bs)
    tokens = logged_tokens(facts, bs)
    if tokens and pool.groups == 1 and facts.num_blocks_override is None:
        return gib * GIB / tokens
    return None


def _step_len(facts: LogFacts, usable: int, length: int, bs: int) -> Recommendation:
    fits = f"at --max-model-len {length}, {requests_fit(usable / length)} ({usable / length:.2f}x)"
    if length == facts.max_model_len and not facts.startup_failed:
        detail = (
            f"--max-model-len {length} leaves headroom (the pool holds {usable:,} usable "
            f"tokens): {fits}; keep it"
        )
    else:
        detail = (
            f"the pool holds {usable:,} usable tokens; start at 60-80% of that "
            f"({round_down(0.6 * usable, bs)}-{round_down(0.8 * usable, bs)}): {fits}"
        )
    return Recommendation(1, PLAN_ORDER[0].title, detail)


def _step_memory(facts: LogFacts, pool: LoggedPool, per_token: float | None) -> Recommendation:
    override, gib, node = facts.num_blocks_override, facts.available_kv_gib, facts.node_memory_gib
    per_gib = f"about {GIB / per_token:,.0f} tokens" if per_token else "tokens"
    if override is not None:
        held = (
            f"; the {gib:.2f} GiB of KV memory holds {facts.profiled_num_blocks:,}"
            if (gib and facts.profiled_num_blocks)
            else ""
        )
        return Recommendation(
            3,
            "Raise --num-gpu-blocks-override (it sets the pool)",
            (
                f"the pool is the override's {override} blocks whatever the memory{held}: "
                + ("each more block adds" if pool.groups == 1 else f"every {pool.groups} more add")
                + f" {pool.block_size} tokens; or drop it to size the pool from the memory"
            ),
        )
    if facts.kv_device == "CPU" and facts.kv_memory_source == "auto":
        return Recommendation(
            3,
            "Raise --gpu-memory-utilization (CPU: the node's share)",
            (
                f"on the CPU backend it is the share of the NUMA node's memory vLLM takes ("
                f"{node or 0:.2f} GiB; weights and activations included); the KV cache got "
                f"{gib or 0:.2f} GiB; each extra GiB adds {per_gib}, if nothing else needs it"
            ),
        )
    if facts.kv_device == "CPU":
        now = f"now {gib:.2f} GiB of the NUMA node's {node or 0:.2f}; " if gib else ""
        return Recommendation(
            3,
            "More KV memory (CPU: --kv-cache-memory-bytes)",
            (
                f"{now}--kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE, in GiB) sets it; each "
                f"extra GiB adds {per_gib}; leave the node room for weights and activations"
            ),
        )
    title = PLAN_ORDER[2].title
    if per_token and facts.total_gpu_gib:
        extra = facts.total_gpu_gib * 0.02 * GIB / per_token
        return Recommendation(
            3,
            title,
            (
                f"+0.02 adds {facts.total_gpu_gib * 0.02:.2f} GiB, about {extra:,.0f} tokens; "
                "only if nothing else uses the GPU; stay at or below 0.95"
            ),
        )
    return Recommendation(
        3,
        title,
        (
            "each +0.01 adds 1% of the GPU's memory to the pool (the log does not say how much "
            "memory the GPU has); only if nothing else uses it; stay at or below 0.95"
        ),
    )


def _step_fp8(facts: LogFacts, usable: int) -> Recommendation:
    title, dtype = PLAN_ORDER[3].title, facts.kv_cache_dtype
    if dtype not in (None, "auto", "bfloat16", "float16"):
        return Recommendation(4, title, f"already {dtype}")
    if facts.num_blocks_override is not None:
        return Recommendation(
            4,
            title,
            (
                f"with --num-gpu-blocks-override the pool stays {facts.num_blocks_override} "
                "blocks: fp8 halves their memory, not their number; raise the override instead"
            ),
        )
    if facts.kv_device == "CPU":
        return Recommendation(
            4,
            title,
            (
                f"about {2 * usable:,} tokens from the same memory (twice as many); vLLM's CPU "
                "attention takes fp8, fp8_e4m3 and fp8_e5m2 caches; some accuracy loss (run "
                "your evals)"
            ),
        )
    return Recommendation(
        4,
        title,
        (
            f"about {2 * usable:,} tokens (twice as many); some accuracy loss, needs fp8 "
            "attention support (native on Hopper/Ada/Blackwell) and calibrated k/v scales"
        ),
    )


def _step_bigger(facts: LogFacts, per_token: float | None) -> Recommendation:
    gained = f"about {GIB / per_token:,.0f} tokens" if per_token else "tokens"
    if facts.kv_device == "CPU":
        return Recommendation(
            5,
            "A node with more memory, or a GPU node",
            (
                f"each GiB of KV memory adds {gained}; --cpu-offload-gb does not apply: the "
                "weights are in host memory already"
            ),
        )
    return Recommendation(
        5,
        "Larger-memory node, or a CPU-offload node",
        (
            f"each GiB freed (a bigger GPU, or --cpu-offload-gb moving weights to host RAM at "
            f"~20-40 ms more per decode step per GiB) adds {gained}"
        ),
    )


def log_recommendations(
    facts: LogFacts, pool: LoggedPool
) -> tuple[tuple[Recommendation, ...], Settings | None]:
    bs, usable = pool.block_size, pool.usable
    if facts.estimated_max_model_len is not None:  # a refused start: vLLM's longest context
        m = facts.estimated_max_model_len
        usable = m if pool.null_block_excluded else m - bs
    if not usable or usable <= 0:
        return (), None  # the pool is unknown: advice on it would be wrong
    target = facts.max_model_len or usable
    if target <= 0.8 * usable:
        length = target
    else:
        length = max(bs, round_down(0.7 * usable, 1024 if usable >= 4096 else bs))
    seqs = suggested_max_num_seqs(usable, length)
    now = f" (now {facts.max_num_seqs})" if facts.max_num_seqs else ""
    batched = (
        "it bounds how long one step's prefill holds up the running requests"
        if facts.kv_device == "CPU"
        else "its activation peak comes out of KV"
    )
    per_token = per_token_bytes(facts, pool)
    recs = (
        _step_len(facts, usable, length, bs),
        Recommendation(
            2,
            PLAN_ORDER[1].title,
            (
                f"--max-num-seqs {seqs}{now} (requests averaging {length // 4} tokens fill the "
                f"pool); keep --max-num-batched-tokens small (2048): {batched}"
            ),
        ),
        _step_memory(facts, pool, per_token),
        _step_fp8(facts, usable),
        _step_bigger(facts, per_token),
    )
    return recs, Settings(length, min(seqs, 256), usable, usable / length)
