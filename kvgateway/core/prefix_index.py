"""Which leading prompt blocks each backend holds in its prefix cache: a pure index.

Two sources per backend, both keyed by :mod:`kvgateway.core.prefix_keys`:

- **Approximate** (every backend): the prompt blocks the gateway routed there, each
  remembered for ``ttl_s`` after it was last routed and at most ``max_blocks`` of them
  (least recently routed forgotten first, as the node's own LRU forgets them). It guesses:
  the node may have evicted a block sooner, or cached output blocks it never saw, so
  :meth:`PrefixIndex.expected_blocks` weighs each block by ``0.5 ** (age / half_life_s)``.
- **Precise** (backends with KV events): what the node reported, block by block, and
  hits computed as vLLM computes them, hybrid models included
  (:class:`~kvgateway.core.cache_view.CacheView`). :meth:`PrefixIndex.event_holders`
  names the backends whose events report a block, so a prefix the gateway never routed
  anywhere still finds its node.

A backend with events that is sent a prompt its view does not hold must report storing
it; :meth:`PrefixIndex.events_awaited_since` says since when such a report is due and
none came (a publisher nobody hears: its subscriber warns).

After a resync (:meth:`PrefixIndex.clear`: lost events, a reconnect, a publisher
restart) the precise view is empty and rebuilds from new events; for ``resync_grace_s``
the index answers from the approximate view instead.

Nothing here does I/O or reads a clock: time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvgateway.core.cache_view import (
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheView,
    EngineHash,
)
from kvgateway.core.prefix_keys import BlockKey, EventHolders


@dataclass(frozen=True, slots=True)
class PrefixIndexStats:
    approximate_blocks: int
    precise: bool
    precise_blocks: int
    stored: int
    removed: int
    orphans: int
    resyncs: int
    last_resync_at: float | None


class _Approximate:
    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: OrderedDict[BlockKey, float] = OrderedDict()


class PrefixIndex:
    """Per-backend prefix-cache views; backends are named by string."""

    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        half_life_s: float = 120.0,
        max_blocks: int = 1_000_000,
        resync_grace_s: float = 30.0,
    ) -> None:
        if ttl_s <= 0 or half_life_s <= 0 or max_blocks < 1 or resync_grace_s < 0:
            raise ValueError("ttl_s, half_life_s, max_blocks must be positive, grace >= 0")
        self._ttl = ttl_s
        self._half_life = half_life_s
        self._default_max = max_blocks
        self._grace = resync_grace_s
        self._approx: dict[str, _Approximate] = {}
        self._max: dict[str, int] = {}
        self._precise: dict[str, CacheView] = {}
        self._holders = EventHolders()
        # Backend -> when the first prompt was routed there that its events must report
        # (not held by its view), counted from its last batch.
        self._awaiting: dict[str, float] = {}

    # -- membership ----------------------------------------------------------------

    def set_capacity(self, backend: str, max_blocks: int) -> None:
        """Bound the approximate view by what the node can hold (its usable blocks)."""
        self._max[backend] = max(1, max_blocks)

    def attach_events(self, backend: str) -> None:
        """The backend reports KV events: answer from the precise view from now on."""
        self._view(backend)

    def detach_events(self, backend: str) -> None:
        state = self._precise.pop(backend, None)
        if state is not None:
            state.reset()  # its blocks leave the holders map with it
        self._awaiting.pop(backend, None)

    def remove_backend(self, backend: str) -> None:
        self._approx.pop(backend, None)
        self._max.pop(backend, None)
        self.detach_events(backend)

    def keep_backends(self, present: set[str]) -> None:
        """Forget every backend not in ``present`` (gone from the fleet: its view would
        stay, up to its whole cache of block keys, for as long as the process runs)."""
        for name in {*self._approx, *self._max, *self._precise} - present:
            self.remove_backend(name)

    # -- feeding -------------------------------------------------------------------

    def record_routed(self, backend: str, keys: Sequence[BlockKey], now: float) -> None:
        """The gateway sent a prompt with these block keys to ``backend``."""
        view = self._approx.setdefault(backend, _Approximate())
        seen = view.seen
        to_end = seen.move_to_end
        for key in keys:
            if key in seen:
                to_end(key)
        seen.update(dict.fromkeys(keys, now))
        self._prune(backend, view, now)
        state = self._precise.get(backend)
        # The deepest key stands for the run: a node holding it holds the rest.
        if state is not None and keys and keys[-1] not in state.held:
            self._awaiting.setdefault(backend, now)

    def apply_events(self, backend: str, events: Iterable[CacheEvent], now: float) -> None:
        """Apply one batch of the backend's events in order (attaches it if needed)."""
        self._awaiting.pop(backend, None)
        state = self._view(backend)
        for event in events:
            if isinstance(event, BlocksStored):
                blocks = state.group_of(event)
                if blocks is not None:
                    state.store(event, blocks)
            elif isinstance(event, BlocksRemoved):
                blocks = state.group_of(event)
                if blocks is not None:
                    state.remove(event, blocks)
            else:
                state.reset()

    def clear(self, backend: str, now: float) -> None:
        """Resync: forget the precise view (events were lost or the stream restarted)."""
        state = self._view(backend)
        state.reset()
        state.resyncs += 1
        state.resync_at = now

    # -- queries -------------------------------------------------------------------

    def matched_blocks(self, backend: str, keys: Sequence[BlockKey], now: float) -> int:
        """How many leading blocks of ``keys`` the backend is believed to hold."""
        state = self._precise.get(backend)
        if state is not None and not self._in_grace(state, now):
            return state.matched(keys)
        return self.routed_blocks(backend, keys, now)

    def routed_blocks(self, backend: str, keys: Sequence[BlockKey], now: float) -> int:
        """:meth:`matched_blocks` from the approximate view alone (what was routed there),
        also for a backend with events: when the gateway's token ids cannot match the
        node's (a chat template it does not know), the events never match its keys."""
        view = self._approx.get(backend)
        if view is None:
            return 0
        oldest = now - self._ttl
        seen = view.seen
        n = 0
        for key in keys:
            at = seen.get(key)
            if at is None or at < oldest:
                break
            n += 1
        return n

    def expected_blocks(self, backend: str, keys: Sequence[BlockKey], now: float) -> float:
        """:meth:`matched_blocks` weighted by belief: 1 per block reported by events,
        ``0.5 ** (age / half_life_s)`` per block the gateway only routed there."""
        if self.is_precise(backend, now):
            return float(self.matched_blocks(backend, keys, now))
        return self.routed_expected_blocks(backend, keys, now)

    def routed_expected_blocks(self, backend: str, keys: Sequence[BlockKey], now: float) -> float:
        """:meth:`expected_blocks` from the approximate view alone."""
        view = self._approx.get(backend)
        if view is None:
            return 0.0
        oldest = now - self._ttl
        seen = view.seen
        total = 0.0
        for key in keys:
            at = seen.get(key)
            if at is None or at < oldest:
                break
            total += 0.5 ** (max(0.0, now - at) / self._half_life)
        return total

    def event_holders(self, key: BlockKey) -> tuple[str, ...]:
        """The backends whose events report holding the block ``key``."""
        return self._holders.of(key)

    def events_awaited_since(self, backend: str) -> float | None:
        """When the first prompt was routed to ``backend`` that its events should have
        reported storing and none has come since (no batch at all); None when none is due."""
        return self._awaiting.get(backend)

    def event_block_size(self, backend: str) -> int | None:
        """The block size the backend's events use: prompts must be keyed with it."""
        state = self._precise.get(backend)
        return state.block_size if state is not None else None

    def is_precise(self, backend: str, now: float) -> bool:
        state = self._precise.get(backend)
        return state is not None and not self._in_grace(state, now)

    def statistics(self, backend: str, now: float) -> PrefixIndexStats:
        view = self._approx.get(backend)
        if view is not None:
            self._prune(backend, view, now)
        state = self._precise.get(backend)
        return PrefixIndexStats(
            approximate_blocks=len(view.seen) if view is not None else 0,
            precise=self.is_precise(backend, now),
            precise_blocks=sum(state.held.values()) if state is not None else 0,
            stored=state.stored if state is not None else 0,
            removed=state.removed if state is not None else 0,
            orphans=state.orphans if state is not None else 0,
            resyncs=state.resyncs if state is not None else 0,
            last_resync_at=state.resync_at if state is not None else None,
        )

    def precise_keys(self, backend: str) -> frozenset[BlockKey]:
        """Every block key the precise view holds (for tests and diagnostics)."""
        state = self._precise.get(backend)
        return frozenset(state.held) if state is not None else frozenset()

    def precise_engine_hashes(self, backend: str) -> frozenset[EngineHash]:
        """The node's own ids of the blocks the precise view holds (diagnostics)."""
        state = self._precise.get(backend)
        return frozenset(state.by_hash) if state is not None else frozenset()

    # -- internals -----------------------------------------------------------------

    def _view(self, backend: str) -> CacheView:
        state = self._precise.get(backend)
        if state is None:
            state = self._precise[backend] = CacheView(backend, self._holders)
        return state

    def _in_grace(self, state: CacheView, now: float) -> bool:
        return state.resync_at is not None and now - state.resync_at < self._grace

    def _prune(self, backend: str, view: _Approximate, now: float) -> None:
        seen = view.seen
        oldest_first = seen.popitem
        for _ in range(len(seen) - self._max.get(backend, self._default_max)):
            oldest_first(last=False)
        oldest = now - self._ttl
        while seen:
            key, at = next(iter(seen.items()))
            if at >= oldest:
                break
            del seen[key]
