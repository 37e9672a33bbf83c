"""The shared ledger as admission sees it: each grant confirmed in Redis with one atomic
check-and-reserve, releases queued for the next pipelined batch, credit kept a moment,
and the local-share fallback while Redis fails or is slow.

Modes: *shared* (every grant is confirmed in Redis; the others' holdings come back with
each answer, with every heartbeat and with every release published by another replica)
and *fallback* (Redis failed or was slow: nothing is sent; the others are taken to hold
all of each budget but what Redis records for this replica, while its lease may still be
live, then all but its share, ``budget // live replicas last seen``).

A finished request's room is kept a moment as credit (see :mod:`kvgateway.ledger.credit`),
given back when it idles, when another replica is refused there, at a sync, and at a stop.
What keeps the book in step with Redis (lease, syncs, the release batches, the listener)
is :class:`kvgateway.ledger.redis_ledger.RedisLedger`, built on this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from kvgateway.config.ledger import LedgerConfig
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.core.reservation import OthersView, Reservation
from kvgateway.ledger.calls import LedgerCalls
from kvgateway.ledger.connect import REDIS_FAILURES
from kvgateway.ledger.credit import Credit
from kvgateway.ledger.fallback import FallbackShare, RequestLives
from kvgateway.ledger.recorded import Recorded
from kvgateway.ledger.scripts import Keys
from kvgateway.ledger.snapshot import UnsentGrants
from kvgateway.ledger.tenant_holds import TenantHolds
from kvgateway.ledger.waiting import WaitMarks

log = logging.getLogger("kvgateway.ledger")


@dataclass(frozen=True, slots=True)
class LedgerStatus:
    kind: str  # "local" or "redis"
    shared: bool  # False: local accounting only, or the Redis fallback
    replica_id: str
    live_replicas: int
    reason: str  # why in fallback ("" when shared)
    fallbacks: int  # times the replica fell back since start


class SharedBook:
    """The ledger's state and what Admission calls on it (see the module)."""

    def __init__(
        self,
        cfg: LedgerConfig,
        replica_id: str,
        fleet: Fleet,
        client: Redis,
        *,
        on_status: Callable[[LedgerStatus], None] | None = None,
        on_credit: Callable[[], None] | None = None,
    ) -> None:
        self._cfg = cfg
        self._id = replica_id
        self._fleet = fleet
        self._keys = Keys(cfg.namespace)
        # Redis losing its data stalls grants this long: a heartbeat interval for every
        # replica to find it, and the calls to write its holdings again.
        stall_ms = int((cfg.lease_s / 4 + 4 * cfg.timeout_s) * 1000)
        self._calls = LedgerCalls(client, self._keys, replica_id, int(cfg.lease_s * 1000), stall_ms)
        self._view = OthersView(fleet.adjust)
        self._on_status = on_status
        self._on_credit = on_credit
        self._admission: Admission | None = None
        self._shared = False
        self._live = cfg.fallback_replicas
        self._reason = "not yet connected"
        self._fallbacks = 0
        self._mine = Recorded()  # for pub/sub arithmetic and the fallback caps
        self._pending: list[tuple[str, int, int]] = []
        self._flush = asyncio.Event()
        self._resync = False
        self._wake = asyncio.Event()  # a heartbeat is due now (a lapsed lease)

        def request_life() -> float:
            """How long a request may live: the nodes' longest total timeout."""
            return max((b.config.timeouts.total_s for b in fleet.backends), default=900.0)

        self._lives = RequestLives(request_life)

        self._share = FallbackShare(
            cfg.lease_s,
            fleet,
            self._view,
            self._mine,
            live=lambda: self._live,
            offer=self._offer,
            in_fallback=lambda: not self._shared,
            lives=self._lives,
        )
        self._stall_timer: asyncio.TimerHandle | None = None
        # Where Redis lists this replica as waiting; the queue changed since it was told.
        self._marks = WaitMarks()
        self._marks_due = False
        # Backends where another replica waits (a published refusal or wait mark, or the
        # last heartbeat's answer): no credit is kept or used there.
        self._contended: set[str] = set()
        # While an absolute sync is out (the end of a fallback, or a resync): grants wait
        # for its answer, and releases in fallback are held back (the snapshot it sends
        # may or may not include them). The sync itself waits for confirms in flight, so
        # each grant is either in its snapshot or added after it, never both.
        self._sync_done: asyncio.Event | None = None
        self._confirming = 0
        self._no_confirms = asyncio.Event()
        self._no_confirms.set()
        self._held_back: list[tuple[str, int, int]] = []
        # Grants not recorded in Redis by their own confirm yet (see ledger.snapshot).
        self._unsent = UnsentGrants()
        # Releases and absolute syncs must not overlap (a batch in flight during a sync
        # would be subtracted from holdings that already exclude it).
        self._io = asyncio.Lock()
        # Set when the block of `running` ends: the loops stop even if a Redis call
        # swallowed their cancellation (the client turns some into connection errors).
        self._closing = False
        # Room recorded in Redis as ours that no request holds (part of `_mine`).
        self._credit = Credit(cfg.credit_hold_s, self._give_back, cfg.credit_max_requests)
        self._holds = TenantHolds(
            client,
            cfg.namespace,
            replica_id,
            cfg.timeout_s,
            shared=self.in_shared_mode,
            live=lambda: self._live,
            lease_left=self._share.lease_left,
            budget=lambda: sum(b.budget_tokens for b in fleet.backends if b.usable),
            slots=lambda: sum(b.max_num_seqs for b in fleet.backends if b.usable),
            models=lambda: sorted({b.model for b in fleet.backends}),
            lives=self._lives,
        )

    # ---- what Admission calls ---------------------------------------------------

    @property
    def shared(self) -> bool:
        return self._shared or self._sync_done is not None

    def granted(self, reservation: Reservation) -> None:
        self._unsent.add(reservation)
        self._lives.born(reservation.id, asyncio.get_running_loop().time())

    async def confirm(self, reservation: Reservation) -> bool:
        confirmed = False
        try:
            confirmed = await self._confirm(reservation)
            return confirmed
        finally:
            if not confirmed:  # released uncounted: never released here
                self._lives.forget(reservation.id)
            # Recorded by now (its reserve, or credit already recorded as ours), refused
            # or failed (released uncounted), or local in the fallback (the next sync's
            # snapshot holds it): no longer to be left out of a snapshot.
            self._unsent.sent(reservation)

    async def _confirm(self, reservation: Reservation) -> bool:
        b = reservation.backend
        if self._sync_done is not None:
            with contextlib.suppress(TimeoutError):
                # Longer than a sync can take (its wait for confirms, then its call).
                async with asyncio.timeout(self._cfg.timeout_s * 5):
                    await self._sync_done.wait()
        if not self._shared:
            return True  # in the fallback: the local share already limited it
        take_t = take_s = 0
        if self._sync_done is None and b.name not in self._contended:
            # What credit there is counts towards it; Redis is asked for the rest, if any.
            # (Not where another replica waits: Redis decides, fairly, who goes first.)
            take_t, take_s = self._credit.take(b.name, reservation.tokens, reservation.seqs)
            if (take_t, take_s) == (reservation.tokens, reservation.seqs):
                if self._on_credit is not None:
                    self._on_credit()
                return True
        self._confirming += 1
        self._no_confirms.clear()
        still_waiting = self._waiting_for(b.name)
        try:
            async with asyncio.timeout(self._cfg.timeout_s):
                got = await self._calls.reserve(
                    b,
                    reservation.tokens - take_t,
                    reservation.seqs - take_s,
                    # A class within its floor is not held off by others' waiters.
                    queued=reservation.queued_s > 0 or self._holds.within_floor(reservation),
                    still_waiting=still_waiting,
                )
        except asyncio.CancelledError:
            # Redis may have recorded it: the next heartbeat rewrites our holdings.
            self._resync = True
            raise
        except REDIS_FAILURES as exc:
            if isinstance(exc, TimeoutError):
                self._share.renewed()  # Redis may have run it: the lease may have been renewed
            self._fall_back(f"reserve failed: {exc!r}")
            return False
        finally:
            self._confirming -= 1
            if self._confirming == 0:
                self._no_confirms.set()
        granted, others_t, others_s, live, lapsed, stall = got
        self._live = live
        self._share.renewed()
        if lapsed:
            self._lapsed()
        if stall:
            self._after_stall(stall)
        if not self.in_shared_mode():  # fell back while the call was out: decide again
            return False
        self._marks.confirmed(b.name, refused=not granted, still_waiting=still_waiting)
        # The queue may have changed while the call was out (or the refused request
        # queues again, or goes elsewhere): check the marks against it once more.
        self.queue_changed()
        if granted:
            self._mine.add(b.name, reservation.tokens - take_t, reservation.seqs - take_s)
        else:
            # Refused: the backend is contended here; what credit there was goes back.
            if take_t or take_s:
                self._give_back(b.name, take_t, take_s)
            self._credit.drop(b.name)
        self._set_others(b, others_t, others_s)
        return bool(granted)

    async def hold(self, reservation: Reservation) -> bool:
        return await self._holds.hold(reservation)

    def release(self, reservation: Reservation, shared: int = 0) -> None:
        self._lives.ended(reservation.id, asyncio.get_running_loop().time())
        self._holds.released(reservation)
        name = reservation.backend.name
        if self._unsent.sent(reservation):
            # Released before its confirm ran: never recorded, in no snapshot. A last
            # shared copy it took over was recorded (by the request that paid for it);
            # a copy it paid for that stays charged to others was not, and is now.
            self.release_shared(reservation.backend, shared)
            return
        self._return((name, max(0, reservation.tokens + shared), reservation.seqs))

    def release_shared(self, backend: Backend, tokens: int) -> None:
        if tokens > 0:
            self._return((backend.name, tokens, 0))
        elif tokens < 0:
            # Its holders give it back when they end: record it (an increment), or every
            # such copy would leave Redis undercounting this replica for good.
            if self._shared:
                self._give_back(backend.name, tokens, 0)
            elif self._sync_done is not None:
                self._held_back.append((backend.name, tokens, 0))

    def _return(self, item: tuple[str, int, int]) -> None:
        """Give ``item`` (backend, tokens, seqs) back: held back while a sync is out in
        the fallback, kept as credit, or sent with the next release batch."""
        if not self._shared:
            if self._sync_done is not None:
                self._held_back.append(item)
            return  # in fallback: the sync that ends it writes absolute holdings
        if self._credit.enabled and self._sync_done is None and item[0] not in self._contended:
            self._credit.keep(*item)
            return
        self._give_back(*item)

    def queue_changed(self) -> None:
        """Tell Redis, with the next release batch, where this replica now starts or
        stops waiting (see :mod:`kvgateway.ledger.waiting`): not at the next heartbeat,
        up to lease_s / 4 later, while a stale entry holds the others' new requests off a
        free backend, or a missing one lets another replica's credit starve this queue."""
        self._marks_due = True
        self._flush.set()

    @property
    def credit_grants(self) -> int:
        """Admissions confirmed from credit, without a Redis round trip."""
        return self._credit.grants

    def _give_back(self, name: str, tokens: int, seqs: int) -> None:
        self._mine.give_back([(name, tokens, seqs)])
        self._pending.append((name, tokens, seqs))
        self._flush.set()

    # ---- state ------------------------------------------------------------------

    def in_shared_mode(self) -> bool:
        """Confirming in Redis now (not in fallback); may change across any await."""
        return self._shared

    def status(self) -> LedgerStatus:
        return LedgerStatus(
            kind="redis",
            shared=self._shared,
            replica_id=self._id,
            live_replicas=self._live,
            reason="" if self._shared else self._reason,
            fallbacks=self._fallbacks,
        )

    def others_tokens(self, b: Backend) -> int:
        """KV tokens the other replicas hold on ``b``, as folded into its counters."""
        return self._view.others(b).tokens

    def _waiting_for(self, name: str) -> bool:
        return self._admission is not None and self._admission.waiting_for(name)

    def _notify(self) -> None:
        if self._on_status is not None:
            self._on_status(self.status())

    def _offer(self, b: Backend) -> None:
        if self._admission is not None:
            self._admission.offer(b)

    def _set_others(self, b: Backend, tokens: int, seqs: int) -> None:
        if self._view.set(b, tokens, seqs):
            self._offer(b)

    def _fall_back(self, reason: str) -> None:
        if not self._shared:
            return
        self._shared = False
        self._reason = reason
        self._fallbacks += 1
        self._pending.clear()
        self._credit.forget()  # the sync that ends the fallback writes what is in use
        self._share.began()
        log.warning(
            "shared ledger unavailable (%s): this replica keeps within what Redis records "
            "for it for %.1f s (its lease), then 1/%d of each backend's budget (less while "
            "what the others held may still run), until Redis answers again",
            reason,
            max(0.0, self._share.lease_left()),
            self._live,
        )
        self._share.apply()
        self._notify()
        # One slow answer (a busy event loop, a Redis hiccup) is often all it was: try to
        # return soon, not a heartbeat interval later; then every interval while it fails.
        asyncio.get_running_loop().call_later(self._cfg.timeout_s, self._wake.set)

    def _after_stall(self, left_ms: int) -> None:
        """Redis stalls grants (it lost its data: holdings are missing there until every
        replica has written its own again) for ``left_ms`` more: a heartbeat then brings
        the others' holdings as rewritten, and with them room for the requests queued
        meanwhile."""
        if self._stall_timer is None:
            loop = asyncio.get_running_loop()
            self._stall_timer = loop.call_later(left_ms / 1000 + 0.01, self._stall_over)

    def _stall_over(self) -> None:
        self._stall_timer = None
        self._wake.set()

    def _lapsed(self) -> None:
        """Redis had let this replica's lease lapse (the process was frozen, or cut off
        longer than the lease): the others may have deleted its holdings while its
        requests still run. Write them again now, as absolute values."""
        if not self._resync:
            log.warning("ledger lease had lapsed: writing this replica's holdings again")
        self._resync = True
        self._wake.set()
