"""Prefix-aware placement over pure backends: the follow-up goes to its history's node
unless budget forbids; the fast candidate set agrees with a scan of the whole tier."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core.cache_view import BlocksRemoved, BlocksStored
from kvgateway.core.demand import Demand, PrefixHint
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.core.prefix_routing import PrefixRouter, PrefixScoring
from kvgateway.core.reservation import Reservation
from kvgateway.core.routing import ModelIndex, Routed, eligible
from kvgateway.core.shared_blocks import SharedBlocks
from tests.support.backends import admission_over, backend, demand


def hinted(ids: list[int], output: int = 100, session: str | None = None) -> Demand:
    keys = tuple(block_keys(ids, 16))
    return replace(demand(len(ids), output), prefix=PrefixHint(keys, 16, session))


def make(backends, router: PrefixRouter | None = None):
    clock = [0.0]
    router = router or PrefixRouter(PrefixIndex(), shared=SharedBlocks())
    adm = admission_over(backends, queue_size=100, clock=lambda: clock[0], prefix=router)
    return adm, router, clock


def history(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(100, 50_000) for _ in range(n)]


def test_follow_up_turn_goes_to_the_node_holding_its_history():
    bs = [backend(f"b{i}", kv=40_000) for i in range(4)]
    adm, _, clock = make(bs)
    turn1 = history(1000)
    r1 = adm.try_admit(hinted(turn1))
    assert not isinstance(r1, Routed) and r1.backend is not None
    home = r1.backend
    # Other traffic makes another node the freest; the follow-up still goes home.
    other = adm.try_admit(hinted(history(800, seed=5)))
    assert other.backend is not home
    adm.release(other)
    clock[0] = 10.0
    turn2 = turn1 + history(300, seed=1)
    r2 = adm.try_admit(hinted(turn2))
    assert r2.backend is home
    # Without prefix awareness kv_aware takes the freest node, not home (home holds r1).
    plain = adm.decide(demand(len(turn2)))
    assert isinstance(plain, Routed) and plain.backend is not home


def test_budget_still_decides_first():
    bs = [backend("a", kv=4096), backend("b", kv=4096)]
    adm, _, _ = make(bs)
    turn1 = history(1000)
    r1 = adm.try_admit(hinted(turn1, output=50))
    home = r1.backend
    # Other work fills the home node: the follow-up cannot fit there any more.
    adm._adjust(home, home.free_tokens - 200, 1, 1)
    r2 = adm.try_admit(hinted(turn1 + history(200, 2)))
    assert r2.backend is not home


def test_session_hint_breaks_a_tie_between_equal_nodes():
    bs = [backend(f"b{i}", kv=40_000) for i in range(3)]
    adm, _, _ = make(bs)
    r1 = adm.try_admit(hinted(history(20, 1), session="s1"))  # no full block: no keys
    adm.release(r1)
    r2 = adm.try_admit(hinted(history(20, 2), session="s1"))
    assert r2.backend is r1.backend


def test_a_fresh_prompt_goes_where_budget_is_freest():
    bs = [backend(f"b{i}", kv=40_000) for i in range(3)]
    adm, _, _ = make(bs)
    first = adm.try_admit(hinted(history(2000, 1)))
    second = adm.try_admit(hinted(history(2000, 2)))
    assert second.backend is not first.backend


def _scan_best(router: PrefixRouter, idx: ModelIndex, d: Demand, chosen, now: float):
    """The slow twin: every eligible backend of the chosen tier that holds some of the
    prefix, plus the ``candidates`` freest, scored one by one."""
    pool = [b for b in idx.backends if b.tier_index == chosen.tier_index and eligible(b, d, now)]
    freest = sorted(pool, key=lambda b: (-b.free_tokens, b.name))[: router.scoring.candidates]
    assert d.prefix is not None
    holders = [b for b in pool if router.index.expected_blocks(b.name, d.prefix.keys, now) > 0]
    if not holders:
        return router._score(chosen, d, now, None)  # nobody holds any of it: kv_aware's pick
    return max(router._score(b, d, now, None) for b in [chosen, *freest, *holders])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_refine_finds_the_best_score_of_the_tier(seed):
    rnd = random.Random(seed)
    bs = [backend(f"b{i}", kv=rnd.choice([8192, 16384, 32768])) for i in range(12)]
    router = PrefixRouter(PrefixIndex(), PrefixScoring(candidates=2, holders_per_key=12))
    adm, router, clock = make(bs, router)
    prefixes = [history(rnd.randrange(16, 600), seed=seed + k) for k in range(3)]
    held = []
    for step in range(40):
        clock[0] = step * 1.0
        ids = rnd.choice(prefixes) + history(rnd.randrange(0, 200), seed=seed * 100 + step)
        d = hinted(ids, output=rnd.randrange(1, 300))
        decision = adm.decide(d)
        if isinstance(decision, Routed):
            best = _scan_best(router, adm._index_for("m"), d, decision.backend, clock[0])
            got = router._score(decision.backend, d, clock[0], None)
            assert got == best
        r = adm.try_admit(d)
        if not isinstance(r, Routed) and hasattr(r, "backend"):
            held.append(r)
        if held and rnd.random() < 0.4:
            adm.release(held.pop(rnd.randrange(len(held))))
    for r in held:
        adm.release(r)
    assert all(b.reserved_tokens == 0 and b.in_flight == 0 for b in bs)


def stored_on(router: PrefixRouter, name: str, ids: list[int], first_hash: int) -> None:
    """``name``'s KV events report caching ``ids``' full blocks (16 tokens each)."""
    n = len(ids) // 16
    hashes = tuple(range(first_hash, first_hash + n))
    router.index.apply_events(name, [BlocksStored(hashes, None, tuple(ids[: n * 16]), 16)], 0.0)


def test_a_follow_up_goes_to_the_node_whose_events_alone_hold_its_history():
    """The history reached b2 without this gateway (a client talking to the node, another
    replica, this gateway before a restart): b2's events are all that says so."""
    bs = [backend(f"b{i}", kv=40_000) for i in range(4)]
    adm, router, clock = make(bs)
    for b in bs:
        router.index.attach_events(b.name)
    turn1 = history(1000)
    stored_on(router, "b2", turn1, 1)
    plain = adm.decide(demand(1300))
    assert isinstance(plain, Routed) and plain.backend.name != "b2"
    clock[0] = 10.0
    for k in range(3):
        r = adm.try_admit(hinted(turn1 + history(300, seed=k)))
        assert r.backend.name == "b2"
        adm.release(r)
    # A node whose events hold only a shorter prefix loses to the one holding more.
    stored_on(router, "b3", turn1[:320], 1_000)
    r = adm.try_admit(hinted(turn1 + history(300, seed=9)))
    assert r.backend.name == "b2"
    adm.release(r)


