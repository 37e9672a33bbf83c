"""Rounds compared: a verdict per change, the run-to-run noise, the next step of the plan.

Pure (``gateway rounds`` renders and prints). A change is judged by two numbers: the best
generated tokens/s a round reached at any step (steps with timeouts excluded), and the
concurrency at which preemptions start. More of the first is a real improvement only
beyond the run-to-run noise: the spread of best tokens/s among repeats (rounds of the same
settings, KV pool and load; a repeated configuration counts by its median) or the noise
the caller gives. Without either a verdict is inconclusive: one run of each cannot tell a
change from a disturbed run. A later start of preemptions with the same best throughput
only moved the out-of-KV point. The next step follows ``gateway plan``'s order
(:data:`~kvgateway.capacity.advice.PLAN_ORDER`): the first step whose flags no round has
touched and that still applies, in the node's own flags (a CPU node's KV memory is
``--kv-cache-memory-bytes``; under ``--num-gpu-blocks-override`` the override sets it).
"""

from __future__ import annotations

import itertools
import json
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvgateway.commands.roundsnext import next_step
from kvgateway.commands.roundstats import (
    Round,
    StepResult,
    changed_keys,
    flag_name,
    rounds_to_json,
    tuning_flags,
)

# Relative change in best tokens/s below which a change is never called one.
FLAT = 0.05
_WIDTH = 100


@dataclass(frozen=True, slots=True)
class Noise:
    fraction: float  # relative spread of best tokens/s between runs of one configuration
    source: str  # "repeats of r1, r1b" or "--noise"


@dataclass(frozen=True, slots=True)
class Verdict:
    before: str
    after: str
    changed: tuple[str, ...]  # "--max-num-seqs 256 -> 12"
    kind: str  # "better", "worse", "moved", "flat", "inconclusive", "repeat"
    sentence: str
    noise: Noise | None = None


def show(value: Any) -> str:
    return "default" if value is None else str(value)


def changed_flags(before: Round, after: Round) -> tuple[str, ...]:
    a, b = tuning_flags(before), tuning_flags(after)
    return tuple(
        f"{flag_name(k)} {show(a.get(k))} -> {show(b.get(k))}" for k in changed_keys(before, after)
    )


def best_step(r: Round) -> StepResult | None:
    """The step with the most generated tokens/s; steps with timeouts do not count."""
    steps = [s for s in r.steps if s.timeouts == 0]
    return max(steps, key=lambda s: s.tokens_per_s, default=None)


def repeat_key(r: Round) -> str:
    """Rounds of one key ran the same settings on the same pool under the same load."""
    load = [r.limits.model, r.limits.kv_tokens, r.prompt_tokens, r.output_tokens]
    return json.dumps([tuning_flags(r), load], sort_keys=True, default=str)


def repeats_of(r: Round, rounds: Sequence[Round]) -> list[Round]:
    key = repeat_key(r)
    return [x for x in rounds if repeat_key(x) == key] or [r]


def _bests(group: Sequence[Round]) -> list[float]:
    return [s.tokens_per_s for r in group if (s := best_step(r)) is not None]


def spread(group: Sequence[Round]) -> float | None:
    """(max - min) / mean of the best tokens/s of repeats; None below two runs."""
    values = _bests(group)
    mean = statistics.fmean(values) if len(values) >= 2 else 0.0
    return (max(values) - min(values)) / mean if mean > 0 else None


def noise_for(
    before: Round, after: Round, rounds: Sequence[Round], given: float | None
) -> Noise | None:
    """The pair's own repeats first, else any repeated configuration's in the file (the
    same node and machine), and never less than the noise the caller gives."""
    groups = [repeats_of(before, rounds), repeats_of(after, rounds)]
    measured = [(s, g) for g in groups if (s := spread(g)) is not None]
    if not measured:
        seen = {repeat_key(r): repeats_of(r, rounds) for r in rounds}
        measured = [(s, g) for g in seen.values() if (s := spread(g)) is not None]
    if measured:
        fraction, group = max(measured, key=lambda m: m[0])
        found = Noise(fraction, "repeats of " + ", ".join(r.name for r in group))
        if given is None or given <= fraction:
            return found
    return None if given is None else Noise(given, "--noise")


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


def verdict(
    before: Round, after: Round, rounds: Sequence[Round] = (), noise: float | None = None
) -> Verdict:
    """``after`` against ``before``; ``rounds`` (the whole file) holds their repeats and
    ``noise`` is the run-to-run noise the caller knows (a fraction)."""
    rounds = rounds or (before, after)
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
    found = noise_for(before, after, rounds, noise)
    if repeat_key(before) == repeat_key(after):
        kind, summary = _repeat(before, after)
    else:
        kind, summary = _judge(before, after, rounds, found)
    load_a = f"{before.prompt_tokens}+{before.output_tokens}"
    load_b = f"{after.prompt_tokens}+{after.output_tokens}"
    if load_a != load_b:
        summary += (
            f" Caution: the requests differ ({load_a} vs {load_b} tokens), so the numbers "
            "are not for the same load."
        )
    what = "; ".join(changed) if changed else "no flag change recorded"
    sentence = f"{after.name} vs {before.name} ({what}): " + ", ".join(parts) + f". {summary}"
    return Verdict(before.name, after.name, changed, kind, sentence, found)


