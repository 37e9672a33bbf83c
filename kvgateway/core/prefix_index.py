"""Which leading prompt blocks each backend holds in its prefix cache: a pure index.

Two sources per backend, both keyed by :mod:`kvgateway.core.prefix_keys`:

- **Approximate** (every backend): the prompt blocks the gateway routed there, each
  remembered for ``ttl_s`` after it was last routed and at most ``max_blocks`` of them
  (least recently routed forgotten first, as the node's own LRU forgets them). It guesses:
  the node may have evicted a block sooner, or cached output blocks it never saw, so
  :meth:`PrefixIndex.expected_blocks` weighs each block by ``0.5 ** (age / half_life_s)``.
- **Precise** (backends with KV events): what the node reported, block by block.
  ``BlockStored`` carries token ids, so each block's key is rebuilt from its parent's key
  (found through the node's hash of the parent) and its tokens; the node's hash values
  are only ids. A block whose parent is unknown (stored before a lost event) cannot be
  placed and is counted as an orphan. The same hash may be stored twice (vLLM does not
  de-duplicate), so blocks are counted. Events for other media than the GPU and for
  KV-cache groups other than the first are ignored.

After a resync (:meth:`PrefixIndex.clear`: lost events, a reconnect, a publisher
restart) the precise view is empty and rebuilds from new events; for ``resync_grace_s``
the index answers from the approximate view instead.

Nothing here does I/O or reads a clock: time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgateway.core.prefix_keys import BlockKey, block_keys

EngineHash = int | bytes
MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """vLLM's ``BlockStored``, decoded (``extra_keys``: one entry per block, or None)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_GPU
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    # vLLM's KVCacheSpecKind of the group ("full_attention", "sliding_window", ...), and
    # a sliding-window group's window.
    kind: str | None = None
    window: int | None = None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


CacheEvent = BlocksStored | BlocksRemoved | AllCleared


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


class _Blocks:
    """One KV-cache group's cached blocks as the node reported them."""

    __slots__ = ("by_hash", "held")

    def __init__(self) -> None:
        self.by_hash: dict[EngineHash, tuple[BlockKey, int]] = {}
        self.held: dict[BlockKey, int] = {}

    def add(self, engine_hash: EngineHash, key: BlockKey) -> None:
        old = self.by_hash.get(engine_hash)
        self.by_hash[engine_hash] = (key, old[1] + 1 if old is not None else 1)
        self.held[key] = self.held.get(key, 0) + 1

    def drop(self, engine_hash: EngineHash) -> bool:
        entry = self.by_hash.get(engine_hash)
        if entry is None:
            return False
        key, count = entry
        if count > 1:
            self.by_hash[engine_hash] = (key, count - 1)
        else:
            del self.by_hash[engine_hash]
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
        return True


