"""Admission's synchronous core: decisions, grants, progress, releases, pauses ending and
the walks handing queued requests the room that appears (the queue's book:
:mod:`.admission_queue`; the async edge and the rules: :mod:`.admission`). No ``await``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from kvgateway.config.model import Policy
from kvgateway.core.admission_queue import (
    AdmissionQueue,
    Plan,
    Waiter,
    backfills,
    plan_of,
    with_busy,
)
from kvgateway.core.backends import Backend, PauseReason
from kvgateway.core.demand import Demand, flight_for, served_as, tokens_on
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.reservation import Ledger, LocalLedger, Reservation
from kvgateway.core.routing import (
    Decision,
    ModelIndex,
    Routed,
    RouteReason,
    RouterState,
    Wait,
    route,
    route_to,
)
from kvgateway.core.tenancy import Tenancy, Ticket

STEP_EWMA = 0.05  # weight of each new observation of a node's seconds per engine step
# Room made by progress is offered at most this often (a walk asks about every waiter).
REOFFER_S = 0.25


class AdmissionCore:
    """Owns every reservation; ``index_for(model)``: its backends now; ``clock``: s."""

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
        self._index_for = index_for
        self._prefix = prefix
        self._adjust = adjust
        self._policy = policy
        self._offload_overflow = offload_overflow
        self._queue_size = queue_size
        self._clock = clock
        self._on_decision = on_decision
        self._router = RouterState()
        self._queue = AdmissionQueue(
            index_for=index_for,
            offload_overflow=offload_overflow,
            clock=clock,
            changed=self._ledger.queue_changed,
            tenancy=tenancy,
            budget=budget,
            capacity=capacity or budget,
            slots=slots,
        )
        # Per backend: the flights that reported since its waiters were last offered room.
        self._reported: dict[str, set[int]] = {}
        self._reoffered: dict[str, float] = {}
        self._reopening: set[str] = set()  # tenants to reopen soon (Admission's edge)

    # ---- synchronous core -------------------------------------------------------

    def decide(self, demand: Demand, stale: bool = False) -> Decision:
        index = self._index_for(demand.model)
        now = self._clock()
        overflow = self._offload_overflow()
        decision = route(
            self._policy(), index, demand, self._router, now, offload_overflow=overflow, stale=stale
        )
        if self._prefix is not None and demand.prefix is not None:
            decision = self._prefix.refine(index, demand, decision, now)
        return decision

    def _grant(
        self, backend: Backend, demand: Demand, reason: RouteReason, ticket: Ticket | None = None
    ) -> Reservation:
        served = served_as(backend, demand) or demand  # as the node serves it, once
        r = (self._grant_projected if demand.projected else self._grant_whole)(
            backend, served, reason, ticket
        )
        if served is not demand:
            r.output_cut = served.output_tokens  # the node's context cuts max_tokens
        backend.unstarted += 1
        if ticket is not None and self._tenancy is not None:
            self._tenancy.granted(ticket, r.tokens, r.seqs, backend.name)
        self._ledger.granted(r)
        return r

    def _grant_whole(
        self, backend: Backend, demand: Demand, reason: RouteReason, ticket: Ticket | None
    ) -> Reservation:
        # Prefix-aware: blocks a ready in-flight request on the node holds are credited.
        holding = self._prefix.granted(backend, demand, self._clock()) if self._prefix else None
        tokens = tokens_on(backend, demand) - (holding.credited_tokens if holding else 0)
        r = Reservation(
            backend, tokens, demand.sequences, reason, self, ticket=ticket, holding=holding
        )
        self._adjust(backend, tokens, demand.sequences, 1)
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
        self._adjust(backend, backend.resync_projected(), demand.sequences, 1)
        return r

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
        elif self._queue.claimed(b.name):
            # Room also comes as flights near their ends: offered again once every started
            # flight reported since the last offer, at most once per REOFFER_S.
            seen = self._reported.setdefault(b.name, set())
            seen.add(f.id)
            last = self._reoffered.get(b.name)
            if len(seen) >= b.projection.started and (last is None or now - last >= REOFFER_S):
                seen.clear()
                self._reoffered[b.name] = now
                self._offer(b)

    def prefill_done(self, reservation: Reservation) -> None:
        h = reservation.holding
        if self._prefix is not None and h is not None and not reservation.released:
            self._prefix.prefill_done(h)

    def try_admit(self, demand: Demand, ticket: Ticket | None = None) -> Decision | Reservation:
        """Reserve now if the policy finds room that no waiter ahead of it claims."""
        if self._queue.gate(demand, ticket) is not None:
            return Wait()
        decision = self.decide(demand, stale=True)
        if isinstance(decision, Routed) and self._queue.claimed(decision.backend.name):
            claimed = self._queue.claimed_ahead(ticket)
            if decision.backend.name in claimed:
                first = decision
                decision = self.decide(with_busy(demand, claimed), stale=True)
                if not isinstance(decision, Routed):
                    filled = self._backfill(demand, first, claimed)
                    if filled is None:
                        return Wait()
                    decision = filled
        if isinstance(decision, Routed):
            return self._grant(decision.backend, demand, decision.reason, ticket)
        return decision

    # ---- backfill: what fits now without delaying the head's projected start ------

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
            head = self._queue.head_plan(b)
            if head is None or (head is not False and backfills(b, demand, head)):
                return routed
        return None

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
            self._adjust(b, b.resync_projected(), -reservation.seqs, -1)
        else:
            self._adjust(b, -(reservation.tokens + shared), -reservation.seqs, -1)
        if not b.in_flight:  # nothing left to report there (DNS names come and go)
            self._reported.pop(b.name, None)
            self._reoffered.pop(b.name, None)
        if reservation.ticket is not None and self._tenancy is not None:
            self._tenancy.released(reservation.ticket, reservation.tokens, reservation.seqs, b.name)
        self._offer(b)
        if reservation.ticket is not None:
            self.reopen(reservation.ticket.tenant)
        return True

    def reopen(self, tenant: str) -> None:
        """``tenant`` holds less (here, or on other replicas): its gated waiters ask again."""
        if self._tenancy is not None:
            for opened in self._queue.ungated(tenant):
                self._offer(opened)

    def release_after(self, r: Reservation, *, gone: bool) -> None:
        """Release ``r`` when the node has freed its blocks: at once, or after the
        backend's KV-connector delay, or (client gone) once the node's abort has landed."""
        delay = r.backend.config.release_delay_s
        if gone:
            delay = max(delay, self._abort_delay())
        if delay <= 0:
            self.release(r)
            return
        if not gone and r.flight is not None:  # ended: held as it is until moved out
            r.backend.projection.hold(r.flight.id)
            self._adjust(r.backend, r.backend.resync_projected(), 0, 0)
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
        if not self._queue:
            return
        now = self._clock()
        claimed, gone, held = frozenset[str](), set[Waiter](), set[tuple[str, str]]()
        for w in self._queue.ordered():
            if w.future.done():
                gone.add(w)
                self._queue.dequeued(w)
                continue
            self._queue.reclaim(w)
            if self._queue.regate_in_turn(w, held) is not None:
                continue
            d = with_busy(w.demand, claimed) if claimed else w.demand
            decision = self.decide(d)
            if isinstance(decision, Routed):
                gone.add(w)
                self._hand_over(w, decision, now)
            else:
                claimed |= w.claims
        for w in gone:
            self._queue.waiters.discard(w)

    def waiting_backends(self) -> set[str]:
        """The backends queued requests claim (as :meth:`waiting_for`)."""
        return set(self._queue.claimed_names())

    def waiting_for(self, name: str) -> bool:
        """Does a queued request claim backend ``name``? (A shared ledger tells the other
        replicas, so their new arrivals leave the room to it.)"""
        return self._queue.claimed(name)

    def offer(self, b: Backend) -> None:
        """Room may have appeared on ``b`` from outside (another replica released)."""
        self._offer(b)

    def _offer(self, b: Backend) -> None:
        """Only ``b`` gained room: walk its claimants in order, stopping at the first it
        cannot take (later ones may not pass it). Then the other claims of those who
        left: of a waiter found abandoned (its clean-up still to run), each once (a
        storm of cancellations costs one walk each); of one granted, those with room,
        which it held against those behind it (each grant adds its own: walks end)."""
        todo: dict[str, Backend] = {b.name: b}
        walked: set[str] = set()
        while todo:
            name = next(iter(todo))
            walked.add(name)
            pruned, granted = self._walk(todo.pop(name))
            for gone in pruned:
                for other in self._queue.claimed_by(gone):
                    if other.name not in walked:
                        todo.setdefault(other.name, other)
            for won in granted:
                for other in self._queue.claimed_by(won):
                    if other.name != name and other.free_seqs > 0 and other.free_tokens > 0:
                        todo.setdefault(other.name, other)

    def _walk(self, b: Backend) -> tuple[list[Waiter], list[Waiter]]:
        """One walk of :meth:`_offer`: the abandoned waiters it took out, those granted."""
        pruned, granted, held = list[Waiter](), list[Waiter](), set[tuple[str, str]]()
        if not self._queue.claimed(b.name):
            return pruned, granted
        now = self._clock()
        overflow = self._offload_overflow()
        head: Plan | None = None
        for w in self._queue.ordered():
            if w.future.done():
                if self._queue.waiters.discard(w):  # not taken out since the snapshot
                    self._queue.dequeued(w)
                    pruned.append(w)
                continue
            if b.name not in w.claims:
                continue
            if self._queue.regate_in_turn(w, held) is not None:
                continue
            routed = route_to(
                self._index_for(w.demand.model), b, w.demand, now, offload_overflow=overflow
            )
            if routed is not None and head is not None and not backfills(b, w.demand, head):
                continue  # fits now, but would delay the head: the next may not
            if routed is None:
                if head is not None:
                    continue
                # The head: later waiters may take what it cannot use before its start.
                plan = plan_of(b, w)
                if plan is None:
                    break
                head = plan
                continue
            self._queue.waiters.remove(w)
            self._hand_over(w, routed, now)
            granted.append(w)
        return pruned, granted

    def _hand_over(self, w: Waiter, decision: Routed, now: float) -> None:
        self._queue.dequeued(w)
        r = self._grant(decision.backend, w.demand, decision.reason, w.ticket)
        r.queued_s = now - w.since
        w.future.set_result(r)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)
