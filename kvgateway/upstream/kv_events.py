"""KV events from vLLM nodes into the :class:`~kvgateway.core.prefix_index.PrefixIndex`.

One :class:`KVEventSubscriber` per backend with ``kv_events: tcp://HOST:PORT``: a pyzmq
asyncio SUB socket (topic prefix filter) reading vLLM's multipart messages
``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` (``vllm/distributed/
kv_events.py``). Payloads are decoded by :func:`decode_batch`, which reads both layouts
vLLM has used (:mod:`.kv_event_decode`).

Losing events makes the index wrong, so the sequence numbers are checked
(:func:`classify_seq`):

- the next number: apply;
- a gap: ask the node's replay socket (if configured) for the missing batches; if it
  cannot fill the gap in time, resync: clear the backend's precise view
  (:meth:`PrefixIndex.clear`) and carry on from this batch;
- 0 after a higher number: the publisher restarted (a new engine, an empty cache): resync;
- an older number: a duplicate after a replay, ignored.

A TCP disconnect seen by the socket monitor also resyncs (whatever happened meanwhile is
unknown) and the next batch is taken as a fresh start.

A batch that cannot be trusted resyncs too, and the stream carries on: one that does not
decode, one holding an event the index cannot hold (checked by :func:`decode_batch`:
``block_size < 1``, a token id outside int64, a list that is not a list), or one whose
application fails for a reason nobody foresaw. One bad event from one node must neither
kill the reader (leaving a stale view trusted as precise) nor the gateway's shutdown;
such errors are counted and logged at a bounded rate. Every wait is bounded; each
subscriber owns its named tasks and :meth:`close` ends them (and never raises theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgateway.config.model import GatewayConfig
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.upstream.kv_event_decode import EventDecodeError, decode_batch

log = logging.getLogger("kvgateway.upstream.kv_events")

_END_SEQ = -1


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """Where one backend publishes: ``endpoint`` as in the backend's ``kv_events``."""

    backend: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None


class SeqAction(Enum):
    APPLY = "apply"
    GAP = "gap"
    RESTART = "restart"
    DUPLICATE = "duplicate"


def classify_seq(last: int | None, seq: int) -> SeqAction:
    """What a batch numbered ``seq`` means after ``last`` (None: nothing seen yet)."""
    if last is None:
        return SeqAction.APPLY if seq == 0 else SeqAction.GAP
    if seq == last + 1:
        return SeqAction.APPLY
    if seq > last + 1:
        return SeqAction.GAP
    if seq == 0:
        return SeqAction.RESTART
    return SeqAction.DUPLICATE


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    batches: int
    gaps: int
    replayed: int
    resyncs: int
    decode_errors: int
    last_seq: int | None
    apply_errors: int = 0


@dataclass(slots=True)
class _LogLimit:
    """At most one log line per ``interval_s``; the lines held back are counted."""

    interval_s: float
    next_at: float | None = None
    held_back: int = 0

    def allow(self, now: float) -> int | None:
        """The number held back since the last line if one may be logged now, else None."""
        if self.next_at is not None and now < self.next_at:
            self.held_back += 1
            return None
        held, self.held_back, self.next_at = self.held_back, 0, now + self.interval_s
        return held


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
    ) -> None:
        self.source = source
        self._index = index
        self._ctx = ctx
        self._clock = clock
        self._replay_timeout = replay_timeout_s
        self._last: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: zmq.asyncio.Socket | None = None
        self._batches = self._gaps = self._replayed = self._resyncs = self._errors = 0
        self._apply_errors = 0
        self._error_log = _LogLimit(error_log_interval_s)
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
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        self._index.attach_events(self.source.backend)
        name = self.source.backend
        self._tasks = [
            asyncio.create_task(self._read(sub), name=f"kv-events:{name}"),
            asyncio.create_task(self._watch(monitor), name=f"kv-events-monitor:{name}"),
        ]

    def stop(self) -> None:
        """Cancel the tasks (they read nothing more); :meth:`close` then ends them."""
        for t in self._tasks:
            t.cancel()

    async def close(self) -> None:
        """End the tasks and the socket. A task that had failed is logged, not raised:
        a reader that died must not also fail the gateway's shutdown."""
        tasks, self._tasks = self._tasks, []
        try:
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
            if self._sub is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disable_monitor()
                self._sub.close(linger=0)
                self._sub = None

    # -- the stream ----------------------------------------------------------------

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            await self.handle(frames)

    async def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message from the PUB socket."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        action = classify_seq(self._last, seq)
        if action is SeqAction.DUPLICATE:
            return
        if action is SeqAction.RESTART:
            self._resync("the publisher restarted")
        elif action is SeqAction.GAP:
            self._gaps += 1
            start = 0 if self._last is None else self._last + 1
            if not await self._replay(start, seq):
                self._resync(f"events {start}..{seq - 1} were lost")
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self._errors += 1
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
        endpoint = self.source.replay_endpoint
        if endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = await sock.recv_multipart()
                    # vLLM >= 0.27 replies [b"", topic, seq, payload] (the end marker
                    # with an empty topic); earlier releases [b"", seq, payload].
                    if len(frames) == 4:
                        frames = frames[:1] + frames[2:]
                    if len(frames) != 3:
                        return False
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq == _END_SEQ:
                        break
                    if seq < upto:
                        got.append((seq, frames[2]))
        except (TimeoutError, zmq.ZMQError) as exc:
            log.info("kv events of %s: replay failed: %s", self.source.backend, exc)
            return False
        finally:
            sock.close(linger=0)
        if [s for s, _ in got] != list(range(start, upto)):
            return False  # the node's buffer no longer holds them all
        for seq, payload in got:
            self._apply(seq, payload)
        self._replayed += len(got)
        return True

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                msg = parse_monitor_message(await monitor.recv_multipart())
                if msg["event"] == zmq.EVENT_CONNECTED:
                    self.connected.set()
                elif msg["event"] == zmq.EVENT_DISCONNECTED:
                    self.connected.clear()
                    self._last = None
                    self._resync("disconnected")
        finally:
            monitor.close(linger=0)


def kv_event_sources(config: GatewayConfig) -> list[KVEventSource]:
    """The backends publishing KV events (``kv_events:``), for the :class:`KVEventHub`."""
    return [
        KVEventSource(b.name, b.kv_events, b.kv_events_topic, b.kv_events_replay)
        for b in config.backends
        if b.kv_events
    ]


class KVEventHub:
    """The subscribers of every backend with KV events; one zmq context for all."""

    def __init__(self, index: PrefixIndex, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
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
                sub = KVEventSubscriber(source, self._index, self._ctx, clock=self._clock)
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
