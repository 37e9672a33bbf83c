"""The KV block pool of a simulated vLLM V1 node, with prefix caching.

After ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` (read, not copied):

- Every block of the pool has an id, a reference count and, once it is full and cached,
  a hash keyed by KV-cache group. Block 0 is the null block: taken out at start-up,
  never handed to a request (sliding-window groups put it where blocks were dropped).
- A full block's hash is ``sha256(pickle((parent_hash or NONE_HASH, tokens, extra_keys)))``
  (vLLM's default ``prefix_caching_hash_algo: sha256``), chained through the prompt.
- Free blocks wait in one queue that is also the eviction order. Allocation takes from
  the front, evicting whatever cached hash the block still carries. Freeing puts blocks
  with no hash at the front (reused first) and cached blocks at the back (kept longest),
  in the order given: a request frees its blocks tail first, so the tail of a chain is
  evicted before its head.
- A cache hit on a free block takes it out of the queue (``touch``); a hit on a block in
  use just raises its count. Identical blocks are not de-duplicated, as in vLLM.
- With KV events on, storing blocks yields one ``BlockStored`` per call (per group), each
  eviction one ``BlockRemoved`` (``AllBlocksCleared``, vLLM's on a prefix-cache reset,
  is modelled for the encoders; the simulator offers no reset). Hashes in
  events are the low 64 bits as an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

BlockHash = bytes
MEDIUM_GPU = "GPU"


# vLLM >= 0.30's seed of NONE_HASH with a cryptographic hash (sha256, its default) when
# PYTHONHASHSEED is not set (v1/core/kv_cache_utils.py resolve_none_hash_seed).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def none_hash(seed: str | None) -> BlockHash:
    """The parent of a chain's first block: the hash function applied to a seed (None:
    vLLM's default, PYTHONHASHSEED if set, else ``DEFAULT_NONE_HASH_SEED``)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_block_tokens(
    root: BlockHash,
    parent: BlockHash | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """vLLM's ``hash_block_tokens`` with the ``sha256`` (pickle) hash function."""
    key = (parent if parent is not None else root, tuple(tokens), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def external_hash(block_hash: BlockHash) -> int:
    """The form hashes take in KV events: the low 64 bits, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU
    # The KV-cache group, and its kind and window (vLLM's group_idx,
    # kv_cache_spec_kind, kv_cache_spec_sliding_window).
    group_idx: int = 0
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "sliding_window" if self.sliding_window is not None else "full_attention"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Block:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # (hash, group id) while the block is in the prefix cache.
        self.block_hash: tuple[BlockHash, int] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Blocks, their free/eviction queue and the prefix-cache map."""

    def __init__(self, num_blocks: int, *, enable_caching: bool, enable_events: bool) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is the eviction order: front = next to be reused.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[tuple[BlockHash, int], dict[int, Block]] = {}
        self.null_block = self._free.popitem(last=False)[1]
        self._events: list[KVEvent] = []

    # -- queries -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def cached_external_hashes(self) -> set[int]:
        """Hashes of every cached block, as KV events name them (for tests)."""
        return {external_hash(h) for (h, _g), blocks in self._cached.items() if blocks}

    def free_order(self) -> list[int]:
        """Block ids of the free queue, next to be reused first (for tests)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash, group: int) -> Block | None:
        blocks = self._cached.get((block_hash, group))
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def is_free(self, block: Block) -> bool:
        return block.block_id in self._free

    # -- mutations -----------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out: list[Block] = []
        for _ in range(n):
            block = self._free.popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            if block.ref_cnt != 0:
                raise AssertionError(f"{block} was in the free queue while in use")
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """A cache hit: take free blocks out of the queue, count one more user."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference from each; ``ordered`` lists first-to-evict first."""
        fresh: list[Block] = []
        cached: list[Block] = []
        for block in ordered:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (fresh if block.block_hash is None else cached).append(block)
        free = self._free
        for block in reversed(fresh):
            free[block.block_id] = block
            free.move_to_end(block.block_id, last=False)
        for block in cached:
            free[block.block_id] = block

    def cache_full_blocks(
        self,
        *,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        num_cached: int,
        num_full: int,
        block_size: int,
        group: int,
        window: int | None = None,
    ) -> None:
        """Put blocks ``num_cached`` .. ``num_full`` of a request into the prefix cache
        (``group``: its KV-cache group, whose sliding window is ``window``)."""
        if not self.enable_caching or num_cached >= num_full:
            return
        stored: list[int] = []
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block is self.null_block:
                continue
            key = (block_hashes[i], group)
            if block.block_hash is not None:
                if block.block_hash != key:
                    raise AssertionError(f"{block} cached under another hash")
                continue  # a cache hit: already in the cache
            block.block_hash = key
            self._cached.setdefault(key, {})[block.block_id] = block
            stored.append(external_hash(block_hashes[i]))
        if self.enable_events:
            parent = external_hash(block_hashes[num_cached - 1]) if num_cached else None
            self._events.append(
                BlockStored(
                    block_hashes=tuple(stored),
                    parent_block_hash=parent,
                    token_ids=tuple(token_ids[num_cached * block_size : num_full * block_size]),
                    block_size=block_size,
                    group_idx=group,
                    sliding_window=window,
                )
            )

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: Block) -> None:
        key = block.block_hash
        assert key is not None
        holders = self._cached.get(key)
        if holders is not None and holders.pop(block.block_id, None) is not None:
            if not holders:
                del self._cached[key]
            if self.enable_events:
                self._events.append(
                    BlockRemoved(block_hashes=(external_hash(key[0]),), group_idx=key[1])
                )
        block.block_hash = None
