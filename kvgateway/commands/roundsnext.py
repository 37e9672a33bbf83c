"""What to try after a series of rounds: the next step of ``gateway plan``'s order.

The first step of :data:`~kvgateway.capacity.advice.PLAN_ORDER` whose flags no round
has passed or changed and that still applies to the last round (nothing to lower when
``--max-model-len`` is already at 70% of the longest context; no fp8 step when the cache
is fp8). Memory steps use the node's own flags, from its start-up log: a CPU node's KV
memory is ``--kv-cache-memory-bytes`` (or, when vLLM sized it itself, the share of the
node's memory ``--gpu-memory-utilization`` sets), and under ``--num-gpu-blocks-override``
the override alone sizes the pool. Before all that, a ``--max-num-seqs`` cap that held
the node back is raised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgateway.capacity.advice import MAX_SAFE_UTILIZATION, PLAN_ORDER, PlanStep, round_down
from kvgateway.capacity.layout import kv_tokens_from_blocks
from kvgateway.commands.roundstats import (
    NOT_TUNING,
    Round,
    StepResult,
    changed_keys,
    flag_name,
)


@dataclass(frozen=True, slots=True)
class NextStep:
    step: PlanStep
    flag: str
    advice: str
    title: str  # the step's title in the node's own flags


def clean(step: StepResult) -> bool:
    """A step the node handled: no preemption, no timeout."""
    return step.preemptions == 0 and step.timeouts == 0


def _step_flags(step: int) -> set[str]:
    """A plan step's flags; a CPU node's KV memory and the block override are step 3's."""
    flags = set(PLAN_ORDER[step - 1].flags)
    if step == 3:
        flags |= {"--kv-cache-memory-bytes", "--num-gpu-blocks-override"}
    return flags


def tried_steps(rounds: Sequence[Round]) -> set[int]:
    """Plan steps whose flags a round passed (its log) or changed from the one before.
    A passed ``--num-gpu-blocks-override`` is no try: it sets the pool, so it is what to
    raise; changed, it is."""
    passed = NOT_TUNING | {"num_gpu_blocks_override"}
    touched = {flag_name(k) for r in rounds for k in r.passed_flags if k not in passed}
    for a, b in itertools.pairwise(rounds):
        touched.update(flag_name(k) for k in changed_keys(a, b))
    return {p.step for p in PLAN_ORDER if touched & _step_flags(p.step)}


# One step's advice for the last round: (flag, advice, title), or None when it does not
# apply (nothing to lower, a dtype already fp8, a pool the override sets).
_Advice = Callable[[Sequence[Round]], tuple[str, str, str] | None]


def next_step(rounds: Sequence[Round]) -> NextStep | None:
    if not rounds:
        return None
    raise_cap = _cap_binds(rounds[-1])
    if raise_cap is not None:
        return NextStep(PLAN_ORDER[1], "--max-num-seqs", raise_cap, PLAN_ORDER[1].title)
    tried = tried_steps(rounds)
    for plan in PLAN_ORDER:
        found = None if plan.step in tried else _ADVICE[plan.step](rounds)
        if found is not None:
            return NextStep(plan, *found)
    last = _advise_bigger(rounds)
    assert last is not None
    return NextStep(PLAN_ORDER[-1], *last)


def _cap_binds(last: Round) -> str | None:
    """Advice to raise --max-num-seqs when the cap, not the KV cache, limited the round:
    no preemption although the ladder went past the cap, and room for more requests."""
    cap = last.flags.get("max_num_seqs")
    if not isinstance(cap, int) or last.first_preempting is not None or not last.steps:
        return None
    top = last.steps[-1].concurrency
    fits = last.limits.kv_tokens // max(1, last.prompt_tokens + last.output_tokens)
    if top <= cap or fits <= cap:
        return None
    peak = max((s.peak_kv_usage or 0.0 for s in last.steps), default=0.0)
    return (
        f"--max-num-seqs {fits}: the cap of {cap} limited this round, not the KV cache "
        f"(no preemption up to {top} concurrent, peak KV usage {peak:.0%}); "
        f"{last.limits.kv_tokens:,} KV tokens hold {fits} requests of "
        f"{last.prompt_tokens}+{last.output_tokens} tokens at once"
    )


def _device(r: Round) -> str | None:
    return r.log.device if r.log is not None else None


def _override(r: Round) -> int | None:
    passed = r.flags.get("num_gpu_blocks_override")
    if isinstance(passed, int) and not isinstance(passed, bool):
        return passed
    return r.log.num_blocks_override if r.log is not None else None


def _advise_len(rounds: Sequence[Round]) -> tuple[str, str, str] | None:
    last = rounds[-1]
    est = next(
        (r.log.estimated_max_model_len for r in reversed(rounds)
         if r.log and r.log.estimated_max_model_len),
        None,
    )  # fmt: skip
    longest = est or last.limits.kv_tokens
    value = min(last.limits.max_model_len, round_down(0.7 * longest, 1024) or longest)
    if value >= last.limits.max_model_len:
        return None  # already at or below 70% of the longest context: nothing to lower
    return (
        "--max-model-len",
        (
            f"--max-model-len {value}: 70% of the {longest:,}-token longest context the KV "
            f"cache holds (now {last.limits.max_model_len})"
        ),
        PLAN_ORDER[0].title,
    )


