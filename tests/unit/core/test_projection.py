"""Admission by the projected KV peak: with output bounds that hold, the node never needs
more blocks than its budget, whatever the arrival order, prefill delays, report lag and
answers whose progress is never reported."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core import projection
from kvgateway.core.demand import earliest_fit, flight_for
from kvgateway.core.flight import AHEAD, FIRST_CHUNK_TOKENS, Flight, chances, curve_steps
from kvgateway.core.output_model import OutputShape
from kvgateway.core.prefix_keys import SharedKeys
from kvgateway.core.projection import NodeProjection, Peak
from tests.support.backends import backend, demand

BLOCK = 16


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


@dataclass
class _Seq:
    """A sequence as the engine runs it (the truth the projection must bound)."""

    flight: Flight
    length: int  # output tokens it will generate (<= its bound)
    prefill_left: int  # steps until its first token
    generated: int = 0

    @property
    def tokens(self) -> int:
        # vLLM holds the prompt and every generated token but the last one's KV; the
        # one being computed is allocated: prompt + generated.
        return self.flight.prompt + self.generated


def _engine_step(running: list[_Seq]) -> list[_Seq]:
    """One engine step: prefills advance, decodes grow a token; finished ones leave."""
    left = []
    for s in running:
        if s.prefill_left > 0:
            s.prefill_left -= 1
            if s.prefill_left == 0:
                s.generated = 1
        else:
            s.generated += 1
        if s.generated < s.length or s.prefill_left > 0:
            left.append(s)
    return left


request = st.tuples(
    st.integers(1, 200),  # prompt tokens
    st.integers(1, 120),  # bound (max_tokens)
    st.floats(0.0, 1.0),  # where in [1, bound] its length falls
    st.integers(0, 4),  # prefill steps
    st.integers(0, 6),  # arrival step gap
    st.booleans(),  # silent: never reports progress (a non-streamed answer)
)


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(request, min_size=1, max_size=40),
    budget=st.integers(20, 60),
    lag=st.integers(0, 1),
)
def test_no_step_needs_more_than_the_budget(
    requests: list[tuple[int, int, float, int, int, bool]], budget: int, lag: int
) -> None:
    """Requests arrive in any order; each is admitted only when the projection with it
    fits; the node reports progress ``lag`` steps late, and never for silent ones. The
    engine never holds more blocks than the budget."""
    proj = NodeProjection()
    ids = itertools.count(1)
    queue: list[tuple[Flight, int, int]] = []
    arrivals: list[tuple[int, Flight, int, int]] = []
    silent: set[int] = set()
    t = 0
    for prompt, bound, frac, prefill, gap, quiet in requests:
        t += gap
        if _blocks(prompt + bound + AHEAD) > budget:
            continue  # could never fit: refused, not queued
        length = max(1, round(frac * bound))
        f = Flight(next(ids), prompt, 1, bound, seen=not quiet)
        if quiet:
            silent.add(f.id)
        arrivals.append((t, f, length, prefill + 1))
    running: list[_Seq] = []
    reports: list[tuple[int, int, int]] = []  # (step due, flight id, generated)
    step = 0
    while arrivals or queue or running:
        while arrivals and arrivals[0][0] <= step:
            _, f, length, prefill = arrivals.pop(0)
            queue.append((f, length, prefill))
        # The gateway: admit in order while the projection fits.
        while queue and proj.fits(BLOCK, budget, 0.0, (queue[0][0],)):
            f, length, prefill = queue.pop(0)
            proj.add(f)
            running.append(_Seq(f, length, prefill))
        used = sum(_blocks(s.tokens) for s in running)
        assert used <= budget, (step, used, budget)
        running_before = {s.flight.id for s in running}
        running = _engine_step(running)
        for s in running:
            if s.prefill_left == 0 and s.flight.id not in silent:
                reports.append((step + lag, s.flight.id, s.generated))
        for fid in running_before - {s.flight.id for s in running}:
            proj.remove(fid)
        due = [r for r in reports if r[0] <= step]
        reports = [r for r in reports if r[0] > step]
        for _, fid, generated in due:
            proj.progress(fid, generated)
        step += 1
        assert step < 100_000


def test_staggered_sequences_share_a_budget_their_maxima_would_not() -> None:
    """Two sequences at different stages need less than the sum of their final sizes:
    one ending soon makes room for the other's growth."""
    proj = NodeProjection()
    old = Flight(1, prompt=16, n=1, bound=160, generated=150, started=True)
    proj.add(old)
    newcomer = Flight(2, prompt=16, n=1, bound=160)
    finals = _blocks(16 + 160) * 2
    assert proj.peak(BLOCK, 0.0, (newcomer,)).blocks < finals
    assert proj.fits(BLOCK, finals - 2, 0.0, (newcomer,))


