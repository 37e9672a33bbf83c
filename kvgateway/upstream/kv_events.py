"""KV events from vLLM nodes into the :class:`~kvgateway.core.prefix_index.PrefixIndex`.

One :class:`KVEventSubscriber` per backend with ``kv_events: tcp://HOST:PORT``: a pyzmq
asyncio SUB socket (topic prefix filter) reading vLLM's multipart messages
``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` (``vllm/distributed/
kv_events.py``). Payloads are decoded by :func:`decode_batch`, which reads both layouts
vLLM has used: msgspec structs as maps (``{"type": "BlockStored", ...}``, current) and
``array_like`` arrays (``["BlockStored", hashes, parent, ...]``, earlier releases).

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
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgateway.config.model import GatewayConfig
from kvgateway.core.prefix_index import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    EngineHash,
    PrefixIndex,
)

log = logging.getLogger("kvgateway.upstream.kv_events")

_END_SEQ = -1

# What the index can hold: tokens are packed as signed int64 (prefix_keys.pack_tokens);
# msgpack's own integer range bounds an int block hash.
_TOKEN_MIN, _TOKEN_MAX = -(2**63), 2**63 - 1
_HASH_MIN, _HASH_MAX = -(2**63), 2**64 - 1


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KVEventBatch."""


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """Where one backend publishes: ``endpoint`` as in the backend's ``kv_events``."""

    backend: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    events: tuple[CacheEvent, ...]
    data_parallel_rank: int | None


# Field order of vLLM's structs (array layout); later fields are optional.
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and _HASH_MIN <= value <= _HASH_MAX:
        return value
    raise EventDecodeError(f"block hash must be a 64-bit int or bytes, got {value!r:.80}")


def _list(fields: dict[Any, Any], name: str) -> list[Any]:
    value = fields[name]
    if not isinstance(value, list):
        raise EventDecodeError(f"{name} must be a list, got {value!r:.80}")
    return value


def _hashes(fields: dict[Any, Any]) -> tuple[EngineHash, ...]:
    return tuple(_hash(h) for h in _list(fields, "block_hashes"))


def _token_ids(fields: dict[Any, Any]) -> tuple[int, ...]:
    tokens = _list(fields, "token_ids")
    for t in tokens:
        if not (_is_int(t) and _TOKEN_MIN <= t <= _TOKEN_MAX):
            raise EventDecodeError(f"token id must be a 64-bit signed int, got {t!r:.80}")
    return tuple(tokens)


def _block_size(fields: dict[Any, Any]) -> int:
    value = fields["block_size"]
    if not (_is_int(value) and value >= 1):
        raise EventDecodeError(f"block_size must be a positive int, got {value!r:.80}")
    return int(value)


def _optional(fields: dict[Any, Any], name: str, kind: type) -> Any:
    value = fields.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise EventDecodeError(f"{name} must be a {kind.__name__} or null, got {value!r:.80}")
    return value


def _extra_keys(fields: dict[Any, Any]) -> tuple[tuple[Any, ...] | None, ...] | None:
    extra = fields.get("extra_keys")
    if extra is None:
        return None
    if not isinstance(extra, list) or not all(e is None or isinstance(e, list) for e in extra):
        raise EventDecodeError(f"extra_keys must be a list of lists or nulls, got {extra!r:.80}")
    return tuple(None if e is None else _as_tuple(e) for e in extra)


def _event(raw: Any) -> CacheEvent | None:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError(f"not a KV cache event: {raw!r:.80}")
    try:
        if tag == "BlockStored":
            parent = fields.get("parent_block_hash")
            return BlocksStored(
                block_hashes=_hashes(fields),
                parent_block_hash=None if parent is None else _hash(parent),
                token_ids=_token_ids(fields),
                block_size=_block_size(fields),
                medium=_optional(fields, "medium", str),
                extra_keys=_extra_keys(fields),
                group_idx=_optional(fields, "group_idx", int),
            )
        if tag == "BlockRemoved":
            return BlocksRemoved(
                block_hashes=_hashes(fields),
                medium=_optional(fields, "medium", str),
                group_idx=_optional(fields, "group_idx", int),
            )
    except EventDecodeError as exc:
        raise EventDecodeError(f"malformed {tag} event: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"malformed {tag} event: {exc!r}") from exc
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None  # an event kind this gateway does not know: skip it


def decode_batch(payload: bytes) -> DecodedBatch:
    """A ``KVEventBatch`` payload (map or array layout) as core events.

    Raises :class:`EventDecodeError` for anything that is not one, including an event
    the index could not hold: the whole batch is then untrusted, as a lost one would be.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError("not a KVEventBatch")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise EventDecodeError("KVEventBatch needs ts and a list of events")
    decoded = tuple(e for e in (_event(r) for r in events) if e is not None)
    return DecodedBatch(float(ts), decoded, rank if isinstance(rank, int) else None)


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
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        self._index.attach_events(self.source.backend)
        name = self.source.backend
        self._tasks = [
            asyncio.create_task(self._read(sub), name=f"kv-events:{name}"),
            asyncio.create_task(self._watch(monitor), name=f"kv-events-monitor:{name}"),
        ]

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
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = await sock.recv_multipart()
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
    return [KVEventSource(b.name, b.kv_events) for b in config.backends if b.kv_events]


class KVEventHub:
    """The subscribers of every backend with KV events; one zmq context for all."""

    def __init__(self, index: PrefixIndex, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._subs: dict[str, KVEventSubscriber] = {}

    def subscriber(self, backend: str) -> KVEventSubscriber | None:
        return self._subs.get(backend)

    async def sync(self, sources: Sequence[KVEventSource]) -> None:
        """Subscribe to ``sources``; drop (and detach) backends no longer listed."""
        wanted = {s.backend: s for s in sources}
        for name in list(self._subs):
            if name not in wanted or self._subs[name].source != wanted[name]:
                await self._subs.pop(name).close()
                self._index.detach_events(name)
        for name, source in wanted.items():
            if name not in self._subs:
                sub = KVEventSubscriber(source, self._index, self._ctx, clock=self._clock)
                sub.start()
                self._subs[name] = sub

    async def close(self) -> None:
        """Close every subscriber, even after one fails to, then the context."""
        subs, self._subs = list(self._subs.values()), {}
        try:
            for sub in subs:
                try:
                    await sub.close()
                except Exception:
                    log.exception("kv events of %s: close failed", sub.source.backend)
        finally:
            self._ctx.destroy(linger=0)