def _advise_caps(rounds: Sequence[Round]) -> tuple[str, str, str] | None:
    last = rounds[-1]
    held = [s.concurrency for s in last.steps if clean(s)]
    onset = last.first_preempting
    if onset is None:
        top = last.steps[-1].concurrency if last.steps else 0
        text = (
            f"no step preempted up to {top} concurrent: cap --max-num-seqs only once a "
            "longer ladder finds where preemptions start"
        )
    else:
        cap = max(held, default=1)
        text = (
            f"--max-num-seqs {cap}: the node ran {cap} requests of {last.prompt_tokens}+"
            f"{last.output_tokens} tokens without preempting and preempted at {onset}; "
            "with the cap, more requests wait in the queue instead of being recomputed"
        )
    return "--max-num-seqs", text, PLAN_ORDER[1].title


def _advise_memory(rounds: Sequence[Round]) -> tuple[str, str, str] | None:
    last = rounds[-1]
    lim, log, override = last.limits, last.log, _override(last)
    if override is not None:
        held = log.profiled_num_blocks if log is not None else None
        raised = 2 * override if held is None else min(2 * override, held)
        if raised <= override:
            return None  # the override already takes all the memory holds
        memory = f" (the KV memory holds {held:,} blocks)" if held else ""
        tokens = kv_tokens_from_blocks(raised, lim.block_size)
        return (
            "--num-gpu-blocks-override",
            f"--num-gpu-blocks-override {raised} (now {override}): the override sets the "
            f"pool whatever the memory{memory}; {raised} blocks hold {tokens:,} tokens "
            f"instead of {lim.kv_tokens:,}",
            "Raise --num-gpu-blocks-override (it sets the pool)",
        )
    gib = log.kv_cache_memory_gib if log is not None else None
    node = (
        f" of the NUMA node's {log.node_memory_gib:.2f} GiB" if log and log.node_memory_gib else ""
    )
    if _device(last) == "CPU" and log is not None and log.kv_memory_source == "auto":
        util = lim.gpu_memory_utilization or 0.92
        if util >= MAX_SAFE_UTILIZATION:
            return None
        return (
            "--gpu-memory-utilization",
            (
                f"--gpu-memory-utilization {min(util + 0.05, MAX_SAFE_UTILIZATION):.2f} (now "
                f"{util:.2f}): on the "
                f"CPU backend it is the share of the node's memory vLLM takes, weights and "
                f"activations included (the KV cache got {gib or 0:.2f} GiB{node}); only if "
                "nothing else needs that memory"
            ),
            "Raise --gpu-memory-utilization (CPU: the node's share)",
        )
    if _device(last) == "CPU":
        now = f"{gib:.2f} GiB{node}" if gib else "unknown"
        more = f"{max(2, round(2 * gib))}G" if gib else "2G"
        return (
            "--kv-cache-memory-bytes",
            (
                f"--kv-cache-memory-bytes {more} (now {now}; VLLM_CPU_KVCACHE_SPACE sets it in "
                "GiB too): more KV memory for more tokens; leave the node room for the weights "
                "and activations"
            ),
            "More KV memory (CPU: --kv-cache-memory-bytes)",
        )
    util = lim.gpu_memory_utilization or 0.92
    new = min(round(util + 0.02, 2), MAX_SAFE_UTILIZATION)
    if new <= util:
        return None  # already at the safe maximum
    return (
        "--gpu-memory-utilization",
        (
            f"--gpu-memory-utilization {new:.2f} (now {util:.2f}), only on a GPU nothing else "
            f"uses; stay at or below {MAX_SAFE_UTILIZATION}"
        ),
        PLAN_ORDER[2].title,
    )


def _advise_fp8(rounds: Sequence[Round]) -> tuple[str, str, str] | None:
    last = rounds[-1]
    dtype = str(last.flags.get("kv_cache_dtype") or "auto")
    if dtype.startswith("fp8") or _override(last) is not None:
        return None  # already fp8; or the override fixes the block count, not their bytes
    kv = last.limits.kv_tokens
    where = (
        "vLLM's CPU attention takes fp8, fp8_e4m3 and fp8_e5m2"
        if _device(last) == "CPU"
        else "run your accuracy evals (long-context recall degrades first)"
    )
    return (
        "--kv-cache-dtype",
        (
            f"--kv-cache-dtype fp8: half the bytes per token, so about {2 * kv:,} KV tokens "
            f"instead of {kv:,}; {where}"
        ),
        PLAN_ORDER[3].title,
    )


def _advise_bigger(rounds: Sequence[Round]) -> tuple[str, str, str] | None:
    if _device(rounds[-1]) == "CPU":
        return (
            "--kv-cache-memory-bytes",
            (
                "the flags of steps 1-4 are spent: a node with more memory (and a larger "
                "--kv-cache-memory-bytes), or a GPU node; --cpu-offload-gb does not apply on CPU"
            ),
            "A node with more memory, or a GPU node",
        )
    return (
        "--cpu-offload-gb",
        (
            "the flags of steps 1-4 are spent: a larger-memory GPU, or --cpu-offload-gb N for "
            "a slow long-context tier (each offloaded GiB adds ~20-40 ms per decode step)"
        ),
        PLAN_ORDER[4].title,
    )


_ADVICE: dict[int, _Advice] = {
    1: _advise_len,
    2: _advise_caps,
    3: _advise_memory,
    4: _advise_fp8,
    5: _advise_bigger,
}
