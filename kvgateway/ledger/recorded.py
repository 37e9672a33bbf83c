"""What this replica has recorded in Redis, per backend name, as far as it knows: every
grant Redis confirmed, less every release sent (or queued to be sent).

The others' holdings on a backend are a published total less this; a fallback caps
this replica at it while its lease may still be live; an absolute sync rewrites it.
No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvgateway.core.reservation import Amount


class Recorded:
    def __init__(self) -> None:
        self._by: dict[str, list[int]] = {}

    def add(self, name: str, tokens: int, seqs: int) -> None:
        m = self._by.setdefault(name, [0, 0])
        m[0] += tokens
        m[1] += seqs

    def give_back(self, items: Iterable[tuple[str, int, int]]) -> None:
        """Releases (backend, tokens, seqs) sent or on their way."""
        for name, tokens, seqs in items:
            self.add(name, -tokens, -seqs)

    def on(self, name: str) -> Amount:
        """What Redis records for this replica under ``name`` (never below zero)."""
        m = self._by.get(name, (0, 0))
        return Amount(max(0, m[0]), max(0, m[1]))

    def caps(self) -> dict[str, Amount]:
        return {n: self.on(n) for n in self._by}

    def names(self) -> set[str]:
        return set(self._by)

    def __contains__(self, name: object) -> bool:
        return name in self._by

    def rewrite(self, names: Sequence[str], own: Sequence[Amount], present: set[str]) -> None:
        """An absolute sync wrote ``own[i]`` under ``names[i]``. A name gone from the
        fleet with nothing left under it is forgotten (DNS members come and go: the next
        sync need not write them again)."""
        self._by = {
            n: [h.tokens, h.seqs]
            for n, h in zip(names, own, strict=True)
            if n in present or h.tokens or h.seqs
        }
