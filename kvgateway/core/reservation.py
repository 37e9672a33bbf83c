"""A reservation: KV tokens and sequence slots held on one backend, as an async context
manager released exactly once on every way out (see :class:`kvgateway.core.admission.
Admission`, which grants them)."""

from __future__ import annotations

import asyncio
import itertools
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
    # False only when a shared ledger refused it (see core/ledger.py): nothing to give
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
        self.owner.release_after(
            self, gone=exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        )


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
