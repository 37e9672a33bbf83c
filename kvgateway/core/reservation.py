"""A reservation: KV tokens and sequence slots held on one backend, as an async context
manager released exactly once on every way out (see :class:`kvgateway.core.admission.
Admission`, which grants them); and the :class:`Ledger` that accounts them.

Where reservations are accounted: this process alone, or a ledger shared by replicas.

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

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand
from kvgateway.core.flight import Flight
from kvgateway.core.routing import RouteReason
from kvgateway.core.shared_blocks import Holding
from kvgateway.core.tenancy import Ticket


class Owner(Protocol):
    """What a reservation asks of the admission that granted it."""

    def release(self, reservation: Reservation) -> bool: ...

    def release_after(self, r: Reservation, *, gone: bool) -> None: ...

    def prefill_done(self, reservation: Reservation) -> None: ...

    def progress(
        self, reservation: Reservation, generated: int, prompt: int | None = None
    ) -> None: ...


class Admitter(Protocol):
    async def admit(self, demand: Demand, timeout: float) -> Reservation: ...


_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Reservation:
    """Tokens and slots held on one backend; freed exactly once by :meth:`release`."""

    backend: Backend
    tokens: int
    seqs: int
    reason: RouteReason
    owner: Owner
    queued_s: float = 0.0
    released: bool = False
    ticket: Ticket | None = None
    # False only when a shared ledger refused it (see :class:`Ledger` below): nothing to give
    # back there. Otherwise its release is reported to the ledger.
    counted: bool = True
    id: int = field(default_factory=lambda: next(_ids))
    # Prefix-aware placement: this request's share of its node's prompt blocks.
    holding: Holding | None = None
    # Admitted by the projected peak: its place in the node's projection. ``tokens``
    # stays its whole bound (what its tenant's share holds); the node's book holds what
    # it holds now.
    flight: Flight | None = None
    # When the node last reported its progress (the admission clock).
    reported_at: float = 0.0
    # The node has reported its progress: it runs there (not queued, not in prefill).
    started: bool = False
    # The output the node's context cut this request's max_tokens to (sent to the node
    # as max_tokens); None: as planned.
    output_cut: int | None = None
    # The gateway stopped reading the node's answer before its end (a timeout): like a
    # way out by an exception, the room is freed once the node's abort has landed.
    dropped: bool = False

    def release(self) -> bool:
        """Give the tokens and slot back; only the first call has an effect."""
        return self.owner.release(self)

    def prefill_done(self) -> None:
        """The node has streamed the first token: the prompt's blocks are cached."""
        self.owner.prefill_done(self)

    def progress(self, generated: int, prompt: int | None = None) -> None:
        """The node reports ``generated`` output tokens per sequence so far (and, with its
        first usage, its count of the prompt)."""
        self.owner.progress(self, generated, prompt)

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Any exception (a cancellation, the client's reset, a timeout) left the node's
        # answer unread: the node is still running it until the closed connection aborts it.
        self.owner.release_after(self, gone=exc_type is not None or self.dropped)


class Reserving:
    """``async with admission.reserve(demand, timeout) as r``: admitted on entry (waiting
    in the queue if need be), released on exit whatever the way out."""

    __slots__ = ("_admission", "_demand", "_reservation", "_timeout")

    def __init__(self, admission: Admitter, demand: Demand, timeout: float) -> None:
        self._admission = admission
        self._demand = demand
        self._timeout = timeout
        self._reservation: Reservation | None = None

    async def __aenter__(self) -> Reservation:
        self._reservation = await self._admission.admit(self._demand, self._timeout)
        return self._reservation

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._reservation is not None:
            await self._reservation.__aexit__(exc_type, exc, tb)


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
class Amount:
    """KV tokens and sequence slots: what a replica holds, or may hold, on a backend."""

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
        self._applied: dict[str, tuple[Backend, Amount]] = {}

    def others(self, b: Backend) -> Amount:
        got = self._applied.get(b.name)
        if got is None or got[0] is not b:
            return Amount(0, 0)
        return got[1]

    def own(self, b: Backend) -> Amount:
        """This replica's own reservations on ``b`` (the counters less the others)."""
        o = self.others(b)
        return Amount(b.reserved_tokens - o.tokens, b.reserved_seqs - o.seqs)

    def set(self, b: Backend, tokens: int, seqs: int) -> bool:
        """The others now hold ``tokens`` / ``seqs`` on ``b``; True if that went down
        (room may have appeared: waiters should be offered ``b``)."""
        tokens, seqs = max(0, tokens), max(0, seqs)
        prev = self._applied.get(b.name)
        if prev is not None and prev[0] is not b:
            # The backend was replaced by a reload: take the amount off the old object.
            self._adjust(prev[0], -prev[1].tokens, -prev[1].seqs, 0)
            prev = None
        old = prev[1] if prev is not None else Amount(0, 0)
        if (old.tokens, old.seqs) == (tokens, seqs):
            return False
        self._adjust(b, tokens - old.tokens, seqs - old.seqs, 0)
        self._applied[b.name] = (b, Amount(tokens, seqs))
        return tokens < old.tokens or seqs < old.seqs

    def fall_back(
        self,
        backends: Iterable[Backend],
        live: int,
        caps: Mapping[str, Amount] | None = None,
        seen: Mapping[str, Amount] | None = None,
    ) -> list[Backend]:
        """Blind mode: the others are taken to hold all but this replica's share, or
        with ``caps`` (by backend name; absent: nothing) all but the lesser of the share
        and the cap; and never less than ``seen`` (by backend name: what they held when
        the fallback began, while that may still run). Returns the backends whose room
        grew."""
        grew = []
        for b in backends:
            share_t = local_share(b.budget_tokens, live)
            share_s = max(1, local_share(b.max_num_seqs, live))
            if caps is not None:
                cap = caps.get(b.name, Amount(0, 0))
                share_t, share_s = min(share_t, cap.tokens), min(share_s, cap.seqs)
            tokens, seqs = b.budget_tokens - share_t, b.max_num_seqs - share_s
            before = seen.get(b.name) if seen is not None else None
            if before is not None:
                tokens = max(tokens, min(b.budget_tokens, before.tokens))
                seqs = max(seqs, min(b.max_num_seqs, before.seqs))
            if self.set(b, tokens, seqs):
                grew.append(b)
        return grew

    def held(self) -> dict[str, Amount]:
        """What the others are taken to hold now, by backend name."""
        return {name: amount for name, (_, amount) in self._applied.items()}