def _repeat(before: Round, after: Round) -> tuple[str, str]:
    values = _bests((before, after))
    if len(values) < 2:
        return "repeat", "A repeat (no recorded setting differs) with no throughput to compare."
    gap = spread((before, after)) or 0.0
    return "repeat", (
        f"A repeat (no recorded setting, pool or load differs): best tokens/s "
        f"{values[0]:,.0f} and {values[1]:,.0f}, {gap:.0%} apart, is run-to-run noise, the "
        "yardstick for the changes (if something unrecorded changed, an environment "
        "variable or the release, it is that change's result instead)."
    )


def _judge(
    before: Round, after: Round, rounds: Sequence[Round], noise: Noise | None
) -> tuple[str, str]:
    ba, bb = best_step(before), best_step(after)
    if bb is None and ba is None:
        return "flat", "Both rounds timed out at every step: no throughput to compare."
    if bb is None:
        return "worse", "Worse: every step of this round timed out."
    if ba is None:
        return "better", (
            f"Better: {bb.tokens_per_s:,.0f} tokens/s at {bb.concurrency} concurrent, where "
            "the previous round timed out at every step."
        )
    runs_a, runs_b = _bests(repeats_of(before, rounds)), _bests(repeats_of(after, rounds))
    va, vb = statistics.median(runs_a), statistics.median(runs_b)
    best = (
        f"best tokens/s {ba.tokens_per_s:,.0f} ({ba.concurrency} concurrent) -> "
        f"{bb.tokens_per_s:,.0f} ({bb.concurrency} concurrent)"
    )
    if len(runs_a) > 1 or len(runs_b) > 1:
        best += f"; medians of {len(runs_a)} and {len(runs_b)} runs {va:,.0f} -> {vb:,.0f}"
    gain = (vb - va) / va if va else 0.0
    if noise is None:
        return "inconclusive", (
            f"Inconclusive: {gain:+.0%} ({best}) from one run of each, and no run-to-run "
            "noise to weigh it against: a disturbed run (other load on the machine, a cold "
            f"start) looks the same. Repeat {before.name} and {after.name} with the same "
            f"flags and load (gateway round --name {before.name}-2 ...), or give --noise "
            "from earlier repeats."
        )
    bar = max(FLAT, noise.fraction)
    within = f"within the {bar:.0%} run-to-run noise ({noise.source})"
    if gain >= bar:
        return "better", f"Better: {best}, {gain:+.0%}, beyond the {bar:.0%} noise."
    if gain <= -bar:
        return "worse", f"Worse: {best}, {gain:+.0%}, beyond the {bar:.0%} noise."
    pa, pb = before.first_preempting, after.first_preempting
    if pa is not None and (pb is None or pb > pa):
        return "moved", f"Only moved the preemptions to a higher concurrency: {best}, {within}."
    return "flat", f"No clear change: {best}, {within}."


# -- rendering --------------------------------------------------------------------------


def _cell_text(value: Any, width: int) -> str:
    """A flag's value in a column: a config object's text is cut to the column."""
    text = show(value)
    return text if len(text) < width else text[: width - 2] + "…"


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


def render(rounds: Sequence[Round], noise: float | None = None) -> str:
    """The table, the verdicts (``noise``: the run-to-run noise the caller knows) and the
    next step."""
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
    keys = sorted({k for r in rounds for k in tuning_flags(r)} - {"max_model_len"})
    lines.extend(
        row(flag_name(k), [_cell_text(r.flags.get(k), width) for r in rounds]) for k in keys
    )
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
    verdicts = [verdict(a, b, rounds, noise) for a, b in itertools.pairwise(rounds)]
    if verdicts:
        lines += ["", "Verdicts:"]
        for v in verdicts:
            lines += textwrap.wrap(
                v.sentence, _WIDTH, initial_indent="  ", subsequent_indent="    "
            )
    nxt = next_step(rounds)
    if nxt is not None:
        lines += ["", f"Next (plan step {nxt.step.step}, {nxt.title}):"]
        lines += textwrap.wrap(nxt.advice, _WIDTH, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def report_json(rounds: Sequence[Round], noise: float | None = None) -> dict[str, Any]:
    nxt = next_step(rounds)
    return {
        **rounds_to_json(rounds),
        "verdicts": [
            {"before": v.before, "after": v.after, "changed": list(v.changed), "kind": v.kind,
             "sentence": v.sentence, "noise": None if v.noise is None else asdict(v.noise)}
            for v in (verdict(a, b, rounds, noise) for a, b in itertools.pairwise(rounds))
        ],
        "next": None if nxt is None else {
            "step": nxt.step.step, "title": nxt.title, "flag": nxt.flag,
            "advice": nxt.advice,
        },
    }  # fmt: skip
