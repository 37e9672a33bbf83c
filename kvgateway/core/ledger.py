"""Where reservations are accounted: this process alone, or a ledger shared by replicas.

:class:`~kvgateway.core.admission.Admission` always decides locally and synchronously,
on each backend's ``reserved_tokens`` / ``reserved_seqs``. With a shared ledger those
numbers are a *view*: this replica's own reservations plus what the other replicas
hold, as the ledger last answered (:class:`OthersView`). A local grant is then
*confirmed* by the ledger (one atomic check-and-reserve); a refusal refreshes the view,
so the next local decision already sees the backend as fuller.

When the shared ledger is unreachable the view becomes a conservative local share: the
others are taken to hold ``budget - budget // live`` of every backend, ``live`` being
the replica count last seen, so replicas that all lost Redis together stay within each
budget. (One replica cut off alone, past its lease, is counted as gone by those that
still reach Redis: its share can then overcommit a node; see the README.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvgateway.core.backends import Backend

if TYPE_CHECKING:
    from kvgateway.core.reservation import Reservation


class Ledger(Protocol):
    """What :class:`Admission` asks of a ledger. ``shared`` False: the local accounting
    is the whole truth and ``confirm`` / ``release`` are never called."""

    @property
    def shared(self) -> bool: ...

    async def confirm(self, reservation: Reservation) -> bool:
        """Record a locally granted reservation in the ledger if the backend's budget
        still has room across all replicas; False: refused (the view was refreshed)."""
        ...

    async def hold(self, reservation: Reservation) -> bool:
        """After a confirm: hold a confirmed reservation for its tenant across replicas
        (``max_concurrent``, ``max_kv_share``); False: other replicas hold too much for
        that tenant (its gate now sees them). Its release gives the hold back."""
        ...

    def release(self, reservation: Reservation, shared: int = 0) -> None:
        """A reservation the ledger may count ended (every one but those it refused);
        synchronous: the ledger sends it later. ``shared``: tokens of prompt blocks
        shared with other in-flight requests that move with this release (negative: a
        copy this one paid for stays charged to them; positive: the last copy, charged
        since its payer ended, goes with this one), as the local book moves them."""
        ...

    def release_shared(self, backend: Backend, tokens: int) -> None:
        """A reservation the ledger never counted (it refused it) ended holding the last
        copy of shared prefix blocks, recorded by the request that paid for them: give
        those ``tokens`` back."""
        ...

    def queue_changed(self) -> None:
        """A request joined or left the admission queue: a shared ledger tells the others
        where this replica starts or stops waiting."""
        ...

    def granted(self, reservation: Reservation) -> None:
        """A reservation was just granted locally (synchronously, before anything else
        runs): a shared ledger notes what its confirm will have to do."""
        ...


class LocalLedger:
    """The embedded ledger: one process, its reservations are the backend's counters."""

    @property
    def shared(self) -> bool:
        return False

    async def confirm(self, reservation: Reservation) -> bool:
        return True

    async def hold(self, reservation: Reservation) -> bool:
        return True

    def release(self, reservation: Reservation, shared: int = 0) -> None:
        return None

    def release_shared(self, backend: Backend, tokens: int) -> None:
        return None

    def queue_changed(self) -> None:
        return None

    def granted(self, reservation: Reservation) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Holding:
    tokens: int
    seqs: int


def local_share(budget: int, live: int) -> int:
    """This replica's part of ``budget`` when ``live`` replicas split it blind."""
    return budget // max(1, live)


class OthersView:
    """What the other replicas hold on each backend, folded into the backend's own
    reservation counters through ``adjust`` (so routing, the admin view and the metrics
    all see the fleet-wide picture). Only this object changes those folded amounts."""

    def __init__(self, adjust: Callable[[Backend, int, int, int], None]) -> None:
        self._adjust = adjust
        # By backend name: the Backend object the amount was folded into, and the amount.
        self._applied: dict[str, tuple[Backend, Holding]] = {}

    def others(self, b: Backend) -> Holding:
        got = self._applied.get(b.name)
        if got is None or got[0] is not b:
            return Holding(0, 0)
        return got[1]

    def own(self, b: Backend) -> Holding:
        """This replica's own reservations on ``b`` (the counters less the others)."""
        o = self.others(b)
        return Holding(b.reserved_tokens - o.tokens, b.reserved_seqs - o.seqs)

    def set(self, b: Backend, tokens: int, seqs: int) -> bool:
        """The others now hold ``tokens`` / ``seqs`` on ``b``; True if that went down
        (room may have appeared: waiters should be offered ``b``)."""
        tokens, seqs = max(0, tokens), max(0, seqs)
        prev = self._applied.get(b.name)
        if prev is not None and prev[0] is not b:
            # The backend was replaced by a reload: take the amount off the old object.
            self._adjust(prev[0], -prev[1].tokens, -prev[1].seqs, 0)
            prev = None
        old = prev[1] if prev is not None else Holding(0, 0)
        if (old.tokens, old.seqs) == (tokens, seqs):
            return False
        self._adjust(b, tokens - old.tokens, seqs - old.seqs, 0)
        self._applied[b.name] = (b, Holding(tokens, seqs))
        return tokens < old.tokens or seqs < old.seqs

    def fall_back(
        self, backends: Iterable[Backend], live: int, caps: Mapping[str, Holding] | None = None
    ) -> list[Backend]:
        """Blind mode: the others are taken to hold all but this replica's share, or
        with ``caps`` (by backend name; absent: nothing) all but the lesser of the share
        and the cap. Returns the backends whose room grew."""
        grew = []
        for b in backends:
            share_t = local_share(b.budget_tokens, live)
            share_s = max(1, local_share(b.max_num_seqs, live))
            if caps is not None:
                cap = caps.get(b.name, Holding(0, 0))
                share_t, share_s = min(share_t, cap.tokens), min(share_s, cap.seqs)
            if self.set(b, b.budget_tokens - share_t, b.max_num_seqs - share_s):
                grew.append(b)
        return grew
