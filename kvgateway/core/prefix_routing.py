"""Prefix-aware placement for ``kv_aware``: route to the cached prefix, credit shared blocks.

:func:`~kvgateway.core.routing.route_kv_aware` decides first: the tier, and whether any
backend can take the request at all (context, budget, slots, health). Only then does
:meth:`PrefixRouter.refine` look again *within that tier*, at a few candidates:

- kv_aware's own choice (the most free budget), and with ``candidates`` above 1 the next
  freest backends that can take it now;
- the backends holding the prompt's deepest blocks: those it was recently routed to (a
  small map from a few block keys of each routed prompt, at positions 1, 2, 4, 8, ...
  and the last, to backends) and those whose KV events report the blocks
  (:meth:`PrefixIndex.event_holders`), looked up at the same positions of the prompt, so
  a prefix that reached a node some other way (direct traffic, another gateway
  replica, before a restart) still finds it;
- the backend of the request's session (``x-session-id`` or ``user``), as a hint.

Each is scored by the share of the prompt it would not recompute (``hit``:
:meth:`PrefixIndex.expected_blocks` x block size / prompt; exact with KV events, decayed
guesses without) traded against how full it is, all on a 0..1 scale (as llm-d's
weighted scorers)::

    score = hit - budget_weight * reserved_fraction - load_weight * slot_use
            + session_bonus  (the session's backend only)

So a follow-up turn (hit ~0.9) goes back to the node holding its history unless that
node cannot take it (then it is not a candidate at all) or is far fuller than the
others; a prompt that shares only a system prompt (hit ~0.3) goes there only while that
node is not much busier; a fresh prompt goes where budget is freest, as without prefix
awareness (when nobody holds any of the prompt, kv_aware's choice stands unscored). A
decision looks at O(candidates + holders) backends, whatever the fleet size
(``python -m bench.prefix_scale``: ~10 us p50 and ~21 us p99 for a follow-up turn at 1,000
backends, where plain kv_aware takes ~6 and ~10).

Granting records the prompt's blocks as routed there (the approximate view) and, with
:class:`~kvgateway.core.shared_blocks.SharedBlocks`, credits blocks a ready in-flight
request on that node holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import BlockKey
from kvgateway.core.routing import Decision, ModelIndex, Routed, eligible
from kvgateway.core.shared_blocks import Holding, SharedBlocks


@dataclass(frozen=True, slots=True)
class PrefixScoring:
    # Backends scored by free budget: kv_aware's own pick (the freest) and, above 1, the
    # next freest that can take the request (each costs a walk down the tier's index).
    candidates: int = 1
    budget_weight: float = 0.5
    load_weight: float = 0.5
    session_bonus: float = 0.05
    holders_per_key: int = 3
    max_tracked_keys: int = 500_000
    max_sessions: int = 100_000


def _probe_positions(n: int) -> list[int]:
    """Indexes of the keys remembered per prompt (deepest last): 0, 1, 3, 7, ..., n-1."""
    out: list[int] = []
    i = 1
    while i <= n:
        out.append(i - 1)
        i *= 2
    if n and out[-1] != n - 1:
        out.append(n - 1)
    return out


class PrefixRouter:
    """Owns the hint maps; reads the :class:`PrefixIndex` (fed by routing and events)."""

    def __init__(
        self,
        index: PrefixIndex,
        scoring: PrefixScoring | None = None,
        shared: SharedBlocks | None = None,
        credit: Callable[[], bool] = lambda: True,
    ) -> None:
        self.index = index
        self.scoring = scoring or PrefixScoring()
        self.shared = shared
        self._credit = credit
        self._holders: OrderedDict[BlockKey, tuple[str, ...]] = OrderedDict()
        self._sessions: OrderedDict[str, str] = OrderedDict()

    # -- deciding --------------------------------------------------------------------

    def refine(self, mindex: ModelIndex, d: Demand, decision: Decision, now: float) -> Decision:
        """kv_aware's decision, moved within its tier to the best prefix candidate."""
        hint = d.prefix
        if hint is None or not isinstance(decision, Routed) or not hint.keys:
            return decision
        chosen = decision.backend
        tier = mindex.tier_of(chosen)
        if tier is None:
            return decision

        def accept(b: Backend) -> bool:
            return b.tier_index == chosen.tier_index and eligible(b, d, now)

        named = self._holders_of(hint.keys)
        session_backend = self._sessions.get(hint.session) if hint.session else None
        if session_backend is not None:
            named.append(session_backend)
        if not named:
            return decision  # nobody holds any of it: kv_aware's freest backend stands
        pool: dict[str, Backend] = {chosen.name: chosen}
        if self.scoring.candidates > 1:  # kv_aware's own pick is the freest already
            for b in tier.top(accept, d.room_floor, self.scoring.candidates):
                pool.setdefault(b.name, b)
        for name in named:
            other = mindex.get(name) if name not in pool else None
            if other is not None and accept(other):
                pool[name] = other
        if len(pool) == 1:
            return decision
        # Events are trusted when they match this prompt somewhere; when they match it
        # nowhere the gateway's ids may not be the node's (a chat template it cannot
        # reproduce), and what was routed where is the better guess.
        precise = any(
            self.index.is_precise(b.name, now) and self.index.matched_blocks(b.name, hint.keys, now)
            for b in pool.values()
        )
        best = max(
            pool.values(),
            key=lambda b: (self._score(b, d, now, session_backend, precise), b.free_tokens, b.name),
        )
        return decision if best is chosen else Routed(best, decision.reason)

    def _score(
        self,
        b: Backend,
        d: Demand,
        now: float,
        session_backend: str | None,
        precise: bool = True,
    ) -> float:
        hint = d.prefix
        assert hint is not None
        s = self.scoring
        cached = self._expected_blocks(b.name, hint.keys, now, precise) * hint.block_size
        hit = min(1.0, cached / d.longest_prompt) if d.longest_prompt > 0 else 0.0
        full = b.reserved_tokens / b.budget_tokens if b.budget_tokens > 0 else 1.0
        use = b.reserved_seqs / b.max_num_seqs if b.max_num_seqs > 0 else 1.0
        score = hit - s.budget_weight * full - s.load_weight * use
        if b.name == session_backend:
            score += s.session_bonus
        return score

    def _expected_blocks(
        self, name: str, keys: tuple[BlockKey, ...], now: float, precise: bool = True
    ) -> float:
        """:meth:`PrefixIndex.expected_blocks`: from the node's events, read whole; from
        what was routed, in O(log n) lookups: the run found by bisection (a node holds a
        prompt's head whenever it holds its tail: the tail is evicted first, and routing
        records whole prompts), weighted by the belief in its deepest block (the oldest,
        so never an overestimate of the run's belief)."""
        index = self.index
        if precise:
            # Read whole: a hybrid model's hit also needs each sliding-window group to
            # hold the blocks of its window before the hit's end (a block alone says not).
            return index.expected_blocks(name, keys, now)
        matched, belief = index.routed_blocks, index.routed_expected_blocks

        def held(i: int) -> bool:
            return matched(name, keys[i : i + 1], now) == 1

        if not keys or not held(0):
            return 0.0
        lo, hi = 0, len(keys) - 1  # keys[lo] held; find the last held
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if held(mid):
                lo = mid
            else:
                hi = mid - 1
        return (lo + 1) * belief(name, keys[lo : lo + 1], now)

    def _holders_of(self, keys: tuple[BlockKey, ...]) -> list[str]:
        """Backends holding ``keys``' deepest prefix found: those reporting its block in
        their KV events (exact, so listed first), then those recently sent prompts sharing
        it (a chain key names its whole prefix, so the deepest probe held is the longest
        run)."""
        limit = self.scoring.holders_per_key
        out: list[str] = []
        for i in reversed(_probe_positions(len(keys))):
            key = keys[i]
            for name in (*self.index.event_holders(key), *self._holders.get(key, ())):
                if name not in out:
                    out.append(name)
                    if len(out) >= limit:  # a key every node holds must not list them all
                        return out
        return out

    # -- granting --------------------------------------------------------------------

    def granted(self, b: Backend, d: Demand, now: float) -> Holding | None:
        """``d`` was granted on ``b``: remember where its blocks went; its credit, if any."""
        hint = d.prefix
        if hint is None:
            return None
        if hint.keys:
            # The node's LRU forgets what exceeds its pool; so does the routed view.
            self.index.set_capacity(b.name, max(1, b.kv_cache_tokens // hint.block_size))
            self.index.record_routed(b.name, hint.keys, now)
            self._remember(b.name, hint.keys)
        if hint.session:
            self._sessions[hint.session] = b.name
            self._sessions.move_to_end(hint.session)
            while len(self._sessions) > self.scoring.max_sessions:
                self._sessions.popitem(last=False)
        if (
            self.shared is None
            or not self._credit()
            or not hint.keys
            or not hint.credit
            or d.sequences != 1
        ):
            return None
        # The node never shares the block holding the prompt's last token (it recomputes
        # that token): the keys already stop before it; this keeps the rule here too.
        keys = hint.keys[: max(0, (d.longest_prompt - 1) // hint.block_size)]
        return self.shared.acquire(b.name, keys, hint.block_size)

    def _remember(self, name: str, keys: tuple[BlockKey, ...]) -> None:
        limit = self.scoring.holders_per_key
        holders = self._holders
        for i in _probe_positions(len(keys)):
            key = keys[i]
            old = holders.get(key, ())
            holders[key] = (name, *(n for n in old if n != name))[:limit]
            holders.move_to_end(key)
        while len(holders) > self.scoring.max_tracked_keys:
            holders.popitem(last=False)

    def prefill_done(self, h: Holding) -> None:
        if self.shared is not None:
            self.shared.mark_ready(h)

    def released(self, h: Holding) -> int:
        """Tokens to add to what ``h``'s reservation gives back: it paid for its uncredited
        blocks, and the node's charge keeps one copy of every block another in-flight
        request still holds (negative when some stay charged)."""
        if self.shared is None:
            return 0
        return (self.shared.release(h) - (len(h.keys) - h.credited)) * h.block_size
