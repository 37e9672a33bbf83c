"""The admission queue, kept in serving order as waiters come and go.

Serving order is :meth:`Ticket.key <kvgateway.core.tenancy.Ticket.key>`: class rank,
then the fair-queuing tag; a waiter that has waited ``aging_s`` is lifted one class per
period and goes before that class's own waiters, oldest first. The key moves with time,
so sorting every waiter on every release cost O(n log n) key computations in Python
(4 ms per release with 2,000 waiters: an overloaded gateway spent its loop sorting).

Here each class keeps two lists, sorted once on insertion (a binary search and a C
``memmove``): by arrival (``since``) and by tag (``start``). At any instant a class's
lifted waiters are a prefix of its arrival list, cut by how long they waited, so the
serving order is a merge of slices, produced lazily: a release that stops at the first
waiter it cannot place reads one or two entries, not the whole queue. Ties fall back to
the order of insertion, as a stable sort of the arrival order does.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field
from typing import Generic

from kvgateway.core.tenancy import Ticket, W

# (since or start, seq, insertion number, waiter): the insertion number is unique, so
# the waiter itself is never compared.
_Entry = tuple[float, int, int, W]


@dataclass(slots=True)
class _Class(Generic[W]):
    by_arrival: list[_Entry[W]] = field(default_factory=list)
    by_tag: list[_Entry[W]] = field(default_factory=list)


def lift(rank: int, since: float, now: float, aging_s: float) -> int:
    """Classes a waiter of ``rank`` queued at ``since`` has been lifted by at ``now``
    (the same arithmetic as :meth:`Ticket.key`)."""
    return min(rank, int((now - since) / aging_s)) if aging_s > 0 else 0


class WaitQueue(Generic[W]):
    """Waiters in arrival order, and in serving order when every one holds a ticket."""

    def __init__(self) -> None:
        self._arrival: dict[W, _Entry[W] | None] = {}  # insertion-ordered
        self._classes: dict[int, _Class[W]] = {}
        self._untagged = 0  # waiters without a ticket: then the order is arrival order
        self._n = itertools.count()

    def __len__(self) -> int:
        return len(self._arrival)

    def __bool__(self) -> bool:
        return bool(self._arrival)

    def __iter__(self) -> Iterator[W]:
        """Arrival order (a snapshot: the queue may change while it is read)."""
        return iter(list(self._arrival))

    def __contains__(self, w: object) -> bool:
        return w in self._arrival

    def append(self, w: W) -> None:
        if w in self._arrival:
            raise ValueError("waiter already queued")
        t = w.ticket
        if t is None:
            self._untagged += 1
            self._arrival[w] = None
            return
        n = next(self._n)
        c = self._classes.get(t.rank)
        if c is None:
            c = self._classes[t.rank] = _Class()
        arrival: _Entry[W] = (w.since, t.seq, n, w)
        insort(c.by_arrival, arrival)
        insort(c.by_tag, (t.start, t.seq, n, w))
        self._arrival[w] = arrival

    def remove(self, w: W) -> None:
        """Take ``w`` out; ValueError if it is not queued (as ``list.remove``)."""
        if w not in self._arrival:
            raise ValueError("waiter not queued")
        arrival = self._arrival.pop(w)
        t = w.ticket
        if arrival is None or t is None:
            self._untagged -= 1
            return
        c = self._classes[t.rank]
        _delete(c.by_arrival, arrival)
        _delete(c.by_tag, (t.start, t.seq, arrival[2], w))
        if not c.by_arrival:
            del self._classes[t.rank]

    def discard(self, w: W) -> bool:
        if w not in self._arrival:
            return False
        self.remove(w)
        return True

    def waiting_for_room(self) -> int:
        """Waiters queued for room on a backend: one held by its own tenant's limit does
        not count against the shared queue (it claims nothing)."""
        return sum(1 for w in self._arrival if w.gated is None)

    def parked_of(self, tenant: str, tenant_of: Callable[[W], str]) -> int:
        """Waiters of ``tenant`` (as ``tenant_of`` names a waiter's) held by its limits."""
        return sum(1 for w in self._arrival if w.gated is not None and tenant_of(w) == tenant)

    # ---- serving order ----------------------------------------------------------

    def ordered(self, now: float, aging_s: float) -> Iterator[W]:
        """The waiters in the order they are served at ``now``, lazily; what it reads is
        a snapshot taken at the call, so the queue may change while it is consumed."""
        if self._untagged:
            return iter(list(self._arrival))
        ranks = sorted(self._classes)
        snap = {r: (list(c.by_arrival), list(c.by_tag)) for r, c in self._classes.items()}
        return self._merge(ranks, snap, now, aging_s)

    def _merge(
        self,
        ranks: list[int],
        snap: dict[int, tuple[list[_Entry[W]], list[_Entry[W]]]],
        now: float,
        aging_s: float,
    ) -> Iterator[W]:
        # For class r, the arrival index where waiters lifted by fewer than L start:
        # lift only falls along the arrival list, so it is a binary search.
        def cut(r: int, level: int) -> int:
            arrival = snap[r][0]
            return bisect_right(arrival, -level, key=lambda e: -lift(r, e[0], now, aging_s))

        top = ranks[-1] if ranks else 0
        for e in range(top + 1):
            # Lifted into class e: from each class r > e, those lifted by exactly r - e,
            # oldest first across classes.
            slices = []
            for r in ranks:
                if r <= e:
                    continue
                level = r - e
                lo, hi = cut(r, level + 1), cut(r, level)
                if lo < hi:
                    slices.append(snap[r][0][lo:hi])
            if slices:
                for entry in heapq.merge(*slices) if len(slices) > 1 else slices[0]:
                    yield entry[3]
            # Then class e's own waiters not lifted, by tag.
            if e in snap:
                for entry in snap[e][1]:
                    if lift(e, entry[3].since, now, aging_s) <= 0:
                        yield entry[3]

    def claims_ahead(
        self,
        ticket: Ticket,
        now: float,
        aging_s: float,
        *,
        live: Callable[[W], bool],
        claimed: Set[str],
        claims: Callable[[W], Set[str]] = lambda w: w.claims,
    ) -> set[str]:
        """Backends claimed by the live waiters served before a newcomer holding
        ``ticket`` (a waiter kept by its tenant's own limit claims nothing; ``claims``:
        what a waiter claims now). ``claimed`` holds at least every backend a waiter
        claims: the walk stops once all are in."""
        mine = ticket.key(now, now, aging_s)
        names: set[str] = set()
        for w in self.ordered(now, aging_s):
            t = w.ticket
            if t is None:  # arrival order: every ticketed waiter is compared
                continue
            if t.key(w.since, now, aging_s) >= mine:
                if not self._untagged:
                    break
                continue
            if w.gated is None and live(w):
                names |= claims(w)
                if names >= claimed:
                    break
        return names

    def displaceable(self, ticket: Ticket, now: float, aging_s: float) -> W | None:
        """Queue full: the waiter to refuse for a newcomer holding ``ticket``: the last
        one served of the lowest class below the newcomer's, among those queued for room
        (one held by its own tenant's limit takes no place in the queue: refusing it
        would make none), or None."""
        for r in sorted((r for r in self._classes if r > ticket.rank), reverse=True):
            c = self._classes[r]
            for entry in reversed(c.by_tag):  # the latest tags not lifted
                w = entry[3]
                if w.gated is None and lift(r, w.since, now, aging_s) <= 0:
                    return w
            for entry in reversed(c.by_arrival):  # then the least lifted, newest
                w = entry[3]
                if w.gated is None and lift(r, w.since, now, aging_s) > 0:
                    return w
        return None


def _delete(entries: list[_Entry[W]], entry: _Entry[W]) -> None:
    # (a, seq, n) sorts before (a, seq, n, w): the search lands on the entry itself.
    i = bisect_left(entries, entry[:3])
    if i == len(entries) or entries[i][:3] != entry[:3]:
        raise ValueError("waiter missing from its class")
    del entries[i]
