from hypothesis import given
from hypothesis import strategies as st

from gateway.routing import NoBackend, Routed, RouterState, TooLong, Wait, demand_tokens, route
from tests.gateway.helpers import backend, demand


def fleet():
    return [
        backend("s1", tier="small", tier_index=0, max_model_len=8192, kv=30000),
        backend("s2", tier="small", tier_index=0, max_model_len=8192, kv=30000),
        backend("l1", tier="large", tier_index=1, max_model_len=32768, kv=400000, seqs=128),
        backend("o1", tier="offload", tier_index=2, offload=True, max_model_len=131072, kv=200000),
    ]


def decide(backends, d, policy="kv_aware", **kw):
    return route(policy, backends, d, RouterState(), 0.0, **kw)


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
    names = [route("round_robin", b, demand(20000), state, 0.0).backend.name for _ in range(4)]
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
