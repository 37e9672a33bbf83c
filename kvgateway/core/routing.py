"""Choosing a backend for a request: pure functions of the fleet state and the demand.

No I/O and no waiting here: :func:`route` says where a request goes now, that it must
wait, or that it can never be served. :mod:`kvgateway.core.admission` acts on the answer.

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

The index: each tier's backends kept sorted by free KV budget (:class:`ModelIndex`). A
kv_aware decision walks the tiers in order and, within a tier, the backends from the
most free budget down, stopping at the first that can take the request or as soon as the
free budget falls below what the request needs. With the index a decision over 1,000
backends looks at a handful of them instead of all of them. Reservations change a
backend's free budget, so every change goes through :meth:`ModelIndex.adjust` (remove,
mutate, re-insert: O(log n)). Limits and membership change rarely (discovery, reload):
the whole index is rebuilt then.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from sortedcontainers import SortedKeyList

from kvgateway.config.model import Policy
from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand, can_ever_hold, fits_limits, projected_room, tokens_on


class RouteReason(StrEnum):
    """Why a request went where it did (a label on the decision metric)."""

    FIT = "fit"  # the first GPU tier that can hold it
    SPILL = "spill"  # a later GPU tier, the first being full
    OFFLOAD = "offload"  # the offload tier: no GPU tier can hold it
    OVERFLOW = "overflow"  # the offload tier while GPU tiers are full (offload_overflow)


@dataclass(frozen=True, slots=True)
class Routed:
    backend: Backend
    reason: RouteReason


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


def _sort_key(b: Backend) -> tuple[int, str]:
    return (-b.free_tokens, b.name)


def _key_better(a: Backend, b: Backend) -> bool:
    return _sort_key(a) < _sort_key(b)


class TierIndex:
    __slots__ = (
        "_known",
        "_sorted",
        "max_budget",
        "max_context",
        "max_seqs",
        "offload",
        "tier_index",
        "uniform",
    )

    def __init__(self, tier_index: int, offload: bool, backends: Iterable[Backend]) -> None:
        self.tier_index = tier_index
        self.offload = offload
        self._sorted: SortedKeyList[Backend, tuple[int, str]] = SortedKeyList(
            backends, key=_sort_key
        )
        known = [b for b in self._sorted if b.limits.known]
        self._known = known
        # Static maxima: a request above them can skip the tier without looking inside.
        self.max_context = max((b.context_limit for b in known), default=0)
        self.max_budget = max((b.budget_tokens for b in known), default=0)
        self.max_seqs = max((b.max_num_seqs for b in known), default=0)
        # Tiers are usually identical nodes; then the maxima answer exactly.
        self.uniform = len({(b.context_limit, b.budget_tokens, b.max_num_seqs) for b in known}) <= 1

    def could_hold(self, d: Demand) -> bool:
        """Could any backend of the tier ever hold this request (health aside)?"""
        if not fits_limits(self.max_context, self.max_budget, self.max_seqs, d):
            return False
        if self.uniform:
            return can_ever_hold(self._known[0], d)
        return any(can_ever_hold(b, d) for b in self._known)

    def any_usable(self, pred: Callable[[Backend], bool]) -> bool:
        return any(pred(b) for b in self._known)

    def best(self, accept: Callable[[Backend], bool], tokens: int) -> Backend | None:
        """The backend with the most free budget that ``accept`` takes."""
        for b in self._sorted:
            if b.free_tokens < tokens:
                return None  # everyone after this one has even less room
            if accept(b):
                return b
        return None

    def top(self, accept: Callable[[Backend], bool], tokens: int, k: int) -> list[Backend]:
        """Up to ``k`` backends that ``accept`` takes, most free budget first."""
        out: list[Backend] = []
        for b in self._sorted:
            if b.free_tokens < tokens or len(out) >= k:
                break
            if accept(b):
                out.append(b)
        return out

    def remove(self, b: Backend) -> None:
        self._sorted.remove(b)

    def add(self, b: Backend) -> None:
        self._sorted.add(b)

    def __len__(self) -> int:
        return len(self._sorted)


class ModelIndex:
    """One model's backends in tier order, plus a :class:`TierIndex` per tier."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.backends: Sequence[Backend] = backends
        # KV block size to round reservations to (the coarsest of the model's nodes).
        self.block_size = max((b.limits.block_size for b in backends), default=16)
        by_tier: dict[int, list[Backend]] = {}
        for b in backends:
            by_tier.setdefault(b.tier_index, []).append(b)
        self.tiers = [
            TierIndex(i, members[0].offload, members) for i, members in sorted(by_tier.items())
        ]
        self._tier_of = {id(b): t for t in self.tiers for b in t._sorted}
        self._by_name = {b.name: b for b in backends}

    def tier_of(self, b: Backend) -> TierIndex | None:
        return self._tier_of.get(id(b))

    def get(self, name: str) -> Backend | None:
        return self._by_name.get(name)

    def adjust(self, b: Backend, tokens: int, seqs: int, in_flight: int) -> None:
        """Change a backend's reservations, keeping its tier sorted."""
        tier = self._tier_of.get(id(b))
        if tier is not None:
            tier.remove(b)
        b.reserved_tokens += tokens
        b.reserved_seqs += seqs
        b.in_flight += in_flight
        if tier is not None:
            tier.add(b)


