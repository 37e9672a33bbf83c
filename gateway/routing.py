"""Choosing a backend for a request: pure functions of the fleet state and the demand.

No I/O and no waiting here: :func:`route` says where a request goes now, that it must
wait, or that it can never be served. :mod:`gateway.admission` acts on the answer.

Policies:

``kv_aware`` (default)
    Candidates serve the model and their context limit (the smaller of
    ``max_model_len`` and the KV budget) holds the longest prompt plus its output.
    GPU tiers are tried in configured order; within a tier the backend with the most
    free KV budget (that also has a free sequence slot) wins. A tier without room
    spills to the next tier that fits. The offload tier takes what fits no GPU tier,
    and overflow from full GPU tiers only when ``routing.offload_overflow`` is set.
    Nothing free: wait. Nothing could ever fit: 400 ``context_length_exceeded``.
``round_robin`` / ``least_loaded``
    Baselines as simple routers do it: every healthy backend of the model, in turn or
    by fewest in-flight requests; context and KV budget are ignored.
``length_aware``
    Least loaded among backends whose ``max_model_len`` fits (as context-window-aware
    proxies do); KV budget is ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.backends import Backend


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request needs, in KV tokens and sequence slots."""

    model: str
    prompt_tokens: int
    longest_prompt: int
    output_tokens: int
    sequences: int
    tokens: int
    exclude: frozenset[str] = frozenset()

    @property
    def longest_sequence(self) -> int:
        return self.longest_prompt + self.output_tokens


def demand_tokens(prompt_lengths: Sequence[int], output_tokens: int, n: int, block: int) -> int:
    """KV tokens a request can occupy: every sequence's prompt and output, in whole blocks.

    vLLM allocates KV in blocks of ``block`` tokens per sequence, so each sequence's
    ``prompt + output`` is rounded up to a block.
    """
    total = 0
    for p in prompt_lengths:
        seq = p + output_tokens
        total += n * (-(-seq // block) * block)
    return total


@dataclass(frozen=True, slots=True)
class Routed:
    backend: Backend
    reason: str  # fit, spill, offload, overflow


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str = "queued"


@dataclass(frozen=True, slots=True)
class TooLong:
    largest_context: int


@dataclass(frozen=True, slots=True)
class NoBackend:
    detail: str


Decision = Routed | Wait | TooLong | NoBackend


@dataclass(slots=True)
class RouterState:
    """The only mutable routing state: the round-robin cursor per model."""

    cursors: dict[str, int] = field(default_factory=dict)


def _has_room(b: Backend, d: Demand) -> bool:
    return b.free_tokens >= d.tokens and b.free_seqs >= d.sequences


def route_kv_aware(
    backends: Sequence[Backend], d: Demand, now: float, *, offload_overflow: bool = False
) -> Decision:
    could = [
        b
        for b in backends
        if b.limits.known
        and b.context_limit >= d.longest_sequence
        and b.budget_tokens >= d.tokens
        and b.max_num_seqs >= d.sequences
    ]
    if not could:
        return _never_fits(backends, d)
    usable = [b for b in could if b.usable and b.name not in d.exclude]
    if not usable:
        return NoBackend("no healthy backend can hold this request")
    best: Backend | None = None
    first_gpu_tier: int | None = None
    # Backends arrive in tier order; find the first tier with room.
    for b in usable:
        if b.offload:
            continue
        if first_gpu_tier is None:
            first_gpu_tier = b.tier_index
        if best is not None and b.tier_index != best.tier_index:
            break
        if (
            b.accepting(now)
            and _has_room(b, d)
            and (best is None or b.free_tokens > best.free_tokens)
        ):
            best = b
    if best is not None:
        return Routed(best, "fit" if best.tier_index == first_gpu_tier else "spill")
    offload = [b for b in usable if b.offload and b.accepting(now) and _has_room(b, d)]
    if offload and (first_gpu_tier is None or offload_overflow):
        pick = max(offload, key=lambda b: b.free_tokens)
        return Routed(pick, "offload" if first_gpu_tier is None else "overflow")
    return Wait()


def _never_fits(backends: Sequence[Backend], d: Demand) -> Decision:
    known = [b for b in backends if b.limits.known]
    if not known:
        return NoBackend("no backend of this model has known limits yet (still starting?)")
    return TooLong(max(b.context_limit for b in known))


def route_simple(
    policy: str, backends: Sequence[Backend], d: Demand, state: RouterState, now: float
) -> Decision:
    pool = [b for b in backends if b.name not in d.exclude and b.healthy and not b.draining]
    if policy == "length_aware":
        known = [b for b in backends if b.limits.known]
        if known and all(b.max_model_len < d.longest_sequence for b in known):
            return TooLong(max(b.max_model_len for b in known))
        pool = [b for b in pool if not b.limits.known or b.max_model_len >= d.longest_sequence]
    if not pool:
        return NoBackend("no healthy backend serves this model")
    if policy == "round_robin":
        i = state.cursors.get(d.model, 0)
        state.cursors[d.model] = i + 1
        return Routed(pool[i % len(pool)], "fit")
    return Routed(min(pool, key=lambda b: b.in_flight), "fit")


def route(
    policy: str,
    backends: Sequence[Backend],
    d: Demand,
    state: RouterState,
    now: float,
    *,
    offload_overflow: bool = False,
) -> Decision:
    """Decide for one demand; ``backends`` are this model's backends in tier order."""
    if policy == "kv_aware":
        return route_kv_aware(backends, d, now, offload_overflow=offload_overflow)
    return route_simple(policy, backends, d, state, now)
