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
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType

from kvgateway.config.model import GatewayConfig, Policy
from kvgateway.core.backends import Backend, PauseReason
from kvgateway.core.demand import Demand, can_ever_hold, tokens_on
from kvgateway.core.fleet import Fleet
from kvgateway.core.ledger import Ledger, LocalLedger
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.routing import (
    Decision,
    NoBackend,
    Routed,
    RouteReason,
    RouterState,
    TooLong,
    Wait,
    route,
    route_to,
)
from kvgateway.core.routing_index import ModelIndex
from kvgateway.core.shared_blocks import Holding
from kvgateway.core.tenancy import (
    Tenancy,
    Ticket,
    claims_ahead,
    displaceable,
    displaced_error,
    gated_error,
    serve_order,
)
from kvgateway.errors import ContextLengthExceeded, NoHealthyBackend, Saturated

_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Reservation:
    """Tokens and slots held on one backend; freed exactly once by :meth:`release`."""

    backend: Backend
    tokens: int
    seqs: int
    reason: RouteReason
    owner: Admission
    queued_s: float = 0.0
    released: bool = False
    ticket: Ticket | None = None
    # False only when a shared ledger refused it (see core/ledger.py): nothing to give
    # back there. Otherwise its release is reported to the ledger.
    counted: bool = True
    id: int = field(default_factory=lambda: next(_ids))
    # Prefix-aware placement: this request's share of its node's prompt blocks.
    holding: Holding | None = None

    def release(self) -> bool:
        """Give the tokens and slot back; only the first call has an effect."""
        return self.owner.release(self)

    def prefill_done(self) -> None:
        """The node has streamed the first token: the prompt's blocks are cached."""
        self.owner.prefill_done(self)

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.owner.release_after(
            self, gone=exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        )


class Reserving:
    """``async with admission.reserve(demand, timeout) as r``: admitted on entry (waiting
    in the queue if need be), released on exit whatever the way out."""

    __slots__ = ("_admission", "_demand", "_reservation", "_timeout")

    def __init__(self, admission: Admission, demand: Demand, timeout: float) -> None:
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


@dataclass(eq=False, slots=True)
class _Waiter:
    demand: Demand
    future: asyncio.Future[Reservation]
    since: float
    claims: frozenset[str]
    ticket: Ticket | None = None
    # The tenant limit this waiter last waited for (it claims nothing meanwhile).
    gated: str | None = None