def test_an_unstarted_flight_holds_its_whole_bound_forever() -> None:
    """Until the node reports progress a flight may be anywhere in its answer and its
    end is unknown: it counts at its final size from now on."""
    proj = NodeProjection()
    proj.add(Flight(1, prompt=32, n=1, bound=64))
    assert proj.peak(BLOCK, 0.0).blocks == _blocks(32 + 64 + AHEAD)
    assert earliest_fit(proj, BLOCK, Flight(2, 32, 1, 64), _blocks(96) + 2, 0.0) is None


def test_an_unseen_flight_holds_its_whole_bound_from_its_admission() -> None:
    """A non-streamed answer may be anywhere in its answer: beside a flight about to
    end it counts at its final size, where a streamed newcomer counts at what it can
    have grown to by then."""
    proj = NodeProjection()
    proj.add(Flight(1, prompt=16, n=1, bound=160, generated=150, started=True))
    streamed = Flight(2, prompt=16, n=1, bound=160)
    unseen = Flight(2, prompt=16, n=1, bound=160, seen=False)
    assert proj.peak(BLOCK, 0.0, (unseen,)).blocks == 2 * _blocks(16 + 160 + AHEAD)
    assert proj.peak(BLOCK, 0.0, (streamed,)).blocks < 2 * _blocks(16 + 160 + AHEAD)


def test_the_earliest_fit_is_the_first_end_that_makes_room() -> None:
    proj = NodeProjection()
    proj.add(Flight(1, prompt=64, n=1, bound=100, generated=90, started=True))
    proj.add(Flight(2, prompt=64, n=1, bound=100, generated=10, started=True))
    head = Flight(3, prompt=160, n=1, bound=40)
    budget = _blocks(64 + 100) + _blocks(160 + 40 + AHEAD)
    start = earliest_fit(proj, BLOCK, head, budget, 0.0)
    assert start == 10  # when the first ends
    assert not proj.fits(BLOCK, budget, 0.0, (head,))


def test_prefix_blocks_shared_are_counted_once_while_a_holder_lives() -> None:
    proj = NodeProjection()
    keys = tuple(range(100, 110))  # a 160-token shared system prompt
    holder = Flight(1, prompt=170, n=1, bound=20, keys=keys, generated=5, started=True)
    proj.add(holder)
    alone = proj.peak(BLOCK, 0.0).blocks
    sharer = Flight(2, prompt=170, n=1, bound=20, keys=keys, credited=len(keys))
    with_sharer = proj.peak(BLOCK, 0.0, (sharer,)).blocks
    assert with_sharer == alone + _blocks(170 + 20) - len(keys) or with_sharer > alone
    proj.add(sharer)
    # The holder ends first: the sharer keeps the shared blocks (counted as its own).
    late = proj.peak_at(BLOCK, holder.end or 0).blocks
    assert late >= _blocks(170 + 20)
    proj.remove(1)
    assert proj.peak(BLOCK, 0.0).blocks == _blocks(170 + 20)


def test_shared_blocks_are_read_in_groups_of_the_same_payers_and_holders() -> None:
    """Blocks with the same payers and holders are summed as one group; the groups
    follow every change of who holds what."""
    shared = SharedKeys()
    history = tuple(range(100, 110))
    a = Flight(1, prompt=170, n=1, bound=20, keys=history, generated=5, started=True)
    b = Flight(2, prompt=170, n=1, bound=20, keys=history, credited=10)
    c = Flight(3, prompt=90, n=1, bound=20, keys=history[:5], credited=5)
    flights = {1: a}
    for f in (b, c):
        flights[f.id] = f
        shared.add(f, flights)

    def groups() -> set[tuple[frozenset[int], frozenset[int], int]]:
        return {(g.payers, g.holders, g.keys) for g in shared.groups()}

    assert groups() == {
        (frozenset({1}), frozenset({1, 2, 3}), 5),
        (frozenset({1}), frozenset({1, 2}), 5),
    }
    shared.remove(3)
    assert groups() == {(frozenset({1}), frozenset({1, 2}), 10)}
    shared.remove(1)
    assert groups() == {(frozenset(), frozenset({2}), 10)}
    shared.remove(2)
    assert groups() == set()


def test_learned_lengths_project_early_ends() -> None:
    """With learned lengths (most answers short) many long-bounded sequences fit where
    their bounds alone would not, and more certainty asked (z) admits fewer."""
    shape = OutputShape([8] * 90 + [200] * 10)
    proj = NodeProjection()
    for i in range(6):
        proj.add(Flight(i, prompt=16, n=1, bound=256, generated=2, started=True, shape=shape))
    by_bound = _blocks(16 + 256) * 6
    lenient = proj.peak(BLOCK, 0.0).blocks
    strict = proj.peak(BLOCK, 3.0).blocks
    assert lenient < strict <= by_bound


