"""The gateway's own chained keys for full token blocks.

vLLM names a cached block by a hash of (parent hash, the block's token ids, extra keys),
chained from the first block, full blocks only. Its hash values cannot be reproduced in
general (the seed, the hash algorithm and pickle's output vary by deployment), so the
gateway keys blocks its own way with the same structure, as llm-d's precise prefix
scorer does: from a prompt's token ids when it routes, and from the token ids that
``BlockStored`` events carry when a node reports what it cached. Only the tokenization
has to match the node's; block size and extra keys come with the events.

Keys are 64-bit ints: Python's hash of the bytes of the parent key, the tokens as
signed 64-bit little-endian, and the extra keys' repr. That hash is SipHash-1-3 under a
key drawn at random per process, so a client cannot aim two prompts at one key; keys
are never compared across processes (each gateway process keys the prompts it routes
and the events its nodes send it). ``ROOT_KEY`` is the parent of a first block.

:class:`SharedKeys` records which in-flight sequences on a node hold, and which paid
for, each shared prompt block: the projection (:mod:`.projection`) counts a block shared
through vLLM's prefix cache once while any holder runs, plus one copy per holder that
paid for its own. :class:`EventHolders` records which backends' KV events report
holding each key (fed by :mod:`.cache_view`, read by :mod:`.prefix_index`).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

BlockKey = int
ROOT_KEY: BlockKey = 0


def chain_key(
    parent: BlockKey | None, block_tokens: bytes, extra_keys: tuple[Any, ...] | None = None
) -> BlockKey:
    """The key of one block from its parent's key and its tokens packed as int64."""
    data = (ROOT_KEY if parent is None else parent).to_bytes(8, "little", signed=True)
    data += block_tokens
    if extra_keys:
        data += repr(tuple(extra_keys)).encode()
    return hash(data)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: BlockKey | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    max_blocks: int | None = None,
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``, chained from ``parent`` (a prompt's start).

    ``extra_keys``, when given, holds one entry per block as vLLM's events carry them
    (LoRA name, multimodal hashes, ``cache_salt`` on block 0); a partial last block has
    no key. ``max_blocks`` stops early (a long prompt on a node that can hold less).
    """
    if block_size < 1:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    packed = pack_tokens(token_ids[: n * block_size])
    width = block_size * 8
    keys: list[BlockKey] = []
    key = parent
    for i in range(n):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        key = chain_key(key, packed[i * width : (i + 1) * width], extra)
        keys.append(key)
    return keys


class _Keyed(Protocol):
    """What is read of a projected flight here."""

    @property
    def id(self) -> int: ...
    @property
    def keys(self) -> tuple[BlockKey, ...]: ...
    @property
    def credited(self) -> int: ...


@dataclass(frozen=True, slots=True)
class KeyGroup:
    """``keys`` tracked keys, each paid for by ``payers`` and held by ``holders``."""

    payers: frozenset[int]
    holders: frozenset[int]
    keys: int


@dataclass(slots=True)
class _KeyUse:
    payers: set[int] = field(default_factory=set)
    holders: set[int] = field(default_factory=set)


def expected_copies(paid: Iterable[float], held: Iterable[float]) -> float:
    """Expected copies of a shared block: one per payer running (chances ``paid``), and
    one more when no payer runs but another holder (chances ``held``) does (it keeps the
    blocks it was credited: vLLM frees a cached block with its last user). Lengths are
    independent, so that is P(no payer) x P(any other holder)."""
    chances = list(paid)
    return sum(chances) + math.prod(1.0 - a for a in chances) * (
        1.0 - math.prod(1.0 - a for a in held)
    )


class ReadyKeys:
    """Prompt blocks a node has cached or scheduled for its flights, counted per holder:
    the leading ones of a newcomer's prompt are shareable."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[BlockKey, int] = {}

    def mark(self, keys: tuple[BlockKey, ...]) -> None:
        count = self._count
        for key in keys:
            count[key] = count.get(key, 0) + 1

    def unmark(self, keys: tuple[BlockKey, ...]) -> None:
        count = self._count
        for key in keys:
            left = count.get(key, 0) - 1
            if left > 0:
                count[key] = left
            else:
                count.pop(key, None)

    def leading(self, keys: tuple[BlockKey, ...]) -> int:
        """How many of ``keys``, from the first, are held."""
        n = 0
        for key in keys:
            if key not in self._count:
                break
            n += 1
        return n


class SharedKeys:
    """Which flights hold and which paid for each prompt block shared on a node.

    A key is tracked here once a flight was credited it; until then each flight's
    keys are part of its own blocks. A tracked key holds, at a step, one copy per paying
    flight still running, and at least one while any holder runs.
    """

    __slots__ = ("_groups", "_keys", "_of")

    def __init__(self) -> None:
        self._keys: dict[BlockKey, _KeyUse] = {}
        self._of: dict[int, tuple[BlockKey, ...]] = {}
        self._groups: list[KeyGroup] | None = None

    def add(self, f: _Keyed, flights: Mapping[int, _Keyed]) -> None:
        if not f.credited:
            return
        self._groups = None
        shared = f.keys[: f.credited]
        for key in shared:
            use = self._keys.get(key)
            if use is None:
                use = self._keys[key] = _KeyUse()
                # Every flight already holding it paid for its copy.
                for other in flights.values():
                    if other.id != f.id and key in other.keys[other.credited :]:
                        use.payers.add(other.id)
                        use.holders.add(other.id)
                        self._of[other.id] = (*self._of.get(other.id, ()), key)
            use.holders.add(f.id)
        self._of[f.id] = (*self._of.get(f.id, ()), *shared)

    def join(self, f: _Keyed) -> None:
        """``f`` (not credited) holds keys already tracked: it paid for its copies."""
        mine = [k for k in f.keys if k in self._keys]
        if mine:
            self._groups = None
        for key in mine:
            use = self._keys[key]
            use.payers.add(f.id)
            use.holders.add(f.id)
        if mine:
            self._of[f.id] = (*self._of.get(f.id, ()), *mine)

    def remove(self, fid: int) -> None:
        if fid in self._of:
            self._groups = None
        for key in self._of.pop(fid, ()):
            use = self._keys.get(key)
            if use is None:
                continue
            use.payers.discard(fid)
            use.holders.discard(fid)
            if not use.holders:
                del self._keys[key]

    def tracking(self) -> Iterable[int]:
        """The flights with blocks counted here."""
        return self._of.keys()

    def tracked(self, fid: int) -> int:
        """How many of ``fid``'s blocks are counted here rather than as its own."""
        return len(self._of.get(fid, ()))

    def groups(self) -> list[KeyGroup]:
        """The tracked keys grouped by who pays for and who holds them: the blocks of
        one shared history have the same, so a reading sums each group once."""
        if self._groups is None:
            count: dict[tuple[frozenset[int], frozenset[int]], int] = {}
            for use in self._keys.values():
                who = (frozenset(use.payers), frozenset(use.holders))
                count[who] = count.get(who, 0) + 1
            self._groups = [KeyGroup(p, h, n) for (p, h), n in count.items()]
        return self._groups

    def __len__(self) -> int:
        return len(self._keys)


class EventHolders:
    """Block key -> the backends whose events report holding it (full-attention group).

    Most keys are held by one node or a few, so each maps to a small tuple."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[BlockKey, tuple[str, ...]] = {}

    def add(self, key: BlockKey, backend: str) -> None:
        held = self._by_key.get(key, ())
        if backend not in held:
            self._by_key[key] = (*held, backend)

    def discard(self, key: BlockKey, backend: str) -> None:
        held = self._by_key.get(key, ())
        if backend not in held:
            return
        rest = tuple(n for n in held if n != backend)
        if rest:
            self._by_key[key] = rest
        else:
            del self._by_key[key]

    def of(self, key: BlockKey) -> tuple[str, ...]:
        return self._by_key.get(key, ())

    def __len__(self) -> int:
        return len(self._by_key)
