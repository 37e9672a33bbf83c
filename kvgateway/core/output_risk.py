"""Pooled output risk: what a node must keep for its requests' outputs in learned mode.

A node preempts only when the *sum* of its in-flight sequences' growth exceeds its
pool, and the sum of N independent output lengths varies far less than each one (its
spread grows as sqrt(N), the sum as N). Reserving every request's own high quantile
(the per-request view) holds about ``max_tokens`` when a third of answers run to their
cap; here instead:

- each request's reservation covers its *expected* output (:attr:`OutputOutlook.covered`,
  the learned mean), its prompt as planned, in whole blocks (its *base*);
- each node keeps one margin for all its learned requests together (:class:`NodeRisk`):
  what they are still expected to generate beyond what their bases cover, plus
  ``z(preemption_risk) * sqrt(sum of their output variances)``. With fewer than
  :data:`POOLED_MIN_SEQUENCES` sequences in flight (too few for the normal
  approximation of a skewed, capped length) the spread is the sum of the per-request
  quantile gaps instead, as before; it is never more than that sum, and the margin
  never more than what the requests' ``max_tokens`` would have reserved.

A stream's expectation is conditional on what it has generated (counted live): a
sequence past its mean is expected to run longer, one near its cap has little spread
left, and the margin puts every stream a block ahead of its output at each recount, so
the node's book does not fall below what it holds. A non-streamed answer is not counted live:
its outlook stays unconditional. A request of ``n`` sequences counts them as ``n``
independent draws (its output is counted over all of them, so each is taken to be at
the mean count).

Nothing here does I/O or reads a clock; :class:`~kvgateway.core.admission_core.
AdmissionCore` applies the margins to the nodes' books.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from kvgateway.core.demand import demand_tokens
from kvgateway.core.output_model import OutputShape

# Below this many learned sequences on a node the normal approximation is not trusted.
POOLED_MIN_SEQUENCES = 8


def z_of(risk: float) -> float:
    """The standard normal quantile that ``risk`` leaves above it (0 at risk 0.5)."""
    if not 0.0 < risk < 1.0:
        raise ValueError(f"risk must be in (0, 1), got {risk}")
    return max(0.0, NormalDist().inv_cdf(1.0 - risk))


@dataclass(frozen=True, slots=True)
class OutputOutlook:
    """A learned request's output plan, carried on its demand (per sequence unless said)."""

    shape: OutputShape
    max_tokens: int
    risk: float
    # z_of(risk), once.
    z: float
    # Output tokens each sequence's base reservation covers (the learned mean).
    covered: int
    # Output tokens per sequence the routing check used (an upper bound of what the
    # request can add to a node: its base and its share of the node's margin).
    checked: int
    # demand.tokens less the base (all sequences): what the grant may add as margin.
    slack: int
    # What max_tokens would reserve beyond the base (all sequences): the margin's cap.
    ceiling: int
    # Its part of a node's margin when it joins (all sequences, nothing generated yet).
    joining: Contribution | None = None


def plan_output(
    shape: OutputShape,
    max_tokens: int,
    risk: float,
    prompts: list[int],
    n: int,
    block: int,
) -> tuple[int, OutputOutlook]:
    """KV tokens the routing check reserves for a learned request, and its outlook.

    The check uses per sequence ``max(quantile, mean + z * sd)`` (never past
    ``max_tokens``): at least what admitting it can add to any node's pooled margin, so
    a node that passes the check still holds the request and the margin after it."""
    o = shape.outlook(-1, max_tokens, 1.0 - risk)
    z = z_of(risk)
    covered = max(1, min(max_tokens, math.ceil(o.expected)))
    spread = math.ceil(o.expected + z * math.sqrt(o.variance))
    checked = max(covered, min(max_tokens, max(o.quantile, spread)))
    tokens = demand_tokens(prompts, checked, n, block)
    base = demand_tokens(prompts, covered, n, block)
    full = demand_tokens(prompts, max_tokens, n, block)
    outlook = OutputOutlook(
        shape, max_tokens, risk, z, covered, checked, slack=tokens - base, ceiling=full - base
    )
    joining = contribution(outlook, n, -1, block)
    outlook = replace(outlook, joining=joining)
    # Alone on a node its margin is its own gap rounded up to a block, which rounding
    # the sequences one by one may not leave in the slack: the check covers it, so a
    # node that passes the check when idle can take the request.
    alone = NodeRisk(block).added_by(joining)
    if alone > outlook.slack:
        outlook = replace(outlook, slack=alone)
        tokens = base + alone
    return tokens, outlook


