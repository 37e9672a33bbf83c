"""Learned output lengths: how much of its ``max_tokens`` a request really generates.

With ``admission.output_reservation: learned`` the projection (:mod:`kvgateway.core.
projection`) reads when a running stream is likely to end from the lengths seen for
requests like it: the same model and client key, in the same ``max_tokens`` bucket
(powers of two). A sequence that ran to its own cap is read as running to the cap of the
request asking (it was cut, not finished: :data:`CENSORED`). Until a group has
``min_samples`` observations nothing is known and its requests are bounded by their
``max_tokens``. Past the longest answer seen, the chance of a longer one falls off
exponentially at the answers' mean excess over their median (a geometric length's own
tail), so a long answer is never taken as impossible.

Observations are kept in bounded rings (the last ``window`` per group, so the model
follows a change of workload); the number of groups is bounded too (least recently
observed forgotten). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import accumulate
from statistics import NormalDist

import numpy as np

ANY_KEY = "*"


def client_key(authorization: str) -> str:
    """A stable, non-secret id of the client's API key (the learning groups' key)."""
    token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
    if not token:
        return ANY_KEY
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:12]


# Answers a group must hold before a node's context may cut its requests' max_tokens.
CUT_SAMPLES = 32
# A sequence that ran to its cap: it would have gone on, how far nobody saw. Kept as a
# length past every cap, so that it counts as running to the cap of whichever request
# reads it (one capped at 129 says nothing about where a 256-token one stops).
CENSORED = 1 << 40
# Answers a group holds before its shape is made anew only every 1/32 of them.
FRESH_FROM = 64
# Outlooks an OutputShape keeps (forgotten all at once past this).
_MEMO = 4096


def bucket_of(max_tokens: int) -> int:
    """``max_tokens`` rounded up to a power of two: requests with similar caps together."""
    return 1 << max(0, max_tokens - 1).bit_length()


def z_of(risk: float) -> float:
    """The standard normal quantile that ``risk`` leaves above it (0 at risk 0.5)."""
    if not 0.0 < risk < 1.0:
        raise ValueError(f"risk must be in (0, 1), got {risk}")
    return max(0.0, NormalDist().inv_cdf(1.0 - risk))


@dataclass(frozen=True, slots=True)
class Outlook:
    """What is left to expect of one sequence's output (in total tokens, at most its
    ``max_tokens``), given how far it has come."""

    expected: float
    variance: float
    quantile: int


class OutputShape:
    """A group's observed output lengths, sorted, with running sums, so that moments
    and quantiles conditional on "generated ``g`` tokens and not finished" cost a
    bisection. Immutable: the model makes a new one when the group changes."""

    __slots__ = (
        "_array",
        "_censored",
        "_memo",
        "_n",
        "_prefix",
        "_sum",
        "_sum2",
        "_tail",
        "_top",
        "_values",
    )

    def __init__(self, values: list[int]) -> None:
        if not values:
            raise ValueError("an output shape needs at least one observation")
        self._values = sorted(values)
        self._n = len(self._values)
        self._sum = [0, *accumulate(self._values)]
        self._sum2 = [0, *accumulate(v * v for v in self._values)]
        finite = [v for v in self._values if v < CENSORED]
        self._censored = self._n - len(finite)
        self._top = finite[-1] if finite else 0
        # Past the longest answer seen the lengths go on falling off as they did past the
        # median: exponentially, at their mean excess over it.
        median = finite[len(finite) // 2] if finite else 0
        excess = [v - median for v in finite if v > median]
        self._tail = max(1.0, sum(excess) / len(excess)) if excess else 1.0
        # Outlooks read before: a projection reads the same few at every step it checks.
        self._memo: dict[tuple[int, int, float], Outlook] = {}
        self._array: np.ndarray | None = None
        self._prefix: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def size(self) -> int:
        return self._n

    @property
    def longest(self) -> int:
        """The longest answer seen (0: every one ran to its cap)."""
        return self._top

    def _beyond(self, x: int) -> float:
        """Chance of an answer longer than ``x`` (any cap aside): the answers seen, and
        past the longest one an exponential tail."""
        if self._censored == self._n:
            return 1.0
        if x < self._top:
            return (self._n - bisect_right(self._values, x)) / self._n
        return (self._censored + math.exp(-(x - self._top) / self._tail)) / self._n

    def beyond_many(self, x: np.ndarray) -> np.ndarray:
        """:meth:`_beyond` of every element of ``x`` (integers), at once."""
        if self._censored == self._n:
            return np.ones(x.shape)
        if self._array is None:
            self._array = np.asarray(self._values, dtype=np.int64)
        seen = (self._n - np.searchsorted(self._array, x, side="right")) / self._n
        past = np.maximum(x, self._top) - self._top
        tail = (self._censored + np.exp(-past / self._tail)) / self._n
        return np.where(x < self._top, seen, tail)

    def surviving(self, generated: int, later: int) -> float:
        """Chance that a sequence still running after ``generated`` tokens runs past
        ``later``."""
        now = self._beyond(generated)
        if now <= 0.0:
            return 1.0
        return min(1.0, self._beyond(later) / now)

    def shortest_cut(self, risk: float, assumed: int = 0) -> int | None:
        """The shortest cap an answer passes with chance at most ``risk`` (None: none
        does, too many ran to their caps). Of the :data:`CENSORED` lengths, ``assumed``
        were never seen (a length taken to run on, not one that did): past the longest
        answer seen they fall off as the tail does; the others pass every cap."""
        n, censored = self._n, self._censored
        allowed = n * risk - (censored - assumed)  # answers that may pass, of n
        if allowed <= 0:
            return None
        finite = self._values[: n - censored]
        # Below the longest answer seen every censored length passes the cap too: at
        # most floor(allowed - assumed) of the answers seen may.
        passing = math.floor(allowed - assumed)
        if passing >= len(finite):
            return 1
        if passing >= 1:
            return finite[len(finite) - 1 - passing]
        if allowed >= assumed:
            return self._top
        # Past it: assumed * exp(-(cap - top) / tail) <= allowed.
        return self._top + math.ceil(self._tail * math.log(assumed / allowed))

    def outlook(self, generated: int, max_tokens: int, q: float) -> Outlook:
        """Total output of a sequence capped at ``max_tokens`` that has generated
        ``generated`` tokens and is still running: the observations above
        ``generated``, each capped. Past every observation (or at its cap) it is taken
        to run to ``max_tokens``: nothing seen says where it stops."""
        key = (generated, max_tokens, q)
        seen = self._memo.get(key)
        if seen is not None:
            return seen
        if len(self._memo) >= _MEMO:
            self._memo.clear()
        seen = self._memo[key] = self._outlook(generated, max_tokens, q)
        return seen

    def outlook_many(self, generated: int, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`outlook`'s mean and variance for each of ``caps`` (integers below
        :data:`CENSORED`), at once: the same sums, so the same floats."""
        if self._array is None:
            self._array = np.asarray(self._values, dtype=np.int64)
        if self._prefix is None:
            finite = self._n - self._censored  # the caps never reach past these
            self._prefix = (
                np.asarray(self._sum[: finite + 1], dtype=np.int64),
                np.asarray(self._sum2[: finite + 1], dtype=np.int64),
            )
        values, (s1, s2) = self._array, self._prefix
        lo = bisect_right(self._values, generated)
        count = self._n - lo
        if count == 0:
            return caps.astype(float), np.zeros(caps.shape)
        hi = np.maximum(lo, np.searchsorted(values, caps, side="left"))
        capped = self._n - hi
        total = s1[hi] - s1[lo] + capped * caps
        total2 = s2[hi] - s2[lo] + capped * caps * caps
        mean = total / count
        variance = np.maximum(0.0, total2 / count - mean * mean)
        done = caps <= generated
        return np.where(done, caps, mean), np.where(done, 0.0, variance)

    def _outlook(self, generated: int, max_tokens: int, q: float) -> Outlook:
        vals = self._values
        lo = bisect_right(vals, generated)
        count = self._n - lo
        if generated >= max_tokens or count == 0:
            return Outlook(float(max_tokens), 0.0, max_tokens)
        hi = max(lo, bisect_left(vals, max_tokens))
        capped = self._n - hi
        total = self._sum[hi] - self._sum[lo] + capped * max_tokens
        total2 = self._sum2[hi] - self._sum2[lo] + capped * max_tokens * max_tokens
        mean = total / count
        variance = max(0.0, total2 / count - mean * mean)
        # Nearest rank, rounded up: never below the empirical quantile.
        rank = min(count - 1, max(0, math.ceil(q * count) - 1))
        return Outlook(mean, variance, min(max_tokens, vals[lo + rank]))