def test_the_learned_check_sees_the_blocks_flights_take_before_they_end() -> None:
    """Where lengths are learned the curve is read on a grid, and also wherever a started
    flight takes a new block within the first block of steps: flights likely to end
    before the next grid step still grow, a block each, first."""
    shape = OutputShape([20] * 50)  # every answer ends at 20 tokens
    proj = NodeProjection()
    for fid in range(4):
        # 10 generated: prompt + generated + AHEAD fills 3 blocks, the next token a 4th.
        proj.add(
            Flight(fid, 3 * BLOCK - 10 - AHEAD, 1, 2048, generated=10, started=True, shape=shape)
        )
    assert proj.peak_at(BLOCK, 0, 3.0).blocks == 4 * 3
    peak = proj.peak(BLOCK, 3.0)
    assert (peak.blocks, peak.step) == (4 * 4, 1)


def test_the_learned_check_never_projects_more_than_the_flights_can_hold() -> None:
    """``mean + z * stddev`` is capped by what every flight that may still run holds:
    a node cannot hold more than that, so no margin may ask for more room."""
    shape = OutputShape([20 + (k * 37) % 400 for k in range(64)])
    proj = NodeProjection()
    for fid in range(10):
        f = Flight(fid, 500, 1, 2048, shape=shape)
        proj.add(f)
        proj.progress(fid, 100)
    newcomer = Flight(99, 300, 1, 2048, shape=shape)
    flights = [*proj.flights, newcomer]
    horizon = max(f.end or 0 for f in proj.flights)
    most = max(
        sum(_blocks(f.tokens_at(t)) for f in flights if f.survival(t) > 0.0)
        for t in range(horizon + 1)
    )
    assert proj.peak(BLOCK, 50.0, (newcomer,)).blocks <= most
    # Now: every flight holds what it holds, whatever the margin.
    assert proj.peak_at(BLOCK, 0, 50.0).blocks == sum(_blocks(f.tokens_at(0)) for f in proj.flights)


def test_a_holder_shares_its_first_chunk_from_admission_and_the_rest_from_its_first_token() -> None:
    """vLLM caches a prompt's full blocks when it schedules them: the blocks of an
    admitted request's first prefill chunk are shareable at once, the rest once it
    reports its first token, and none after it ends."""
    first = FIRST_CHUNK_TOKENS // BLOCK
    keys = tuple(range(1000, 1000 + first + 4))
    proj = NodeProjection()
    proj.add(Flight(1, prompt=len(keys) * BLOCK + 10, n=1, bound=20, keys=keys, scheduled=first))
    assert proj.creditable(keys) == first
    proj.progress(1, 1)
    assert proj.creditable(keys) == len(keys)
    proj.remove(1)
    assert proj.creditable(keys) == 0


def test_credit_from_an_unstarted_holder_lasts_as_long_as_it_is_projected() -> None:
    """A newcomer credited blocks an unstarted holder schedules counts them once: the
    holder's end is unknown, so the credit holds at every step projected."""
    keys = tuple(range(200, 210))
    proj = NodeProjection()
    holder = Flight(1, prompt=170 + BLOCK * 9, n=1, bound=20, keys=keys, scheduled=len(keys))
    proj.add(holder)
    alone = proj.peak(BLOCK, 0.0).blocks
    sharer = Flight(2, prompt=170 + BLOCK * 9, n=1, bound=20, keys=keys, credited=len(keys))
    own = _blocks(170 + BLOCK * 9 + 20 + AHEAD)
    assert proj.peak(BLOCK, 0.0, (sharer,)).blocks == alone + own - len(keys)


def test_a_flight_whose_report_lags_is_taken_as_far_as_the_node_has_stepped() -> None:
    """vLLM steps every running sequence together: when other flights report steps that a
    flight has not (its stream read late), it is taken to hold a token more for each of
    them, while its end stays where its own report puts it."""
    proj = NodeProjection()
    proj.add(Flight(id=1, prompt=3 * BLOCK - AHEAD - 10, n=1, bound=100))
    proj.add(Flight(id=2, prompt=2 * BLOCK - 20, n=1, bound=100))
    proj.progress(1, 5)
    proj.progress(2, 5)
    one = proj.get(1)
    assert one is not None
    assert one.tokens_at(0) == 3 * BLOCK - 5 and proj.current_blocks(BLOCK) == 3 + 2
    for g in range(6, 13):
        proj.progress(2, g)  # flight 1's chunks for these steps are not read yet
    assert one.tokens_at(0) == 3 * BLOCK + 2
    assert proj.current_blocks(BLOCK) == 4 + 2
    assert one.end == 95
    proj.progress(1, 12)
    assert one.tokens_at(0) == 3 * BLOCK + 2 and one.end == 88


