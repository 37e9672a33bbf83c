"""The synchronous core of admission: routing decisions, grants, releases, the wait
queue's order and claims, pauses ending. No ``await`` here; :mod:`kvgateway.core.admission`
adds the async edge (a waiter parked on a future) on top. See that module for the rules.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal, Self

from kvgateway.config.model import GatewayConfig, Policy
from kvgateway.core.backends import Backend, PauseReason
from kvgateway.core.demand import (
    Demand,
    can_ever_hold,
    flight_for,
    projected_budget,
    tokens_on,
)
from kvgateway.core.fleet import Fleet
from kvgateway.core.ledger import Ledger, LocalLedger
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.projection import Flight, delayed
from kvgateway.core.reservation import Reservation
from kvgateway.core.routing import (
    Decision,
    Routed,
    RouteReason,
    RouterState,
    Wait,
    route,
    route_to,
)
from kvgateway.core.routing_index import ModelIndex
from kvgateway.core.tenancy import CLASS_FLOOR, Tenancy, Ticket, displaced_error
from kvgateway.core.wait_queue import WaitQueue

# Weight of each new observation of a node's seconds per engine step.
STEP_EWMA = 0.05


@dataclass(eq=False, slots=True)
class _Waiter:
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


class AdmissionCore:
    """Owns every reservation. ``backends_for(model)`` gives that model's backends in
    tier order (it reflects reloads), ``clock`` is monotonic seconds."""

    def __init__(
        self,
        *,
        index_for: Callable[[str], ModelIndex],
        adjust: Callable[[Backend, int, int, int], None],
        policy: Callable[[], Policy],
        offload_overflow: Callable[[], bool],
        queue_size: Callable[[], int],
        clock: Callable[[], float],
        on_decision: Callable[[Decision, Demand], None] | None = None,
        ledger: Ledger | None = None,
        abort_delay: Callable[[], float] = lambda: 0.0,
        tenancy: Tenancy | None = None,
        budget: Callable[[], int] = lambda: 0,
        prefix: PrefixRouter | None = None,
        capacity: Callable[[], int] | None = None,
        slots: Callable[[], int] = lambda: 0,
    ) -> None:
        self._ledger: Ledger = ledger if ledger is not None else LocalLedger()
        self._abort_delay = abort_delay
        self._tenancy = tenancy
        self._budget = budget
        # The budget with every configured backend usable: what "never" is judged against
        # (a node down for a moment does not make a request impossible).
        self._capacity = capacity or budget
        # The sequence slots of the usable backends (class floors hold on them too).
        self._slots = slots
        self._index_for = index_for
        self._prefix = prefix
        self._adjust = adjust
        self._policy = policy
        self._offload_overflow = offload_overflow
        self._queue_size = queue_size
        self._clock = clock
        self._on_decision = on_decision
        self._router = RouterState()
        self._waiters: WaitQueue[_Waiter] = WaitQueue()
        # How many waiters claim each backend: "is it claimed?" without walking the queue.
        self._claim_counts: Counter[str] = Counter()
        # Per backend: the flights that reported since its waiters were last offered room.
        self._reported: dict[str, set[int]] = {}
        # Per tenant: its waiters that its limits let through, waiting for room (count,
        # tokens): they count against those limits as if running.
        self._through: dict[str, list[int]] = {}

    @classmethod
    def for_fleet(
        cls,
        fleet: Fleet,
        config: Callable[[], GatewayConfig],
        clock: Callable[[], float],
        on_decision: Callable[[Decision, Demand], None] | None = None,
        tenancy: Tenancy | None = None,
        ledger: Ledger | None = None,
        prefix: PrefixRouter | None = None,
    ) -> Self:
        """Admission over ``fleet``, following the live config (it changes on reload)."""
        return cls(
            tenancy=tenancy or Tenancy(lambda: config().auth),
            budget=lambda: sum(b.budget_tokens for b in fleet.backends if b.usable),
            capacity=lambda: sum(b.budget_tokens for b in fleet.active),
            slots=lambda: sum(b.max_num_seqs for b in fleet.backends if b.usable),
            index_for=fleet.index,
            adjust=fleet.adjust,
            policy=lambda: config().routing.policy,
            offload_overflow=lambda: config().routing.offload_overflow,
            queue_size=lambda: config().admission.queue_size,
            clock=clock,
            on_decision=on_decision,
            ledger=ledger,
            abort_delay=lambda: config().admission.abort_release_delay_s,
            prefix=prefix,
        )

    # ---- synchronous core -------------------------------------------------------

    def decide(self, demand: Demand) -> Decision:
        index = self._index_for(demand.model)
        now = self._clock()
        decision = route(
            self._policy(),
            index,
            demand,
            self._router,
            now,
            offload_overflow=self._offload_overflow(),
        )
        if self._prefix is not None and demand.prefix is not None:
            decision = self._prefix.refine(index, demand, decision, now)
        return decision

    def _grant(
        self, backend: Backend, demand: Demand, reason: RouteReason, ticket: Ticket | None = None
    ) -> Reservation:
        if demand.projected:
            return self._grant_projected(backend, demand, reason, ticket)
        # Prefix-aware: blocks a ready in-flight request on the node holds are credited.
        holding = self._prefix.granted(backend, demand, self._clock()) if self._prefix else None
        tokens = tokens_on(backend, demand) - (holding.credited_tokens if holding else 0)
        r = Reservation(
            backend, tokens, demand.sequences, reason, self, ticket=ticket, holding=holding
        )
        self._adjust(backend, tokens, demand.sequences, 1)
        backend.unstarted += 1
        if ticket is not None and self._tenancy is not None:
            self._tenancy.granted(ticket, r.tokens, r.seqs)
        self._ledger.granted(r)
        return r

    def _grant_projected(
        self, backend: Backend, demand: Demand, reason: RouteReason, ticket: Ticket | None
    ) -> Reservation:
        """A flight on the node's projection; its book entry is what it holds now. The
        prefix router only learns where the prompt went (credit is the projection's)."""
        if self._prefix is not None and demand.prefix is not None:
            hint = replace(demand.prefix, credit=False)
            self._prefix.granted(backend, replace(demand, prefix=hint), self._clock())
        r = Reservation(
            backend, tokens_on(backend, demand), demand.sequences, reason, self, ticket=ticket
        )
        r.flight = flight_for(backend, demand, r.id)
        backend.projection.add(r.flight)
        self._adjust(backend, self._resync(backend), demand.sequences, 1)
        backend.unstarted += 1
        if ticket is not None and self._tenancy is not None:
            self._tenancy.granted(ticket, r.tokens, r.seqs)
        self._ledger.granted(r)
        return r

    @staticmethod
    def _resync(b: Backend) -> int:
        """Make ``b.projected_tokens`` what its flights hold now; the change."""
        block = b.limits.block_size
        now = b.projection.current_blocks(block) * block
        change, b.projected_tokens = now - b.projected_tokens, now
        return change

    def progress(self, reservation: Reservation, generated: int, prompt: int | None = None) -> None:
        """The node reports ``generated`` output tokens per sequence for a request (it is
        serving), and its own count of a single prompt (``prompt``). A projected
        request's first report puts its end in the projection: room may appear."""
        f = reservation.flight
        b = reservation.backend
        if reservation.released:
            return
        now = self._clock()
        b.served_at = now
        if not reservation.started:
            reservation.started = True
            b.unstarted -= 1
        if f is None or f.id not in b.projection:
            return
        block = b.limits.block_size
        before = -(-f.tokens_at(0) // block)
        if f.started and generated > f.generated:
            per_step = (now - reservation.reported_at) / (generated - f.generated)
            b.step_s = per_step if not b.step_s else b.step_s + STEP_EWMA * (per_step - b.step_s)
        reservation.reported_at = now
        single = prompt if reservation.seqs == f.n else None
        first = b.projection.progress(f.id, generated, single)
        grown = (-(-f.tokens_at(0) // block) - before) * f.n * block
        if grown:
            b.projected_tokens += grown
            self._adjust(b, grown, 0, 0)
        if first:
            self._offer(b)
        elif self._claim_counts[b.name] > 0:
            # Room also comes as running flights near their ends: a queue waiting for
            # this node is offered it again once every started flight has reported since
            # the last offer (about once an engine step, with every count fresh).
            seen = self._reported.setdefault(b.name, set())
            seen.add(f.id)
            if len(seen) >= b.projection.started:
                seen.clear()
                self._offer(b)

    def prefill_done(self, reservation: Reservation) -> None:
        h = reservation.holding
        if self._prefix is not None and h is not None and not reservation.released:
            self._prefix.prefill_done(h)

    def try_admit(self, demand: Demand, ticket: Ticket | None = None) -> Decision | Reservation:
        """Reserve now if the policy finds room that no waiter ahead of it claims."""
        if self._gate(demand, ticket) is not None:
            return Wait()
        decision = self.decide(demand)
        if isinstance(decision, Routed) and self._claim_counts[decision.backend.name] > 0:
            claimed = self._claimed_ahead(ticket)
            if decision.backend.name in claimed:
                first = decision
                decision = self.decide(_with_busy(demand, claimed))
                if not isinstance(decision, Routed):
                    filled = self._backfill(demand, first, claimed)
                    if filled is None:
                        return Wait()
                    decision = filled
        if isinstance(decision, Routed):
            return self._grant(decision.backend, demand, decision.reason, ticket)
        return decision

    # ---- backfill: what fits now without delaying the head's projected start ------

    def _head_plan(self, b: Backend) -> _Plan | Literal[False] | None:
        """The first waiter claiming ``b``, planned where it first fits there. None:
        nobody waits for ``b``; False: its start cannot be projected (no backfill)."""
        for w in self._ordered():
            if w.future.done() or w.gated is not None or b.name not in w.claims:
                continue
            plan = _plan_of(b, w)
            return False if plan is None else plan
        return None

    def _backfill(self, demand: Demand, first: Routed, claimed: frozenset[str]) -> Routed | None:
        """A backend that waiters ahead claim, taken by ``demand`` as a backfill."""
        if not demand.projected:
            return None
        index = self._index_for(demand.model)
        now = self._clock()
        overflow = self._offload_overflow()
        order = [first.backend, *(b for b in index.backends if b is not first.backend)]
        for b in order:
            if b.name not in claimed:
                continue
            routed = route_to(index, b, demand, now, offload_overflow=overflow)
            if routed is None:
                continue
            head = self._head_plan(b)
            if head is None or (head is not False and _backfills(b, demand, head)):
                return routed
        return None

    # ---- tenancy: order, gates, displacement ------------------------------------

    def _gate(
        self, demand: Demand, ticket: Ticket | None, own: _Waiter | None = None
    ) -> str | None:
        """The limit holding ``demand`` back, counting the tenant's waiters already let
        through (all of them would otherwise pass at once when a limit opens by one, and
        overfill the queue); ``own``, a waiter asking again, does not count itself."""
        if self._tenancy is None:
            return None
        ahead = ahead_tokens = 0
        through = self._through.get(_tenant_key(demand, ticket))
        if through is not None:
            ahead, ahead_tokens = through
            if own is not None and own.gated is None:
                ahead -= 1
                ahead_tokens -= own.demand.tokens
        return self._tenancy.gate(
            demand.tenant,
            demand.tokens,
            self._budget(),
            ahead,
            ahead_tokens,
            seqs=demand.sequences,
            slots=self._slots(),
        )

    def _never_passes_floors(self, demand: Demand) -> bool:
        return self._tenancy is not None and self._tenancy.never_passes_floors(
            demand.tenant,
            demand.tokens,
            self._capacity(),
            seqs=demand.sequences,
            slots=self._slots(),
        )

    def _ordered(self) -> Iterator[_Waiter]:
        """The waiters in the order they are served (arrival order without tenancy), as
        a snapshot: the queue may change while it is read."""
        if self._tenancy is None:
            return iter(self._waiters)
        return self._waiters.ordered(self._clock(), self._tenancy.auth.aging_s)

    def _claimed_ahead(self, ticket: Ticket | None) -> frozenset[str]:
        """Backends claimed by waiters served before a newcomer holding ``ticket``."""
        claimed = frozenset(n for n, c in self._claim_counts.items() if c > 0)
        if ticket is None or self._tenancy is None:
            return claimed
        ahead = self._waiters.claims_ahead(
            ticket,
            self._clock(),
            self._tenancy.auth.aging_s,
            live=lambda w: not w.future.done(),
            claimed=claimed,
        )
        return frozenset(ahead)

    def _displace(self, ticket: Ticket | None) -> bool:
        """Queue full: refuse the last waiter of a class below ``ticket``'s, if any."""
        if ticket is None or self._tenancy is None:
            return False
        victim = self._waiters.displaceable(ticket, self._clock(), self._tenancy.auth.aging_s)
        if victim is None:
            return False
        self._waiters.remove(victim)
        self._dequeued(victim)
        if not victim.future.done():
            victim.future.set_exception(displaced_error())
        self._offer_claims(victim)
        return True

    def _offer_claims(self, w: _Waiter) -> None:
        """``w`` left the queue without a grant: offer the backends it claimed to the
        waiters behind it."""
        for b in self._index_for(w.demand.model).backends:
            if b.name in w.claims:
                self._offer(b)

    def _claims(self, demand: Demand) -> frozenset[str]:
        """The backends routing could give this request: those that can hold it, minus
        the offload tier when a GPU tier can hold it (unless overflow is on)."""
        could = [b for b in self._index_for(demand.model).backends if can_ever_hold(b, demand)]
        if any(not b.offload for b in could) and not self._offload_overflow():
            could = [b for b in could if not b.offload]
        return frozenset(b.name for b in could)

    def _enqueue(self, w: _Waiter) -> None:
        self._waiters.append(w)
        if w.gated is None:
            self._waits_for_room(w, 1)
        self._ledger.queue_changed()

    def _dequeued(self, w: _Waiter) -> None:
        if w.gated is None:
            self._waits_for_room(w, -1)
        self._ledger.queue_changed()

    def _waits_for_room(self, w: _Waiter, sign: int) -> None:
        """``w`` starts (1) or stops (-1) waiting for room: its claims, and its place
        among its tenant's requests let through."""
        if sign > 0:
            self._claim_counts.update(w.claims)
        else:
            self._claim_counts.subtract(w.claims)
            for name in w.claims:  # no key left at 0 (DNS members come and go as names)
                if self._claim_counts[name] <= 0:
                    del self._claim_counts[name]
        key = _tenant_key(w.demand, w.ticket)
        through = self._through.setdefault(key, [0, 0])
        through[0] += sign
        through[1] += sign * w.demand.tokens
        if through[0] <= 0:
            del self._through[key]

    def _regate(self, w: _Waiter) -> str | None:
        """Ask ``w``'s tenant limit again. While it holds ``w``, ``w`` claims no backend:
        it would keep other requests (of this replica, and through a shared ledger's wait
        marks, of every replica) off backends it cannot take."""
        gate = self._gate(w.demand, w.ticket, own=w)
        if (gate is None) != (w.gated is None):
            self._waits_for_room(w, 1 if gate is None else -1)
            self._ledger.queue_changed()
        w.gated = gate
        return gate

    def release(self, reservation: Reservation) -> bool:
        """Return a reservation's tokens and slot; only the first call has an effect."""
        if reservation.released:
            return False
        reservation.released = True
        b = reservation.backend
        if not reservation.started:
            b.unstarted -= 1
        shared = 0
        if reservation.holding is not None and self._prefix is not None:
            shared = self._prefix.released(reservation.holding)  # shared blocks settled
        if reservation.counted:
            # The ledger moves shared copies as the book does: a holder's kept copy stays
            # recorded until the last request holding those blocks ends.
            self._ledger.release(reservation, shared)
        elif shared:
            # Refused by the ledger: the last holder of copies its payer recorded (> 0),
            # or the payer of a copy that stays charged to others, never recorded (< 0).
            self._ledger.release_shared(b, shared)
        if reservation.flight is not None:
            b.projection.remove(reservation.flight.id)
            self._reported.get(b.name, set()).discard(reservation.flight.id)
            self._adjust(b, self._resync(b), -reservation.seqs, -1)
        else:
            self._adjust(b, -(reservation.tokens + shared), -reservation.seqs, -1)
        if reservation.ticket is not None and self._tenancy is not None:
            self._tenancy.released(reservation.ticket, reservation.tokens, reservation.seqs)
        self._offer(b)
        if self._tenancy is not None and reservation.ticket is not None:
            self._ungate(reservation.ticket.tenant)
        return True

    def _ungate(self, tenant: str) -> None:
        """``tenant``'s limit may have opened (and with it, any class floor): waiters it
        held may now take room on any backend they could use (a tenant at its
        concurrency limit waits for any of its requests to end, wherever that one ran).
        Only those waiters are asked again: a release touches no other tenant's."""
        opened: dict[str, Backend] = {}
        for w in self._ordered():  # in serving order: the first let through go first
            if w.gated is None or w.future.done():
                continue
            # The resolved name (a tenant gone from the config on reload is the default).
            name = w.ticket.tenant if w.ticket is not None else w.demand.tenant
            if name != tenant and w.gated != CLASS_FLOOR:
                continue
            if self._regate(w) is None:
                # The backend just offered too: it was walked while this waiter claimed
                # nothing.
                for b in self._index_for(w.demand.model).backends:
                    if b.name in w.claims:
                        opened.setdefault(b.name, b)
        for b in opened.values():
            self._offer(b)

    def release_after(self, r: Reservation, *, gone: bool) -> None:
        """Release ``r`` when the node has freed its blocks: at once, or after the
        backend's KV-connector delay, or (client gone) once the node's abort has landed."""
        delay = r.backend.config.release_delay_s
        if gone:
            delay = max(delay, self._abort_delay())
        if delay <= 0:
            self.release(r)
            return
        asyncio.get_running_loop().call_later(delay, self.release, r)

    def end_pause(self, b: Backend, now: float) -> bool:
        """End ``b``'s timed pause once its time has come, and offer ``b`` to the waiters
        (the pause itself is read-only everywhere else). Returns True if it ended."""
        if not b.paused or not b.paused_until or now < b.paused_until:
            return False
        b.paused = False
        b.pause_reason = PauseReason.NONE
        b.paused_until = 0.0
        self._offer(b)
        return True

    def rebalance(self) -> None:
        """Offer every backend's capacity to the waiters in order (FIFO, or the tenancy
        order); after changes that may touch any backend (health, load feedback, reload)."""
        if not self._waiters:
            return
        now = self._clock()
        claimed: frozenset[str] = frozenset()
        gone: set[_Waiter] = set()
        for w in self._ordered():
            if w.future.done():
                gone.add(w)
                self._dequeued(w)
                continue
            if self._regate(w) is not None:
                continue
            d = _with_busy(w.demand, claimed) if claimed else w.demand
            decision = self.decide(d)
            if isinstance(decision, Routed):
                gone.add(w)
                self._hand_over(w, decision, now)
            else:
                claimed |= w.claims
        for w in gone:
            self._waiters.discard(w)

    def projected_wait(self, demand: Demand) -> float | None:
        """Seconds until ``demand`` first fits a backend it could use, as the projection
        sees it now (the queue ahead aside: a lower bound); None when no backend's
        projection can say (an end unknown, no step time seen yet)."""
        if not demand.projected:
            return None
        best: float | None = None
        for b in self._index_for(demand.model).backends:
            if not b.usable or not b.step_s or not can_ever_hold(b, demand):
                continue
            start = b.projection.earliest_start(
                b.limits.block_size, flight_for(b, demand), projected_budget(b), demand.z
            )
            if start is None:
                continue
            wait = start * b.step_s
            best = wait if best is None else min(best, wait)
        return best

    def waiting_backends(self) -> set[str]:
        """The backends queued requests claim (as :meth:`waiting_for`)."""
        return {n for n, c in self._claim_counts.items() if c > 0}

    def waiting_for(self, name: str) -> bool:
        """Does a queued request claim backend ``name``? (A shared ledger tells the other
        replicas, so their new arrivals leave the room to it.)"""
        return self._claim_counts[name] > 0

    def offer(self, b: Backend) -> None:
        """Room may have appeared on ``b`` from outside (another replica released)."""
        self._offer(b)

    def _offer(self, b: Backend) -> None:
        """Only ``b`` gained room: walk the waiters that claim it, in order, and stop at
        the first one it cannot take (later ones may not pass it). Nobody else's options
        changed, so nobody else is asked; except that a waiter found abandoned on the
        way (cancelled or timed out in this same instant, its own clean-up still to
        run) is taken out there and then, and the backends it claimed are walked in
        turn, each once: a storm of cancellations costs one walk, not one per waiter."""
        todo: dict[str, Backend] = {b.name: b}
        walked: set[str] = set()
        while todo:
            name = next(iter(todo))
            walked.add(name)
            for gone in self._walk(todo.pop(name)):
                for other in self._index_for(gone.demand.model).backends:
                    if other.name in gone.claims and other.name not in walked:
                        todo.setdefault(other.name, other)

    def _walk(self, b: Backend) -> list[_Waiter]:
        """One walk of :meth:`_offer`; returns the abandoned waiters it took out."""
        pruned: list[_Waiter] = []
        if self._claim_counts[b.name] <= 0:
            return pruned
        now = self._clock()
        overflow = self._offload_overflow()
        head: _Plan | None = None
        for w in self._ordered():
            if w.future.done():
                if self._waiters.discard(w):  # not taken out since the snapshot
                    self._dequeued(w)
                    pruned.append(w)
                continue
            if b.name not in w.claims:
                continue
            if self._regate(w) is not None:
                continue
            routed = route_to(
                self._index_for(w.demand.model), b, w.demand, now, offload_overflow=overflow
            )
            if routed is not None and head is not None and not _backfills(b, w.demand, head):
                continue  # fits now, but would delay the head: the next may not
            if routed is None:
                if head is not None:
                    continue
                # The head: later waiters may take what it cannot use before its start.
                plan = _plan_of(b, w)
                if plan is None:
                    break
                head = plan
                continue
            self._waiters.remove(w)
            self._hand_over(w, routed, now)
        return pruned

    def _hand_over(self, w: _Waiter, decision: Routed, now: float) -> None:
        self._dequeued(w)
        r = self._grant(decision.backend, w.demand, decision.reason, w.ticket)
        r.queued_s = now - w.since
        w.future.set_result(r)

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)


@dataclass(frozen=True, slots=True)
class _Plan:
    """A queue head's planned start on one backend: later waiters may take only what
    leaves it in place."""

    flight: Flight
    z: float


def _plan_of(b: Backend, w: _Waiter) -> _Plan | None:
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
    start = proj.earliest_start(block, head, budget, d.z)
    kept = w.plans.get(b.name)
    if kept is not None and (start is None or kept - proj.clock < start):
        # A plan only moves earlier: a report not in yet makes the node look further
        # from its ends than it is, and a later plan would let backfills take the room
        # the head was promised.
        start = max(0, kept - proj.clock)
    if start is None:
        return None
    w.plans[b.name] = proj.clock + start
    return _Plan(delayed(head, start), d.z)


def _backfills(b: Backend, d: Demand, head: _Plan) -> bool:
    """``d`` fits ``b`` now and leaves the head's planned start as it is."""
    if not d.projected or b.free_seqs < d.sequences + head.flight.n:
        return False
    extra = (flight_for(b, d), head.flight)
    return b.projection.fits(b.limits.block_size, projected_budget(b), max(d.z, head.z), extra)


def _tenant_key(demand: Demand, ticket: Ticket | None) -> str:
    """The tenant a request counts under: its ticket's resolved name, else its own."""
    return ticket.tenant if ticket is not None else demand.tenant


def _with_busy(d: Demand, names: frozenset[str]) -> Demand:
    return replace(d, busy=d.busy | names)
