"""vLLM's KV events from a simulated node: ZMQ PUB, msgpack ``KVEventBatch``.

After ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``; read, not copied):

- One batch per engine step that changed the prefix cache, sent as the multipart message
  ``[topic, seq as 8-byte big-endian, payload]``; ``seq`` counts batches from 0 per
  publisher, so a subscriber sees a gap when it lost some.
- The payload is msgspec's msgpack encoding of ``EventBatch(ts, events,
  data_parallel_rank)`` with tagged event structs (tag field ``type`` = class name) and
  ``omit_defaults``: fields left at their default (``extra_keys``, a full-attention
  group's ``kv_cache_spec_sliding_window``) are not sent. Every event names its
  KV-cache group (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``
  on BlockStored, ``group_idx`` on BlockRemoved), as vLLM does since hybrid models
  publish events. Current vLLM encodes structs as maps; releases before that used
  ``array_like`` (``[ts, events, rank]``, events ``["BlockStored", hashes, parent,
  tokens, block_size, lora_id, medium, lora_name, ...]`` with every field, defaults
  included: msgspec omits nothing from arrays), selected by ``kv_events_array_like``.
  The batch is an array in every release (``EventBatch`` is ``array_like``); since 0.27
  a text block's ``extra_keys`` is one ``None`` per block.
- A ROUTER replay socket answers ``[identity, b"", start_seq]`` with every buffered
  batch from ``start_seq`` on as ``[identity, b"", topic, seq, payload]``, then
  ``[identity, b"", b"", -1, b""]`` (vLLM >= 0.27; the array-like releases sent no
  topic frame).
- The PUB socket binds when the endpoint has ``*``, ``::``, ``ipc://`` or ``inproc://``
  and connects otherwise, as vLLM; unlike vLLM the simulator also binds loopback
  addresses (``127.0.0.1``, ``localhost``) so that tests stay on the loopback interface.
  ``tcp://127.0.0.1:*`` binds a free port (see :attr:`KVEventPublisher.endpoint`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvgateway.simulator.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvgateway.simulator.settings import NodeSettings, SettingsError

log = logging.getLogger("kvgateway.simulator.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_LOOPBACK = ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:")


def kv_events_overrides(value: Any, path: str) -> dict[str, Any]:
    """A ``simulate.kv_events`` mapping as :class:`NodeSettings` fields."""
    if not isinstance(value, Mapping):
        raise SettingsError(f"{path}: expected a mapping with endpoint (and topic)")
    fields = {
        "endpoint": "kv_events_endpoint",
        "topic": "kv_events_topic",
        "replay_endpoint": "kv_events_replay_endpoint",
        "array_like": "kv_events_array_like",
    }
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in fields:
            raise SettingsError(f"{path}.{key}: unknown key; known: {', '.join(fields)}")
        out[fields[key]] = item
    if not isinstance(out.get("kv_events_endpoint"), str):
        raise SettingsError(f"{path}.endpoint: required, e.g. tcp://127.0.0.1:5557")
    return out


# Fields vLLM declares with a default; ``omit_defaults`` drops them from maps while they
# hold it (msgspec's array layout keeps every field).
_DEFAULTED = frozenset(
    {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
)


def _event_fields(event: KVEvent) -> tuple[str, list[tuple[str, Any]]]:
    if isinstance(event, BlockStored):
        return "BlockStored", [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", None),
            ("medium", event.medium),
            ("lora_name", None),
            ("extra_keys", None),
            ("group_idx", event.group_idx),
            ("kv_cache_spec_kind", event.kind),
            ("kv_cache_spec_sliding_window", event.sliding_window),
        ]
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [
            ("block_hashes", list(event.block_hashes)),
            ("medium", event.medium),
            ("group_idx", event.group_idx),
        ]
    assert isinstance(event, AllBlocksCleared)
    return "AllBlocksCleared", []


def encode_batch(
    events: Sequence[KVEvent], ts: float, *, data_parallel_rank: int = 0, array_like: bool = False
) -> bytes:
    """The msgpack payload vLLM's publisher sends for one ``KVEventBatch``."""
    encoded: list[Any] = []
    for event in events:
        tag, fields = _event_fields(event)
        if array_like:
            encoded.append([tag, *(v for _, v in fields)])
        else:
            if isinstance(event, BlockStored):
                # vLLM >= 0.27 sends one entry per block (None: no LoRA, media or salt).
                fields = [
                    (k, [None] * len(event.block_hashes) if k == "extra_keys" else v)
                    for k, v in fields
                ]
            kept = {k: v for k, v in fields if not (k in _DEFAULTED and v is None)}
            encoded.append({"type": tag, **kept})
    # The batch itself is array-like in every release: [ts, events, data_parallel_rank].
    return msgspec.msgpack.encode([ts, encoded, data_parallel_rank])


def _binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.startswith(_LOOPBACK)
    )


class KVEventPublisher:
    """The node's PUB (and optional ROUTER replay) sockets; owned by the node's app."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        assert settings.kv_events_endpoint is not None
        self._configured = settings.kv_events_endpoint
        self._replay_configured = settings.kv_events_replay_endpoint
        self._topic = settings.kv_events_topic.encode()
        self._array_like = settings.kv_events_array_like
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.name = settings.name

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        ctx = self._ctx = zmq.asyncio.Context()
        pub = self._pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if _binds(self._configured):
            pub.bind(self._configured)
            self.endpoint = _last_endpoint(pub)
        else:
            pub.connect(self._configured)
            self.endpoint = self._configured
        if self._replay_configured is not None:
            replay = self._replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self._replay_configured)
            self.replay_endpoint = _last_endpoint(replay)
            self._replay_task = asyncio.create_task(
                self._serve_replay(replay), name=f"sim-kv-replay:{self.name}"
            )

    def publish(self, events: Sequence[KVEvent], ts: float) -> None:
        """Send one batch now; PUB never blocks (beyond its HWM, ZMQ drops)."""
        if self._pub is None or not events:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, ts, array_like=self._array_like)
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("node %s: invalid KV-event replay request", self.name)
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # vLLM >= 0.27 puts the topic before seq (an empty one on the end marker);
            # the releases with array-like events did not.
            topic: tuple[bytes, ...] = () if self._array_like else (self._topic,)
            end: tuple[bytes, ...] = () if self._array_like else (b"",)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart(
                        (client, b"", *topic, seq.to_bytes(8, "big"), payload)
                    )
            await sock.send_multipart((client, b"", *end, END_SEQ, b""))


def _last_endpoint(sock: zmq.asyncio.Socket) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