@dataclass(frozen=True, slots=True)
class OutputModelStats:
    groups: int
    observations: int


class LearnedLengths:
    """One group's observed lengths, as they are when read: a request planned before
    anything was learned reads what is known by the time it is admitted."""

    __slots__ = ("_cuts", "_fresh", "_min", "_ring", "_shape")

    def __init__(self, window: int, min_samples: int) -> None:
        self._ring: deque[int] = deque(maxlen=window)
        self._min = min_samples
        self._shape: OutputShape | None = None
        self._cuts: dict[float, int | None] = {}
        self._fresh = 0  # answers added since the shape was made

    def add(self, value: int) -> None:
        self._ring.append(value)
        self._fresh += 1
        # Past FRESH_FROM answers the shape is made anew once 1/32 of them are new: it
        # moves little with each, and the flights admitted meanwhile share one shape
        # (the projection reads each distinct shape in a pass of its own).
        if len(self._ring) < FRESH_FROM or self._fresh * 32 >= len(self._ring):
            self._shape = None
            self._cuts.clear()

    @property
    def learning(self) -> bool:
        """Too few answers yet for a node's context to cut such a request (a cut may be
        allowed once :data:`CUT_SAMPLES` are seen)."""
        return len(self._ring) < CUT_SAMPLES

    def shortest_cut(self, risk: float) -> int | None:
        """The shortest ``max_tokens`` that cuts such an answer short with chance at most
        ``risk`` (None while too little is known, or when too many ran to their caps):
        what a node's context may cut the request to without changing its answer but
        that rarely. The one answer :attr:`shape` adds that runs to its cap is an
        assumption, not a sighting: it falls off past the longest seen as the tail does."""
        if risk in self._cuts:
            return self._cuts[risk]
        shape = None if self.learning else self.shape
        cut = None if shape is None else shape.shortest_cut(risk, assumed=1)
        if cut is not None:
            # The tail's scale, read off a few hundred answers at most, is itself
            # uncertain: never closer than twice the longest answer seen.
            cut = max(cut, 2 * shape.longest) if shape is not None else None
        self._cuts[risk] = cut
        return cut

    @property
    def shape(self) -> OutputShape | None:
        """The lengths seen, and one more that runs to its cap (None while fewer than
        ``min_samples`` were seen): the next answer outruns all ``n`` seen with chance
        ``1 / (n + 1)``, and how far nothing seen says. Few answers seen, each running
        sequence may well run to its cap; many, and the model is what they show."""
        if len(self._ring) < self._min:
            return None
        if self._shape is None:
            self._shape = OutputShape([*self._ring, CENSORED])
            self._fresh = 0
        return self._shape