def margin_beyond_slack(risk: NodeRisk | None, block: int, o: OutputOutlook) -> int:
    """What a node's margin would grow by, past the request's slack, if ``o``'s request
    joined it (``risk``: the node's learned requests; None, none). The routing check
    counts the slack; the sum is rounded up to a block and capped by its members'
    ceilings, so joining may add more, and a node takes the request only if its room
    holds that too."""
    c = o.joining
    if c is None:
        return 0
    if risk is None:
        risk = NodeRisk(block)
    return max(0, risk.added_by(c) - o.slack)


@dataclass(frozen=True, slots=True)
class Contribution:
    """One request's part of its node's margin, in tokens over all its sequences."""

    # Expected output beyond what the base covers (at least a block ahead of a stream).
    excess: float = 0.0
    variance: float = 0.0
    # The per-request view: its quantile beyond its expectation.
    gap: float = 0.0
    ceiling: float = 0.0
    seqs: int = 0
    # z of the risk it was planned with (a reload may change the risk mid-flight).
    z: float = 0.0


def contribution(o: OutputOutlook, seqs: int, generated: int, block: int) -> Contribution:
    """``o``'s request of ``seqs`` sequences, each having generated ``generated`` tokens
    (-1: not counted live, unconditional)."""
    now = o.shape.outlook(generated, o.max_tokens, 1.0 - o.risk)
    ahead = generated + block if generated >= 0 else 0
    expected = max(now.expected, float(ahead))
    return Contribution(
        excess=seqs * max(0.0, expected - o.covered),
        variance=seqs * now.variance,
        gap=seqs * max(0.0, now.quantile - now.expected),
        ceiling=float(o.ceiling),  # what max_tokens reserves beyond the base: never more
        seqs=seqs,
        z=o.z,
    )


@dataclass(slots=True)
class NodeRisk:
    """The learned requests in flight on one node, summed; and the margin they need."""

    block: int
    members: dict[int, Contribution] = field(default_factory=dict)
    excess: float = 0.0
    variance: float = 0.0
    gap: float = 0.0
    ceiling: float = 0.0
    seqs: int = 0
    # The margin now in the node's book (tokens, whole blocks).
    held: int = 0
    # How many members were planned with each z: the margin uses the largest, whichever
    # member last changed (a reload that changes preemption_risk mid-flight).
    zs: dict[float, int] = field(default_factory=dict)

    def put(self, rid: int, c: Contribution) -> None:
        """Add request ``rid``'s contribution, or replace it."""
        self._apply(self.members.get(rid), -1)
        self.members[rid] = c
        self._apply(c, 1)

    def remove(self, rid: int) -> None:
        c = self.members.pop(rid, None)
        if not self.members:
            self.excess = self.variance = self.gap = self.ceiling = 0.0
            self.seqs = 0
            self.zs.clear()
        elif c is not None:
            self._apply(c, -1)

    def _apply(self, c: Contribution | None, sign: int) -> None:
        if c is None:
            return
        self.excess += sign * c.excess
        self.variance += sign * c.variance
        self.gap += sign * c.gap
        self.ceiling += sign * c.ceiling
        self.seqs += sign * c.seqs
        left = self.zs.get(c.z, 0) + sign
        if left > 0:
            self.zs[c.z] = left
        else:
            self.zs.pop(c.z, None)

    def need(self) -> int:
        """The margin the node's requests need now, in whole blocks (at the most
        cautious risk any of them was planned with)."""
        if not self.members:
            return 0
        return self._margin(
            self.excess,
            self.variance,
            self.gap,
            self.ceiling,
            self.seqs,
            max(self.zs, default=0.0),
        )

    def added_by(self, c: Contribution) -> int:
        """How much the margin would grow if a new request of contribution ``c`` joined
        (nothing changes). Its share of the sum is at most its own spread, but the sum
        is rounded up to a block and capped at the members' ceilings, so a request can
        add more than its slack: admission checks this against the node's room."""
        z = max(max(self.zs, default=0.0), c.z) if self.members else c.z
        need = self._margin(
            self.excess + c.excess,
            self.variance + c.variance,
            self.gap + c.gap,
            self.ceiling + c.ceiling,
            self.seqs + c.seqs,
            z,
        )
        return need - self.held

    def _margin(
        self, excess: float, variance: float, gap: float, ceiling: float, seqs: int, z: float
    ) -> int:
        spread = max(0.0, gap)
        if seqs >= POOLED_MIN_SEQUENCES:
            spread = min(spread, z * math.sqrt(max(0.0, variance)))
        tokens = min(max(0.0, ceiling), max(0.0, excess) + spread)
        return -(-math.ceil(tokens - 1e-6) // self.block) * self.block
