"""What an absolute sync writes to Redis for this replica: its holdings per backend name,
as later releases will give them back.

- :class:`UnsentGrants`: grants not yet recorded by their own confirm, from the moment
  they are made until their confirm ends (or their release, if it comes first): by
  reservation id, and summed per backend name. A snapshot leaves them out; each is
  recorded once, by its confirm (or, made in the fallback, by the next snapshot once
  its confirm has let it go).
- :func:`settled_holding`: one name's holding, summed over every backend object of that
  name (a draining one, removed or replaced by a reload, included: its releases are
  subtracted there later), less those unsent grants.

No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvgateway.core.backends import Backend
from kvgateway.core.reservation import Amount, Reservation


class UnsentGrants:
    def __init__(self) -> None:
        self._by_id: dict[int, Reservation] = {}
        self._by_name: dict[str, list[int]] = {}

    def add(self, r: Reservation) -> None:
        self._by_id[r.id] = r
        by = self._by_name.setdefault(r.backend.name, [0, 0])
        by[0] += r.tokens
        by[1] += r.seqs

    def sent(self, r: Reservation) -> bool:
        """Let ``r`` go; False if it was not there."""
        if self._by_id.pop(r.id, None) is None:
            return False
        by = self._by_name[r.backend.name]
        by[0] -= r.tokens
        by[1] -= r.seqs
        return True

    def on(self, name: str) -> Amount:
        by = self._by_name.get(name, (0, 0))
        return Amount(by[0], by[1])


def settled_holding(
    name: str,
    backends: Iterable[Backend],
    own: Callable[[Backend], Amount],
    unsent: UnsentGrants,
) -> Amount:
    """This replica's holding under ``name`` for an absolute sync (see the module)."""
    tokens = seqs = 0
    for b in backends:
        if b.name == name:
            mine = own(b)
            tokens += mine.tokens
            seqs += mine.seqs
    out = unsent.on(name)
    return Amount(max(0, tokens - out.tokens), max(0, seqs - out.seqs))
