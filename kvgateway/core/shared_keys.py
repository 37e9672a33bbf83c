"""Which in-flight sequences on a node hold, and which paid for, each shared prompt block:
the projection (:mod:`.projection`) counts a block shared through vLLM's prefix cache
once while any holder runs, plus one copy per holder that paid for its own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvgateway.core.prefix_keys import BlockKey


class _Keyed(Protocol):
    """What is read of a projected flight here."""

    @property
    def id(self) -> int: ...
    @property
    def keys(self) -> tuple[BlockKey, ...]: ...
    @property
    def credited(self) -> int: ...


@dataclass(slots=True)
class _KeyUse:
    payers: set[int] = field(default_factory=set)
    holders: set[int] = field(default_factory=set)


class SharedKeys:
    """Which flights hold and which paid for each prompt block shared on a node.

    A key is tracked here once a flight was credited it; until then each flight's
    keys are part of its own blocks. A tracked key holds, at a step, one copy per paying
    flight still running, and at least one while any holder runs.
    """

    __slots__ = ("_keys", "_of")

    def __init__(self) -> None:
        self._keys: dict[BlockKey, _KeyUse] = {}
        self._of: dict[int, tuple[BlockKey, ...]] = {}

    def add(self, f: _Keyed, flights: Mapping[int, _Keyed]) -> None:
        if not f.credited:
            return
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
        for key in mine:
            use = self._keys[key]
            use.payers.add(f.id)
            use.holders.add(f.id)
        if mine:
            self._of[f.id] = (*self._of.get(f.id, ()), *mine)

    def remove(self, fid: int) -> None:
        for key in self._of.pop(fid, ()):
            use = self._keys.get(key)
            if use is None:
                continue
            use.payers.discard(fid)
            use.holders.discard(fid)
            if not use.holders:
                del self._keys[key]

    def tracked(self, fid: int) -> int:
        """How many of ``fid``'s blocks are counted here rather than as its own."""
        return len(self._of.get(fid, ()))

    def uses(self) -> Iterator[_KeyUse]:
        return iter(self._keys.values())

    def __len__(self) -> int:
        return len(self._keys)