def test_a_block_every_node_reports_nominates_a_bounded_few():
    bs = [backend(f"b{i}", kv=40_000) for i in range(20)]
    router = PrefixRouter(PrefixIndex(), PrefixScoring(holders_per_key=3))
    system = history(64, seed=3)
    for i, b in enumerate(bs):
        stored_on(router, b.name, system, 100 * i)
    assert len(router._holders_of(tuple(block_keys(system + history(40), 16)))) == 3


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_refine_with_events_finds_the_best_score_of_the_tier(seed):
    """The slow twin again, the prompts' holders known from KV events only (nothing was
    granted, so the routed view is empty)."""
    rnd = random.Random(seed)
    bs = [backend(f"b{i}", kv=rnd.choice([8192, 16384, 32768])) for i in range(12)]
    router = PrefixRouter(PrefixIndex(), PrefixScoring(candidates=2, holders_per_key=12))
    adm, router, clock = make(bs, router)
    prefixes = [history(rnd.randrange(16, 600), seed=seed + k) for k in range(3)]
    for b in bs:
        router.index.attach_events(b.name)
        if rnd.random() < 0.5:
            p = rnd.choice(prefixes)
            stored_on(router, b.name, p[: rnd.randrange(0, len(p) + 1)], rnd.randrange(10**9))
        # Some nodes are busier than others: the score trades hit against load.
        adm._index_for("m").adjust(b, rnd.randrange(0, b.budget_tokens // 2), 1, 1)
    for step in range(20):
        ids = rnd.choice(prefixes) + history(rnd.randrange(0, 200), seed=seed * 100 + step)
        d = hinted(ids, output=rnd.randrange(1, 300))
        decision = adm.decide(d)
        if isinstance(decision, Routed):
            best = _scan_best(router, adm._index_for("m"), d, decision.backend, clock[0])
            assert router._score(decision.backend, d, clock[0], None) == best


def _hybrid_view(prompt: list[int], name: str) -> PrefixIndex:
    """``name`` reports ``prompt`` cached in a full-attention group and in a 64-token
    sliding-window group that freed all but its window's 4 blocks (as vLLM frees them)."""
    index = PrefixIndex()
    hashes = tuple(range(1000, 1000 + len(prompt) // 16))
    tokens = tuple(prompt)
    sliding = BlocksStored(hashes, None, tokens, 16, group_idx=0, kind="sliding_window", window=64)
    full = BlocksStored(hashes, None, tokens, 16, group_idx=1, kind="full_attention")
    index.apply_events(name, [sliding, full], now=0.0)
    index.apply_events(name, [BlocksRemoved(hashes[:-4], group_idx=0)], now=0.0)
    return index


def test_a_hybrid_node_holding_the_prompt_is_scored_as_its_events_say() -> None:
    """A hybrid model's node hits a prompt when its full-attention group holds the run
    and its sliding group the window before the hit's end (not the prompt's head): it is
    scored at the blocks its view matches, and a prompt goes to it over a freer node."""
    prompt = list(range(100, 100 + 16 * 100))
    keys = tuple(block_keys(prompt, 16))
    bs = [backend("a", kv=40_000), backend("n", kv=38_000)]  # kv_aware alone picks "a"
    index = _hybrid_view(prompt, "n")
    assert index.matched_blocks("n", keys, now=1.0) == 100
    adm, _, clock = make(bs, PrefixRouter(index))
    clock[0] = 1.0
    d = replace(demand(len(prompt) + 16), prefix=PrefixHint(keys, 16, None))
    r = adm.try_admit(d)
    assert isinstance(r, Reservation) and r.backend.name == "n"
