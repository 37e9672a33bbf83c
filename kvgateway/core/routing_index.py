"""Per-model routing index: each tier's backends kept sorted by free KV budget.

A kv_aware decision walks the tiers in order and, within a tier, the backends from the
most free budget down, stopping at the first that can take the request or as soon as the
free budget falls below what the request needs. With the index a decision over 1,000
backends looks at a handful of them instead of all of them.

Reservations change a backend's free budget, so every change goes through
:meth:`ModelIndex.adjust` (remove, mutate, re-insert: O(log n)). Limits and membership
change rarely (discovery, reload): the whole index is rebuilt then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sortedcontainers import SortedKeyList

from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand, can_ever_hold, fits_limits


def _key(b: Backend) -> tuple[int, str]:
    return (-b.free_tokens, b.name)


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
        self._sorted: SortedKeyList[Backend, tuple[int, str]] = SortedKeyList(backends, key=_key)
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
