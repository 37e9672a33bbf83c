"""The fallback's view of the others: what this replica may take on each backend while
Redis does not answer it.

While its lease may still be live, the other replicas (if they reach Redis) count this
one at what Redis records for it, so it keeps within that and within its share
(``budget // live replicas last seen``); once the lease has surely run out, within its
share alone. The lease is measured from the last call that renewed it, or may have (one
that timed out may still have run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.core.ledger import OthersView
from kvgateway.ledger.recorded import Recorded


class FallbackShare:
    def __init__(
        self,
        lease_s: float,
        fleet: Fleet,
        view: OthersView,
        recorded: Recorded,
        live: Callable[[], int],
        offer: Callable[[Backend], None],
        in_fallback: Callable[[], bool],
    ) -> None:
        self._lease_s = lease_s
        self._fleet = fleet
        self._view = view
        self._recorded = recorded
        self._live = live
        self._offer = offer
        self._in_fallback = in_fallback
        self._renewed_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def renewed(self) -> None:
        """A call renewed the lease (or may have), at the latest now."""
        self._renewed_at = asyncio.get_running_loop().time()

    def lease_left(self) -> float:
        if self._renewed_at is None:
            return 0.0
        return self._renewed_at + self._lease_s - asyncio.get_running_loop().time()

    def apply(self) -> None:
        """Set the view for the fallback (again: the lease ran out, Redis still fails,
        a reload added backends); the backends whose room grew are offered."""
        caps = None
        left = self.lease_left()
        if left > 0:
            caps = self._recorded.caps()
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(left, self._lease_over)
        for b in self._view.fall_back(self._fleet.active, self._live(), caps):
            self._offer(b)

    def _lease_over(self) -> None:
        self._timer = None
        if self._in_fallback():
            self.apply()
