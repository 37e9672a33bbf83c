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
        abort_delay: Callable[[], float] = lambda: 0.0,
        prefix: PrefixRouter | None = None,
    ) -> None:
        self._abort_delay = abort_delay
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
        prefix: PrefixRouter | None = None,
    ) -> Admission:
        """Admission over ``fleet``, following the live config (it changes on reload)."""
        return cls(
            index_for=fleet.index,
            adjust=fleet.adjust,
            policy=lambda: config().routing.policy,
            offload_overflow=lambda: config().routing.offload_overflow,
            queue_size=lambda: config().admission.queue_size,
            clock=clock,
            on_decision=on_decision,
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

    def _grant(self, backend: Backend, demand: Demand, reason: RouteReason) -> Reservation:
        # Prefix-aware: blocks a ready in-flight request on the node holds are credited.
        holding = self._prefix.granted(backend, demand, self._clock()) if self._prefix else None
        tokens = tokens_on(backend, demand) - (holding.credited_tokens if holding else 0)
        self._adjust(backend, tokens, demand.sequences, 1)
        return Reservation(backend, tokens, demand.sequences, reason, self, holding=holding)

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

    def try_admit(self, demand: Demand) -> Decision | Reservation:
        """Reserve now if the policy finds room that no earlier waiter claims."""
        decision = self.decide(demand)
        if isinstance(decision, Routed) and self._claim_counts[decision.backend.name] > 0:
            claimed = frozenset(n for n, c in self._claim_counts.items() if c > 0)
            decision = self.decide(_with_busy(demand, claimed))
            if not isinstance(decision, Routed):
                return Wait()
        if isinstance(decision, Routed):
            return self._grant(decision.backend, demand, decision.reason)
        return decision

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
        tokens = reservation.tokens
        if reservation.holding is not None and self._prefix is not None:
            tokens += self._prefix.released(reservation.holding)  # shared blocks settled
        self._adjust(reservation.backend, -tokens, -reservation.seqs, -1)
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
        """Offer every backend's capacity to the waiters in FIFO order; after changes that
        may touch any backend (health, load feedback, reload)."""
        if not self._waiters:
            return
        now = self._clock()
        kept: deque[_Waiter] = deque()
        claimed: frozenset[str] = frozenset()
        while self._waiters:
            w = self._waiters.popleft()
            if w.future.done():
                self._dequeued(w)
                continue
            d = _with_busy(w.demand, claimed) if claimed else w.demand
            decision = self.decide(d)
            if isinstance(decision, Routed):
                self._hand_over(w, decision, now)
            else:
                kept.append(w)
                claimed |= w.claims
        self._waiters = kept

    def _offer(self, b: Backend) -> None:
        """Only ``b`` gained room: walk the waiters that claim it, in order, and stop at
        the first one it cannot take (later ones may not pass it). Nobody else's options
        changed, so nobody else is asked."""
        if self._claim_counts[b.name] <= 0:
            return
        now = self._clock()
        overflow = self._offload_overflow()
        for w in list(self._waiters):
            if w.future.done() or b.name not in w.claims:
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
        r = self._grant(decision.backend, w.demand, decision.reason)
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
        outcome = self.try_admit(demand)
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
        if len(self._waiters) >= self._queue_size() or timeout <= 0:
            raise Saturated(
                "Every backend that can hold this request is at its KV-cache budget and "
                "the admission queue is full. Retry later.",
                retry_after=max(1.0, timeout),
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(demand, loop.create_future(), self._clock(), self._claims(demand))
        self._enqueue(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter.future
        except BaseException as exc:
            self._abandon(waiter)
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
        if fut.done() and not fut.cancelled():
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