def _has_room(b: Backend, d: Demand, stale: bool = False) -> bool:
    kept = d.kept_slots(b.name, b.max_num_seqs) if d.kept_slots is not None else 0.0
    if b.free_seqs - kept < d.sequences:
        return False
    if d.projected:
        return projected_room(b, d, stale)
    return b.free_tokens >= tokens_on(b, d)


def eligible(b: Backend, d: Demand, now: float, stale: bool = False) -> bool:
    """Can ``b`` take ``d`` right now (fits, healthy, accepting, has room)? ``stale``:
    see :func:`~.demand.projected_room`."""
    return (
        can_ever_hold(b, d)
        and b.name not in d.exclude
        and b.name not in d.busy
        and b.accepting(now)
        and _has_room(b, d, stale)
    )


def _could_use(b: Backend, d: Demand) -> bool:
    return b.usable and b.name not in d.exclude and can_ever_hold(b, d)


def _first_fit_tier(index: ModelIndex, d: Demand) -> int | None:
    """The first GPU tier that could hold ``d`` and has a live backend for it: the
    tier a request "fits"; landing in a later one is a spill."""
    for tier in index.tiers:
        if not tier.offload and tier.could_hold(d) and tier.any_usable(lambda b: _could_use(b, d)):
            return tier.tier_index
    return None


def route_to(
    index: ModelIndex, b: Backend, d: Demand, now: float, *, offload_overflow: bool = False
) -> Routed | None:
    """kv_aware's answer restricted to one backend: the reason it would be chosen, or
    None when it cannot take the request (used when only ``b`` gained room)."""
    if not eligible(b, d, now):
        return None
    first_fit = _first_fit_tier(index, d)
    if b.offload:
        if first_fit is None:
            return Routed(b, RouteReason.OFFLOAD)
        return Routed(b, RouteReason.OVERFLOW) if offload_overflow else None
    return Routed(b, RouteReason.FIT if b.tier_index == first_fit else RouteReason.SPILL)


def route_kv_aware(
    index: ModelIndex, d: Demand, now: float, *, offload_overflow: bool = False, stale: bool = False
) -> Decision:
    """The indexed decision: looks at a few backends per tier, not all of them."""

    def accept(b: Backend) -> bool:
        return eligible(b, d, now, stale)

    first_fit = _first_fit_tier(index, d)
    for tier in index.tiers:
        if (
            tier.offload
            or first_fit is None
            or tier.tier_index < first_fit
            or not tier.could_hold(d)
        ):
            continue
        b = tier.best(accept, d.room_floor)
        if b is not None:
            return Routed(b, RouteReason.FIT if tier.tier_index == first_fit else RouteReason.SPILL)
    if first_fit is None or offload_overflow:
        for tier in index.tiers:
            if tier.offload and tier.could_hold(d):
                b = tier.best(accept, d.room_floor)
                if b is not None:
                    return Routed(
                        b, RouteReason.OFFLOAD if first_fit is None else RouteReason.OVERFLOW
                    )
    # Nothing can take it now: the exact (slower) scan says why.
    return kv_aware_scan(index.backends, d, now, offload_overflow=offload_overflow, stale=stale)


