"""One admitted request on a node as the projection (:mod:`.projection`) sees it: a
:class:`Flight` grows a token per engine step from its reported length and ends at the
latest at its output bound; a queued one is a :func:`delayed` flight. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, fields

import numpy as np

from kvgateway.core.output_model import OutputShape
from kvgateway.core.prefix_keys import BlockKey, KeyGroup

# Tokens a flight may hold beyond its reported count: the token being computed and one
# step the scheduler may have allocated ahead. Steps the node is known to have taken since
# the report (``Flight.behind``) come on top.
AHEAD = 2
# Prompt tokens vLLM schedules in a request's first step at least (its smallest default).
FIRST_CHUNK_TOKENS = 2048


@dataclass(eq=False, slots=True)
class Flight:
    """One admitted request on a node, as the projection sees it."""

    id: int
    prompt: int  # tokens of its longest prompt
    n: int  # sequences
    bound: int  # output tokens per sequence, at most
    generated: int = 0  # per sequence, as the node last reported
    # The node reports its progress: its end is projected. Else it holds its bound.
    started: bool = False
    # Its prompt's full blocks (prefix-aware routing), the leading ones it was credited
    # (another flight held them) and those cached from its admission (its first chunk's).
    keys: tuple[BlockKey, ...] = ()
    credited: int = 0
    scheduled: int = 0
    # Learned output lengths of requests like it (None: ``bound`` is the length).
    shape: OutputShape | None = None
    # Steps before it starts (a queued request's place in a plan; 0 for admitted ones).
    delay: int = 0
    # Tokens held beyond the reported count (:func:`ahead_of`), and tokens a sequence
    # may grow by in one step: 1, or 1 + k where the node drafts k tokens a step.
    ahead: int = AHEAD
    rate: int = 1
    # The node's step count (its projection's clock) when this flight had generated 0.
    origin: int = 0
    # False: it runs unseen (not streamed), so it holds its whole bound until it ends.
    seen: bool = True
    # Steps the node has taken since this flight last reported (other flights' reports
    # say so): it holds that many tokens more than reported, and still ends no earlier
    # than its report says. Its projection keeps it; ``seen_at`` is the clock then (its
    # admission's until its first report).
    behind: int = 0
    seen_at: int = 0

    def tokens_at(self, t: int) -> int:
        """Tokens per sequence at step ``t`` from now, if it is still running."""
        if not self.seen:
            return self.prompt + self.bound + self.ahead
        grown = min(self.bound, self.generated + self.rate * max(0, t - self.delay))
        return self.prompt + grown + self.rate * self.behind + self.ahead

    @property
    def end(self) -> int | None:
        """Steps until it has ended at the latest; None while its end is unknown."""
        if not self.started:
            return None
        return self.delay + max(0, self.bound - self.generated)

    def survival(self, t: int) -> float:
        """Chance it is still running at step ``t`` (1 until its end without a shape)."""
        end = self.end
        if end is None:
            return 1.0
        if t >= end:
            return 0.0
        if self.shape is None:
            return 1.0
        return self.shape.surviving(self.generated, self.generated + max(0, t - self.delay))

    def blocks_at(self, t: int, block: int) -> tuple[float, float, float]:
        """(chance it is running, mean blocks, variance of blocks) at step ``t``.

        An unstarted flight with learned lengths never ends in the projection (its
        start is unknown) but holds at most ``prompt + min(L, t)`` tokens by step ``t``
        (``prompt + L`` from its admission if it is never seen), ``L`` its learned
        length: mean and variance come from the shape, a block added for rounding."""
        if not self.started and self.shape is not None:
            grown = self.generated + self.rate * max(0, t - self.delay)
            cap = min(self.bound, grown) if self.seen else self.bound
            o = self.shape.outlook(self.generated - 1, cap, 0.5)
            tokens = self.prompt + o.expected + self.ahead
            return 1.0, self.n * (tokens / block + 1.0), self.n * o.variance / (block * block)
        a = self.survival(t)
        if a <= 0.0:
            return 0.0, 0.0, 0.0
        one = blocks_of(self.tokens_at(t), block)
        return a, a * one * self.n, self.n * a * (1.0 - a) * one * one


def blocks_of(tokens: int, block: int) -> int:
    return -(-tokens // block)


def ahead_of(k: int) -> int:
    """Tokens a sequence holds beyond its reported count on a node drafting ``k`` tokens
    a step: those being computed (1 + k: the drafts verified and the bonus token), one
    step the scheduler may have allocated ahead (1 + k more), and the lookahead slots
    its drafter writes (vLLM's num_lookahead_tokens: k, or k + 1 for fill-in drafting).
    Without drafting, :data:`AHEAD`."""
    return AHEAD + 3 * k + 1 if k else AHEAD


def delayed(f: Flight, steps: int) -> Flight:
    """``f`` admitted ``steps`` from now: nothing held until then, then as a newcomer
    is (its end unknown until the node reports it)."""
    values = {x.name: getattr(f, x.name) for x in fields(Flight)}
    return _Later(**{**values, "started": False, "delay": steps, "origin": 0})


def frozen(f: Flight) -> Flight:
    """``f`` holding what it holds now at every step (its blocks no longer shared)."""
    grown = f.tokens_at(0) - f.prompt - f.ahead
    return Flight(f.id, f.prompt, f.n, grown, grown, seen=False, ahead=f.ahead)


class _Later(Flight):
    """A flight admitted later: it holds nothing before its start."""

    __slots__ = ()

    def tokens_at(self, t: int) -> int:
        if t < self.delay:
            return 0
        return Flight.tokens_at(self, t)

    def blocks_at(self, t: int, block: int) -> tuple[float, float, float]:
        if t < self.delay:
            return 0.0, 0.0, 0.0
        return Flight.blocks_at(self, t, block)


# Learned lengths: the curve is read every eighth of a block of steps, at most 128 times
# (between two readings the chance of the running sequences' ends moves while their
# blocks grow: read every half block, answers of nearly one length peaked unread
# between readings, up to 5 blocks over the budget on 63).
SAMPLES_PER_BLOCK = 8
MAX_SAMPLES = 128


def likeness(f: Flight) -> tuple[object, ...] | None:
    """What a newcomer's place in a curve depends on besides its prompt (its blocks at
    every step grow with its prompt, its spread does not): of two newcomers alike, the
    one with the longer prompt fits nowhere the other does not. None once started."""
    if f.started:
        return None
    shape = None if f.shape is None else id(f.shape)
    # Credited blocks count as their holders' while one runs: the deepest names them.
    credit = f.keys[f.credited - 1] if f.credited else None
    sizes = (f.n, f.bound, f.generated, f.delay, f.rate, f.ahead, f.behind)
    return (type(f), f.seen, *sizes, shape, f.credited, credit)


def is_static(f: Flight) -> bool:
    """Whether ``f`` holds the same at every step until it ends: unseen, not started."""
    return not (f.seen or f.started or f.delay)


def curve_steps(flights: tuple[Flight, ...], block: int) -> list[int]:
    """Steps where the curve can peak: just before each end, where an unended flight
    reaches its bound, now, and where lengths are learned on a grid and wherever a started
    flight takes a new block in the first block of steps (before most can end)."""
    steps = {0}
    horizon = 0
    learned = False
    for f in flights:
        learned = learned or f.shape is not None
        end = f.end
        if end is not None:
            if end > 0:
                steps.add(end - 1)
            horizon = max(horizon, end)
        else:
            reach = f.delay + max(0, f.bound - f.generated)
            steps.update((reach, f.delay + -(-max(0, f.bound - f.generated) // f.rate)))
            horizon = max(horizon, reach)
        if f.delay:
            steps.add(f.delay)
    if learned:
        stride = max(1, block // SAMPLES_PER_BLOCK, horizon // MAX_SAMPLES)
        steps.update(range(0, horizon, stride))
        for f in flights:
            if f.started:
                # The step at which its tokens first spill into a new block.
                t = f.delay + ((1 - f.tokens_at(f.delay)) % block or block)
                end = f.end
                if t < block and (end is None or t < end):
                    steps.add(t)
    return sorted(steps)


def fixed_curve(
    flights: tuple[Flight, ...],
    steps: list[int],
    block: int,
    tracked: Callable[[int], int],
    groups: Iterable[KeyGroup],
    static: AbstractSet[int],
) -> list[int] | None:
    """Blocks ``flights`` hold at each of ``steps`` (ascending), their prompt blocks
    counted in ``tracked`` aside and ``groups`` of shared ones added (``static``: other
    flights, running throughout, that may pay for or hold them); None unless every
    flight is streamed, admitted and without learned lengths.

    Such a flight holds ``ceil((c + t) / block)`` blocks per sequence at step ``t``
    (``c`` its tokens now) until its growth stops (its bound reached): then it ends if
    started, else holds on. Summed over the growing ones, with ``N`` their sequences,
    ``S`` the sum of their ``c`` and ``r = -c mod block``::

        sum ceil((c + t) / block) = (S + t N + sum r - s N + block * #{r < s}) / block

    for ``s = t mod block`` (all weighted by sequences). So one pass in the order of
    the steps and of the flights' growth ends reads every step: a flight leaves the sums
    once, and ``#{r < s}`` is a prefix sum over residues (a Fenwick tree).
    """
    for f in flights:
        if f.shape is not None or f.delay or not f.seen or f.rate != 1 or type(f) is not Flight:
            return None
    counts = [0] * (block + 1)  # Fenwick tree over residues 0 .. block-1

    def move(r: int, n: int) -> None:
        i = r + 1
        while i <= block:
            counts[i] += n
            i += i & -i

    def below(s: int) -> int:
        total, i = 0, s
        while i > 0:
            total += counts[i]
            i -= i & -i
        return total

    seqs = tokens = residues = held = tracked_alive = 0
    order: list[tuple[int, Flight, int]] = []
    for f in flights:
        c = f.prompt + f.ahead + f.behind + f.generated
        move(-c % block, f.n)
        seqs += f.n
        tokens += f.n * c
        residues += f.n * (-c % block)
        tracked_alive += tracked(f.id)
        order.append((max(0, f.bound - f.generated), f, c))
    order.sort(key=lambda e: e[0])
    # Shared blocks: per group, its live payers and holders (static flights live on).
    kept = list(groups)
    live = static | {f.id for f in flights}
    payers = [sum(1 for p in g.payers if p in live) for g in kept]
    holders = [sum(1 for h in g.holders if h in live) for g in kept]
    sizes = [g.keys for g in kept]
    of: dict[int, list[tuple[int, bool, bool]]] = {}
    for i, g in enumerate(kept):
        for fid in g.payers | g.holders:
            of.setdefault(fid, []).append((i, fid in g.payers, fid in g.holders))
    shared = sum(k * max(p, int(h > 0)) for k, p, h in zip(sizes, payers, holders, strict=True))
    out: list[int] = []
    i = 0
    for t in steps:
        while i < len(order) and order[i][0] <= t:
            stop, f, c = order[i]
            i += 1
            r = -c % block
            move(r, -f.n)
            seqs -= f.n
            tokens -= f.n * c
            residues -= f.n * r
            if not f.started:
                held += f.n * blocks_of(c + stop, block)  # at its bound from here on
                continue
            tracked_alive -= tracked(f.id)
            for k, paid, holds in of.get(f.id, ()):
                before = sizes[k] * max(payers[k], int(holders[k] > 0))
                payers[k] -= paid
                holders[k] -= holds
                shared += sizes[k] * max(payers[k], int(holders[k] > 0)) - before
        s = t % block
        growing = (tokens + t * seqs + residues - s * seqs + block * below(s)) // block
        out.append(growing + held - tracked_alive + shared)
    return out


def chances(fs: Sequence[Flight], t: np.ndarray) -> np.ndarray:
    """Each flight's chance of still running at each of steps ``t`` (ascending), one row
    a flight: :meth:`Flight.survival` for all at once."""
    generated = np.asarray([f.generated for f in fs], dtype=np.int64)[:, None]
    delay = np.asarray([f.delay for f in fs], dtype=np.int64)[:, None]
    later = generated + np.maximum(0, t - delay)
    a = np.ones(later.shape)
    shapes: dict[int, tuple[OutputShape, list[int]]] = {}
    for k, f in enumerate(fs):
        if f.started and f.shape is not None:
            shapes.setdefault(id(f.shape), (f.shape, []))[1].append(k)
    for shape, ks in shapes.values():
        now = shape.beyond_many(generated[ks, 0])[:, None]
        ratio = shape.beyond_many(later[ks]) / np.where(now > 0.0, now, 1.0)
        a[ks] = np.where(now > 0.0, np.minimum(1.0, ratio), 1.0)
    last = int(t[-1]) + 1 if len(t) else 0
    ends = np.asarray([f.end if f.end is not None else last for f in fs], dtype=np.int64)
    a[t >= ends[:, None]] = 0.0
    return a


def learned_curve(
    flights: tuple[Flight, ...],
    steps: list[int],
    block: int,
    tracked: Callable[[int], int],
    groups: Iterable[KeyGroup],
    static: AbstractSet[int],
) -> list[tuple[float, float, int]] | None:
    """(mean, variance, most) of the blocks ``flights`` hold at each of ``steps``, their
    tracked prompt blocks aside and ``groups`` of shared ones added (``static``: other
    flights, running throughout): what :meth:`Flight.blocks_at` gives step by step,
    read for every flight and step at once. None unless every flight is an admitted one.

    A flight with learned lengths that has not started holds its outlook's blocks (read
    one step at a time: there are few such, the ones just admitted); every other one
    holds ``ceil(tokens / block)`` per sequence while it runs, with its chance of running
    from its shape."""
    if any(type(f) is not Flight for f in flights):
        return None
    t = np.asarray(steps, dtype=np.int64)
    alive = np.zeros((len(flights), len(steps)))  # each flight's chance of running
    mean = np.zeros(len(steps))
    var = np.zeros(len(steps))
    most = np.zeros(len(steps), dtype=np.int64)
    plain = [i for i, f in enumerate(flights) if f.started or f.shape is None]
    if plain:
        fs = [flights[i] for i in plain]

        def col(values: list[int] | list[bool]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)[:, None]

        n = col([f.n for f in fs])
        # Size at the fastest growth; survival (chances) at the slowest, a token a step.
        steps_in = np.maximum(0, t - col([f.delay for f in fs]))
        grown = np.minimum(
            col([f.bound for f in fs]),
            col([f.generated for f in fs]) + col([f.rate for f in fs]) * steps_in,
        )
        tokens = np.where(
            col([f.seen for f in fs]),
            col([f.prompt + f.rate * f.behind + f.ahead for f in fs]) + grown,
            col([f.prompt + f.bound + f.ahead for f in fs]),
        )
        blocks = -(-tokens // block)
        alive[plain] = a = chances(fs, t)
        fl = n.astype(float)
        mean += (a * blocks * fl).sum(axis=0)
        var += (fl * a * (1.0 - a) * blocks * blocks).sum(axis=0)
        most += np.where(a > 0.0, n * blocks, 0).sum(axis=0)
    for i, f in enumerate(flights):
        if f.started or f.shape is None:
            continue
        # As blocks_at reads it (a = 1 throughout), at every step at once.
        grown = np.minimum(f.bound, f.generated + f.rate * np.maximum(0, t - f.delay))
        cap = grown if f.seen else np.full(t.shape, f.bound)
        expected, variance = f.shape.outlook_many(f.generated - 1, cap)
        mean += f.n * ((f.prompt + expected + f.ahead) / block + 1.0)
        var += f.n * variance / (block * block)
        held = f.prompt + (grown + f.rate * f.behind if f.seen else f.bound) + f.ahead
        most += f.n * -(-held // block)
        alive[i] = 1.0
    for i, f in enumerate(flights):
        held = tracked(f.id)
        if held:
            mean -= alive[i] * held
            most -= np.where(alive[i] > 0.0, held, 0)
    row = {f.id: i for i, f in enumerate(flights)}

    def rows(ids: frozenset[int]) -> np.ndarray:
        out = np.zeros((len(ids), len(steps)))
        for k, fid in enumerate(ids):
            out[k] = alive[row[fid]] if fid in row else float(fid in static)
        return out

    for g in groups:
        payers = rows(g.payers)
        others = rows(g.holders - g.payers)
        none_paid = np.prod(1.0 - payers, axis=0)
        mean += g.keys * (payers.sum(axis=0) + none_paid * (1.0 - np.prod(1.0 - others, axis=0)))
        anyone = np.concatenate((payers, others)).max(axis=0, initial=0.0)
        most += g.keys * np.maximum((payers > 0.0).sum(axis=0), (anyone > 0.0).astype(np.int64))
    return [(float(x), float(v), int(m)) for x, v, m in zip(mean, var, most, strict=True)]
