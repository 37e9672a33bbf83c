"""The fallback's view of the others: what this replica may take on each backend, and
of each tenant limit and class floor (:func:`tenant_fallback`), while Redis does not
answer it.

While its lease may still be live, the other replicas (if they reach Redis) count this
one at what Redis records for it, so it keeps within that and within its share
(``budget // live replicas last seen``); once the lease has surely run out, within its
share alone. The lease is measured from the last call that renewed it, or may have (one
that timed out may still have run). Either way the others are taken to hold at least
what they held when the fallback began, while a request admitted then may still run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.core.reservation import Amount, OthersView
from kvgateway.core.tenancy import Elsewhere
from kvgateway.ledger.recorded import Recorded

# Lives of this replica's requests remembered: those that ended in the last one or two
# spans of this length.
LIVES_SPAN_S = 600.0

T = TypeVar("T")


class RequestLives:
    """How long this replica's requests have lived lately. What the others held when
    Redis went is taken to run at most as long as the longest of them (their requests
    taken to be like ours), and never longer than ``cap()`` (the nodes' longest total
    timeout); 0 until one has ended."""

    def __init__(self, cap: Callable[[], float]) -> None:
        self._cap = cap
        self._born: dict[int, float] = {}
        self._longest = 0.0  # of those ended in the current span
        self._before = 0.0  # in the span before it
        self._span_from: float | None = None

    def born(self, rid: int, now: float) -> None:
        self._born[rid] = now

    def ended(self, rid: int, now: float) -> None:
        start = self._born.pop(rid, None)
        if start is not None:
            self._roll(now)
            self._longest = max(self._longest, now - start)

    def forget(self, rid: int) -> None:
        """It never held anything the others could count (refused, released uncounted)."""
        self._born.pop(rid, None)

    def window(self, now: float) -> float:
        """How long what the others held when Redis went may still run."""
        self._roll(now)
        return min(self._cap(), max(self._longest, self._before))

    def _roll(self, now: float) -> None:
        if self._span_from is None:
            self._span_from = now
        elif now - self._span_from >= LIVES_SPAN_S:
            self._before, self._longest, self._span_from = self._longest, 0.0, now


class LastSeen(Generic[T]):
    """What the others held when Redis went, kept for as long as a request admitted
    then may still run (``lives``), then forgotten. Both fallbacks (KV budgets, tenant
    limits) keep theirs here."""

    def __init__(self, lives: RequestLives) -> None:
        self._lives = lives
        self._value: T | None = None
        self._until = 0.0

    def keep(self, value: T, now: float) -> float | None:
        """Keep ``value`` from ``now``; how long it is kept (None: not at all, no
        request has ended yet to say how long one runs)."""
        window = self._lives.window(now)
        if window <= 0.0:
            self._value = None
            return None
        self._value, self._until = value, now + window
        return window

    def at(self, now: float) -> T | None:
        """What is kept at ``now`` (None once its time is over)."""
        if self._value is not None and now >= self._until:
            self._value = None
        return self._value

    def forget(self) -> None:
        self._value = None


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
        lives: RequestLives | None = None,
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
        # What the others held when the fallback began: a replica past its share then
        # keeps what it holds until its requests end.
        self._seen: LastSeen[dict[str, Amount]] = LastSeen(
            lives if lives is not None else RequestLives(lambda: 0.0)
        )
        self._seen_timer: asyncio.TimerHandle | None = None

    def began(self) -> None:
        """The fallback begins (not at start-up: nothing was seen then)."""
        if self._seen_timer is not None:
            self._seen_timer.cancel()
            self._seen_timer = None
        loop = asyncio.get_running_loop()
        window = self._seen.keep(self._view.held(), loop.time())
        if window is not None:
            self._seen_timer = loop.call_later(window, self._seen_over)

    def _seen_over(self) -> None:
        # A timer may fire a moment early: what was kept ends here, not by the clock.
        self._seen_timer = None
        self._seen.forget()
        if self._in_fallback():
            self.apply()

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
        seen = self._seen.at(asyncio.get_running_loop().time())
        for b in self._view.fall_back(self._fleet.active, self._live(), caps, seen):
            self._offer(b)

    def _lease_over(self) -> None:
        self._timer = None
        if self._in_fallback():
            self.apply()


@dataclass(frozen=True, slots=True)
class TenantRecord:
    """What Redis records for this replica's tenants: per tenant (KV tokens, requests),
    over its classes (KV tokens, sequences), and whether its lease may still be live."""

    tenants: dict[str, tuple[int, int]]
    classes: tuple[int, int]
    leased: bool


@dataclass(frozen=True, slots=True)
class SeenBefore:
    """What the others were last seen holding when Redis went (per tenant: KV tokens,
    requests; over every class: KV tokens, sequences). While requests admitted then may
    still run (:class:`RequestLives`) the others are taken to hold at least this, their
    share of a limit notwithstanding."""

    tenants: dict[str, tuple[int, int]]
    classes: tuple[int, int]

    @staticmethod
    def of(away: Elsewhere, tenants: list[str]) -> SeenBefore:
        classes = (
            sum(away.class_tokens.values()) + away.unclassed_tokens,
            sum(away.class_seqs.values()) + away.unclassed_seqs,
        )
        return SeenBefore({t: (away.tokens[t], away.requests[t]) for t in tenants}, classes)


NOTHING_SEEN = SeenBefore({}, (0, 0))


def tenant_fallback(
    away: Elsewhere,
    caps: dict[str, tuple[int, int]],
    fleet: tuple[int, int] | None,
    mine: TenantRecord,
    live: int,
    seen: SeenBefore = NOTHING_SEEN,
) -> list[str]:
    """Set ``away`` to what the others are taken to hold in the fallback: all of each
    tenant's ``caps`` (KV tokens, requests) and, with class floors, of the ``fleet`` (KV
    budget, slots) but this replica's share (``1 / live``), and while its lease may
    still be live, but what Redis records for it if less (as the KV budgets' fallback
    does); never less than they were ``seen`` holding when Redis went, while what they
    held then may still run (a replica past its share then keeps it until its requests
    end). Returns the tenants whose view fell (the others were last seen holding more),
    whose waiters are to ask again."""
    live = max(1, live)

    def others(cap: int, recorded: int, before: int) -> int:
        share = cap // live
        blind = max(0, cap - (min(share, recorded) if mine.leased else share))
        return max(blind, min(cap, before))

    before = sum(away.class_tokens.values()) + away.unclassed_tokens
    before_s = sum(away.class_seqs.values()) + away.unclassed_seqs
    fell: list[str] = []
    for tenant, (tokens, requests) in caps.items():
        rec_tokens, rec_requests = mine.tenants.get(tenant, (0, 0))
        seen_tokens, seen_requests = seen.tenants.get(tenant, (0, 0))
        was = (away.tokens[tenant], away.requests[tenant])
        away.tokens[tenant] = others(tokens, rec_tokens, seen_tokens)
        away.requests[tenant] = others(requests, rec_requests, seen_requests)
        if away.tokens[tenant] < was[0] or away.requests[tenant] < was[1]:
            fell.append(tenant)
    away.class_tokens.clear()
    away.class_seqs.clear()
    away.node_seqs.clear()  # each node's floors kept whole (nothing known held there)
    away.unclassed_tokens = away.unclassed_seqs = 0
    if fleet is not None:
        away.unclassed_tokens = others(fleet[0], mine.classes[0], seen.classes[0])
        away.unclassed_seqs = others(fleet[1], mine.classes[1], seen.classes[1])
        if away.unclassed_tokens < before or away.unclassed_seqs < before_s:
            fell = list(caps)
    return fell


class TenantFallback:
    """The tenant limits' view of the others while Redis does not answer
    (:func:`tenant_fallback`), what they held when it went kept for as long as a request
    admitted then may run (``lives``)."""

    def __init__(self, lives: RequestLives) -> None:
        self._gone = False  # Redis stopped answering: what the others held is kept
        self._seen: LastSeen[SeenBefore] = LastSeen(lives)

    def answered(self) -> None:
        """Redis answered: nothing is kept from before it went."""
        self._gone = False
        self._seen.forget()

    def apply(
        self,
        away: Elsewhere,
        caps: dict[str, tuple[int, int]],
        fleet: tuple[int, int] | None,
        mine: TenantRecord,
        live: int,
        now: float,
    ) -> list[str]:
        """Set ``away`` for the fallback; the tenants whose view fell."""
        if not self._gone:
            self._gone = True
            self._seen.keep(SeenBefore.of(away, list(caps)), now)
        seen = self._seen.at(now) or NOTHING_SEEN
        return tenant_fallback(away, caps, fleet, mine, live, seen)


def over_limit(
    caps: tuple[int, int] | None, mine: tuple[int, int], others: tuple[int, int], more: int
) -> bool:
    """One more request of ``more`` KV tokens takes a tenant past its ``caps``, holding
    ``mine`` here and the others taken to hold ``others`` (each KV tokens, requests, as
    the caps are; -1: no cap). A tenant holding nothing may run one request, however
    large, as its gate says."""
    if caps is None:
        return False
    cap_tokens, cap_requests = caps
    if cap_requests >= 0 and mine[1] + 1 + others[1] > cap_requests:
        return True
    held = mine[0] + others[0]
    return cap_tokens >= 0 and held > 0 and held + more > cap_tokens
