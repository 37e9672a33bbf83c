"""The admission queue's book: who waits, in which order, for which backends, and which
tenant limits hold them (:class:`AdmissionQueue`); and a queue head's planned start,
around which later waiters may backfill (:func:`plan_of`, :func:`backfills`).

Nothing here grants: :class:`~kvgateway.core.admission_core.AdmissionCore` walks the
queue when room appears and hands waiters their reservations. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand, can_ever_hold, earliest_fit, flight_for, projected_budget
from kvgateway.core.flight import Flight, delayed
from kvgateway.core.reservation import Reservation
from kvgateway.core.routing import ModelIndex
from kvgateway.core.tenancy import CLASS_FLOOR, Tenancy, Ticket, displaced_error
from kvgateway.core.wait_queue import WaitQueue


@dataclass(eq=False, slots=True)
class Waiter:
    demand: Demand
    future: asyncio.Future[Reservation]
    since: float
    claims: frozenset[str]
    ticket: Ticket | None = None
    # The tenant limit this waiter last waited for (it claims nothing meanwhile).
    gated: str | None = None
    # Where it heads a backend's queue: its planned start there, on that node's
    # projection clock (kept, so backfills are held to one plan, not to each new one).
    plans: dict[str, int] = field(default_factory=dict)
    # The model's index its claims were read from (a new one: limits or members changed).
    index: ModelIndex | None = None

    @property
    def tenant(self) -> str:
        return tenant_key(self.demand, self.ticket)


def tenant_key(demand: Demand, ticket: Ticket | None) -> str:
    """The tenant a request counts under: its ticket's resolved name (a tenant gone from
    the config on reload resolves to the default), else the one it asked as."""
    return ticket.tenant if ticket is not None else demand.tenant


class AdmissionQueue:
    """The waiters, the backends they claim and the tenant limits holding them back:
    a waiter that its tenant's limits let through claims every backend routing could
    give it (nobody after it may take room there); one held by a limit claims nothing."""

    def __init__(
        self,
        *,
        index_for: Callable[[str], ModelIndex],
        offload_overflow: Callable[[], bool],
        clock: Callable[[], float],
        changed: Callable[[], None],
        tenancy: Tenancy | None,
        budget: Callable[[], int],
        capacity: Callable[[], int],
        slots: Callable[[], int],
    ) -> None:
        self.waiters: WaitQueue[Waiter] = WaitQueue()
        self._index_for = index_for
        self._offload_overflow = offload_overflow
        self._clock = clock
        self._changed = changed
        self._tenancy = tenancy
        self._budget = budget
        # The budget with every configured backend usable: what "never" is judged against
        # (a node down for a moment does not make a request impossible).
        self._capacity = capacity
        # The sequence slots of the usable backends (class floors hold on them too).
        self._slots = slots
        # How many waiters claim each backend: "is it claimed?" without walking the queue.
        self._claim_counts: Counter[str] = Counter()
        # Per tenant: its waiters that its limits let through, waiting for room (count,
        # tokens): they count against those limits as if running.
        self._through: dict[str, list[int]] = {}
        # Per class and model: its waiters held behind the other classes' floors.
        self._floor_parked: Counter[tuple[str, str]] = Counter()
        self._gated = 0  # waiters a tenant limit holds

    def __len__(self) -> int:
        return len(self.waiters)

    def ordered(self) -> Iterator[Waiter]:
        """The waiters in serving order (arrival order without tenancy), as a snapshot."""
        if self._tenancy is None:
            return iter(self.waiters)
        return self.waiters.ordered(self._clock(), self._tenancy.auth.aging_s)

    def claimed(self, name: str) -> bool:
        return self._claim_counts[name] > 0

    def claimed_names(self) -> frozenset[str]:
        return frozenset(n for n, c in self._claim_counts.items() if c > 0)

    def claimed_ahead(self, ticket: Ticket | None) -> frozenset[str]:
        """Backends claimed by waiters served before a newcomer holding ``ticket``."""
        claimed = self.claimed_names()
        if ticket is None or self._tenancy is None:
            return claimed
        ahead = self.waiters.claims_ahead(
            ticket,
            self._clock(),
            self._tenancy.auth.aging_s,
            live=lambda w: not w.future.done(),
            claimed=claimed,
            claims=self._claims_now,
        )
        return frozenset(ahead)

    def _claims_now(self, w: Waiter) -> frozenset[str]:
        """``w``'s claims but where other classes' floors keep it off now (aged up, too)."""
        kept = w.demand.kept_slots
        if kept is None:
            return w.claims
        index = self._index_for(w.demand.model)
        return frozenset(
            n
            for n in w.claims
            if (b := index.get(n)) is None
            or b.free_seqs - kept(n, b.max_num_seqs) >= w.demand.sequences
        )

    def claims_of(self, demand: Demand) -> frozenset[str]:
        """The backends routing could give this request: those that can hold it and it
        does not exclude, minus the offload tier when a GPU tier can hold it (unless
        overflow is on)."""
        could = [
            b
            for b in self._index_for(demand.model).backends
            if b.name not in demand.exclude and can_ever_hold(b, demand)
        ]
        if any(not b.offload for b in could) and not self._offload_overflow():
            could = [b for b in could if not b.offload]
        return frozenset(b.name for b in could)

    def claimed_by(self, w: Waiter) -> list[Backend]:
        return [b for b in self._index_for(w.demand.model).backends if b.name in w.claims]

    def enqueue(self, w: Waiter) -> None:
        w.index = self._index_for(w.demand.model)
        self.waiters.append(w)
        if w.gated is None:
            self._waits_for_room(w, 1)
        self._park(w, 1)
        self._changed()

    def reclaim(self, w: Waiter) -> None:
        """Read ``w``'s claims afresh if its model's backends changed since it claimed
        (a node's limits learned, members reloaded): walks of a node it could not hold
        then would pass it by."""
        index = self._index_for(w.demand.model)
        if index is w.index:
            return
        w.index = index
        claims = self.claims_of(w.demand)
        if claims == w.claims:
            return
        if w.gated is None:
            self._waits_for_room(w, -1)
        w.claims = claims
        if w.gated is None:
            self._waits_for_room(w, 1)
        self._changed()

    def dequeued(self, w: Waiter) -> None:
        """``w`` left the queue (taken out by the caller)."""
        if w.gated is None:
            self._waits_for_room(w, -1)
        self._park(w, -1)
        self._changed()

    def _park(self, w: Waiter, sign: int) -> None:
        """Count ``w`` in (1) or out (-1) of the waiters limits hold (and floors, by class)."""
        self._gated += sign if w.gated is not None else 0
        if w.gated == CLASS_FLOOR and w.ticket is not None:
            key = (w.ticket.klass, w.demand.model)
            self._floor_parked[key] += sign
            if self._floor_parked[key] <= 0:
                del self._floor_parked[key]

    def _waits_for_room(self, w: Waiter, sign: int) -> None:
        """``w`` starts (1) or stops (-1) waiting for room: its claims, and its place
        among its tenant's requests let through."""
        if sign > 0:
            self._claim_counts.update(w.claims)
        else:
            self._claim_counts.subtract(w.claims)
            for name in w.claims:  # no key left at 0 (DNS members come and go as names)
                if self._claim_counts[name] <= 0:
                    del self._claim_counts[name]
        key = w.tenant
        through = self._through.setdefault(key, [0, 0])
        through[0] += sign
        through[1] += sign * w.demand.tokens
        if through[0] <= 0:
            del self._through[key]

    # ---- tenancy: gates, floors, displacement -----------------------------------

    def gate(self, demand: Demand, ticket: Ticket | None, own: Waiter | None = None) -> str | None:
        """The limit holding ``demand`` back, counting the tenant's waiters already let
        through (all of them would otherwise pass at once when a limit opens by one, and
        overfill the queue); ``own``, a waiter asking again, does not count itself."""
        if self._tenancy is None:
            return None
        ahead = ahead_tokens = 0
        through = self._through.get(tenant_key(demand, ticket))
        if through is not None:
            ahead, ahead_tokens = through
            if own is not None and own.gated is None:
                ahead -= 1
                ahead_tokens -= own.demand.tokens
        totals = self._tenancy.reads_totals(demand.tenant)
        gate = self._tenancy.gate(
            demand.tenant,
            demand.tokens,
            self._budget() if totals else 0,
            ahead,
            ahead_tokens,
            seqs=demand.sequences,
            slots=self._slots() if totals else 0,
        )
        if gate is None and self._floors_fill_every_node(demand):
            return CLASS_FLOOR
        # A newcomer goes behind its class's requests the floors hold (they are asked
        # again in order as room frees): else smaller ones would take each bit of room a
        # held larger one waits for, and it would never pass.
        parked = ticket is not None and self._floor_parked[(ticket.klass, demand.model)]
        if gate is None and own is None and parked:
            return CLASS_FLOOR
        if gate is None and ticket is not None:
            older = self._tenancy.elsewhere.floor_waits.get((ticket.klass, demand.model))
            if older is not None and older > (self._clock() - own.since if own else 0.0):
                return CLASS_FLOOR
        return gate

    def floor_waits(self) -> dict[tuple[str, str], float]:
        """Per class and model, how long the oldest request waiting behind the floors
        has waited."""
        now = self._clock()
        oldest: dict[tuple[str, str], float] = {}
        for w in self.waiters:
            if w.gated == CLASS_FLOOR and w.ticket is not None and not w.future.done():
                k = (w.ticket.klass, w.demand.model)
                oldest[k] = max(oldest.get(k, 0.0), now - w.since)
        return oldest

    def _floors_fill_every_node(self, d: Demand) -> bool:
        """Other classes' floors leave ``d`` no slot on any usable backend that could
        hold it: it waits as its tenant's limits make it wait, claiming none (a claim
        would hold the floor's own class off them, here and, through a shared ledger's
        wait marks, on every replica)."""
        kept = d.kept_slots
        if kept is None:
            return False
        nodes = [b for b in self._index_for(d.model).backends if b.usable and can_ever_hold(b, d)]
        return bool(nodes) and all(
            b.free_seqs - kept(b.name, b.max_num_seqs) < d.sequences for b in nodes
        )

    def never_passes_floors(self, demand: Demand) -> bool:
        """Other classes' floors leave ``demand`` no room however the fleet is used: its
        KV beside theirs in the whole fleet's, or its sequences beside the slots they
        keep on every node of its model (usable now or not: a node down for a moment
        makes nothing impossible)."""
        nodes = self._index_for(demand.model).backends
        return self._tenancy is not None and self._tenancy.never_passes_floors(
            demand.tenant,
            demand.tokens,
            self._capacity(),
            seqs=demand.sequences,
            slots=[b.max_num_seqs for b in nodes if b.limits.known],
        )

    def regate(self, w: Waiter) -> str | None:
        """Ask ``w``'s tenant limit again. While it holds ``w``, ``w`` claims no backend:
        it would keep other requests (of this replica, and through a shared ledger's wait
        marks, of every replica) off backends it cannot take."""
        gate = self.gate(w.demand, w.ticket, own=w)
        if (gate is None) != (w.gated is None):
            self._waits_for_room(w, 1 if gate is None else -1)
            self._changed()
        self._park(w, -1)
        w.gated = gate
        self._park(w, 1)
        return gate

    def regate_in_turn(self, w: Waiter, held: set[tuple[str, str]]) -> str | None:
        """:meth:`regate` in a walk in serving order (``held``: the walk's classes and
        models with a waiter the floors still hold): one behind such a waiter of its class
        stays held too, or smaller ones would take each bit of room it waits for."""
        key = (w.ticket.klass, w.demand.model) if w.ticket is not None else None
        if key in held and w.gated == CLASS_FLOOR:
            return CLASS_FLOOR
        gate = self.regate(w)
        if gate == CLASS_FLOOR and key is not None:
            held.add(key)
        return gate

    def ungated(self, tenant: str) -> list[Backend]:
        """``tenant``'s limit may have opened (and with it, any class floor): the waiters
        it held are asked again (no other tenant's). Returns the backends those now let
        through claim, to be offered to the queue (a tenant at its concurrency limit
        waits for any of its requests to end, wherever that one ran)."""
        opened: dict[str, Backend] = {}
        held: set[tuple[str, str]] = set()
        for w in self.ordered() if self._gated else ():  # in serving order
            if w.gated is None or w.future.done():
                continue
            if w.tenant != tenant and w.gated != CLASS_FLOOR:
                continue
            if self.regate_in_turn(w, held) is None:
                for b in self.claimed_by(w):
                    opened.setdefault(b.name, b)
        return list(opened.values())

    def displace(self, ticket: Ticket | None) -> Waiter | None:
        """Queue full: refuse the last waiter of a class below ``ticket``'s, if any; the
        caller offers the backends it claimed to those behind it."""
        if ticket is None or self._tenancy is None:
            return None
        victim = self.waiters.displaceable(ticket, self._clock(), self._tenancy.auth.aging_s)
        if victim is None:
            return None
        self.waiters.remove(victim)
        self.dequeued(victim)
        if not victim.future.done():
            victim.future.set_exception(displaced_error())
        return victim

    def parked(self, tenant: str) -> int:
        """Waiters of ``tenant`` held by its own limits."""
        return self.waiters.parked_of(tenant, lambda w: w.tenant)

    # ---- backfill: the head's plan ----------------------------------------------

    def head_plan(self, b: Backend) -> Plan | Literal[False] | None:
        """The first waiter claiming ``b``, planned where it first fits there. None:
        nobody waits for ``b``; False: its start cannot be projected (no backfill)."""
        for w in self.ordered():
            if w.future.done() or w.gated is not None or b.name not in w.claims:
                continue
            plan = plan_of(b, w)
            return False if plan is None else plan
        return None


@dataclass(frozen=True, slots=True)
class Plan:
    """A queue head's planned start on one backend: later waiters may take only what
    leaves it in place."""

    flight: Flight
    z: float


def plan_of(b: Backend, w: Waiter) -> Plan | None:
    """``w`` as a flight starting where ``b``'s projection first fits it (where it was
    planned before, while that still fits); None when that cannot be projected (it
    holds its whole bound, or an end there is unknown)."""
    d = w.demand
    if not d.projected:
        return None
    proj = b.projection
    block = b.limits.block_size
    budget = projected_budget(b)
    head = flight_for(b, d)
    start = earliest_fit(proj, block, head, budget, d.z)
    kept = w.plans.get(b.name)
    if kept is not None and (start is None or kept - proj.clock < start):
        # A plan only moves earlier: a report not in yet makes the node look further
        # from its ends than it is, and a later plan would let backfills take the room
        # the head was promised.
        start = max(0, kept - proj.clock)
    if start is None:
        return None
    w.plans[b.name] = proj.clock + start
    return Plan(delayed(head, start), d.z)


def backfills(b: Backend, d: Demand, head: Plan) -> bool:
    """``d`` fits ``b`` now and leaves the head's planned start as it is."""
    if not d.projected or b.free_seqs < d.sequences + head.flight.n:
        return False
    extra = (flight_for(b, d), head.flight)
    return b.projection.fits(b.limits.block_size, projected_budget(b), max(d.z, head.z), extra)


def with_busy(d: Demand, names: frozenset[str]) -> Demand:
    return replace(d, busy=d.busy | names)