def kv_aware_scan(
    backends: Sequence[Backend],
    d: Demand,
    now: float,
    *,
    offload_overflow: bool = False,
    stale: bool = False,
) -> Decision:
    """The reference decision over every backend (tier order): used to explain a miss,
    and by the tests as the oracle for :func:`route_kv_aware`."""
    could = [b for b in backends if can_ever_hold(b, d)]
    if not could:
        return _never_fits(backends, d)
    if not any(b.usable and b.name not in d.exclude for b in could):
        if any(b.starting and b.name not in d.exclude for b in backends):
            return Wait("starting")  # a node is coming up: wait for it, within the queue timeout
        return NoBackend("no healthy backend can hold this request")
    first_fit = next((b.tier_index for b in could if not b.offload and _could_use(b, d)), None)
    best: Backend | None = None
    for b in could:
        if b.offload:
            continue
        if best is not None and b.tier_index != best.tier_index:
            break
        if eligible(b, d, now, stale) and (best is None or _key_better(b, best)):
            best = b
    if best is not None:
        return Routed(best, RouteReason.FIT if best.tier_index == first_fit else RouteReason.SPILL)
    if first_fit is None or offload_overflow:
        offload = [b for b in could if b.offload and eligible(b, d, now, stale)]
        if offload:
            first_tier = min(b.tier_index for b in offload)
            pick = min((b for b in offload if b.tier_index == first_tier), key=_sort_key)
            return Routed(pick, RouteReason.OFFLOAD if first_fit is None else RouteReason.OVERFLOW)
    return Wait()


def _never_fits(backends: Sequence[Backend], d: Demand) -> Decision:
    known = [b for b in backends if b.limits.known]
    if not known:
        if any(b.starting and b.name not in d.exclude for b in backends):
            return Wait("starting")  # limits come with the first probe: wait for them
        return NoBackend("no backend of this model has known limits yet (still starting?)")
    return TooLong(max(b.context_limit for b in known))


def route_simple(
    policy: Policy, backends: Sequence[Backend], d: Demand, state: RouterState, now: float
) -> Decision:
    pool = [b for b in backends if b.name not in d.exclude and b.healthy and not b.draining]
    if policy == Policy.LENGTH_AWARE:
        known = [b for b in backends if b.limits.known]
        if known and all(b.max_model_len < d.longest_sequence for b in known):
            return TooLong(max(b.max_model_len for b in known))
        pool = [b for b in pool if not b.limits.known or b.max_model_len >= d.longest_sequence]
    if not pool:
        return NoBackend("no healthy backend serves this model")
    if policy == Policy.ROUND_ROBIN:
        i = state.cursors.get(d.model, 0)
        state.cursors[d.model] = i + 1
        return Routed(pool[i % len(pool)], RouteReason.FIT)
    return Routed(min(pool, key=lambda b: b.in_flight), RouteReason.FIT)


def least_in_flight(
    backends: Iterable[Backend], now: float, excluded: Collection[str], turn: int
) -> Backend | None:
    """Where a request that reserves no KV goes (embeddings, rerank, score, tokenize): an
    accepting backend not in ``excluded`` with the fewest requests in flight, ties taken
    in turn (``turn``: the caller's counter); None when there is none."""
    pool = [b for b in backends if b.accepting(now) and b.name not in excluded]
    if not pool:
        return None
    least = min(b.in_flight for b in pool)
    ties = [b for b in pool if b.in_flight == least]
    return ties[turn % len(ties)]


def route(
    policy: Policy,
    index: ModelIndex,
    d: Demand,
    state: RouterState,
    now: float,
    *,
    offload_overflow: bool = False,
    stale: bool = False,
) -> Decision:
    """Decide for one demand over one model's backends (``stale``: kv_aware may take a
    refusal from a projected curve a few steps old; an arrival's first look)."""
    if policy == Policy.KV_AWARE:
        return route_kv_aware(index, d, now, offload_overflow=offload_overflow, stale=stale)
    return route_simple(policy, index.backends, d, state, now)
