"""Crediting prompt blocks that an in-flight request on the same node already holds.

vLLM shares a cached block between every running request whose prompt starts with it
(reference counts): a second request with the same prefix allocates only the rest. While
any holder runs, the node cannot evict those blocks, so reserving them again for the
newcomer would reserve room the node never uses. Charging them once per node is safe as
long as, for every block some in-flight request holds, at least one copy stays charged.

Per backend and block key this module keeps three counts:

- ``held``: in-flight reservations whose prompt contains the block;
- ``ready``: those whose prefill is known done (first token seen). Only these credit a
  newcomer: a block still being prefilled in chunks is not in the node's cache yet, and
  a request arriving meanwhile allocates its own copy, as vLLM does;
- ``paid``: copies charged. A reservation pays for the blocks it was not credited. When it
  ends, its copies are given back, except the last copy of a block someone still holds:
  that one stays charged (to the remaining holders) until the last holder ends.

So the charge of a node is always at least one copy of every block an in-flight request
holds, plus every uncredited copy; a credit never lets the gateway admit past what the
node's pool holds. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgateway.core.prefix_keys import BlockKey


@dataclass(eq=False, slots=True)
class Holding:
    """One reservation's share of its node's prompt blocks."""

    backend: str
    keys: tuple[BlockKey, ...]
    block_size: int
    credited: int  # leading blocks not charged (held ready by others)
    ready: bool = False
    released: bool = False

    @property
    def credited_tokens(self) -> int:
        return self.credited * self.block_size


@dataclass(slots=True)
class _Counts:
    held: dict[BlockKey, int] = field(default_factory=dict)
    ready: dict[BlockKey, int] = field(default_factory=dict)
    paid: dict[BlockKey, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SharedBlocksStats:
    backends: int
    held_blocks: int
    paid_blocks: int


class SharedBlocks:
    """Per-backend reference counts of in-flight prompt blocks."""

    def __init__(self) -> None:
        self._by_backend: dict[str, _Counts] = {}

    def creditable(self, backend: str, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` that a ready in-flight request on ``backend`` holds."""
        counts = self._by_backend.get(backend)
        if counts is None:
            return 0
        ready = counts.ready
        n = 0
        for key in keys:
            if ready.get(key, 0) <= 0:
                break
            n += 1
        return n

    def acquire(self, backend: str, keys: Sequence[BlockKey], block_size: int) -> Holding:
        """A reservation of a prompt with ``keys`` on ``backend``; credits what it can."""
        counts = self._by_backend.setdefault(backend, _Counts())
        credited = self.creditable(backend, keys)
        held, paid = counts.held, counts.paid
        for i, key in enumerate(keys):
            held[key] = held.get(key, 0) + 1
            if i >= credited:
                paid[key] = paid.get(key, 0) + 1
        return Holding(backend, tuple(keys), block_size, credited)

    def mark_ready(self, h: Holding) -> None:
        """The holder's prefill is done: its blocks are in the node's cache."""
        if h.ready or h.released:
            return
        h.ready = True
        ready = self._by_backend.setdefault(h.backend, _Counts()).ready
        for key in h.keys:
            ready[key] = ready.get(key, 0) + 1

    def release(self, h: Holding) -> int:
        """The holder ended: how many charged block copies to give back (once)."""
        if h.released:
            return 0
        h.released = True
        counts = self._by_backend.get(h.backend)
        if counts is None:
            return 0
        held, ready, paid = counts.held, counts.ready, counts.paid
        freed = 0
        for i, key in enumerate(h.keys):
            left = held.get(key, 0) - 1
            if h.ready:
                r = ready.get(key, 0) - 1
                if r > 0:
                    ready[key] = r
                else:
                    ready.pop(key, None)
            copies = paid.get(key, 0)
            keep = copies - (1 if i >= h.credited else 0)
            if left > 0:
                keep = max(keep, 1)  # someone still holds it: one copy stays charged
                held[key] = left
            else:
                keep = 0
                held.pop(key, None)
            freed += copies - keep
            if keep > 0:
                paid[key] = keep
            else:
                paid.pop(key, None)
        if not held:
            del self._by_backend[h.backend]
        return freed

    def statistics(self) -> SharedBlocksStats:
        return SharedBlocksStats(
            backends=len(self._by_backend),
            held_blocks=sum(len(c.held) for c in self._by_backend.values()),
            paid_blocks=sum(sum(c.paid.values()) for c in self._by_backend.values()),
        )
