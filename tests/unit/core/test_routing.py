from typing import cast

from hypothesis import given
from hypothesis import strategies as st

from kvgateway.config.model import Policy
from kvgateway.core.backends import Backend, PauseReason
from kvgateway.core.demand import demand_tokens
from kvgateway.core.routing import (
    ModelIndex,
    NoBackend,
    Routed,
    RouterState,
    TooLong,
    Wait,
    kv_aware_scan,
    least_in_flight,
    route,
)
from tests.support.backends import backend, demand


def fleet():
    return [
        backend("s1", tier="small", tier_index=0, max_model_len=8192, kv=30000),
        backend("s2", tier="small", tier_index=0, max_model_len=8192, kv=30000),
        backend("l1", tier="large", tier_index=1, max_model_len=32768, kv=400000, seqs=128),
        backend("o1", tier="offload", tier_index=2, offload=True, max_model_len=131072, kv=200000),
    ]


def decide(backends, d, policy="kv_aware", **kw):
    return route(policy, ModelIndex(backends), d, RouterState(), 0.0, **kw)


def test_short_request_prefers_first_tier_with_most_free_budget():
    b = fleet()
    b[0].reserved_tokens = 10000
    r = decide(b, demand(1000))
    assert isinstance(r, Routed) and r.backend.name == "s2" and r.reason == "fit"


def test_long_request_goes_to_large_tier_as_fit():
    r = decide(fleet(), demand(20000, 1000))
    assert isinstance(r, Routed) and r.backend.name == "l1" and r.reason == "fit"


def test_full_small_tier_spills_to_large():
    b = fleet()
    for x in b[:2]:
        x.reserved_tokens = 29000
    r = decide(b, demand(1000, 500))
    assert isinstance(r, Routed) and r.backend.name == "l1" and r.reason == "spill"


def test_sequence_cap_counts_as_full():
    b = fleet()
    for x in b[:2]:
        x.reserved_seqs = 16
    r = decide(b, demand(100))
    assert isinstance(r, Routed) and r.backend.name == "l1"


def test_only_offload_takes_very_long_prompts():
    r = decide(fleet(), demand(100000, 1000))
    assert isinstance(r, Routed) and r.backend.name == "o1" and r.reason == "offload"


def test_gpu_overflow_to_offload_only_when_enabled():
    b = fleet()
    for x in b[:3]:
        x.reserved_tokens = x.budget_tokens
    assert isinstance(decide(b, demand(1000)), Wait)
    r = decide(b, demand(1000), offload_overflow=True)
    assert isinstance(r, Routed) and r.backend.name == "o1" and r.reason == "overflow"


def test_never_fits_reports_largest_context():
    r = decide(fleet(), demand(140000, 1000))
    assert isinstance(r, TooLong) and r.largest_context == 131072


def test_context_limit_is_smaller_of_model_len_and_pool():
    b = [backend("tiny", max_model_len=32768, kv=5000)]
    assert isinstance(decide(b, demand(6000)), TooLong)


def test_unhealthy_fitting_backends_give_no_backend():
    b = fleet()
    b[2].healthy = False
    r = decide(b, demand(20000))
    assert isinstance(r, Routed) and r.backend.name == "o1" and r.reason == "offload"
    b[3].healthy = False
    assert isinstance(decide(b, demand(20000)), NoBackend)


def test_paused_backend_gets_no_work():
    b = fleet()
    b[0].paused = True
    b[0].pause_reason = "kv_full"
    r = decide(b, demand(100))
    assert isinstance(r, Routed) and r.backend.name == "s2"


def test_excluded_backends_are_skipped_but_do_not_make_it_too_long():
    b = [backend("a"), backend("b")]
    d = demand(100)
    d2 = type(d)(**{**{f: getattr(d, f) for f in d.__slots__}, "exclude": frozenset({"a", "b"})})
    assert isinstance(decide(b, d2), NoBackend)


def test_round_robin_ignores_context():
    b = fleet()
    state = RouterState()
    idx = ModelIndex(b)
    names = [
        cast(
            Routed, route(cast(Policy, "round_robin"), idx, demand(20000), state, 0.0)
        ).backend.name
        for _ in range(4)
    ]
    assert names == ["s1", "s2", "l1", "o1"]


def test_least_loaded_and_length_aware():
    b = fleet()
    b[0].in_flight = 3
    b[1].in_flight = 1
    b[2].in_flight = 2
    b[3].in_flight = 5
    assert decide(b, demand(100), "least_loaded").backend.name == "s2"
    assert decide(b, demand(20000), "length_aware").backend.name == "l1"
    assert isinstance(decide(b, demand(200000), "length_aware"), TooLong)