def test_a_late_first_report_is_bounded_by_the_steps_since_admission() -> None:
    """A flight's first report may be read late too: until its next one it is taken to
    have generated a token for every step the node took since its admission."""
    proj = NodeProjection()
    proj.add(Flight(id=1, prompt=50, n=1, bound=100))
    proj.progress(1, 1)
    proj.add(Flight(id=2, prompt=50, n=1, bound=100))
    for g in range(2, 12):
        proj.progress(1, g)
    proj.progress(2, 3)  # admitted 10 steps ago: it may be as far as 10
    two = proj.get(2)
    assert two is not None
    assert two.tokens_at(0) == 50 + 10 + AHEAD and two.end == 97
    proj.progress(2, 4)  # timely now: as reported
    assert two.tokens_at(0) == 50 + 4 + AHEAD


def test_what_a_running_flight_holds_stays_within_a_step_of_its_own_report() -> None:
    """A node runs a stream of sequences whose first reports lag their later ones by two
    steps (the first token comes after the prefill), every flight reporting every step.
    What each flight is taken to hold now exceeds its own report plus AHEAD by at most
    the node's steps since that report: one step and one first report's lag, however
    many flights came and went (the node's clock, built from first reports, runs ahead
    of the node by their lags; only its advance since a report counts)."""
    proj = NodeProjection()
    starts: dict[int, int] = {}
    for step in range(1, 600):
        if step % 10 == 1:
            proj.add(Flight(id=step, prompt=300, n=1, bound=400))
            starts[step] = step
        for fid, start in list(starts.items()):
            true = step - start
            f = proj.get(fid)
            assert f is not None
            if true >= 400:
                proj.remove(fid)
                del starts[fid]
            elif f.started:
                proj.progress(fid, true)
            elif true >= 3:
                proj.progress(fid, true - 2)
        for fid, start in starts.items():
            f = proj.get(fid)
            assert f is not None
            if f.started:
                assert f.tokens_at(0) <= 300 + (step - start) + AHEAD + 1 + 2


op = st.tuples(
    st.sampled_from(["add", "add", "progress", "remove"]),
    st.integers(1, 200),  # prompt tokens
    st.integers(1, 100),  # bound
    st.booleans(),  # seen (streamed)
    st.integers(0, 3),  # shared history blocks credited (0: none)
    st.integers(0, 50),  # generated, for progress
    st.booleans(),  # with learned lengths
)
LEARNED = OutputShape([5 + (k * 13) % 90 for k in range(40)])


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=40))
def test_the_curve_kept_through_changes_is_the_curve_of_its_flights_added_afresh(ops) -> None:
    """Flights that hold the same at every step are summed as they come and go; after
    any admissions, reports and ends the projection reads as one built from its
    flights as they now are."""
    proj = NodeProjection()
    history = tuple(range(500, 503))
    next_id = 1
    for kind, prompt, bound, seen, credited, generated, learned in ops:
        ids = list(proj.flights)
        if kind == "add" or not ids:
            f = Flight(
                next_id,
                prompt=max(prompt, 16 * credited + 1),
                n=1,
                bound=bound,
                keys=history[:credited],
                credited=credited if ids else 0,
                seen=seen,
                shape=LEARNED if learned else None,
            )
            proj.add(f)
            next_id += 1
        elif kind == "progress":
            f = ids[generated % len(ids)]
            proj.progress(f.id, min(f.bound, f.generated + generated))
        else:
            proj.remove(ids[generated % len(ids)].id)
        fresh = NodeProjection()
        for f in proj.flights:
            fresh.add(Flight(**{k: getattr(f, k) for k in Flight.__slots__}))
        for z in (0.0, 2.0):
            for t in (0, 1, 7, 30, 120):
                kept, anew = proj.peak_at(BLOCK, t, z).blocks, fresh.peak_at(BLOCK, t, z).blocks
                assert abs(kept - anew) < 1e-6
            assert abs(proj.peak(BLOCK, z).blocks - fresh.peak(BLOCK, z).blocks) < 1e-6


flight_st = st.tuples(
    st.integers(1, 300),  # prompt tokens
    st.integers(1, 200),  # bound
    st.booleans(),  # seen (streamed)
    st.one_of(st.none(), st.integers(1, 200)),  # generated when it reported, if it did
    st.integers(0, 4),  # shared history blocks
    st.booleans(),  # credited them (else it paid for its own copies)
    st.integers(1, 2),  # sequences
)


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(flight_st, min_size=1, max_size=30), block=st.sampled_from([16, 128]))
def test_the_curve_read_in_one_pass_is_the_curve_read_step_by_step(specs, block) -> None:
    """With no learned lengths the curve is read at all its steps in one pass; every
    reading equals the reading of the same flights step by step, shared blocks and
    flights that run unseen included."""
    history = tuple(range(700, 704))

    def build() -> NodeProjection:
        proj = NodeProjection()
        for i, (prompt, bound, seen, generated, shared, credit, n) in enumerate(specs):
            keys = history[:shared]
            f = Flight(
                i + 1,
                prompt=max(prompt, block * shared + 1),
                n=n,
                bound=bound,
                keys=keys,
                credited=shared if i and credit else 0,
                seen=seen,
            )
            proj.add(f)
            if generated is not None:
                proj.progress(f.id, min(bound, generated))
        return proj

    one_pass, by_step = build(), build()
    newcomer = Flight(999, prompt=50, n=1, bound=30)
    assert one_pass.peak(block, 0.0, (newcomer,)) == by_step_peak(by_step, block, newcomer)
    for t in sorted({0, 1, 5, 17, 64, 129, 250, *(f.end or 0 for f in one_pass.flights)}):
        assert one_pass.peak_at(block, t).blocks == pytest.approx(by_step.peak_at(block, t).blocks)


