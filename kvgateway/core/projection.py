"""A node's KV use projected forward in engine steps: admission by the projected peak.

vLLM decodes every running sequence one token per engine step and frees its blocks at
its end, at the latest at its output bound: each :class:`Flight` grows a token a step
from its current length and vanishes at its end. A newcomer fits if the curve, with it
added, stays within the budget at every future step; it can only peak just before an
end (or where a flight whose end is unknown reaches its bound). Each assumption errs on
the safe side (docs/admission.md, "Admission by the projected KV peak"): an unreported
flight grows to its whole bound and stays; a reported one holds :data:`AHEAD` tokens
more plus a token per step the node took since; blocks are ``ceil(tokens / block)``
per sequence; shared prompt blocks count once while a holder lives (:class:`SharedKeys`,
:data:`FIRST_CHUNK_TOKENS`); with learned lengths the check is ``mean + z * stddev``,
never more than every flight that may still run holds. No I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from kvgateway.core.flight import (
    Flight,
    blocks_of,
    chances,
    curve_steps,
    fixed_curve,
    frozen,
    is_static,
    learned_curve,
    likeness,
)
from kvgateway.core.prefix_keys import BlockKey, ReadyKeys, SharedKeys, expected_copies

# Variance (blocks squared) below which a sum kept as flights come and go reads as none.
_NO_SPREAD = 1e-9
# Steps of reports a curve may be behind and still refuse a newcomer (a refusal is safe;
# "fits" is read fresh): routing across a saturated fleet re-reads fewer curves.
STALE_STEPS = 8


@dataclass(frozen=True, slots=True)
class _Static:
    """The step-invariant part of a node's curve, and the flights read step by step."""

    mean: float
    var: float
    most: int
    ids: AbstractSet[int]
    varying: tuple[Flight, ...]


@dataclass(frozen=True, slots=True)
class Peak:
    """The projected maximum of blocks in use (``mean + z * stddev``) and its step."""

    blocks: float
    step: int