def test_demand_rounds_each_sequence_to_blocks():
    assert demand_tokens([1], 1, 1, 16) == 16
    assert demand_tokens([16], 1, 1, 16) == 32
    assert demand_tokens([100, 50], 10, 2, 16) == 2 * 112 + 2 * 64


@given(
    prompt=st.integers(1, 200_000),
    output=st.integers(1, 50_000),
    reserved=st.lists(st.integers(0, 400_000), min_size=4, max_size=4),
)
def test_kv_aware_never_overcommits_or_exceeds_context(prompt, output, reserved):
    b = fleet()
    for x, r in zip(b, reserved, strict=True):
        x.reserved_tokens = min(r, x.budget_tokens)
    d = demand(prompt, output)
    r = decide(b, d)
    if isinstance(r, Routed):
        assert r.backend.free_tokens >= d.tokens
        assert r.backend.context_limit >= prompt + output
    elif isinstance(r, TooLong):
        assert all(x.context_limit < prompt + output or x.budget_tokens < d.tokens for x in b)


backend_st = st.fixed_dictionaries(
    {
        "tier": st.integers(0, 3),
        "ctx": st.sampled_from([4096, 8192, 32768, 131072]),
        "kv": st.integers(1000, 500_000),
        "seqs": st.integers(1, 64),
        "healthy": st.booleans(),
        "paused": st.integers(0, 4),
        "reserved": st.floats(0, 1),
        "rseqs": st.floats(0, 1),
    }
)


@given(
    specs=st.lists(backend_st, min_size=1, max_size=12),
    prompt=st.integers(1, 140_000),
    output=st.integers(1, 8000),
    n=st.integers(1, 3),
    overflow=st.booleans(),
    exclude=st.sets(st.integers(0, 11), max_size=3),
    busy=st.sets(st.integers(0, 11), max_size=4),
)
def test_indexed_kv_aware_matches_the_full_scan(specs, prompt, output, n, overflow, exclude, busy):
    specs = sorted(specs, key=lambda s: s["tier"])
    bs = []
    for i, s in enumerate(specs):
        b = backend(
            f"b{i}",
            tier=f"t{s['tier']}",
            tier_index=s["tier"],
            offload=s["tier"] == 3,
            max_model_len=s["ctx"],
            kv=s["kv"],
            seqs=s["seqs"],
            healthy=s["healthy"],
        )
        b.reserved_tokens = int(b.budget_tokens * s["reserved"])
        b.reserved_seqs = int(b.max_num_seqs * s["rseqs"])
        b.paused = s["paused"] == 0
        b.pause_reason = cast(PauseReason, "kv_full" if b.paused else "")
        bs.append(b)
    d = demand(prompt, output, n=n)
    d = type(d)(
        **{
            **{f: getattr(d, f) for f in d.__slots__},
            "exclude": frozenset(f"b{i}" for i in exclude),
            "busy": frozenset(f"b{i}" for i in busy),
        }
    )
    fast = route(
        cast(Policy, "kv_aware"), ModelIndex(bs), d, RouterState(), 0.0, offload_overflow=overflow
    )
    slow = kv_aware_scan(bs, d, 0.0, offload_overflow=overflow)
    assert fast == slow


def test_index_stays_sorted_through_reservations():
    bs = [backend(f"b{i}", kv=10_000 + i) for i in range(50)]
    idx = ModelIndex(bs)
    import random

    rnd = random.Random(5)
    held: list[tuple[Backend, int]] = []
    for _ in range(500):
        if held and rnd.random() < 0.5:
            b, t = held.pop(rnd.randrange(len(held)))
            idx.adjust(b, -t, -1, -1)
        else:
            b = rnd.choice(bs)
            t = rnd.randint(1, 500)
            idx.adjust(b, t, 1, 1)
            held.append((b, t))
        order = [x.free_tokens for x in idx.tiers[0]._sorted]
        assert order == sorted(order, reverse=True)


def test_a_request_that_reserves_nothing_goes_to_the_least_busy_node_in_turn() -> None:
    """Embeddings, rerank, tokenize: the fewest requests in flight among nodes that
    accept work and were not tried; ties in turn, so no node takes them all."""
    a, b, c = backend("a"), backend("b"), backend("c", healthy=False)
    a.in_flight, b.in_flight = 3, 1
    assert least_in_flight([a, b, c], 0.0, set(), 0) is b
    assert least_in_flight([a, b, c], 0.0, {"b"}, 0) is a  # tried already: the next
    b.in_flight = 3
    assert {cast(Backend, least_in_flight([a, b], 0.0, set(), turn)).name for turn in range(4)} == {
        "a",
        "b",
    }
    assert least_in_flight([c], 0.0, set(), 0) is None
