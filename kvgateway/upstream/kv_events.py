"""KV events from vLLM nodes into the :class:`~kvgateway.core.prefix_index.PrefixIndex`.

One :class:`KVEventSubscriber` per backend with ``kv_events: tcp://HOST:PORT``: a pyzmq
asyncio SUB socket (topic prefix filter) reading vLLM's ``[topic, seq (8-byte big-endian),
msgpack KVEventBatch]`` (``vllm/distributed/kv_events.py``), decoded by
:func:`decode_batch` in either layout vLLM has used.

vLLM's publisher binds an endpoint with a wildcard host (``tcp://*:5557``) and
*connects* to one naming a host. The subscriber connects, or with the backend's
``kv_events_bind`` binds the address a node connects to. Two sides that both connect
hear nothing and say nothing, so a backend sent prompts its view does not hold while no
batch comes for ``silence_s`` is warned about. On every link to the node the subscriber
asks its replay socket (if configured) for what it missed, the whole buffer at first: a
gateway that starts beside a node that already serves learns what it holds.

Losing events makes the index wrong, so sequence numbers are checked (:func:`classify_seq`):

- the next number: apply;
- a gap: ask the node's replay socket (if configured) for the missing batches (none seen
  yet: what it holds); if it cannot fill the gap in time, resync: clear the backend's
  precise view (:meth:`PrefixIndex.clear`) and carry on from this batch;
- 0 after a higher number: the publisher restarted (a new engine, an empty cache): resync;
- an older number: a duplicate after a replay, ignored.

A TCP disconnect seen by the socket monitor also resyncs (whatever happened meanwhile is
unknown) and the next batch is taken as a fresh start. So does a batch that cannot be
trusted (one that does not decode, holds an event the index cannot hold, or fails to
apply), and the stream carries on: one bad event must neither kill the reader (leaving
a stale view trusted as precise) nor the gateway's shutdown. Such errors are logged at a
bounded rate; everything is counted per backend through ``tally`` (:class:`EventCount`,
the ``gateway_kv_event_*`` metrics). Every wait is bounded; each subscriber owns its
named tasks and :meth:`close` ends them (and never raises theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.upstream.kv_event_decode import (
    EventCount,
    EventDecodeError,
    KVEventSource,
    LogLimit,
    SeqAction,
    SubscriberStats,
    Tally,
    classify_seq,
    decode_batch,
    kv_event_sources,
    no_tally,
    replay_reply,
)

__all__ = ["KVEventHub", "KVEventSource", "KVEventSubscriber", "kv_event_sources"]

log = logging.getLogger("kvgateway.upstream.kv_events")

_CATCH_UP_TIMEOUT_S = 10.0  # a node's whole buffer: vLLM keeps 10,000 batches
_POLL_MS = 250  # how often the reader looks up from the socket (silence, catch-up)
_SETTLE_S = 0.2  # from a link to the node to the catch-up (its subscription took effect)


class KVEventSubscriber:
    """One backend's event stream; feeds ``index`` under the backend's name."""

    def __init__(
        self,
        source: KVEventSource,
        index: PrefixIndex,
        ctx: zmq.asyncio.Context,
        *,
        clock: Callable[[], float] = time.monotonic,
        replay_timeout_s: float = 1.0,
        error_log_interval_s: float = 30.0,
        tally: Tally = no_tally,
        silence_s: float = 30.0,
    ) -> None:
        self.source = source
        self._index = index
        self._ctx = ctx
        self._clock = clock
        self._replay_timeout = replay_timeout_s
        self._tally = tally
        self._silence = silence_s
        self._silence_log = LogLimit(max(300.0, silence_s))
        self._last: int | None = None
        self._linked_at: float | None = None  # a link to the node not yet caught up on
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the reader of the SUB's monitor
        self._batches = self._gaps = self._replayed = self._resyncs = self._errors = 0
        self._apply_errors = 0
        self._error_log = LogLimit(error_log_interval_s)
        self.connected = asyncio.Event()

    def statistics(self) -> SubscriberStats:
        return SubscriberStats(
            self._batches,
            self._gaps,
            self._replayed,
            self._resyncs,
            self._errors,
            self._last,
            self._apply_errors,
        )

    def start(self) -> None:
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # libzmq does not connect to tcp://[v6]:port without
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        links = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        monitor = self._monitor = sub.get_monitor_socket(links)
        name = self.source.backend
        try:
            (sub.bind if self.source.bind else sub.connect)(self.source.endpoint)
        except zmq.ZMQError as exc:  # the reader lives on; the silence warning follows
            log.error("kv events of %s: %s: %s", name, self.source.endpoint, exc)
        self._index.attach_events(name)
        self._tasks = [
            asyncio.create_task(self._read(sub), name=f"kv-events:{name}"),
            asyncio.create_task(self._watch(monitor), name=f"kv-events-monitor:{name}"),
        ]

    def stop(self) -> None:
        """Cancel the tasks (they read nothing more); :meth:`close` then ends them."""
        for t in self._tasks:
            t.cancel()

    async def close(self) -> None:
        """End the tasks and the sockets. A task that had failed is logged, not raised:
        a reader that died must not also fail the gateway's shutdown. The monitor stops
        while its reader is open: libzmq's I/O thread sends it events holding a lock that
        stopping it takes, and would block for good on a reader that is gone."""
        tasks, self._tasks = self._tasks, []
        try:
            if self._sub is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disable_monitor()
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for t, result in zip(tasks, results, strict=True):
                if isinstance(result, Exception):
                    log.error(
                        "kv events of %s: task %s had failed",
                        self.source.backend,
                        t.get_name(),
                        exc_info=result,
                    )
        finally:
            for sock in (self._monitor, self._sub):
                if sock is not None:
                    sock.close(linger=0)
            self._monitor = self._sub = None

    # -- the stream ----------------------------------------------------------------

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            if await sub.poll(_POLL_MS):
                frames = await sub.recv_multipart()
                try:
                    await self.handle(frames)
                except Exception as exc:  # a batch no check foresaw: distrust it, read on
                    self._errors += 1
                    self._reject(f"a batch could not be handled: {exc!r}")
            linked = self._linked_at
            if linked is not None and asyncio.get_running_loop().time() - linked >= _SETTLE_S:
                self._linked_at = None
                await self.catch_up()
            self.check_silence()

    def check_silence(self) -> bool:
        """Warn (at a bounded rate) when the backend was sent prompts its view does not
        hold and no batch has come for ``silence_s``; True when that is the case."""
        backend = self.source.backend
        since = self._index.events_awaited_since(backend)
        now = self._clock()
        if since is None or now - since < self._silence:
            return False
        if self._silence_log.allow(now) is not None:
            log.warning(
                "kv events of %s: no batch in %.0f s though it was sent prompts not in its "
                "view (%s %s, %s). A node whose --kv-events-config endpoint names a host "
                "connects to it: give it tcp://*:PORT, or set kv_events_bind on the backend",
                backend,
                now - since,
                "bound to" if self.source.bind else "connected to",
                self.source.endpoint,
                "a peer is connected" if self.connected.is_set() else "no peer connected",
            )
        return True

    async def catch_up(self) -> None:
        """Apply what the node's replay socket holds past the last batch seen (all of it
        when none was), on every link to the node: batches published before the link
        reached no subscriber, and a gateway that starts beside a node that already
        serves learns what it holds (a subset when the buffer no longer reaches back to
        batch 0: orphans are left out)."""
        if self.source.replay_endpoint is None:
            return
        start = 0 if self._last is None else self._last + 1
        for seq, payload in await self._fetch(start, _CATCH_UP_TIMEOUT_S) or ():
            action = classify_seq(self._last, seq)
            if action is SeqAction.DUPLICATE:
                continue
            if action is not SeqAction.APPLY and self._last is not None:
                self._resync(f"batches before {seq} are no longer in the node's buffer")
            self._apply(seq, payload)
            self._replayed += 1

    async def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message from the PUB socket."""
        self._tally(self.source.backend, EventCount.BATCHES)
        if len(frames) != 3 or len(frames[1]) != 8:
            self._errors += 1
            self._tally(self.source.backend, EventCount.DECODE_ERRORS)
            return
        seq = int.from_bytes(frames[1], "big")
        action = classify_seq(self._last, seq)
        if action is SeqAction.DUPLICATE:
            return
        if action is SeqAction.RESTART:
            self._resync("the publisher restarted")
        elif action is SeqAction.GAP:
            self._gaps += 1
            self._tally(self.source.backend, EventCount.GAPS)
            start = 0 if self._last is None else self._last + 1
            if not await self._replay(start, seq):
                self._resync(f"events {start}..{seq - 1} were lost")
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        try:
            batch = decode_batch(payload)
        except (EventDecodeError, RecursionError, ValueError, TypeError) as exc:
            self._errors += 1
            self._tally(self.source.backend, EventCount.DECODE_ERRORS)
            self._reject(f"undecodable batch {seq}: {exc}")
            return
        self._batches += 1
        try:
            self._index.apply_events(self.source.backend, batch.events, self._clock())
        except Exception as exc:  # the view may be half-applied: never trust it, never die
            self._apply_errors += 1
            self._reject(f"batch {seq} could not be applied: {exc!r}")

    def _reject(self, reason: str) -> None:
        """Resync after a batch that cannot be trusted; logged at a bounded rate, since
        a node sending bad events sends them on every batch."""
        held_back = self._error_log.allow(self._clock())
        if held_back is not None:
            more = f"; {held_back} more like it not logged" if held_back else ""
            log.warning("kv events of %s: resync (%s%s)", self.source.backend, reason, more)
        self._clear()

    def _resync(self, reason: str) -> None:
        log.warning("kv events of %s: resync (%s)", self.source.backend, reason)
        self._clear()

    def _clear(self) -> None:
        self._resyncs += 1
        self._index.clear(self.source.backend, self._clock())

    async def _replay(self, start: int, upto: int) -> bool:
        """Fetch batches ``start`` .. ``upto - 1`` from the replay socket; True if applied."""
        got = await self._fetch(start, _CATCH_UP_TIMEOUT_S if start == 0 else self._replay_timeout)
        if got is None:
            return False
        got = [(seq, payload) for seq, payload in got if seq < upto]
        first = got[0][0] if got and start == 0 else start
        if [s for s, _ in got] != list(range(first, upto)):
            return False  # the node's buffer no longer holds them all
        for seq, payload in got:
            self._apply(seq, payload)
        self._replayed += len(got)
        return True

    async def _fetch(self, start: int, timeout_s: float) -> list[tuple[int, bytes]] | None:
        """The batches the replay socket holds from ``start`` on; None if it did not
        answer in time (or not as vLLM does)."""
        endpoint = self.source.replay_endpoint
        if endpoint is None:
            return None
        self._tally(self.source.backend, EventCount.REPLAYS_ASKED)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(timeout_s):
                while True:
                    reply = replay_reply(await sock.recv_multipart())
                    if reply is None:
                        return None
                    if reply[0] < 0:  # the end marker
                        break
                    got.append(reply)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.info("kv events of %s: replay failed: %s", self.source.backend, exc)
            return None
        finally:
            sock.close(linger=0)
        self._tally(self.source.backend, EventCount.REPLAYS_ANSWERED)
        return got

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:  # the monitor socket is closed by close(), after the monitor stops
            msg = parse_monitor_message(await monitor.recv_multipart())
            if msg["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.connected.set()
                self._linked_at = asyncio.get_running_loop().time()
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self.connected.clear()
                self._last = None
                self._resync("disconnected")


class KVEventHub:
    """The subscribers of every backend with KV events; one zmq context for all."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        clock: Callable[[], float] = time.monotonic,
        tally: Tally = no_tally,
        silence_s: float = 30.0,
    ) -> None:
        self._index = index
        self._ctx = zmq.asyncio.Context()
        self._subscriber = functools.partial(
            KVEventSubscriber,
            index=index,
            ctx=self._ctx,
            clock=clock,
            tally=tally,
            silence_s=silence_s,
        )
        self._subs: dict[str, KVEventSubscriber] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def subscriber(self, backend: str) -> KVEventSubscriber | None:
        return self._subs.get(backend)

    def follow(self, sources: Sequence[KVEventSource]) -> None:
        """Subscribe to ``sources`` now; backends no longer listed (or listed with another
        source) are detached at once and their subscribers closed in the background
        (:meth:`close` waits for those)."""
        wanted = {s.backend: s for s in sources}
        for name in list(self._subs):
            if name not in wanted or self._subs[name].source != wanted[name]:
                sub = self._subs.pop(name)
                sub.stop()  # its reader feeds the index no more from here on
                self._index.detach_events(name)
                closing = asyncio.create_task(sub.close(), name=f"kv-events-close:{name}")
                self._closing.add(closing)
                closing.add_done_callback(self._closed)
        for name, source in wanted.items():
            if name not in self._subs:
                sub = self._subscriber(source)
                sub.start()
                self._subs[name] = sub

    async def sync(self, sources: Sequence[KVEventSource]) -> None:
        """:meth:`follow`, then wait until the dropped subscribers are closed."""
        self.follow(sources)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kv events: closing a subscriber failed", exc_info=task.exception())

    async def close(self) -> None:
        """Close every subscriber, even after one fails to, then the context."""
        subs, self._subs = list(self._subs.values()), {}
        try:
            await asyncio.gather(*self._closing, return_exceptions=True)
            for sub in subs:
                try:
                    await sub.close()
                except Exception:
                    log.exception("kv events of %s: close failed", sub.source.backend)
        finally:
            self._ctx.destroy(linger=0)
