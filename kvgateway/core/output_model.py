"""Learned output lengths: how much of its ``max_tokens`` a request really generates.

Reserving the full ``max_tokens`` is what makes "no preemption caused by the gateway" a
guarantee, and it costs capacity: nodes generate about half of it on average. With
``admission.output_reservation: learned`` a request reserves instead a high quantile
(``1 - admission.preemption_risk``) of the output lengths seen for requests like it:
the same model and client key, in the same ``max_tokens`` bucket (powers of two), never
more than its ``max_tokens``. Until a group has ``min_samples`` observations the
model-wide group of that bucket answers; until that has them, nothing does and the
request reserves its ``max_tokens``.

Observations are kept in bounded rings (the last ``window`` per group, so the model
follows a change of workload); the number of groups is bounded too (least recently
observed forgotten). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

ANY_KEY = "*"


def bucket_of(max_tokens: int) -> int:
    """``max_tokens`` rounded up to a power of two: requests with similar caps together."""
    return 1 << max(0, max_tokens - 1).bit_length()


@dataclass(frozen=True, slots=True)
class OutputModelStats:
    groups: int
    observations: int


class OutputModel:
    def __init__(self, *, window: int = 512, min_samples: int = 50, max_groups: int = 10_000):
        if window < 1 or min_samples < 1 or max_groups < 1:
            raise ValueError("window, min_samples and max_groups must be positive")
        self._window = window
        self._min = min(min_samples, window)
        self._max_groups = max_groups
        self._groups: OrderedDict[tuple[str, str, int], deque[int]] = OrderedDict()
        self._seen = 0

    def observe(self, model: str, key: str, max_tokens: int, output_tokens: int) -> None:
        """One finished sequence generated ``output_tokens`` of its ``max_tokens``."""
        if max_tokens < 1 or output_tokens < 0:
            return
        value = min(output_tokens, max_tokens)
        b = bucket_of(max_tokens)
        for group in (
            ((model, key, b), (model, ANY_KEY, b)) if key != ANY_KEY else ((model, key, b),)
        ):
            ring = self._groups.get(group)
            if ring is None:
                ring = self._groups[group] = deque(maxlen=self._window)
            ring.append(value)
            self._groups.move_to_end(group)
        self._seen += 1
        while len(self._groups) > self._max_groups:
            self._groups.popitem(last=False)

    def quantile(self, model: str, key: str, max_tokens: int, q: float) -> int | None:
        """The ``q`` quantile of learned output lengths for such a request (at most
        ``max_tokens``), or None while too little is known."""
        b = bucket_of(max_tokens)
        for group in ((model, key, b), (model, ANY_KEY, b)):
            ring = self._groups.get(group)
            if ring is not None and len(ring) >= self._min:
                values = sorted(ring)
                # Nearest rank, rounded up: never below the empirical quantile.
                rank = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
                return max(1, min(max_tokens, values[rank]))
        return None

    def reservation(self, model: str, key: str, max_tokens: int, risk: float) -> int:
        """Output tokens to reserve for one sequence: the ``1 - risk`` quantile, or
        ``max_tokens`` while nothing is known (or with ``risk`` 0)."""
        if risk <= 0:
            return max_tokens
        learned = self.quantile(model, key, max_tokens, 1.0 - risk)
        return max_tokens if learned is None else learned

    def statistics(self) -> OutputModelStats:
        return OutputModelStats(len(self._groups), self._seen)
