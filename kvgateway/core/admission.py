"""Admission: reserve a request's KV tokens and sequence slots on a backend, or wait.

Shaped like httpcore's connection pool: state changes are plain synchronous methods
(:meth:`Admission.try_admit`, :meth:`Admission.release`, :meth:`Admission.rebalance`,
:meth:`Admission.end_pause`) and the only ``await`` is a waiter parked on a future.
Callers hold a reservation as an async context manager
(``async with admission.reserve(demand, timeout) as r:``), released on every way out. A waiter that is cancelled or
times out is removed in ``except BaseException``; if the cancellation raced with a
grant, the granted reservation is released there, so nothing leaks.

The wait queue is a bounded FIFO, fair per backend: a waiting request *claims* every
backend that could ever hold it, and nobody who arrived later may take capacity on a
claimed backend. Whenever capacity may have appeared (a release, a backend turning
healthy, a reload) waiters are offered it in arrival order. Requests that fit only on
unclaimed backends still pass: a huge prompt waiting for a large node does not hold up
short chats on small nodes, and a stream of short chats cannot starve it either.

With tenants (:mod:`kvgateway.core.tenancy`) "arrival order" becomes the tenancy order:
class first (with aging), then fair queuing on KV tokens within a class. A newcomer is
held back only by the claims of waiters ahead of it in that order; a waiter kept by its
tenant's own limit (``max_concurrent``, ``max_kv_share``, a class floor) claims nothing;
and when the queue is full a newcomer displaces the last waiter of a lower class, which
gets the 429. Everything tenant-specific is in the methods marked "tenancy".
"""

from __future__ import annotations

import asyncio

from kvgateway.core.admission_core import AdmissionCore, _Waiter
from kvgateway.core.demand import Demand, context_error
from kvgateway.core.reservation import Reservation, Reserving
from kvgateway.core.routing import NoBackend, TooLong, Wait
from kvgateway.core.tenancy import (
    CLASS_FLOOR,
    Ticket,
    floors_error,
    gated_error,
    tenant_queue_full_error,
)
from kvgateway.errors import NoHealthyBackend, Saturated

__all__ = ["Admission", "Reservation", "Reserving"]


class Admission(AdmissionCore):
    """Owns every reservation: the synchronous core plus waiting for room."""

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
        try:
            while True:
                r = await self._admit_ticketed(
                    demand, deadline - loop.time(), ticket, since, stated=timeout
                )
                ok = False
                try:
                    ok = await self._ledger.confirm(r)
                finally:
                    if not ok:
                        r.counted = False
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
                self._tenancy.refund(ticket, demand.tokens)
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
        gated = self._gate(demand, ticket)
        if gated == CLASS_FLOOR and self._never_passes_floors(demand):
            raise floors_error(demand.tenant, demand.tokens)
        if gated is not None:
            # Held by its own tenant's limit: it waits in its tenant's share of the
            # queue (queue_size of them at most), never in the room others queue in.
            name = ticket.tenant if ticket is not None else demand.tenant
            parked = self._waiters.parked_of(name, _tenant_of)
            if timeout <= 0 or parked >= self._queue_size():
                raise tenant_queue_full_error(name, gated, parked)
        else:
            full = self._waiters.waiting_for_room() >= self._queue_size()
            if timeout <= 0 or (full and not self._displace(ticket)):
                raise Saturated(
                    "Every backend that can hold this request is at its KV-cache budget "
                    "and the admission queue is full. Retry later.",
                    retry_after=1.0,  # refused at once: room may free any moment
                )
            wait = self.projected_wait(demand)
            if wait is not None and wait > timeout:
                # Even the soonest room the projection sees comes after the deadline.
                raise Saturated(
                    f"No backend is projected to have room for this request "
                    f"({demand.tokens} KV tokens) within {stated:g}s (the soonest in "
                    f"{wait:.0f}s). Retry later.",
                    retry_after=max(1.0, wait),
                )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(demand, loop.create_future(), since, self._claims(demand), ticket)
        waiter.gated = gated
        self._enqueue(waiter)
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

    def _abandon(self, waiter: _Waiter) -> None:
        # The waiter gave up (timeout, cancellation). If a grant raced with that, the
        # caller never received the reservation: give it back here.
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass  # already handed over (granted) or dropped by a rebalance
        else:
            self._dequeued(waiter)
            # It held its claims against those behind it: the room it could not use may
            # fit them (nothing else would offer it until some release).
            self._offer_claims(waiter)
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())
        else:
            fut.cancel()


def _tenant_of(w: _Waiter) -> str:
    """The name a waiter's ticket resolved (a tenant gone from the config on reload is
    the default), else the one it asked as."""
    return w.ticket.tenant if w.ticket is not None else w.demand.tenant