class Admission:
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
    ) -> None:
        self._ledger: Ledger = ledger if ledger is not None else LocalLedger()
        self._abort_delay = abort_delay
        self._tenancy = tenancy
        self._budget = budget
        self._index_for = index_for
        self._prefix = prefix
        self._adjust = adjust
        self._policy = policy
        self._offload_overflow = offload_overflow
        self._queue_size = queue_size
        self._clock = clock
        self._on_decision = on_decision
        self._router = RouterState()
        self._waiters: deque[_Waiter] = deque()
        # How many waiters claim each backend: "is it claimed?" without walking the queue.
        self._claim_counts: Counter[str] = Counter()

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
    ) -> Admission:
        """Admission over ``fleet``, following the live config (it changes on reload)."""
        return cls(
            tenancy=tenancy or Tenancy(lambda: config().auth),
            budget=lambda: sum(b.budget_tokens for b in fleet.backends if b.usable),
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
        # Prefix-aware: blocks a ready in-flight request on the node holds are credited.
        holding = self._prefix.granted(backend, demand, self._clock()) if self._prefix else None
        tokens = tokens_on(backend, demand) - (holding.credited_tokens if holding else 0)
        self._adjust(backend, tokens, demand.sequences, 1)
        if ticket is not None and self._tenancy is not None:
            self._tenancy.granted(ticket, tokens)
        return Reservation(
            backend, tokens, demand.sequences, reason, self, ticket=ticket, holding=holding
        )

    def grow(self, reservation: Reservation, tokens: int) -> None:
        """A running request outgrew its reservation (learned output): charge it now,
        even past the budget; the node takes no new work until enough ends."""
        if reservation.released or tokens <= 0:
            return
        self._adjust(reservation.backend, tokens, 0, 0)
        reservation.tokens += tokens

    def prefill_done(self, reservation: Reservation) -> None:
        h = reservation.holding
        if self._prefix is not None and h is not None and not reservation.released:
            self._prefix.prefill_done(h)

    def try_admit(self, demand: Demand, ticket: Ticket | None = None) -> Decision | Reservation:
        """Reserve now if the policy finds room that no waiter ahead of it claims."""
        if self._gate(demand) is not None:
            return Wait()
        decision = self.decide(demand)
        if isinstance(decision, Routed) and self._claim_counts[decision.backend.name] > 0:
            claimed = self._claimed_ahead(ticket)
            if decision.backend.name in claimed:
                decision = self.decide(_with_busy(demand, claimed))
                if not isinstance(decision, Routed):
                    return Wait()
        if isinstance(decision, Routed):
            return self._grant(decision.backend, demand, decision.reason, ticket)
        return decision

    # ---- tenancy: order, gates, displacement ------------------------------------

    def _gate(self, demand: Demand) -> str | None:
        if self._tenancy is None:
            return None
        return self._tenancy.gate(demand.tenant, demand.tokens, self._budget())

    def _ordered(self) -> list[_Waiter]:
        """The waiters in the order they are served (arrival order without tenancy)."""
        if self._tenancy is None:
            return list(self._waiters)
        return serve_order(self._waiters, self._clock(), self._tenancy.auth.aging_s)

    def _claimed_ahead(self, ticket: Ticket | None) -> frozenset[str]:
        """Backends claimed by waiters served before a newcomer holding ``ticket``."""
        if ticket is None or self._tenancy is None:
            return frozenset(n for n, c in self._claim_counts.items() if c > 0)
        live = (w for w in self._waiters if not w.future.done())
        return frozenset(claims_ahead(live, ticket, self._clock(), self._tenancy.auth.aging_s))

    def _displace(self, ticket: Ticket | None) -> bool:
        """Queue full: refuse the last waiter of a class below ``ticket``'s, if any."""
        if ticket is None or self._tenancy is None:
            return False
        victim = displaceable(self._waiters, ticket, self._clock(), self._tenancy.auth.aging_s)
        if victim is None:
            return False
        self._waiters.remove(victim)
        self._dequeued(victim)
        if not victim.future.done():
            victim.future.set_exception(displaced_error())
        return True

    def _claims(self, demand: Demand) -> frozenset[str]:
        """The backends routing could give this request: those that can hold it, minus
        the offload tier when a GPU tier can hold it (unless overflow is on)."""
        could = [b for b in self._index_for(demand.model).backends if can_ever_hold(b, demand)]
        if any(not b.offload for b in could) and not self._offload_overflow():
            could = [b for b in could if not b.offload]
        return frozenset(b.name for b in could)

    def _enqueue(self, w: _Waiter) -> None:
        self._waiters.append(w)
        self._claim_counts.update(w.claims)

    def _dequeued(self, w: _Waiter) -> None:
        self._claim_counts.subtract(w.claims)

    def release(self, reservation: Reservation) -> bool:
        """Return a reservation's tokens and slot; only the first call has an effect."""
        if reservation.released:
            return False
        reservation.released = True
        if reservation.counted:
            self._ledger.release(reservation)
        tokens = reservation.tokens
        if reservation.holding is not None and self._prefix is not None:
            tokens += self._prefix.released(reservation.holding)  # shared blocks settled
        self._adjust(reservation.backend, -tokens, -reservation.seqs, -1)
        if reservation.ticket is not None and self._tenancy is not None:
            # A tenant limit may open too: _offer asks each waiter's gate again.
            self._tenancy.released(reservation.ticket, reservation.tokens)
        self._offer(reservation.backend)
        return True

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
            w.gated = self._gate(w.demand)
            if w.gated is not None:
                continue
            d = _with_busy(w.demand, claimed) if claimed else w.demand
            decision = self.decide(d)
            if isinstance(decision, Routed):
                gone.add(w)
                self._hand_over(w, decision, now)
            else:
                claimed |= w.claims
        if gone:
            self._waiters = deque(w for w in self._waiters if w not in gone)

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
        changed, so nobody else is asked."""
        if self._claim_counts[b.name] <= 0:
            return
        now = self._clock()
        overflow = self._offload_overflow()
        for w in self._ordered():
            if w.future.done() or b.name not in w.claims:
                continue
            w.gated = self._gate(w.demand)
            if w.gated is not None:
                continue
            routed = route_to(
                self._index_for(w.demand.model), b, w.demand, now, offload_overflow=overflow
            )
            if routed is None:
                return
            self._waiters.remove(w)
            self._hand_over(w, routed, now)

    def _hand_over(self, w: _Waiter, decision: Routed, now: float) -> None:
        self._dequeued(w)
        r = self._grant(decision.backend, w.demand, decision.reason, w.ticket)
        r.queued_s = now - w.since
        w.future.set_result(r)

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    # ---- async edge -------------------------------------------------------------

    def reserve(self, demand: Demand, timeout: float) -> Reserving:
        """The reservation for ``demand`` as an async context manager."""
        return Reserving(self, demand, timeout)

    async def admit(self, demand: Demand, timeout: float) -> Reservation:
        """Reserve room for ``demand``, waiting up to ``timeout`` seconds in the queue.

        Raises ContextLengthExceeded (never fits), NoHealthyBackend, or Saturated
        (queue full or timed out).
        """
        if not self._ledger.shared:
            return await self._admit_local(demand, timeout)
        # Shared ledger: the local grant must be confirmed; a refusal has refreshed the
        # view (the backend now looks fuller), so deciding again picks another or waits.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            r = await self._admit_local(demand, deadline - loop.time())
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

    async def _admit_local(self, demand: Demand, timeout: float) -> Reservation:
        ticket = self._tenancy.ticket(demand.tenant, demand.tokens) if self._tenancy else None
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
        full = len(self._waiters) >= self._queue_size()
        if timeout <= 0 or (full and not self._displace(ticket)):
            raise Saturated(
                "Every backend that can hold this request is at its KV-cache budget and "
                "the admission queue is full. Retry later.",
                retry_after=max(1.0, timeout),
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(demand, loop.create_future(), self._clock(), self._claims(demand), ticket)
        waiter.gated = self._gate(demand)
        self._enqueue(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter.future
        except BaseException as exc:
            self._abandon(waiter)
            if isinstance(exc, TimeoutError) and waiter.gated is not None:
                raise gated_error(demand.tenant, waiter.gated, timeout) from None
            if isinstance(exc, TimeoutError):
                raise Saturated(
                    f"No backend had room for this request ({demand.tokens} KV tokens) "
                    f"within {timeout:g}s. Retry later.",
                    retry_after=max(1.0, timeout / 2),
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
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())
        else:
            fut.cancel()


def _with_busy(d: Demand, names: frozenset[str]) -> Demand:
    return replace(d, busy=d.busy | names)


def context_error(demand: Demand, largest: int) -> ContextLengthExceeded:
    # OpenAI's and vLLM's wording first: clients (LiteLLM's ContextWindowExceededError,
    # fallbacks to larger models) recognise a context-length error by it.
    return ContextLengthExceeded(
        f"This model's maximum context length is {largest} tokens. However, you requested "
        f"{demand.longest_sequence} tokens ({demand.longest_prompt} in the messages, "
        f"{demand.output_tokens} in the completion). Please reduce the length of the "
        f"messages or completion. (The largest context any backend for model "
        f"'{demand.model}' offers is {largest} tokens.)",
        param="messages",
    )
