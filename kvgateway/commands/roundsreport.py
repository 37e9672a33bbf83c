"""Rounds side by side: a table, a verdict per change and the next step of the plan.

Pure (``gateway rounds`` prints). A change is judged by two numbers: the best generated
tokens/s a round reached at any step (steps with timeouts excluded), and the concurrency
at which preemptions start. More of the first is a real improvement; a later start with the same best
throughput only moved the out-of-KV point to a higher concurrency. The next step follows
``gateway plan``'s order (:data:`~kvgateway.capacity.advice.PLAN_ORDER`): the first step
whose flags no round has touched yet.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgateway.capacity.advice import MAX_SAFE_UTILIZATION, PLAN_ORDER, PlanStep, round_down
from kvgateway.commands.roundstats import Round, StepResult, rounds_to_json

# Relative change in best tokens/s below which a change is called flat (run-to-run noise).
FLAT = 0.05
_WIDTH = 100


@dataclass(frozen=True, slots=True)
class Verdict:
    before: str
    after: str
    changed: tuple[str, ...]  # "--max-num-seqs 256 -> 12"
    kind: str  # "better", "worse", "moved", "flat"
    sentence: str


@dataclass(frozen=True, slots=True)
class NextStep:
    step: PlanStep
    flag: str
    advice: str


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _show(value: Any) -> str:
    return "default" if value is None else str(value)


def changed_flags(before: Round, after: Round) -> tuple[str, ...]:
    keys = sorted(set(before.flags) | set(after.flags))
    return tuple(
        f"{_flag(k)} {_show(before.flags.get(k))} -> {_show(after.flags.get(k))}"
        for k in keys
        if before.flags.get(k) != after.flags.get(k)
    )


def clean(step: StepResult) -> bool:
    """A step the node handled: no preemption, no timeout."""
    return step.preemptions == 0 and step.timeouts == 0


def best_step(r: Round) -> StepResult | None:
    """The step with the most generated tokens/s; steps with timeouts do not count."""
    steps = [s for s in r.steps if s.timeouts == 0]
    return max(steps, key=lambda s: s.tokens_per_s, default=None)


def _pct(new: float, old: float) -> str:
    if old <= 0:
        return "n/a"
    change = (new - old) / old
    return "±0%" if round(change * 100) == 0 else f"{change:+.0%}"


def _onset_sentence(before: Round, after: Round) -> str:
    pa, pb = before.first_preempting, after.first_preempting
    top_a = before.steps[-1].concurrency if before.steps else 0
    top_b = after.steps[-1].concurrency if after.steps else 0
    if pa is not None and pb is not None:
        if pa == pb:
            return f"preemptions still start at {pb} concurrent"
        return f"preemptions start at {pb} instead of {pa}"
    if pa is not None:
        return f"no preemptions up to {top_b} concurrent (they started at {pa})"
    if pb is not None:
        return f"preemptions now start at {pb} (none up to {top_a} before)"
    tops = f"{top_a}" if top_a == top_b else f"{top_a} and {top_b}"
    return f"no preemptions in either round (up to {tops} concurrent)"


def verdict(before: Round, after: Round) -> Verdict:
    changed = changed_flags(before, after)
    parts = []
    ka, kb = before.limits.kv_tokens, after.limits.kv_tokens
    parts.append(f"KV {ka:,} -> {kb:,} tokens ({_pct(kb, ka)})")
    common = sorted({s.concurrency for s in before.steps} & {s.concurrency for s in after.steps})
    if common:
        at = common[-1]
        sa, sb = before.step_at(at), after.step_at(at)
        assert sa is not None and sb is not None
        parts.append(
            f"{_pct(sb.tokens_per_s, sa.tokens_per_s)} tokens/s at {at} concurrent "
            f"({sa.tokens_per_s:,.0f} -> {sb.tokens_per_s:,.0f})"
        )
        if sa.ttft_p99_s is not None and sb.ttft_p99_s is not None:
            parts.append(f"TTFT p99 {sa.ttft_p99_s:.2f}s -> {sb.ttft_p99_s:.2f}s")
    parts.append(_onset_sentence(before, after))
    ba, bb = best_step(before), best_step(after)
    kind, summary = _judge(before, after, ba, bb)
    load_a = f"{before.prompt_tokens}+{before.output_tokens}"
    load_b = f"{after.prompt_tokens}+{after.output_tokens}"
    if load_a != load_b:
        summary += (
            f" Caution: the requests differ ({load_a} vs {load_b} tokens), so the numbers "
            "are not for the same load."
        )
    what = "; ".join(changed) if changed else "no flag change recorded"
    sentence = f"{after.name} vs {before.name} ({what}): " + ", ".join(parts) + f". {summary}"
    return Verdict(before.name, after.name, changed, kind, sentence)


def _judge(
    before: Round, after: Round, ba: StepResult | None, bb: StepResult | None
) -> tuple[str, str]:
    if bb is None and ba is None:
        return "flat", "Both rounds timed out at every step: no throughput to compare."
    if bb is None:
        return "worse", "Worse: every step of this round timed out."
    if ba is None:
        return "better", (
            f"Better: {bb.tokens_per_s:,.0f} tokens/s at {bb.concurrency} concurrent, where "
            "the previous round timed out at every step."
        )
    best = (
        f"best tokens/s {ba.tokens_per_s:,.0f} ({ba.concurrency} concurrent) -> "
        f"{bb.tokens_per_s:,.0f} ({bb.concurrency} concurrent)"
    )
    gain = (bb.tokens_per_s - ba.tokens_per_s) / ba.tokens_per_s if ba.tokens_per_s else 0.0
    if gain >= FLAT:
        return "better", f"Better: {best}."
    if gain <= -FLAT:
        return "worse", f"Worse: {best}."
    pa, pb = before.first_preempting, after.first_preempting
    later = pa is not None and (pb is None or pb > pa)
    if later:
        return "moved", (
            f"Only moved the preemptions to a higher concurrency: {best}, within {FLAT:.0%}."
        )
    return "flat", f"No clear change: {best}, within {FLAT:.0%}."


def tried_steps(rounds: Sequence[Round]) -> set[int]:
    """Plan steps whose flags a round passed (its log) or changed from the one before."""
    touched: set[str] = set()
    for r in rounds:
        touched.update(_flag(k) for k in r.passed_flags)
    for a, b in itertools.pairwise(rounds):
        touched.update(
            _flag(k) for k in set(a.flags) | set(b.flags) if a.flags.get(k) != b.flags.get(k)
        )
    return {p.step for p in PLAN_ORDER if touched & set(p.flags)}


def next_step(rounds: Sequence[Round]) -> NextStep | None:
    if not rounds:
        return None
    raise_cap = _cap_binds(rounds[-1])
    if raise_cap is not None:
        return NextStep(PLAN_ORDER[1], "--max-num-seqs", raise_cap)
    tried = tried_steps(rounds)
    plan = next((p for p in PLAN_ORDER if p.step not in tried), PLAN_ORDER[-1])
    advice: Callable[[Sequence[Round]], tuple[str, str]] = _ADVICE[plan.step]
    flag, text = advice(rounds)
    return NextStep(plan, flag, text)


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


def _advise_len(rounds: Sequence[Round]) -> tuple[str, str]:
    last = rounds[-1]
    est = next(
        (
            r.log.estimated_max_model_len
            for r in reversed(rounds)
            if r.log and r.log.estimated_max_model_len
        ),
        None,
    )
    longest = est or last.limits.kv_tokens
    value = min(last.limits.max_model_len, round_down(0.7 * longest, 1024) or longest)
    return "--max-model-len", (
        f"--max-model-len {value}: 70% of the {longest:,}-token longest context the KV "
        f"cache holds (now {last.limits.max_model_len})"
    )


def _advise_caps(rounds: Sequence[Round]) -> tuple[str, str]:
    last = rounds[-1]
    held = [s.concurrency for s in last.steps if clean(s)]
    onset = last.first_preempting
    if onset is None:
        top = last.steps[-1].concurrency if last.steps else 0
        return "--max-num-seqs", (
            f"no step preempted up to {top} concurrent: cap --max-num-seqs only once a "
            "longer ladder finds where preemptions start"
        )
    cap = max(held, default=1)
    return "--max-num-seqs", (
        f"--max-num-seqs {cap}: the node ran {cap} requests of {last.prompt_tokens}+"
        f"{last.output_tokens} tokens without preempting and preempted at {onset}; "
        "with the cap, more requests wait in the queue instead of being recomputed"
    )


def _advise_util(rounds: Sequence[Round]) -> tuple[str, str]:
    util = rounds[-1].limits.gpu_memory_utilization or 0.92
    new = min(round(util + 0.02, 2), MAX_SAFE_UTILIZATION)
    if new <= util:
        return "--gpu-memory-utilization", (
            f"already at {util:.2f}: go no higher; move on to --kv-cache-dtype fp8"
        )
    return "--gpu-memory-utilization", (
        f"--gpu-memory-utilization {new:.2f} (now {util:.2f}), only on a GPU nothing else "
        f"uses; stay at or below {MAX_SAFE_UTILIZATION}"
    )


def _advise_fp8(rounds: Sequence[Round]) -> tuple[str, str]:
    kv = rounds[-1].limits.kv_tokens
    return "--kv-cache-dtype", (
        f"--kv-cache-dtype fp8: half the bytes per token, so about {2 * kv:,} KV tokens "
        f"instead of {kv:,}; run your accuracy evals (long-context recall degrades first)"
    )


def _advise_bigger(rounds: Sequence[Round]) -> tuple[str, str]:
    return "--cpu-offload-gb", (
        "the flags of steps 1-4 are spent: a larger-memory GPU, or --cpu-offload-gb N for "
        "a slow long-context tier (each offloaded GiB adds ~20-40 ms per decode step)"
    )


_ADVICE: dict[int, Callable[[Sequence[Round]], tuple[str, str]]] = {
    1: _advise_len,
    2: _advise_caps,
    3: _advise_util,
    4: _advise_fp8,
    5: _advise_bigger,
}


# -- rendering --------------------------------------------------------------------------


def _cell(step: StepResult | None, metric: str) -> str:
    if step is None:
        return "-"
    if metric == "tokens":
        return f"{step.tokens_per_s:,.0f}"
    if metric == "ttft":
        p50, p99 = step.ttft_p50_s, step.ttft_p99_s
        return "-" if p50 is None or p99 is None else f"{p50:.2f}/{p99:.2f}"
    if metric == "preempt":
        failed = step.bad_requests + step.errors + step.timeouts
        return f"{step.preemptions}" + (f" ({failed} failed)" if failed else "")
    return "-" if step.peak_kv_usage is None else f"{step.peak_kv_usage:.0%}"


def render(rounds: Sequence[Round]) -> str:
    names = [r.name for r in rounds]
    width = max(12, *(len(n) + 2 for n in names))
    label = 24

    def row(title: str, cells: Sequence[str]) -> str:
        return f"{title:<{label}}" + "".join(f"{c:>{width}}" for c in cells)

    def gib(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} GiB"

    lines = [row("round", names)]
    lines.append(row("KV tokens", [f"{r.limits.kv_tokens:,}" for r in rounds]))
    lines.append(row("max_model_len", [str(r.limits.max_model_len) for r in rounds]))
    keys = sorted({k for r in rounds for k in r.flags} - {"max_model_len"})
    lines.extend(row(_flag(k), [_show(r.flags.get(k)) for r in rounds]) for k in keys)
    lines.append(
        row(
            "KV cache memory (log)",
            [gib(r.log.kv_cache_memory_gib if r.log else None) for r in rounds],
        )
    )
    lines.append(
        row("peak memory (log)", [gib(r.log.peak_memory_gib if r.log else None) for r in rounds])
    )
    lines.append(row("load per request", [f"{r.prompt_tokens}+{r.output_tokens}" for r in rounds]))
    levels = sorted({s.concurrency for r in rounds for s in r.steps})
    for title, metric in (
        ("generated tokens/s", "tokens"),
        ("TTFT p50/p99 (s)", "ttft"),
        ("preemptions", "preempt"),
        ("peak KV usage", "kv"),
    ):
        lines.append("")
        lines.append(title)
        lines.extend(
            row(f"  {c} concurrent", [_cell(r.step_at(c), metric) for r in rounds]) for c in levels
        )
    stops = [f"{r.name}: ladder stopped: {r.stopped}" for r in rounds if r.stopped]
    if stops:
        lines += ["", *stops]
    verdicts = [verdict(a, b) for a, b in itertools.pairwise(rounds)]
    if verdicts:
        lines += ["", "Verdicts:"]
        for v in verdicts:
            lines += textwrap.wrap(
                v.sentence, _WIDTH, initial_indent="  ", subsequent_indent="    "
            )
    nxt = next_step(rounds)
    if nxt is not None:
        lines += ["", f"Next (plan step {nxt.step.step}, {nxt.step.title}):"]
        lines += textwrap.wrap(nxt.advice, _WIDTH, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def report_json(rounds: Sequence[Round]) -> dict[str, Any]:
    nxt = next_step(rounds)
    return {
        **rounds_to_json(rounds),
        "verdicts": [
            {"before": v.before, "after": v.after, "changed": list(v.changed), "kind": v.kind,
             "sentence": v.sentence}
            for v in (verdict(a, b) for a, b in itertools.pairwise(rounds))
        ],
        "next": None if nxt is None else {
            "step": nxt.step.step, "title": nxt.step.title, "flag": nxt.flag,
            "advice": nxt.advice,
        },
    }  # fmt: skip
