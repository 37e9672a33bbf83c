"""One admitted request on a node as the projection (:mod:`.projection`) sees it: a
:class:`Flight` grows a token per engine step from its reported length and ends at the
latest at its output bound; a queued one is a :func:`delayed` flight. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvgateway.core.output_model import OutputShape
from kvgateway.core.prefix_keys import BlockKey

# Tokens a flight may hold beyond its reported count: the token being computed and one
# step the scheduler may have allocated ahead.
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
    # Tokens held beyond the reported count: AHEAD, plus a draft model's lookahead.
    ahead: int = AHEAD
    # The node's step count (its projection's clock) when this flight had generated 0.
    origin: int = 0
    # False: it runs unseen (not streamed), so it holds its whole bound until it ends.
    seen: bool = True

    def tokens_at(self, t: int) -> int:
        """Tokens per sequence at step ``t`` from now, if it is still running."""
        if not self.seen:
            return self.prompt + self.bound + self.ahead
        return self.prompt + min(self.bound, self.generated + max(0, t - self.delay)) + self.ahead

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
            grown = self.generated + max(0, t - self.delay)
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


def delayed(f: Flight, steps: int) -> Flight:
    """``f`` admitted ``steps`` from now: nothing held until then, then as a newcomer
    is (its end unknown until the node reports it)."""
    values = {x.name: getattr(f, x.name) for x in fields(Flight)}
    return _Later(**{**values, "started": False, "delay": steps, "origin": 0})


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