OTHER = OutputShape([40 + (k * 7) % 150 for k in range(20)] + [1 << 40] * 3)


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(st.tuples(flight_st, st.booleans()), min_size=1, max_size=30),
    block=st.sampled_from([16, 128]),
    z=st.sampled_from([0.0, 1.5]),
)
def test_the_learned_curve_read_at_once_is_the_curve_read_step_by_step(specs, block, z) -> None:
    """With learned lengths (two shapes, one with answers cut at their caps) the curve is
    read for every flight and step at once; each step reads as the same flights read
    step by step, unstarted and unseen flights and shared blocks included."""
    history = tuple(range(700, 704))

    def build() -> NodeProjection:
        proj = NodeProjection()
        for i, ((prompt, bound, seen, generated, shared, credit, n), other) in enumerate(specs):
            f = Flight(
                i + 1,
                prompt=max(prompt, block * shared + 1),
                n=n,
                bound=bound,
                keys=history[:shared],
                credited=shared if i and credit else 0,
                seen=seen,
                shape=OTHER if other else LEARNED,
            )
            proj.add(f)
            if generated is not None:
                proj.progress(f.id, min(bound, generated))
        return proj

    at_once, by_step = build(), build()
    newcomer = Flight(999, prompt=50, n=1, bound=30, shape=LEARNED)
    steps = {*by_step._base_steps(block), *curve_steps((newcomer,), block)}
    for t in steps:
        by_step.peak_at(block, t, z)  # each step read on its own
    got, want = at_once.peak(block, z, (newcomer,)), by_step.peak(block, z, (newcomer,))
    assert got.blocks == pytest.approx(want.blocks)
    for t in steps:  # read at once by the peak above (when it had 4 or more to read)
        assert at_once.peak_at(block, t, z).blocks == pytest.approx(
            by_step.peak_at(block, t, z).blocks
        )


def by_step_peak(proj: NodeProjection, block: int, newcomer: Flight) -> Peak:
    """:meth:`NodeProjection.peak` with every step it reads read on its own first."""
    for t in {*proj._base_steps(block), *curve_steps((newcomer,), block)}:
        proj.peak_at(block, t)
    return proj.peak(block, 0.0, (newcomer,))


@dataclass(eq=False, slots=True)
class _Spread(Flight):
    """An unseen flight whose holding has a given variance."""

    spread: float = 0.0

    def blocks_at(self, t: int, block: int) -> tuple[float, float, float]:
        return 1.0, 4.0, self.spread


def test_a_spread_summed_up_and_down_again_reads_as_none() -> None:
    """Flights that leave the step-invariant sum take their variance with them, to
    zero and not a rounding below it (whose square root would fail a reading)."""
    proj = NodeProjection()
    proj.add(_Spread(1, prompt=10, n=1, bound=10, seen=False))
    assert proj.peak_at(BLOCK, 0, 2.0).blocks == 4.0
    for fid, spread in ((2, 0.7), (3, 0.1)):  # 0.7 + 0.1 - 0.7 - 0.1 < 0 in floats
        proj.add(_Spread(fid, prompt=10, n=1, bound=10, seen=False, spread=spread))
    proj.remove(2)
    proj.remove(3)
    assert proj.peak_at(BLOCK, 0, 2.0).blocks == 4.0
    assert proj.peak(BLOCK, 2.0).blocks == 4.0


def test_the_check_of_a_credited_newcomer_is_the_book_it_joins() -> None:
    """A newcomer credited the blocks of a holder that likely ends first is checked at the
    curve the node books once it is admitted: its credited blocks are another's copy only
    while a holder runs, then its own (the copy lives on with it)."""
    shape = OutputShape([10] * 95 + [20_000] * 5)  # the holder (at 5 tokens) likely ends soon
    keys = tuple(range(100, 300))  # 200 shared blocks
    prompt = 200 * BLOCK + 10
    for z in (0.0, 2.0):
        proj = NodeProjection()
        proj.add(Flight(1, prompt, 1, 20_000, keys=keys, scheduled=len(keys), shape=shape))
        proj.progress(1, 5)
        proj.add(Flight(3, 16, 1, 8_000))
        proj.progress(3, 1)
        newcomer = Flight(2, prompt, 1, 1_000, keys=keys, credited=proj.creditable(keys))
        assert newcomer.credited == 200
        checked = proj.peak(BLOCK, z, (newcomer,))
        proj.add(newcomer)
        assert checked.blocks == pytest.approx(proj.peak(BLOCK, z).blocks)


