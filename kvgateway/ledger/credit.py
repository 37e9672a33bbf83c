"""Ledger credit: room recorded in Redis as this replica's that no request holds.

A finished request's room is kept (at most ``max_requests`` times the room of the request
released last, per backend) for ``hold_s`` after it was last topped up or used; a new request that fits in it is admitted
without a Redis round trip. The room never counts twice: Redis holds it for this replica
all along. What goes back to Redis goes through ``give_back``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

GiveBack = Callable[[str, int, int], None]


class Credit:
    def __init__(self, hold_s: float, give_back: GiveBack, max_requests: int = 32) -> None:
        self._hold = hold_s
        self._give_back = give_back
        self._max = max_requests
        self._room: dict[str, list[int]] = {}  # backend -> [tokens, seqs]
        self._used_at: dict[str, float] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.grants = 0  # admissions it covered whole

    @property
    def enabled(self) -> bool:
        return self._hold > 0

    def take(self, name: str, tokens: int, seqs: int) -> tuple[int, int]:
        """Take what there is towards a request of ``tokens``/``seqs``: all of it when
        the request fits (counted in ``grants``), else the part there is."""
        room = self._room.get(name)
        if room is None:
            return 0, 0
        got = min(room[0], tokens), min(room[1], seqs)
        room[0] -= got[0]
        room[1] -= got[1]
        if got == (tokens, seqs):
            self.grants += 1
            self._touch(name)
        return got

    def keep(self, name: str, tokens: int, seqs: int) -> None:
        """A request released ``tokens``/``seqs``: keep them, up to ``max_requests``
        times that."""
        room = self._room.setdefault(name, [0, 0])
        room[0] += tokens
        room[1] += seqs
        over = max(0, room[0] - self._max * tokens), max(0, room[1] - self._max * seqs)
        if over != (0, 0):
            room[0] -= over[0]
            room[1] -= over[1]
            self._give_back(name, *over)
        self._touch(name)

    def drop(self, name: str) -> None:
        """Give this backend's credit back."""
        room = self._room.pop(name, None)
        if room is not None and room != [0, 0]:
            self._give_back(name, room[0], room[1])

    def drop_all(self) -> None:
        for name in list(self._room):
            self.drop(name)

    def forget(self) -> None:
        """Drop it all without giving anything back (an absolute sync rewrites what is
        recorded; a fallback stops recording)."""
        self._room.clear()

    def _touch(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        self._used_at[name] = loop.time()
        if name not in self._timers:
            self._timers[name] = loop.call_later(self._hold, self._expired, name)

    def _expired(self, name: str) -> None:
        del self._timers[name]
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._used_at.get(name, 0.0)
        if idle >= self._hold * 0.999:
            self.drop(name)
        elif name in self._room:
            self._timers[name] = loop.call_later(self._hold - idle, self._expired, name)
