"""vLLM's KV event batches decoded into the prefix index's events (pure: no I/O).

A ``KVEventBatch`` payload is msgpack in either layout vLLM has used: msgspec structs as
maps (``{"type": "BlockStored", ...}``, current) and ``array_like`` arrays
(``["BlockStored", hashes, parent, ...]``, earlier releases) (``vllm/distributed/
kv_events.py``). :func:`decode_batch` also refuses an event the index could not hold
(``block_size < 1``, a token id outside int64, a field of the wrong type): the whole
batch is then untrusted, as a lost one would be, and the subscriber resyncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

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
