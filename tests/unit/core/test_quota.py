"""Token and request quotas over a sliding minute, with an injected clock."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.config.model import TenantLimits
from kvgateway.core.quota import OUTPUT, PROMPT, REQUESTS, Charge, LocalQuotaLedger, RateLimitHit


def test_a_hit_names_the_limit_and_when_it_frees():
    ledger = LocalQuotaLedger()
    limits = TenantLimits(requests_per_minute=3)
    for t in (0.0, 10.0, 20.0):
        assert isinstance(ledger.take("a", limits, 10, 10, t), Charge)
    hit = ledger.take("a", limits, 10, 10, 30.0)
    assert isinstance(hit, RateLimitHit)
    assert (hit.limit, hit.value, hit.used) == (REQUESTS, 3, 3)
    assert hit.retry_after_s == 30.0  # the charge made at t=0 leaves the window at t=60
    assert isinstance(ledger.take("a", limits, 10, 10, 60.01), Charge)
    # Another tenant has its own window.
    assert isinstance(ledger.take("b", limits, 10, 10, 30.0), Charge)


def test_the_limit_that_frees_last_is_reported():
    ledger = LocalQuotaLedger()
    limits = TenantLimits(prompt_tokens_per_minute=1000, output_tokens_per_minute=1000)
    ledger.take("a", limits, 900, 100, 0.0)
    ledger.take("a", limits, 50, 850, 30.0)
    hit = ledger.take("a", limits, 200, 200, 40.0)
    assert isinstance(hit, RateLimitHit)
    # Prompt frees at t=60 (the 900), output only at t=90 (the 850 must leave too).
    assert hit.limit == OUTPUT and hit.retry_after_s == 50.0
    too_big = ledger.take("a", limits, 2000, 0, 40.0)
    assert isinstance(too_big, RateLimitHit) and too_big.limit == PROMPT
    assert too_big.retry_after_s == float("inf")


def test_settling_gives_back_unused_output_once():
    ledger = LocalQuotaLedger()
    limits = TenantLimits(output_tokens_per_minute=1000)
    c = ledger.take("a", limits, 10, 800, 0.0)
    assert isinstance(c, Charge)
    assert isinstance(ledger.take("a", limits, 10, 300, 1.0), RateLimitHit)
    ledger.settle(c, 100, 2.0)
    ledger.settle(c, 900, 2.0)  # only the first settlement counts
    assert ledger.usage("a", 3.0)[OUTPUT] == 100
    assert isinstance(ledger.take("a", limits, 10, 300, 3.0), Charge)
    status = ledger.status("a", limits, 3.0)[OUTPUT]
    assert (status.limit, status.remaining) == (
        1000,
        600,
    ) and status.reset_s == 60.0  # the newest charge (t=3) leaves at t=63


def test_token_quotas_hold_within_one_percent_over_minutes_of_mixed_traffic():
    rng = random.Random(7)
    limits = TenantLimits(
        prompt_tokens_per_minute=60_000, output_tokens_per_minute=20_000, requests_per_minute=400
    )
    ledger = LocalQuotaLedger()
    now = 0.0
    admitted: list[tuple[float, int, int]] = []  # time, prompt, settled output
    pending: list[tuple[float, Charge, int, float]] = []
    while now < 240.0:
        now += rng.expovariate(20.0)  # ~20 requests a second offered: far above the limits
        for item in [p for p in pending if p[3] <= now]:
            pending.remove(item)
            _, charge, actual, _ = item
            ledger.settle(charge, actual, now)
        prompt = rng.choice([50, 200, 800, 3000])
        reserved = rng.choice([64, 256, 1024])
        c = ledger.take("t", limits, prompt, reserved, now)
        if isinstance(c, Charge):
            actual = rng.randint(0, reserved)
            pending.append((now, c, actual, now + rng.uniform(0.1, 20.0)))
            admitted.append((now, prompt, actual))
    # Over every sliding minute (checked at each admission), within 1% of each limit.
    for t, _, _ in admitted:
        window = [a for a in admitted if t - 60.0 < a[0] <= t]
        assert sum(p for _, p, _ in window) <= 60_000 * 1.01
        assert sum(o for _, _, o in window) <= 20_000 * 1.01
        assert len(window) <= 400
    # And the quota is used, not refused wholesale: the prompt limit binds in steady state.
    steady = [a for a in admitted if 120.0 < a[0] <= 180.0]
    assert sum(p for _, p, _ in steady) >= 60_000 * 0.9


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 5.0),  # seconds since the previous request
            st.integers(0, 3000),  # prompt
            st.integers(0, 2000),  # reserved output
            st.floats(0.0, 1.0),  # share of the reservation generated
            st.floats(0.0, 90.0),  # seconds until it is settled
        ),
        max_size=120,
    )
)
def test_no_sliding_minute_ever_holds_more_than_a_limit(requests):
    """Whatever the arrivals and settlements, the settled amounts in any minute ending at
    an admission stay within each limit (settling only ever lowers a charge)."""
    limits = TenantLimits(
        prompt_tokens_per_minute=8000, output_tokens_per_minute=5000, requests_per_minute=20
    )
    ledger = LocalQuotaLedger()
    now = 0.0
    pending: list[tuple[float, Charge, int]] = []
    admitted: list[tuple[float, int, Charge]] = []
    for gap, prompt, reserved, share, settle_in in requests:
        now += gap
        for item in sorted((p for p in pending if p[0] <= now), key=lambda p: p[0]):
            pending.remove(item)
            ledger.settle(item[1], item[2], item[0])
        c = ledger.take("t", limits, prompt, reserved, now)
        if isinstance(c, Charge):
            admitted.append((now, prompt, c))
            pending.append((now + settle_in, c, int(reserved * share)))
        else:
            assert c.used + c.asked > c.value  # refused only when over
    for at, _, _ in admitted:
        window = [a for a in admitted if at - 60.0 < a[0] <= at]
        assert len(window) <= 20
        assert sum(p for _, p, _ in window) <= 8000
        assert sum(c.entries["output_tokens_per_minute"].amount for _, _, c in window) <= 5000