class OutputModel:
    def __init__(self, *, window: int = 512, min_samples: int = 4, max_groups: int = 10_000):
        if window < 1 or min_samples < 1 or max_groups < 1:
            raise ValueError("window, min_samples and max_groups must be positive")
        self._window = window
        self._min = min(min_samples, window)
        self._max_groups = max_groups
        self._groups: OrderedDict[tuple[str, str, int], LearnedLengths] = OrderedDict()
        self._seen = 0

    def group(self, model: str, key: str, max_tokens: int) -> LearnedLengths:
        """The lengths of such requests (the client's own), learned or still to learn."""
        name = (model, key, bucket_of(max_tokens))
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = LearnedLengths(self._window, self._min)
            while len(self._groups) > self._max_groups:
                self._groups.popitem(last=False)
        return group

    def observe(
        self, model: str, key: str, max_tokens: int, output_tokens: int, cap: int | None = None
    ) -> bool:
        """One finished sequence generated ``output_tokens`` of its ``max_tokens``; one
        that reached its cap (``max_tokens``, or the ``cap`` a node's context cut it to)
        was cut there, and is kept as :data:`CENSORED`. True when this answer is the one
        that makes its group no longer :attr:`~LearnedLengths.learning`: requests
        waiting for a cut may now be served."""
        if max_tokens < 1 or output_tokens < 0:
            return False
        value = output_tokens if output_tokens < min(max_tokens, cap or max_tokens) else CENSORED
        # Only the client's own group: another key's answers never say when a client's
        # answers end (one key could teach the gateway that every answer is short, and
        # every other key's flood would be admitted as if it were).
        group = self.group(model, key, max_tokens)
        was_learning = group.learning
        group.add(value)
        self._groups.move_to_end((model, key, bucket_of(max_tokens)))
        self._seen += 1
        return was_learning and not group.learning

    def shape(self, model: str, key: str, max_tokens: int) -> OutputShape | None:
        """The learned lengths for such a request (its client's own), or None while too
        little is known."""
        group = self._groups.get((model, key, bucket_of(max_tokens)))
        return None if group is None else group.shape

    def statistics(self) -> OutputModelStats:
        return OutputModelStats(
            sum(1 for g in self._groups.values() if g.shape is not None), self._seen
        )
