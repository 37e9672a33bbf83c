"""Admission: reserve a request's KV tokens and sequence slots on a backend, or wait.

Shaped like httpcore's connection pool: state changes are plain synchronous methods
(:meth:`Admission.try_admit`, :meth:`Admission.release`, :meth:`Admission.rebalance`,
:meth:`Admission.end_pause`) and the only ``await`` is a waiter parked on a future.
Callers hold a reservation as an async context manager
(``async with admission.reserve(demand, timeout) as r:``), released on every way out. A waiter that is cancelled or
times out is removed in ``except BaseException``; if the cancellation raced with a
grant, the granted reservation is released there, so nothing leaks.

The wait queue is a bounded FIFO, fair per backend: a waiting request *claims* every
backend that could ever hold it (but one it excludes), and nobody who arrived later may
take capacity on a claimed backend. Whenever capacity may have appeared (a release, a
backend turning healthy, a reload) waiters are offered it in arrival order. Requests
that fit only on unclaimed backends still pass: a huge prompt waiting for a large node
does not hold up short chats on small nodes, and a stream of short chats cannot starve
it either.

With tenants (:mod:`kvgateway.core.tenancy`) "arrival order" becomes the tenancy order:
class first (with aging), then fair queuing on KV tokens within a class. A newcomer is
held back only by the claims of waiters ahead of it in that order; a waiter kept by its
tenant's own limit (``max_concurrent``, ``max_kv_share``, a class floor) claims nothing;
and when the queue is full a newcomer displaces the last waiter of a lower class, which
gets the 429. Everything tenant-specific is in the methods marked "tenancy".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Self

from kvgateway.config.model import GatewayConfig
from kvgateway.core.admission_core import AdmissionCore
from kvgateway.core.admission_queue import Waiter, tenant_key
from kvgateway.core.demand import (
    Demand,
    can_ever_hold,
    context_error,
    earliest_fit,
    flight_for,
    projected_budget,
)
from kvgateway.core.fleet import Fleet
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.reservation import Ledger, Reservation, Reserving
from kvgateway.core.routing import Decision, NoBackend, TooLong, Wait
from kvgateway.core.tenancy import (
    CLASS_FLOOR,
    Tenancy,
    Ticket,
    floors_error,
    gated_error,
    tenant_queue_full_error,
)
from kvgateway.errors import NoHealthyBackend, Saturated

__all__ = ["Admission", "Reservation", "Reserving"]


class Admission(AdmissionCore):
    """Owns every reservation: the synchronous core plus waiting for room."""

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

    # ---- async edge -------------------------------------------------------------

    def reserve(self, demand: Demand, timeout: float) -> Reserving:
        """The reservation for ``demand`` as an async context manager."""
        return Reserving(self, demand, timeout)

    async def admit(self, demand: Demand, timeout: float) -> Reservation:
        """Reserve room for ``demand``, waiting up to ``timeout`` seconds in the queue.

        Raises ContextLengthExceeded (never fits), NoHealthyBackend, or Saturated
        (queue full or timed out).
        """
        # Every grant goes through the ledger's confirm (the in-process ledger says yes at
        # once; a shared one records it, or lets it count locally in its fallback). A
        # refusal has refreshed the view (the backend now looks fuller), so deciding
        # again picks another backend or waits: in the place it had, with its arrival
        # time and fair-queuing tag (not behind everyone who came while it was out).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        since = self._clock()
        ticket = self._tenancy.ticket(demand.tenant, demand.tokens) if self._tenancy else None
        kept = self._tenancy.kept_on(ticket.klass) if self._tenancy and ticket else None
        if kept is not None:  # no copy of the demand where no floor concerns it
            demand = replace(demand, kept_slots=kept)
        try:
            while True:
                r = await self._admit_ticketed(
                    demand, deadline - loop.time(), ticket, since, stated=timeout
                )
                confirmed = ok = False
                try:
                    confirmed = await self._ledger.confirm(r)
                    ok = confirmed and await self._ledger.hold(r)
                finally:
                    if not ok:
                        r.counted = confirmed  # refused for its tenant: its room goes back
                        self.release(r)
                if ok:
                    return r
                if loop.time() >= deadline:
                    raise Saturated(
                        f"The shared ledger had no room for this request ({demand.tokens} KV "
                        f"tokens) within {timeout:g}s. Retry later.",
                        retry_after=max(1.0, timeout / 2),
                    )
        except BaseException:
            # Refused, timed out, displaced or cancelled: served nothing, so its place in
            # the fair-queuing order is given back (its tenant's next tag is not pushed
            # back by requests that never ran).
            if self._tenancy is not None and ticket is not None:
                self._tenancy.refund(ticket)
            raise

    async def _admit_ticketed(
        self,
        demand: Demand,
        timeout: float,
        ticket: Ticket | None,
        since: float,
        *,
        stated: float | None = None,
    ) -> Reservation:
        """One pass: reserve now, or wait up to ``timeout`` (what is left of the
        request's queue timeout, ``stated``, which the 429 states)."""
        stated = timeout if stated is None else stated
        outcome = self.try_admit(demand, ticket)
        if self._on_decision is not None and not isinstance(outcome, Reservation):
            self._on_decision(outcome, demand)
        if isinstance(outcome, Reservation):
            return outcome
        if isinstance(outcome, TooLong):
            raise context_error(demand, outcome.largest_context)
        if isinstance(outcome, NoBackend):
            raise NoHealthyBackend(
                f"No healthy backend for model '{demand.model}': {outcome.detail}.",
                retry_after=5,
            )
        assert isinstance(outcome, Wait)
        gated = self._queue.gate(demand, ticket)
        if gated == CLASS_FLOOR and self._queue.never_passes_floors(demand):
            raise floors_error(demand.tenant, demand.tokens)
        if gated is not None:
            # Held by its own tenant's limit: it waits in its tenant's share of the
            # queue (queue_size of them at most), never in the room others queue in.
            name = tenant_key(demand, ticket)
            parked = self._queue.parked(name)
            if timeout <= 0 or parked >= self._queue_size():
                raise tenant_queue_full_error(name, gated, parked)
        else:
            wait = self.projected_wait(demand)
            if wait is not None and wait > timeout and not self._cut_soon(demand):
                # Even the soonest room the projection sees comes after the deadline (full
                # queue or not: its Retry-After is that wait).
                raise Saturated(
                    f"No backend is projected to have room for this request "
                    f"({demand.tokens} KV tokens) within {stated:g}s (the soonest in "
                    f"{wait:.0f}s). Retry later.",
                    retry_after=max(1.0, wait),
                )
            full = self._queue.waiters.waiting_for_room() >= self._queue_size()
            # A waiter is displaced only for a newcomer that then waits.
            if timeout <= 0 or (full and not self._displace(ticket)):
                raise Saturated(
                    "Every backend that can hold this request is at its KV-cache budget "
                    "and the admission queue is full. Retry later.",
                    retry_after=1.0,  # refused at once: room may free any moment
                )
        loop = asyncio.get_running_loop()
        waiter = Waiter(demand, loop.create_future(), since, self._queue.claims_of(demand), ticket)
        waiter.gated = gated
        self._queue.enqueue(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter.future
        except BaseException as exc:
            self._abandon(waiter)
            if isinstance(exc, TimeoutError) and waiter.gated is not None:
                raise gated_error(demand.tenant, waiter.gated, stated) from None
            if isinstance(exc, TimeoutError):
                wait = self.projected_wait(demand)
                raise Saturated(
                    f"No backend had room for this request ({demand.tokens} KV tokens) "
                    f"within {stated:g}s. Retry later.",
                    retry_after=max(1.0, wait if wait is not None else stated / 2),
                ) from None
            raise

    def floor_waits(self) -> dict[tuple[str, str], float]:
        """Per class and model, how long the oldest request waiting behind the floors
        has waited (a shared ledger orders such waiters across replicas by it)."""
        return self._queue.floor_waits()

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
            proj, block, budget = b.projection, b.limits.block_size, projected_budget(b)
            start = earliest_fit(proj, block, flight_for(b, demand), budget, demand.z, stale=True)
            if start is None:
                continue
            wait = start * b.step_s
            best = wait if best is None else min(best, wait)
        return best

    def _cut_soon(self, demand: Demand) -> bool:
        """Room the projection cannot see yet: a live backend's context holds the
        prompt but not the whole output, and would serve it cut once the request's group
        has learned enough answers (the queue is offered again then)."""
        if not demand.cut_pending:
            return False
        return any(
            b.usable and demand.longest_prompt < b.context_limit < demand.longest_sequence
            for b in self._index_for(demand.model).backends
            if b.limits.known
        )

    def _reopen_soon(self, tenant: str) -> None:
        """Reopen ``tenant`` once the loop's current callbacks ran: waiters leaving
        together (a storm of cancellations) cost one walk of its parked waiters."""
        if not self._reopening:
            asyncio.get_running_loop().call_soon(self._reopen_pending)
        self._reopening.add(tenant)

    def _reopen_pending(self) -> None:
        tenants, self._reopening = self._reopening, set()
        for tenant in tenants:
            self.reopen(tenant)

    def _displace(self, ticket: Ticket | None) -> bool:
        """Queue full: refuse the last waiter of a class below ``ticket``'s, if any."""
        victim = self._queue.displace(ticket)
        if victim is None:
            return False
        self._offer_claims(victim)
        return True

    def _offer_claims(self, w: Waiter) -> None:
        """``w`` left the queue without a grant: offer the backends it claimed to the
        waiters behind it."""
        for b in self._queue.claimed_by(w):
            self._offer(b)

    def _abandon(self, waiter: Waiter) -> None:
        # The waiter gave up (timeout, cancellation, displaced). If a grant raced with
        # that, the caller never received the reservation: give it back here.
        if waiter.gated is None and self._tenancy is not None:
            self._reopen_soon(waiter.tenant)  # its tenant's parked waiters counted it
        try:
            self._queue.waiters.remove(waiter)
        except ValueError:
            pass  # already handed over (granted) or dropped by a rebalance
        else:
            self._queue.dequeued(waiter)
            # It held its claims against those behind it: the room it could not use may
            # fit them (nothing else would offer it until some release).
            self._offer_claims(waiter)
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())
        else:
            fut.cancel()
