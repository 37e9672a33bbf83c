"""vLLM's KV event stream without I/O: where each backend publishes (from the config),
batches decoded into the prefix index's events, sequence numbers classified, replay
replies read, and what a subscriber counts.

A ``KVEventBatch`` payload is msgpack in either layout vLLM has used: msgspec structs as
maps (``{"type": "BlockStored", ...}``, current) and ``array_like`` arrays
(``["BlockStored", hashes, parent, ...]``, earlier releases) (``vllm/distributed/
kv_events.py``). :func:`decode_batch` also refuses an event the index could not hold
(``block_size < 1``, a token id outside int64, a field of the wrong type): the whole
batch is then untrusted, as a lost one would be, and the subscriber resyncs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

import msgspec

from kvgateway.config.model import GatewayConfig
from kvgateway.core.cache_view import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    EngineHash,
)

# What the index can hold: tokens are packed as signed int64 (prefix_keys.pack_tokens);
# msgpack's own integer range bounds an int block hash.
_TOKEN_MIN, _TOKEN_MAX = -(2**63), 2**63 - 1
_HASH_MIN, _HASH_MAX = -(2**63), 2**64 - 1


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KVEventBatch."""


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


# Lists nested deeper than this in an event are not vLLM's (extra keys nest two deep).
_MAX_DEPTH = 16


def _as_tuple(value: Any, depth: int = 0) -> Any:
    if not isinstance(value, list):
        return value
    if depth >= _MAX_DEPTH:
        raise EventDecodeError(f"lists nested more than {_MAX_DEPTH} deep")
    return tuple(_as_tuple(v, depth + 1) for v in value)


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
                kind=_optional(fields, "kv_cache_spec_kind", str),
                window=_optional(fields, "kv_cache_spec_sliding_window", int),
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


class EventCount(StrEnum):
    """What a subscriber counts, per backend (``gateway_kv_event_<value>``)."""

    BATCHES = "batches"
    GAPS = "gaps"
    REPLAYS_ASKED = "replays_asked"
    REPLAYS_ANSWERED = "replays_answered"
    DECODE_ERRORS = "decode_errors"

    @property
    def doc(self) -> str:
        return {
            EventCount.BATCHES: "KV event batches from the node's publisher (not replayed).",
            EventCount.GAPS: "Gaps in the node's KV event sequence (batches lost in transit).",
            EventCount.REPLAYS_ASKED: "KV event replays asked (on each link to the node, per gap).",
            EventCount.REPLAYS_ANSWERED: "KV event replays the node answered in time.",
            EventCount.DECODE_ERRORS: "KV event batches that did not decode (view rebuilt).",
        }[self]


Tally = Callable[[str, EventCount], None]


def no_tally(backend: str, what: EventCount) -> None:
    """A :data:`Tally` that counts nothing."""


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
class LogLimit:
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


def replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One message from vLLM's replay socket as (seq, payload), seq -1 for the end marker;
    None for anything else. vLLM >= 0.27 replies ``[b"", topic, seq, payload]`` (the end
    marker with an empty topic), earlier releases ``[b"", seq, payload]``."""
    if len(frames) == 4:
        frames = [frames[0], *frames[2:]]
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """Where one backend publishes: ``endpoint`` as in the backend's ``kv_events``;
    ``bind``: the subscriber binds it (the node's publisher connects to it)."""

    backend: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    bind: bool = False


def kv_event_sources(config: GatewayConfig) -> list[KVEventSource]:
    """The backends publishing KV events (``kv_events:``), for the :class:`KVEventHub`."""
    return [
        KVEventSource(b.name, b.kv_events, b.kv_events_topic, b.kv_events_replay, b.kv_events_bind)
        for b in config.backends
        if b.kv_events
    ]