class NodeProjection:
    """One node's flights and the curve they make, in blocks of ``block`` tokens (passed
    to every reading). The curve is kept per step read until the flights change (reports
    leave it stale: see :meth:`fits`); step-invariant flights are summed as they come."""

    def __init__(self) -> None:
        self._flights: dict[int, Flight] = {}
        self._shared = SharedKeys()
        # Prompt blocks the flights' node has cached or scheduled: shareable by newcomers.
        self._ready = ReadyKeys()
        self._base: dict[tuple[int, int], tuple[float, float, int]] = {}
        # Per kind of newcomer (:meth:`fits`), the shortest prompt refused since a change.
        self._refused: dict[tuple[object, ...], tuple[int, tuple[Flight, ...]]] = {}
        self._covers: dict[tuple[BlockKey, tuple[int, ...]], list[float]] = {}
        self._steps: dict[int, tuple[int, ...]] = {}
        self._static: dict[int, _Static] = {}
        # Per block size, what each step-invariant flight holds (it never changes), and
        # their sum (mean, variance, most) while one of them runs.
        self._held: dict[int, dict[int, tuple[float, float, int]]] = {}
        self._sums: dict[int, tuple[float, float, int]] = {}
        self._static_ids: set[int] = set()
        self._varying: dict[int, Flight] = {}
        self._started = 0
        self._clock = 0
        self._stale, self._built = False, 0  # reports since the curve was read, and when

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, fid: int) -> bool:
        return fid in self._flights

    @property
    def started(self) -> int:
        """How many flights the node reports progress for."""
        return self._started

    @property
    def clock(self) -> int:
        """Engine steps this node is known to have taken (the furthest any report puts
        it): plans made at one moment are kept in these steps."""
        return self._clock

    @property
    def flights(self) -> Iterable[Flight]:
        return self._flights.values()

    def get(self, fid: int) -> Flight | None:
        return self._flights.get(fid)

    def _changed(self) -> None:
        self._stale, self._built = False, self._clock
        self._refused.clear()
        self._covers.clear()
        self._base.clear()
        self._steps.clear()
        self._static.clear()

    def add(self, f: Flight) -> None:
        self._flights[f.id] = f
        f.seen_at = self._clock
        if is_static(f):
            self._static_ids.add(f.id)
            for block in self._sums:
                self._sum_in(block, f)
        else:
            self._varying[f.id] = f
        self._ready.mark(f.keys[: f.scheduled])
        if f.credited:
            self._shared.add(f, self._flights)
        elif f.keys and len(self._shared):
            self._shared.join(f)
        self._changed()

    def remove(self, fid: int) -> Flight | None:
        f = self._flights.pop(fid, None)
        if f is not None:
            self._unstatic(f)
            self._varying.pop(fid, None)
            for held in self._held.values():
                held.pop(fid, None)
            self._shared.remove(fid)
            if f.started:
                self._started -= 1
            self._ready.unmark(f.keys if f.started else f.keys[: f.scheduled])
            self._changed()
        return f

    def hold(self, fid: int) -> None:
        """``fid`` ended; its blocks stay until moved out: it holds what it holds now."""
        f = self.remove(fid)
        if f is not None:
            self.add(frozen(f))

    def progress(self, fid: int, generated: int, prompt: int | None = None) -> bool:
        """The node reports ``generated`` tokens per sequence for ``fid`` (and its count of
        the prompt). True on its first report (its end now projected: room may appear)."""
        f = self._flights.get(fid)
        if f is None or generated < f.generated:
            return False
        f.generated = min(generated, f.bound)
        if prompt is not None and prompt > 0:
            f.prompt = prompt
        first = not f.started
        if first:
            self._unstatic(f)
            self._varying[fid] = f
            f.started = True
            f.origin = self._clock - f.generated
            self._started += 1
            self._ready.mark(f.keys[f.scheduled :])
        if self._clock < f.origin + f.generated:
            self._clock = f.origin + f.generated
            for other in self._varying.values():  # the node stepped past their reports
                if other.started:
                    other.behind = self._clock - other.seen_at
        # A first report may itself be late: at most a token a step since its admission.
        f.seen_at = min(self._clock, f.seen_at + f.generated) if first else self._clock
        f.behind = self._clock - f.seen_at
        if first:  # it leaves the step-invariant sum
            self._changed()
        else:
            self._stale = True
        return first

    def _sum_in(self, block: int, f: Flight) -> None:
        """Adds a step-invariant flight's holding to the sum for ``block``."""
        held = self._held.setdefault(block, {})
        part = held.get(f.id)
        if part is None:
            _, blocks, spread = f.blocks_at(0, block)
            part = held[f.id] = (blocks, spread, f.n * blocks_of(f.tokens_at(0), block))
        mean, var, most = self._sums.get(block, (0.0, 0.0, 0))
        self._sums[block] = (mean + part[0], var + part[1], most + part[2])

    def _unstatic(self, f: Flight) -> None:
        """``f`` leaves the step-invariant sum (it ended, or its progress is reported)."""
        if f.id not in self._static_ids:
            return
        self._static_ids.discard(f.id)
        if not self._static_ids:
            self._sums.clear()  # from exactly nothing again: no rounding carried along
            return
        for block, (mean, var, most) in self._sums.items():
            part = self._held[block][f.id]
            # A variance summed up and down again may come back a rounding below zero.
            left = var - part[1]
            self._sums[block] = (mean - part[0], left if left > _NO_SPREAD else 0.0, most - part[2])

    def creditable(self, keys: tuple[BlockKey, ...]) -> int:
        """Leading ``keys`` an admitted flight holds (cached or scheduled by the node)."""
        return self._ready.leading(keys)

    def current_blocks(self, block: int) -> int:
        """Blocks the flights hold now (as projected at step 0)."""
        self._fresh()
        return math.ceil(self._base_at(block, 0)[0] - 1e-9)

    def _fresh(self) -> None:
        if self._stale:
            self._changed()

    def peak(
        self, block: int, z: float, extra: Iterable[Flight] = (), above: float | None = None
    ) -> Peak:
        """The curve's maximum from now on, with ``extra`` flights (not added) in it; or,
        given ``above``, its first reading past that, as soon as one is (the rest of the
        curve is then not read)."""
        self._fresh()
        return self._peak(block, z, tuple(extra), above)

    def _peak(self, block: int, z: float, added: tuple[Flight, ...], above: float | None) -> Peak:
        steps = self._base_steps(block)
        if added:
            steps = tuple(sorted({*steps, *curve_steps(added, block)}))
        credit = [(f, self._cover(f, steps)) for f in added]
        self._fill(block, steps)
        best = Peak(0.0, 0)
        for j, t in enumerate(steps):
            mean, var, most = self._base_at(block, t)
            for f, covers in credit:
                a, blocks, spread = f.blocks_at(t, block)
                if a <= 0.0:
                    continue
                # Credited blocks are another's copy while a holder runs, then its own.
                cover = covers[j]
                mean += blocks - a * cover * f.credited
                var += spread
                most += f.n * blocks_of(f.tokens_at(t), block) - (f.credited if cover else 0)
            value = min(mean + z * math.sqrt(var), float(most)) if var > 0.0 else mean
            if value > best.blocks:
                best = Peak(value, t)
                if above is not None and value > above:
                    break
        return best

    def fits(
        self, block: int, budget_blocks: int, z: float, extra: Iterable[Flight], stale: bool = False
    ) -> bool:
        """Whether the curve with ``extra`` stays within ``budget_blocks``. Until the
        flights change, one like a newcomer refused (:func:`~.flight.likeness`, beside the
        same others) with a prompt no shorter is refused unread. ``stale``: a refusal may
        come from a curve read :data:`STALE_STEPS` steps ago; "fits" is read fresh."""
        if self._stale and not (stale and self._clock - self._built <= STALE_STEPS):
            self._changed()
        added = tuple(extra)
        alike = likeness(added[0]) if added else None
        key = None if alike is None else (block, budget_blocks, z, alike, *map(id, added[1:]))
        if key in self._refused and added[0].prompt >= self._refused[key][0]:
            return False
        limit = budget_blocks + 1e-9
        room = self._peak(block, z, added, limit).blocks <= limit
        if room and self._stale:
            self._changed()
            room = self._peak(block, z, added, limit).blocks <= limit
        if room:
            return True
        if key is not None:  # the shortest refused yet; kept alive, their ids stay theirs
            self._refused[key] = (added[0].prompt, added)
        return False

    def peak_at(self, block: int, t: int, z: float = 0.0) -> Peak:
        """Blocks the admitted flights use at step ``t`` (``mean + z * stddev``)."""
        self._fresh()
        mean, var, most = self._base_at(block, t)
        return Peak(min(mean + z * math.sqrt(var), float(most)) if var > 0.0 else mean, t)

    def _cover(self, f: Flight, steps: tuple[int, ...]) -> list[float]:
        """At each of ``steps``, the chance that an admitted flight holding ``f``'s
        credited blocks still runs (a holder of its deepest credited block holds every
        block before it); kept until the flights change (a walk asks it of many)."""
        if not f.credited:
            return [0.0] * len(steps)
        key = f.keys[f.credited - 1]
        covers = self._covers.get((key, steps))
        if covers is None:
            holders = [other for other in self._flights.values() if key in other.keys]
            if any(not h.started for h in holders):  # its end unknown: it runs throughout
                covers = [1.0] * len(steps)
            else:
                alive = chances(holders, np.asarray(steps, dtype=np.int64)) if holders else None
                covers = [0.0] * len(steps) if alive is None else 1.0 - np.prod(1.0 - alive, 0)
            covers = self._covers[(key, steps)] = [float(c) for c in covers]
        return covers

    def _base_steps(self, block: int) -> tuple[int, ...]:
        steps = self._steps.get(block)
        if steps is None:
            # Step-invariant flights hold the same at every step: no step of theirs can
            # be where the curve peaks.
            steps = self._steps[block] = tuple(curve_steps(tuple(self._varying.values()), block))
        return steps

    def _fill(self, block: int, steps: tuple[int, ...]) -> None:
        """Reads the curve at the ``steps`` not read yet, in one pass over the flights."""
        todo = [t for t in steps if (block, t) not in self._base]
        if len(todo) < 4:
            return
        static, shared = self._static_part(block), self._shared
        args = (static.varying, todo, block, shared.tracked, shared.groups(), static.ids)
        part = fixed_curve(*args)  # without learned lengths; else each step's spread too
        rows = [(x, 0.0, x) for x in part] if part is not None else learned_curve(*args)
        if rows is not None:
            for t, (m, v, x) in zip(todo, rows, strict=True):
                self._base[(block, t)] = (static.mean + m, static.var + v, static.most + x)

    def _base_at(self, block: int, t: int) -> tuple[float, float, int]:
        """(mean, variance, most) of the blocks the flights hold at step ``t``: ``most``
        is what they hold if every one that may still run does."""
        cached = self._base.get((block, t))
        if cached is not None:
            return cached
        static = self._static_part(block)
        mean = static.mean
        var = static.var
        most = static.most
        alive: dict[int, float] = {}  # the varying flights' chances; static ones run
        shared = self._shared
        for f in static.varying:
            a, blocks, spread = f.blocks_at(t, block)
            if a <= 0.0:
                continue
            alive[f.id] = a
            tracked = shared.tracked(f.id)
            mean += blocks - a * tracked
            var += spread
            most += f.n * blocks_of(f.tokens_at(t), block) - tracked
        ids = static.ids
        for group in shared.groups():
            paid = [alive.get(fid, float(fid in ids)) for fid in group.payers]
            held = [alive.get(fid, float(fid in ids)) for fid in group.holders - group.payers]
            mean += group.keys * expected_copies(paid, held)
            most += group.keys * max(
                sum(1 for a in paid if a > 0.0), int(any(a > 0.0 for a in (*paid, *held)))
            )
        self._base[(block, t)] = (mean, var, most)
        return mean, var, most

    def _static_part(self, block: int) -> _Static:
        """The flights whose holding is the same at every step (unseen and not started),
        summed as they come and go less what the shared blocks count for them, and the
        others, read step by step."""
        static = self._static.get(block)
        if static is not None:
            return static
        if self._static_ids and block not in self._sums:
            for fid in self._static_ids:
                self._sum_in(block, self._flights[fid])
        mean, var, most = self._sums.get(block, (0.0, 0.0, 0))
        shared = self._shared
        for fid in shared.tracking():
            if fid in self._static_ids:
                tracked = shared.tracked(fid)
                mean -= tracked
                most -= tracked
        static = self._static[block] = _Static(
            mean, var, most, self._static_ids, tuple(self._varying.values())
        )
        return static
