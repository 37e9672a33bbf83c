"""A node's prefix cache as its KV events report it: vLLM's events, decoded, and the
per-node view they build (pure; :mod:`kvgateway.core.prefix_index` asks it for hits).

``BlockStored`` carries token ids, so each block's key is rebuilt from its parent's key
(found through the node's hash of the parent) and its tokens; the node's hash values are
only ids. A block whose parent is unknown (stored before a lost event) cannot be placed
and is counted as an orphan. The same hash may be stored twice (vLLM does not
de-duplicate), so blocks are counted. Events for other media than the GPU are ignored.

Every view shares one :class:`~kvgateway.core.prefix_keys.EventHolders`: which backends' events report each block
key, so routing can find a prompt's holders from the events alone, whatever put the
prefix there (the gateway, direct traffic, another gateway replica, this gateway before
a restart).

Hybrid models (vLLM names each event's KV-cache group and its kind): the view follows
the first full-attention group and every other group, and a hit is the full-attention
run cut back until each other group holds what vLLM's hybrid ``find_longest_cache_hit``
needs there (a sliding window's blocks before the hit's end; Mamba's last block; any
other kind its whole run). Events without kinds (older vLLM): group 0 or unnumbered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgateway.core.prefix_keys import BlockKey, EventHolders, block_keys

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


class _Blocks:
    """One KV-cache group's cached blocks as the node reported them; ``holders``, when
    given, hears of every key this group starts or stops holding (under ``owner``)."""

    __slots__ = ("by_hash", "held", "holders", "owner")

    def __init__(self, owner: str = "", holders: EventHolders | None = None) -> None:
        self.by_hash: dict[EngineHash, tuple[BlockKey, int]] = {}
        self.held: dict[BlockKey, int] = {}
        self.owner = owner
        self.holders = holders

    def add(self, engine_hash: EngineHash, key: BlockKey) -> None:
        old = self.by_hash.get(engine_hash)
        self.by_hash[engine_hash] = (key, old[1] + 1 if old is not None else 1)
        count = self.held.get(key, 0)
        self.held[key] = count + 1
        if not count and self.holders is not None:
            self.holders.add(key, self.owner)

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
            if self.holders is not None:
                self.holders.discard(key, self.owner)
        return True

    def forget(self) -> None:
        """Tell ``holders`` this group holds nothing any more."""
        if self.holders is not None:
            for key in self.held:
                self.holders.discard(key, self.owner)


class CacheView:
    """A node's prefix cache from its events: the full-attention group's blocks, and on
    a hybrid model each sliding-window group's (a hit also needs the blocks of the
    window before its end: vLLM's hybrid ``find_longest_cache_hit``)."""

    __slots__ = (
        "block_size",
        "full",
        "full_group",
        "holders",
        "orphans",
        "owner",
        "removed",
        "resync_at",
        "resyncs",
        "sliding",
        "stored",
    )

    def __init__(self, owner: str = "", holders: EventHolders | None = None) -> None:
        self.owner = owner
        self.holders = holders
        self.full = _Blocks(owner, holders)
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
        self.full.forget()
        self.full = _Blocks(self.owner, self.holders)
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
