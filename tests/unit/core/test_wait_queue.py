"""The wait queue's serving order against its definition: a stable sort by Ticket.key."""

import random
from dataclasses import dataclass

import pytest

from kvgateway.core.tenancy import Ticket
from kvgateway.core.wait_queue import WaitQueue


@dataclass(eq=False)
class Waiter:
    ticket: Ticket | None
    since: float
    claims: frozenset[str]
    gated: str | None = None
    done: bool = False


def by_key(arrival, now, aging_s):
    """The definition: arrival order sorted (stably) by each ticket's key."""
    return sorted(arrival, key=lambda w: w.ticket.key(w.since, now, aging_s))


def population(rng, n, *, ranks=3, seqs=None):
    out = []
    clock = 0.0
    for i in range(n):
        clock += rng.choice((0.0, 0.0, 0.3, 1.7, 4.9))  # ties on purpose
        rank = rng.randrange(ranks)
        seq = rng.randrange(seqs) if seqs else i
        start = rng.choice((0.0, 10.0, rng.uniform(0, 50)))
        claims = frozenset(rng.sample("abcdef", rng.randint(1, 3)))
        gated = "max_concurrent" if rng.random() < 0.15 else None
        t = Ticket(f"t{rng.randrange(5)}", f"c{rank}", rank, start, seq)
        out.append(Waiter(t, clock, claims, gated))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_order_claims_and_victim_match_the_definition_under_churn(seed):
    rng = random.Random(seed)
    aging_s = rng.choice((0.0, 1.0, 5.0, 7.5))
    # Duplicate seqs in some runs (a reload starts a new Tenancy and its counter anew).
    ws = population(rng, rng.randint(0, 120), ranks=rng.randint(1, 4), seqs=rng.choice((None, 7)))
    q: WaitQueue[Waiter] = WaitQueue()
    arrival = []
    for w in ws:
        q.append(w)
        arrival.append(w)
        if arrival and rng.random() < 0.3:  # leave from anywhere
            gone = rng.choice(arrival)
            arrival.remove(gone)
            q.remove(gone)
        assert len(q) == len(arrival) and list(q) == arrival
    last = ws[-1].since if ws else 0.0
    for now in (last, last + 0.5, last + 5.0, last + 11.0, last + 60.0):
        assert list(q.ordered(now, aging_s)) == by_key(arrival, now, aging_s)
        for rank in range(4):
            newcomer = Ticket("n", "c", rank, rng.uniform(0, 50), 10_000)
            live = [w for w in arrival if not w.done]
            mine = newcomer.key(now, now, aging_s)
            want = set()
            for w in live:
                if w.gated is None and w.ticket.key(w.since, now, aging_s) < mine:
                    want |= w.claims
            everything = set().union(*(w.claims for w in arrival)) if arrival else set()
            got = q.claims_ahead(
                newcomer, now, aging_s, live=lambda w: not w.done, claimed=everything
            )
            assert got == want
            # The last one served of the lowest class below the newcomer's, among those
            # queued for room (not held by their tenant's limit).
            lower = [w for w in arrival if w.ticket.rank > rank and w.gated is None]
            lowest = [w for w in lower if w.ticket.rank == max(v.ticket.rank for v in lower)]
            victim = by_key(lowest, now, aging_s)[-1] if lowest else None
            assert q.displaceable(newcomer, now, aging_s) is victim


def test_without_tickets_the_order_is_arrival_order():
    rng = random.Random(1)
    ws = population(rng, 20)
    ws[7] = Waiter(None, ws[7].since, frozenset("a"))
    q: WaitQueue[Waiter] = WaitQueue()
    for w in ws:
        q.append(w)
    assert list(q.ordered(ws[-1].since + 30, 5.0)) == ws
    q.remove(ws[7])
    assert list(q.ordered(ws[-1].since + 30, 5.0)) == by_key(
        [w for w in ws if w is not ws[7]], ws[-1].since + 30, 5.0
    )


def test_the_order_is_a_snapshot_the_queue_may_change_under():
    rng = random.Random(2)
    ws = population(rng, 50)
    q: WaitQueue[Waiter] = WaitQueue()
    for w in ws:
        q.append(w)
    want = by_key(ws, ws[-1].since + 6, 5.0)
    seen = []
    for w in q.ordered(ws[-1].since + 6, 5.0):
        seen.append(w)
        q.remove(w)  # as a release hands waiters over while it walks
    assert seen == want and len(q) == 0


def test_removing_what_is_not_queued_raises_as_list_remove_does():
    q: WaitQueue[Waiter] = WaitQueue()
    w = population(random.Random(3), 1)[0]
    with pytest.raises(ValueError):
        q.remove(w)
    q.append(w)
    with pytest.raises(ValueError):
        q.append(w)
    assert q.discard(w) and not q.discard(w)
