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
from kvgateway.core.output_risk import OutputOutlook
from kvgateway.core.routing import RouteReason
from kvgateway.core.shared_blocks import Holding
from kvgateway.core.tenancy import Ticket


class Owner(Protocol):
    """What a reservation asks of the admission that granted it."""

    def release(self, reservation: Reservation) -> bool: ...

    def release_after(self, r: Reservation, *, gone: bool) -> None: ...

    def prefill_done(self, reservation: Reservation) -> None: ...

    def grow(self, reservation: Reservation, tokens: int) -> None: ...

    def progress(self, reservation: Reservation, generated: int) -> int: ...


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
    # ``tokens`` is what was granted (what a shared ledger and the tenant's share
    # recorded, and get back). The node's book may hold more: ``grown`` tokens taken
    # while a learned stream outgrew its reservation, kept in this process only.
    grown: int = 0
    # Pooled learned output: the request's output plan and its base (its prompt and
    # expected output, in blocks); its share of the node's margin is the node's.
    outlook: OutputOutlook | None = None
    base: int = 0

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
