"""Per-request KV blocks over one shared pool, by KV-cache group, as vLLM V1 does.

After ``vllm/v1/core/kv_cache_manager.py``, ``kv_cache_coordinator.py`` and
``single_type_kv_cache_manager.py`` (read, not copied):

- A model has one KV-cache group, or several for a hybrid model (full attention plus
  sliding-window groups, see ``capacity/layout.py``). Every group keeps its own block
  table per request and draws from the same pool, so a token costs one block slot per
  group: the pool holds ``num_blocks // num_groups * block_size`` tokens of short requests.
- A sliding-window group only needs the last ``window - 1`` tokens: once they are
  computed, blocks wholly before the window go back to the pool and the null block takes
  their place in the table.
- Prefix lookup (``get_computed_blocks``): at most ``num_tokens - 1`` tokens can hit (the
  last one is recomputed for its logits). Full-attention groups take the longest run of
  cached blocks from the start; a sliding-window group then needs the last
  ``cdiv(window - 1, block_size)`` blocks before the hit point cached (scanning right to
  left) and the hit is cut back until it has them. Each lookup is counted in the
  prefix-cache stats (queries = the request's tokens, hits = tokens found), apart for
  requests that were preempted before, as vLLM's ``PrefixCacheStats.record`` does.
- Allocation needs the new blocks plus the hit blocks that are now free (touching them
  takes them out of the free queue), and fails without side effects if the pool is short.

- The engine allocates chunk by chunk (``allocate`` up to the tokens scheduled this
  step), so a sliding-window group drops what fell out of its window as a long prompt is
  prefilled, and holds at most a window and a chunk of it.
- Groups are numbered as vLLM numbers them, by each kind's first layer (see
  ``capacity/layout.py``); cache events carry the group, its kind and its window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgateway.simulator.block_pool import Block, BlockHash, BlockPool, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class KVRequest(Protocol):
    """What the KV manager needs of a sequence: its tokens and their full-block hashes."""

    token_ids: list[int]
    block_hashes: list[BlockHash]
    num_preemptions: int


# Blocks a lookup found, per group (None in sliding-window slots before the window).
ComputedBlocks = list[list[Block]]


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        *,
        block_size: int,
        windows: Sequence[int | None] = (None,),
        root_hash: BlockHash,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = tuple(windows)
        self._full = [g for g, w in enumerate(self.windows) if w is None]
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self._root = root_hash
        self._tables: dict[int, list[list[Block]]] = {}
        self._num_cached: dict[int, list[int]] = {}
        self._nulls: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_of(self, req_id: int) -> list[list[Block]]:
        return self._tables.get(req_id, [[] for _ in self.windows])

    def num_held(self, req_id: int) -> int:
        """Pool blocks the request holds, over all groups (null slots not counted)."""
        table = self._tables.get(req_id)
        if table is None:
            return 0
        return sum(len(row) for row in table) - self._nulls.get(req_id, 0)

    # -- hashing -------------------------------------------------------------------

    def update_hashes(self, req: KVRequest) -> None:
        """Hash every block of ``req`` that became full since the last call."""
        bs = self.block_size
        tokens = req.token_ids
        hashes = req.block_hashes
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(self._root, parent, tokens[i * bs : (i + 1) * bs]))

    # -- lookup --------------------------------------------------------------------

    def get_computed_blocks(self, req: KVRequest) -> tuple[ComputedBlocks, int]:
        """The longest cached prefix of ``req``, per group, and its length in tokens."""
        empty: ComputedBlocks = [[] for _ in self.windows]
        if not self.pool.enable_caching:
            return empty, 0
        self.update_hashes(req)
        num_tokens = len(req.token_ids)
        max_blocks = min((num_tokens - 1) // self.block_size, len(req.block_hashes))
        pool = self.pool
        hit = 0
        for i in range(max_blocks):
            h = req.block_hashes[i]
            if any(pool.get_cached_block(h, g) is None for g in self._full):
                break
            hit = i + 1
        if not self._full:
            hit = max_blocks
        while self._sliding:  # until every sliding-window group agrees on the hit
            before = hit
            for g in self._sliding:
                hit = self._sliding_hit(req, g, hit)
            if hit == before:
                break
        computed: ComputedBlocks = empty
        if hit:
            for g, window in enumerate(self.windows):
                row: list[Block] = []
                keep_from = 0 if window is None else hit - cdiv(window - 1, self.block_size)
                for i in range(hit):
                    if i < keep_from:
                        row.append(pool.null_block)
                    else:
                        block = pool.get_cached_block(req.block_hashes[i], g)
                        assert block is not None
                        row.append(block)
                computed[g] = row
        return computed, hit * self.block_size

    def record_lookup(self, req: KVRequest, num_hit: int) -> None:
        """Count an admitted request's lookup in the prefix-cache stats (vLLM records
        at admission: a waiting head looked up again every step is counted once)."""
        s = self.stats
        num_tokens = len(req.token_ids)
        if req.num_preemptions:
            s.preempted_requests += 1
            s.preempted_queries += num_tokens
            s.preempted_hits += num_hit
        else:
            s.requests += 1
            s.queries += num_tokens
            s.hits += num_hit

    def _sliding_hit(self, req: KVRequest, group: int, limit: int) -> int:
        window = self.windows[group]
        assert window is not None
        needed = cdiv(window - 1, self.block_size)
        run = 0
        for i in range(limit - 1, -1, -1):
            if self.pool.get_cached_block(req.block_hashes[i], group) is None:
                run = 0
                continue
            run += 1
            if run >= needed:
                return i + needed
        return run  # the run that reaches block 0 (a prefix shorter than the window)

    # -- allocation ----------------------------------------------------------------

    def allocate(
        self,
        req_id: int,
        req: KVRequest,
        num_tokens: int,
        num_computed: int,
        computed: ComputedBlocks | None = None,
    ) -> bool:
        """Blocks for ``num_tokens`` tokens of ``req``; False (and no change) if short.

        ``computed`` are hit blocks of a request being admitted; ``num_computed`` the
        tokens already computed (the hit, or the running request's progress).
        """
        table = self._tables.get(req_id)
        bs = self.block_size
        if computed is None and table is not None and not self._sliding:
            # The common case, a running request in full-attention groups only.
            new = cdiv(num_tokens, bs) - len(table[0])
            if new <= 0:
                return True
        self._remove_skipped(req_id, num_computed)
        need, plan = self._plan(table, num_tokens, num_computed, computed)
        if need > self.pool.num_free:
            return False
        if table is None:
            table = self._tables[req_id] = [[] for _ in self.windows]
            self._num_cached[req_id] = [0] * len(self.windows)
        cached = self._num_cached[req_id]
        # Every group's hits are touched before any group takes new blocks, as vLLM's
        # allocate_new_computed_blocks does: taking blocks first could evict a hit of
        # another group of the same request.
        for g in range(len(plan)):
            hits = computed[g] if computed is not None else []
            if hits:
                self.pool.touch(hits)
                table[g].extend(hits)
                cached[g] = len(hits)
                null_hits = sum(1 for b in hits if b is self.pool.null_block)
                self._nulls[req_id] = self._nulls.get(req_id, 0) + null_hits
        for g, (nulls, new) in enumerate(plan):
            self._nulls[req_id] = self._nulls.get(req_id, 0) + nulls
            table[g].extend([self.pool.null_block] * nulls)
            cached[g] = max(cached[g], nulls)
            table[g].extend(self.pool.get_new_blocks(new))
        return True

    def can_admit(
        self,
        req_id: int,
        num_tokens: int,
        num_computed: int,
        computed: ComputedBlocks | None,
        max_num_batched_tokens: int,
    ) -> bool:
        """Whether a waiting request's whole sequence (``num_tokens``) fits the free
        blocks, its hits included: vLLM's admission gate (``scheduler_reserve_full_isl``,
        on by default: ``allocate_slots(full_sequence_must_fit=True)``). A sliding-window
        group is counted up to its admission cap, the blocks a window and a chunk can
        span: ``cdiv(min(window - 1 + max_num_batched_tokens, num_tokens), block_size) + 1``.
        """
        need, _ = self._plan(
            self._tables.get(req_id), num_tokens, num_computed, computed, max_num_batched_tokens
        )
        return need <= self.pool.num_free

    def _plan(
        self,
        table: list[list[Block]] | None,
        num_tokens: int,
        num_computed: int,
        computed: ComputedBlocks | None,
        admission_cap: int | None = None,
    ) -> tuple[int, list[tuple[int, int]]]:
        """Free blocks needed, and (nulls to add, new blocks) per group, to hold
        ``num_tokens`` tokens."""
        bs = self.block_size
        need = 0
        plan: list[tuple[int, int]] = []
        for g, window in enumerate(self.windows):
            have = len(table[g]) if table is not None else 0
            hits = computed[g] if computed is not None else []
            if hits:
                need += sum(1 for b in hits if b.ref_cnt == 0 and b is not self.pool.null_block)
            have += len(hits)
            nulls = 0
            if window is not None and have == 0:
                # A new request's blocks wholly before the window are never allocated.
                nulls = self._skipped_tokens(window, num_computed) // bs
            new = max(0, cdiv(num_tokens, bs) - have - nulls)
            if window is not None and admission_cap is not None:
                new = min(new, cdiv(min(window - 1 + admission_cap, num_tokens), bs) + 1)
            plan.append((nulls, new))
            need += new
        return need, plan

    def cache_blocks(self, req_id: int, req: KVRequest, num_tokens: int) -> None:
        """Cache the full blocks among the first ``num_tokens`` tokens (once scheduled)."""
        if not self.pool.enable_caching:
            return
        num_full = min(num_tokens, len(req.token_ids)) // self.block_size
        cached = self._num_cached[req_id]
        if min(cached) >= num_full:
            return
        self.update_hashes(req)
        table = self._tables[req_id]
        for g in range(len(self.windows)):
            if num_full > cached[g]:
                self.pool.cache_full_blocks(
                    blocks=table[g],
                    block_hashes=req.block_hashes,
                    token_ids=req.token_ids,
                    num_cached=cached[g],
                    num_full=num_full,
                    block_size=self.block_size,
                    group=g,
                    window=self.windows[g],
                )
                cached[g] = num_full

    def free(self, req_id: int) -> None:
        """Give back every block of the request, tail first (evicted first)."""
        table = self._tables.pop(req_id, None)
        self._num_cached.pop(req_id, None)
        self._nulls.pop(req_id, None)
        if table is None:
            return
        for row in table:
            self.pool.free_blocks(reversed(row))

    def _skipped_tokens(self, window: int, num_computed: int) -> int:
        return max(0, num_computed - window + 1)

    def _remove_skipped(self, req_id: int, num_computed: int) -> None:
        table = self._tables.get(req_id)
        if table is None or not self._sliding:
            return
        null = self.pool.null_block
        for g in self._sliding:
            window = self.windows[g]
            assert window is not None
            row = table[g]
            skipped = min(self._skipped_tokens(window, num_computed) // self.block_size, len(row))
            removed: list[Block] = []
            for i in range(skipped - 1, -1, -1):
                if row[i] is null:
                    break
                removed.append(row[i])
                row[i] = null
            self._nulls[req_id] = self._nulls.get(req_id, 0) + len(removed)
            self.pool.free_blocks(removed)

    def check(self) -> None:
        """Raise if the pool's counts disagree with the block tables (for tests)."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for row in table:
                for block in row:
                    if block is not self.pool.null_block:
                        held[block.block_id] = held.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            if block.ref_cnt != held.get(block.block_id, 0):
                raise AssertionError(f"{block} held by {held.get(block.block_id, 0)} tables")
            if (block.ref_cnt == 0) != self.pool.is_free(block):
                raise AssertionError(f"{block}: free queue disagrees with its count")