def test_shared_blocks_count_while_any_of_their_holders_may_run() -> None:
    """Four credited holders of blocks whose payer has ended, each running with chance
    1/2 at a step: the blocks' expected copies there are P(any holder runs) = 15/16, not
    the likeliest holder's 1/2."""
    shape = OutputShape([10] * 50 + [1_000] * 50)
    keys = tuple(range(100, 300))
    prompt = 200 * BLOCK + 10
    proj = NodeProjection()
    proj.add(Flight(1, prompt, 1, 1_000, keys=keys, scheduled=len(keys)))
    proj.progress(1, 5)
    for fid in range(2, 6):
        proj.add(Flight(fid, prompt, 1, 1_000, keys=keys, credited=200, shape=shape))
        proj.progress(fid, 5)
    proj.remove(1)
    t = 20
    holders = [f for f in proj.flights]
    own = sum(f.survival(t) * (_blocks(f.tokens_at(t)) - 200) for f in holders)
    assert {f.survival(t) for f in holders} == {0.5}
    assert proj.peak_at(BLOCK, t).blocks == pytest.approx(own + 200 * (1 - 0.5**4))
    # Read in one pass over several steps, as admission reads the curve: the same.
    assert proj.peak(BLOCK, 0.0).blocks >= proj.peak_at(BLOCK, t).blocks


SPEC_K = 4


def test_a_drafting_nodes_sequence_is_projected_with_the_slots_vllm_allocates() -> None:
    """On a node drafting k tokens a step, vLLM's scheduler allocates, for a running
    sequence, its computed tokens plus the 1 + k it verifies and up to k + 1 lookahead
    slots its drafter writes (num_lookahead_tokens), one step of 1 + k possibly ahead of
    the last report: the projection holds at least that."""
    b = backend("a", kv=64 * BLOCK)
    b.config = dataclasses.replace(b.config, num_speculative_tokens=SPEC_K)
    f = flight_for(b, dataclasses.replace(demand(20, 100), projected=True), 1)
    b.projection.add(f)
    b.projection.progress(1, 6)
    computed = 20 + 6 - 1 + (1 + SPEC_K)  # the report may lag a step of 1 + k tokens
    vllm = _blocks(computed + (1 + SPEC_K) + (SPEC_K + 1))
    assert b.projection.peak_at(BLOCK, 0).blocks >= vllm


@pytest.mark.parametrize("fast", [1, 2], ids=["newcomer-drafts-well", "runner-drafts-well"])
def test_sequences_drafting_at_any_rate_stay_within_the_projected_peak(fast: int) -> None:
    """Two sequences on a drafting node, one accepting every draft (1 + k tokens a
    step), the other none: whichever it is, no step needs more blocks (its slots as vLLM
    allocates them) than the peak the newcomer was admitted at."""
    b = backend("a", kv=1_000 * BLOCK)
    b.config = dataclasses.replace(b.config, num_speculative_tokens=SPEC_K)
    first = flight_for(b, dataclasses.replace(demand(16, 100), projected=True), 1)
    b.projection.add(first)
    b.projection.progress(1, 0)
    newcomer = flight_for(b, dataclasses.replace(demand(16, 400), projected=True), 2)
    admitted_at = b.projection.peak(BLOCK, 0.0, (newcomer,)).blocks
    # The engine: per sequence [prompt, generated, tokens a step, bound].
    seqs = {1: [16, 0, 1, 100], 2: [16, 0, 1, 400]}
    seqs[fast][2] = 1 + SPEC_K
    worst = 0
    while seqs:
        slots = (p + g + (1 + SPEC_K) + (SPEC_K + 1) for p, g, _, _ in seqs.values())
        worst = max(worst, sum(_blocks(x) for x in slots))
        for fid, s in list(seqs.items()):
            s[1] = min(s[3], s[1] + s[2])
            if s[1] >= s[3]:
                del seqs[fid]
    assert worst <= admitted_at