class _Precise:
    """A node's prefix cache from its events: the full-attention group's blocks, and on
    a hybrid model each sliding-window group's (a hit also needs the blocks of the
    window before its end: vLLM's hybrid ``find_longest_cache_hit``)."""

    __slots__ = (
        "block_size",
        "full",
        "full_group",
        "orphans",
        "removed",
        "resync_at",
        "resyncs",
        "sliding",
        "stored",
    )

    def __init__(self) -> None:
        self.full = _Blocks()
        # group_idx -> (window, blocks), for groups events name as sliding-window ones.
        self.sliding: dict[int, tuple[int, _Blocks]] = {}
        self.stored = self.removed = self.orphans = self.resyncs = 0
        self.resync_at: float | None = None
        self.block_size: int | None = None
        # The KV-cache group this view follows, once events name their groups' kinds.
        self.full_group: int | None = None

    @property
    def held(self) -> dict[BlockKey, int]:
        return self.full.held

    @property
    def by_hash(self) -> dict[EngineHash, tuple[BlockKey, int]]:
        return self.full.by_hash

    def reset(self) -> None:
        self.full = _Blocks()
        self.sliding.clear()
        self.full_group = None  # learnt again (a restarted node may serve another model)

    def group_of(self, event: BlocksStored | BlocksRemoved) -> _Blocks | None:
        """The group view an event belongs to, or None for one not followed. vLLM numbers
        groups by their first layer, so group 0 is a sliding-window group on models
        whose first layer is one (gpt-oss); events that name kinds say which group is
        full attention (the view follows the first such group it hears of) and which
        slide. Events without kinds (older vLLM, one group): group 0 or unnumbered."""
        if not _gpu(event.medium):
            return None
        group = event.group_idx
        if isinstance(event, BlocksStored) and event.kind is not None:
            if event.kind in FULL_KINDS:
                if self.full_group is None:
                    self.full_group = group
                return self.full if group == self.full_group else None
            if group is None:
                return None
            followed = self.sliding.get(group)
            if followed is None:
                followed = self.sliding[group] = (_reach(event), _Blocks())
            return followed[1]
        if group is None:
            return self.full
        if group in self.sliding:
            return self.sliding[group][1]
        return (
            self.full if group == (self.full_group if self.full_group is not None else 0) else None
        )

    def _key_of(self, engine_hash: EngineHash) -> BlockKey | None:
        known = self.full.by_hash.get(engine_hash)
        if known is None:
            for _, blocks in self.sliding.values():
                known = blocks.by_hash.get(engine_hash)
                if known is not None:
                    break
        return known[0] if known is not None else None

    def store(self, event: BlocksStored, blocks: _Blocks) -> None:
        self.block_size = event.block_size
        if event.parent_block_hash is None:
            parent: BlockKey | None = None
        else:
            # Block hashes are the request's, whatever the group: a sliding-window
            # group's parent may be a block only the full-attention group stored.
            parent = self._key_of(event.parent_block_hash)
            if parent is None:
                self.orphans += len(event.block_hashes)
                return
        n = len(event.token_ids) // event.block_size
        extra = event.extra_keys
        if extra is not None and len(extra) < n:
            extra = (None,) * (n - len(extra)) + tuple(extra)
        keys = block_keys(event.token_ids, event.block_size, parent=parent, extra_keys=extra)
        # A sliding-window group skips the blocks already out of its window (null
        # blocks): its hashes are those of the range's last blocks.
        keys = keys[len(keys) - len(event.block_hashes) :] if event.block_hashes else []
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            blocks.add(engine_hash, key)
            self.stored += 1

    def remove(self, event: BlocksRemoved, blocks: _Blocks) -> None:
        for engine_hash in event.block_hashes:
            if blocks.drop(engine_hash):
                self.removed += 1

    def matched(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` a request would hit: the full-attention run, cut
        back until every sliding-window group holds the blocks of its window before the
        hit's end (or a run from the start when the hit is shorter than that)."""
        held = self.full.held
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        if not self.sliding or not n or self.block_size is None:
            return n
        bs = self.block_size
        while True:
            before = n
            for window, blocks in self.sliding.values():
                n = _sliding_hit(keys, blocks.held, n, -(-(window - 1) // bs))
            if n == before:
                return n


def _reach(event: BlocksStored) -> int:
    """How far back from a hit's end a group that is not full attention must hold blocks,
    in tokens (the window): a sliding window its own; Mamba one block (its state at the
    hit's end, vLLM's MambaManager); any other kind (chunked local attention, a kind
    this gateway does not know) every block from the start, which never predicts a hit
    the node would not give."""
    if event.kind in SLIDING_KINDS and event.window is not None and event.window > 0:
        return event.window
    if event.kind == "mamba":
        return 2  # cdiv(2 - 1, block_size) = 1 block
    return 1 << 62


def _sliding_hit(keys: Sequence[BlockKey], held: dict[BlockKey, int], limit: int, need: int) -> int:
    """The longest hit <= ``limit`` whose last ``need`` blocks a sliding-window group
    holds (scanning right to left, as vLLM's SlidingWindowManager does)."""
    run = 0
    for i in range(limit - 1, -1, -1):
        if keys[i] not in held:
            run = 0
            continue
        run += 1
        if run >= need:
            return i + need
    return run  # the run that reaches block 0 (a prefix shorter than the window)


# Groups whose blocks hold every token of the prefix (a prefix hit needs them all); a
# sliding-window or Mamba group keeps only the end and frees the rest as it goes.
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


def _gpu(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


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
        self._precise: dict[str, _Precise] = {}

    # -- membership ----------------------------------------------------------------

    def set_capacity(self, backend: str, max_blocks: int) -> None:
        """Bound the approximate view by what the node can hold (its usable blocks)."""
        self._max[backend] = max(1, max_blocks)

    def attach_events(self, backend: str) -> None:
        """The backend reports KV events: answer from the precise view from now on."""
        self._precise.setdefault(backend, _Precise())

    def detach_events(self, backend: str) -> None:
        self._precise.pop(backend, None)

    def remove_backend(self, backend: str) -> None:
        self._approx.pop(backend, None)
        self._max.pop(backend, None)
        self._precise.pop(backend, None)

    # -- feeding -------------------------------------------------------------------

    def record_routed(self, backend: str, keys: Sequence[BlockKey], now: float) -> None:
        """The gateway sent a prompt with these block keys to ``backend``."""
        view = self._approx.setdefault(backend, _Approximate())
        seen = view.seen
        for key in keys:
            seen[key] = now
            seen.move_to_end(key)
        self._prune(backend, view, now)

    def apply_events(self, backend: str, events: Iterable[CacheEvent], now: float) -> None:
        """Apply one batch of the backend's events in order (attaches it if needed)."""
        state = self._precise.setdefault(backend, _Precise())
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
        state = self._precise.setdefault(backend, _Precise())
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

    def match_all(
        self, keys: Sequence[BlockKey], backends: Iterable[str], now: float
    ) -> dict[str, int]:
        """:meth:`matched_blocks` for each backend."""
        return {b: self.matched_blocks(b, keys, now) for b in backends}

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

    def _in_grace(self, state: _Precise, now: float) -> bool:
        return state.resync_at is not None and now - state.resync_at < self._grace

    def _prune(self, backend: str, view: _Approximate, now: float) -> None:
        seen = view.seen
        limit = self._max.get(backend, self._default_max)
        oldest = now - self._ttl
        while seen:
            key, at = next(iter(seen.items()))
            if at >= oldest and len(seen) <= limit:
                break
            del seen[key]
