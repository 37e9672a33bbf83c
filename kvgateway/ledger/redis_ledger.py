"""The shared ledger on Redis: :class:`~kvgateway.ledger.shared_book.SharedBook` kept in
step with Redis by three tasks, owned by :meth:`RedisLedger.running`: the heartbeat
(lease, view refresh, recovery), the release flusher (one pipeline per batch) and the
pub/sub listener. Back from fallback, the heartbeat writes this replica's holdings as
absolute values, so what was admitted meanwhile is counted once, and the replica is
shared again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kvgateway.core.admission import Admission
from kvgateway.core.reservation import Amount
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.calls import release_totals
from kvgateway.ledger.connect import REDIS_FAILURES
from kvgateway.ledger.scripts import Refused, parse_message
from kvgateway.ledger.shared_book import SharedBook
from kvgateway.ledger.snapshot import settled_holding
from kvgateway.tasks import stop_tasks

log = logging.getLogger("kvgateway.ledger")


class RedisLedger(SharedBook):
    """The shared ledger and the tasks that keep it in step with Redis."""

    @contextlib.asynccontextmanager
    async def running(
        self, admission: Admission, tenancy: Tenancy | None = None
    ) -> AsyncIterator[None]:
        """Join the ledger (or start in fallback if Redis is not there) and keep the
        lease, the view, the listener and ``tenancy``'s holdings going until the block
        ends."""
        self._admission = admission
        self._share.apply()  # blind until the first sync answers
        await self._heartbeat_once()
        if not self._shared:
            # Said as a fall back is said (log, /ready, the fallback gauge): an alert on
            # the gauge must fire for a replica that never reached Redis too.
            log.warning(
                "shared ledger unreachable at start (%s): this replica keeps within 1/%d "
                "of each backend's budget until Redis answers",
                self._reason,
                self._live,
            )
            self._fallbacks += 1
            self._notify()
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="ledger-heartbeat"),
            asyncio.create_task(self._flush_loop(), name="ledger-release"),
            asyncio.create_task(self._listen_loop(), name="ledger-listen"),
        ]
        try:
            if tenancy is None:
                yield
            else:
                async with self._holds.running(tenancy, admission.reopen, admission.floor_waits):
                    yield
        finally:
            self._closing = True
            await stop_tasks(tasks, self._cfg.timeout_s * 4 + 1.0, "ledger loops", log)
            await self._leave()
            await self._calls.close()

    async def _leave(self) -> None:
        """A clean stop: give back what is still recorded and drop the lease now."""
        if not self._shared:
            return
        self._credit.drop_all()
        with contextlib.suppress(*REDIS_FAILURES):
            async with asyncio.timeout(self._cfg.timeout_s * 4):
                await self._calls.release(release_totals(self._pending))
                await self._calls.leave()

    def _interval(self) -> float:
        return self._cfg.lease_s / 4

    async def _heartbeat_loop(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval()):
                    await self._wake.wait()
            self._wake.clear()
            await self._heartbeat_once()

    async def _heartbeat_once(self) -> None:
        if self._shared and not self._resync:
            await self._heartbeat(absolute=False)
            return
        if not self._shared and not await self._reachable():
            return  # no sync attempted: grants are not held up waiting for one
        async with self._io:
            self._sync_done = asyncio.Event()
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._cfg.timeout_s * 2):
                        await self._no_confirms.wait()
                await self._heartbeat(absolute=True)
            finally:
                done, self._sync_done = self._sync_done, None
                held, self._held_back = self._held_back, []
                done.set()
            if self.in_shared_mode() and held:
                self._mine.give_back(held)
                self._pending.extend(held)
                self._flush.set()

    async def _heartbeat(self, *, absolute: bool) -> None:
        backends = list(self._fleet.active)
        names = [b.name for b in backends]
        own: list[Amount] = []
        if absolute:
            # Every name this replica may hold room under: draining backends (removed,
            # or replaced by a reload) included, and names it had recorded before.
            rest = {b.name for b in self._fleet.backends} | self._mine.names()
            rest |= {item[0] for item in (*self._pending, *self._held_back)}
            names += sorted(rest - set(names))
            own = [self._own_settled(n) for n in names]
            # From here on the holdings in `own` are the truth: releases queued or held
            # back until now are in them, and credit is not.
            self._pending.clear()
            self._held_back.clear()
            self._credit.forget()
        waiting = {b.name for b in backends if self._waiting_for(b.name)}
        try:
            async with asyncio.timeout(self._cfg.timeout_s * 2):
                if absolute:
                    await self._calls.load_scripts()
                values = await self._calls.heartbeat(names, own if absolute else None, waiting)
        except REDIS_FAILURES as exc:
            if isinstance(exc, TimeoutError) and self._shared:
                self._share.renewed()  # Redis may have run it
            if self._shared:
                self._fall_back(f"heartbeat failed: {exc!r}")
            else:
                self._reason = f"Redis unreachable: {exc!r}"
                self._share.apply()  # backends a reload added get their share too
            return
        self._share.renewed()
        self._marks.heartbeat(waiting)
        self.queue_changed()  # the queue may have changed while the heartbeat was out
        live_changed = values[0] != self._live
        self._live = values[0]
        if values[1] and not absolute:
            self._lapsed()
        if values[2]:
            self._after_stall(values[2])
        if absolute:
            self._mine.rewrite(names, own, {b.name for b in self._fleet.backends})
            # Given back while the sync was out (a resync in shared mode): not in the
            # snapshot, still to be sent.
            self._mine.give_back(self._pending)
            self._resync = False
            if not self._shared:
                self._shared = True
                log.info("shared ledger reached: %d live replica(s)", self._live)
        for i, b in enumerate(backends):
            self._set_others(b, values[3 + 3 * i], values[4 + 3 * i])
        self._contended = {b.name for i, b in enumerate(backends) if values[5 + 3 * i]}
        if absolute or live_changed:
            self._notify()

    async def _reachable(self) -> bool:
        """In the fallback: does Redis answer at all? (A sync holds new grants until it
        ends; against a Redis that hangs, each attempt would hold them for its timeout.)"""
        try:
            async with asyncio.timeout(self._cfg.timeout_s):
                await self._calls.ping()
        except REDIS_FAILURES as exc:
            self._reason = f"Redis unreachable: {exc!r}"
            self._share.apply()  # backends a reload added get their share too
            return False
        return True

    def _own_settled(self, name: str) -> Amount:
        """This replica's holdings under ``name`` for an absolute sync, as releases will
        give them back (:func:`kvgateway.ledger.snapshot.settled_holding`)."""
        return settled_holding(name, self._fleet.backends, self._view.own, self._unsent)

    async def _flush_loop(self) -> None:
        while not self._closing:
            await self._flush.wait()
            self._flush.clear()
            try:
                # What is sent is taken once the lock is held: a sync that held it first
                # has written holdings that already leave out what was queued before it.
                async with self._io, asyncio.timeout(self._cfg.timeout_s):
                    if not self._shared:
                        continue
                    batch, self._pending = self._pending, []
                    enter: set[str] = set()
                    leave: set[str] = set()
                    if self._marks_due and self._admission is not None:
                        self._marks_due = False
                        enter, leave = self._marks.changes(self._admission.waiting_backends())
                    if batch or enter or leave:
                        await self._calls.release(release_totals(batch), enter, leave)
                        self._marks.sent(enter, leave)
            except REDIS_FAILURES as exc:
                self._fall_back(f"release failed: {exc!r}")

    async def _listen_loop(self) -> None:
        while not self._closing:
            try:
                async with self._calls.pubsub() as ps:
                    await ps.subscribe(self._keys.channel)
                    while not self._closing:
                        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if msg is not None:
                            self._on_released(msg["data"])
            except REDIS_FAILURES as exc:
                log.debug("ledger listener: %r; reconnecting", exc)
                await asyncio.sleep(self._interval())

    def _on_released(self, data: bytes) -> None:
        """Another replica released on a backend: the others' holdings there are the
        published total less ours; waiters here are offered the room."""
        if not self._shared:
            return
        msg = parse_message(data)
        if msg is None:
            log.warning("ledger: unreadable message %r", data[:100])
            return
        if msg.replica == self._id:
            return
        if isinstance(msg, Refused):
            # A replica waits there: our credit goes back, and none is kept there until
            # a heartbeat finds nobody waiting.
            self._contended.add(msg.backend)
            self._credit.drop(msg.backend)
            return
        name, tokens, seqs = msg.backend, msg.tokens, msg.seqs
        b = self._fleet.get(name)
        if b is None:
            return
        mine = self._mine.on(name)
        self._set_others(b, tokens - mine.tokens, seqs - mine.seqs)