@pytest.mark.parametrize("seed", [0, 1])
def test_answers_of_nearly_one_length_never_outgrow_the_budget(seed: int) -> None:
    """Learned lengths that barely vary (280-320 tokens under a max_tokens of 2,048, the
    node's 63 blocks of 128): the curve's peak falls where the sequences' blocks grow while
    their ends draw near, between the steps a coarse reading takes. 24 clients keep a
    queue; each request is admitted when the projection with it fits (progress reported
    a step late); the engine never holds more blocks than the budget."""
    import random

    from kvgateway.core.output_model import CENSORED, z_of

    rng = random.Random(seed)
    block, budget, cap = 128, 63, 2048
    shape = OutputShape([rng.randint(280, 320) for _ in range(300)] + [CENSORED])
    z = z_of(0.001)
    proj = NodeProjection()
    ids = itertools.count(1)
    queue = [(rng.randint(145, 770), rng.randint(280, 320)) for _ in range(24)]
    left = 120 - len(queue)
    running: list[_Seq] = []
    reports: list[tuple[int, int, int]] = []
    step = 0
    while queue or running:
        while queue:
            prompt, length = queue[0]
            f = Flight(next(ids), prompt, 1, cap, shape=shape)
            if not proj.fits(block, budget, z, (f,)):
                break
            queue.pop(0)
            proj.add(f)
            running.append(_Seq(f, length, 1))
        used = sum(-(-s.tokens // block) for s in running)
        assert used <= budget, (step, used)
        running_before = {s.flight.id for s in running}
        running = _engine_step(running)
        for s in running:
            reports.append((step + 1, s.flight.id, s.generated))
        for fid in running_before - {s.flight.id for s in running}:
            proj.remove(fid)
            if left > 0:
                left -= 1
                queue.append((rng.randint(145, 770), rng.randint(280, 320)))
        for _, fid, generated in [r for r in reports if r[0] <= step]:
            proj.progress(fid, generated)
        reports = [r for r in reports if r[0] > step]
        step += 1


_LEARNED = OutputShape([30 + (k * 53) % 700 for k in range(48)])


@settings(max_examples=200, deadline=None)
@given(
    running=st.lists(
        st.tuples(st.integers(1, 900), st.integers(1, 600), st.booleans()), min_size=1, max_size=12
    ),
    prompts=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3)), min_size=2, max_size=25),
    learned=st.booleans(),
    room=st.integers(0, 40),
)
def test_a_refused_newcomer_answers_for_longer_prompts_alike_and_only_them(
    running: list[tuple[int, int, bool]],
    prompts: list[tuple[int, int]],
    learned: bool,
    room: int,
):
    """Checking newcomers one after another gives what reading the curve for each gives,
    whatever refusals came before: a newcomer alike to a refused one (the same credit
    for shared blocks among them) with a prompt no shorter never fits; a shorter one, or
    another kind, is read anew."""
    shape = _LEARNED if learned else None
    proj = NodeProjection()
    shared: tuple[int, ...] = (7, 8, 9)  # a system prompt's blocks: every other flight's
    for i, (prompt, generated, started) in enumerate(running):
        keys = shared if i % 2 == 0 and prompt >= 3 * BLOCK else ()
        proj.add(Flight(i, prompt, 1, 700, shape=shape, keys=keys, scheduled=len(keys)))
        if started:
            proj.progress(i, generated)
    z = 3.0
    budget = int(proj.peak(BLOCK, z).blocks) + room  # newcomers near the edge
    for k, (prompt, asked) in enumerate(prompts):
        keys = shared[: prompt // BLOCK]
        credit = min(asked, proj.creditable(keys))
        f = Flight(1000 + k, prompt, 1, 700, shape=shape, keys=keys, credited=credit)
        limit = budget + 1e-9
        read = proj.peak(BLOCK, z, (f,), above=limit).blocks <= limit
        assert proj.fits(BLOCK, budget, z, (f,)) is read


def test_newcomers_alike_to_a_refused_one_are_refused_without_reading_the_curve(
    monkeypatch: pytest.MonkeyPatch,
):
    """A queue walk checks many waiters of one client against a full node: past the first
    refusal, the longer prompts cost no reading, until the node's flights change."""
    proj = NodeProjection()
    for i in range(8):
        proj.add(Flight(i, 400, 1, 700, shape=_LEARNED))
        proj.progress(i, 10 + 40 * i)
    budget = int(proj.peak(BLOCK, 3.0).blocks) + 2
    reads = 0
    peak = NodeProjection._peak

    def counted(self: NodeProjection, *args: object, **kwargs: object) -> Peak:
        nonlocal reads
        reads += 1
        return peak(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(NodeProjection, "_peak", counted)
    assert not proj.fits(BLOCK, budget, 3.0, (Flight(100, 600, 1, 700, shape=_LEARNED),))
    assert reads == 1
    for k, prompt in enumerate((600, 900, 2000)):
        assert not proj.fits(BLOCK, budget, 3.0, (Flight(101 + k, prompt, 1, 700, shape=_LEARNED),))
    assert reads == 1
    # Another bound, or credit for shared blocks, makes another kind of newcomer: read once.
    proj.fits(BLOCK, budget, 3.0, (Flight(110, 900, 1, 500, shape=_LEARNED),))
    for fid, keys in ((111, (1, 2)), (112, (1, 2, 3)), (113, (1, 3))):
        credited = Flight(fid, 900 + fid, 1, 700, shape=_LEARNED, keys=keys, credited=1)
        assert not proj.fits(BLOCK, budget, 3.0, (credited,))
    assert reads == 3
    proj.progress(0, 60)  # the flights changed: what was refused is read again
    proj.fits(BLOCK, budget, 3.0, (Flight(120, 900, 1, 700, shape=_LEARNED),))
    assert reads == 4


@settings(max_examples=80, deadline=None)
@given(
    flights=st.lists(
        st.tuples(
            st.integers(0, 700),
            st.integers(1, 700),
            st.booleans(),
            st.booleans(),
            st.integers(0, 40),
        ),
        min_size=1,
        max_size=10,
    ),
    steps=st.lists(st.integers(0, 900), min_size=1, max_size=30, unique=True),
)
def test_chances_read_at_once_are_each_flights_survival(
    flights: list[tuple[int, int, bool, bool, int]], steps: list[int]
):
    """The chances of running read for many flights and steps at once (a credited
    newcomer's holders, a learned curve) are what each flight's survival says."""
    fs = []
    for i, (generated, bound, started, learned, delay) in enumerate(flights):
        shape = _LEARNED if learned else None
        f = Flight(i, 100, 1, bound, min(generated, bound), started, shape=shape, delay=delay)
        fs.append(f)
    t = np.asarray(sorted(steps), dtype=np.int64)
    at_once = chances(fs, t)
    for row, f in zip(at_once, fs, strict=True):
        assert row.tolist() == pytest.approx([f.survival(int(x)) for x in t])


def test_a_curve_some_reports_old_may_refuse_but_never_admits() -> None:
    """Routing may take a refusal from a curve read before the flights' last reports (up
    to STALE_STEPS steps of them): a flight nearer its end makes room the old curve does
    not show. "Fits" is read on the current curve, and past STALE_STEPS so is all."""
    proj = NodeProjection()
    proj.add(Flight(1, 1000, 1, 100))
    proj.add(Flight(2, 16, 1, 400))
    proj.progress(1, 50)
    proj.progress(2, 50)
    budget = int(proj.peak(BLOCK, 0.0, (Flight(9, 46, 1, 200),)).blocks) - 1
    assert not proj.fits(BLOCK, budget, 0.0, (Flight(10, 46, 1, 200),), stale=True)
    proj.progress(1, 52)  # two steps on: its end, where the curve peaks, comes sooner
    proj.progress(2, 52)
    assert not proj.fits(BLOCK, budget, 0.0, (Flight(11, 46, 1, 200),), stale=True)
    assert proj.fits(BLOCK, budget, 0.0, (Flight(12, 46, 1, 200),))  # read afresh
    assert proj.fits(BLOCK, budget, 0.0, (Flight(13, 46, 1, 200),), stale=True)
    budget -= 1
    assert not proj.fits(BLOCK, budget, 0.0, (Flight(14, 46, 1, 200),), stale=True)
    assert projection.STALE_STEPS < 15
    for step in range(53, 68):  # 15 steps on: room again, seen though the read is stale
        proj.progress(1, step)
        proj.progress(2, step)
    assert proj.fits(BLOCK, budget, 0.0, (Flight(15, 46, 1, 200),), stale=True)


@settings(max_examples=200, deadline=None)
@given(
    flights=st.lists(
        st.tuples(st.integers(1, 400), st.integers(1, 300), st.integers(0, 300), st.booleans()),
        min_size=2,
        max_size=12,
    ),
    steps=st.integers(1, 12),
    prompt=st.integers(1, 600),
    learned=st.booleans(),
)
def test_a_stale_read_never_admits_what_a_fresh_one_refuses(
    flights: list[tuple[int, int, int, bool]], steps: int, prompt: int, learned: bool
) -> None:
    """Whatever the flights, and whichever report since the curve was read (a flight
    that does not report holds a token more for each step the others show),
    ``fits(stale=True)`` admits only what the current curve admits."""
    shape = _LEARNED if learned else None

    def build() -> NodeProjection:
        proj = NodeProjection()
        for i, (p, bound, generated, _) in enumerate(flights):
            proj.add(Flight(i, p, 1, bound, shape=shape))
            proj.progress(i, min(bound, generated))
        return proj

    old, new = build(), build()
    top = int(old.peak(BLOCK, 2.0, (Flight(500, prompt, 1, 300, shape=shape),)).blocks)
    for proj in (old, new):
        for _ in range(steps):
            for i, (*_, reports) in enumerate(flights):
                f = proj.get(i)
                if f is not None and (reports or i == 0):
                    proj.progress(i, f.generated + 1)
    for budget in range(max(1, top - 12), top + 12):  # the first the old curve admits
        newcomer = Flight(600 + budget, prompt, 1, 300, shape=shape)
        if old.fits(BLOCK, budget, 2.0, (newcomer,), stale=True):
            assert new.fits(BLOCK, budget, 2.0, (Flight(1, prompt, 1, 300, shape=shape),))
            break
