"""Pooled output risk: conditional outlooks of learned lengths, the per-request plan,
and the margin a node keeps for the sum of its requests' outputs."""

from __future__ import annotations

import math
import random

import pytest

from kvgateway.core.demand import demand_tokens
from kvgateway.core.output_model import OutputModel, OutputShape
from kvgateway.core.output_risk import (
    POOLED_MIN_SEQUENCES,
    Contribution,
    NodeRisk,
    contribution,
    plan_output,
    z_of,
)


def capped_lognormal(rnd: random.Random, cap: int, mean: float = 512.0) -> int:
    # The simulated nodes' answers: a lognormal of mean ``mean`` capped by max_tokens.
    sigma = 0.8
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, int(rnd.lognormvariate(mu, sigma))))


def test_outlook_by_hand():
    s = OutputShape([40, 10, 30, 20])
    o = s.outlook(-1, 100, 0.75)
    assert (o.expected, o.variance, o.quantile) == (25.0, 125.0, 30)
    # Generated 20 and still running: only 30 and 40 remain possible.
    o = s.outlook(20, 100, 0.5)
    assert (o.expected, o.variance, o.quantile) == (35.0, 25.0, 30)
    # A smaller max_tokens caps what was seen.
    assert s.outlook(-1, 35, 0.99) == s.outlook(-1, 35, 1.0)
    assert s.outlook(-1, 35, 1.0).expected == pytest.approx(23.75)
    assert s.outlook(-1, 35, 1.0).quantile == 35
    # Past everything seen, or at the cap: it runs to max_tokens, nothing uncertain left.
    assert s.outlook(40, 100, 0.5) == s.outlook(100, 100, 0.5)
    assert (s.outlook(40, 100, 0.5).expected, s.outlook(40, 100, 0.5).variance) == (100.0, 0.0)


def test_model_shapes_follow_the_groups_and_the_quantile_is_unchanged():
    m = OutputModel(min_samples=4)
    for v in (10, 20, 30, 40):
        m.observe("m", "k", 100, v)
    shape = m.shape("m", "k", 100)
    assert shape is not None and shape.size == 4
    assert m.shape("m", "k", 100) is shape  # cached until the group changes
    assert m.quantile("m", "k", 100, 0.75) == 30
    m.observe("m", "k", 100, 50)
    assert m.shape("m", "k", 100) is not shape
    assert m.shape("m", "other", 100) is None  # another key learns from its own answers
    assert m.shape("m", "k", 1000) is None


def test_z_of_risk():
    assert z_of(0.01) == pytest.approx(2.326, abs=1e-3)
    assert z_of(0.5) == 0.0
    with pytest.raises(ValueError):
        z_of(0.0)


def test_plan_checks_at_least_the_quantile_and_reserves_the_mean():
    rnd = random.Random(1)
    shape = OutputShape([capped_lognormal(rnd, 512) for _ in range(512)])
    tokens, o = plan_output(shape, 512, 0.01, [1000], 1, 16)
    mean = shape.outlook(-1, 512, 0.99).expected
    assert o.covered == math.ceil(mean) and 250 < o.covered < 400
    assert o.checked >= shape.outlook(-1, 512, 0.99).quantile
    assert tokens == demand_tokens([1000], o.checked, 1, 16)
    base = demand_tokens([1000], o.covered, 1, 16)
    assert o.slack == tokens - base
    assert o.ceiling == demand_tokens([1000], 512, 1, 16) - base
    # n sequences of two prompts: everything counted for all four.
    tokens2, o2 = plan_output(shape, 512, 0.01, [1000, 40], 2, 16)
    assert tokens2 == demand_tokens([1000, 40], o2.checked, 2, 16)
    assert o2.slack == tokens2 - demand_tokens([1000, 40], o2.covered, 2, 16)


def test_few_sequences_keep_the_per_request_quantiles():
    risk = NodeRisk(block=16)
    c = Contribution(excess=0.0, variance=10_000.0, gap=200.0, ceiling=400.0, seqs=1, z=2.33)
    for rid in range(POOLED_MIN_SEQUENCES - 1):
        risk.put(rid, c)
    assert risk.need() == 16 * math.ceil(200 * (POOLED_MIN_SEQUENCES - 1) / 16)


def test_many_sequences_pool_their_spread_and_never_pass_the_quantiles_or_max_tokens():
    rnd = random.Random(2)
    shape = OutputShape([capped_lognormal(rnd, 512) for _ in range(512)])
    _, o = plan_output(shape, 512, 0.01, [3000], 1, 16)
    risk = NodeRisk(block=16)
    per_request = 0.0
    for rid in range(64):
        c = contribution(o, 1, -1, 16)
        per_request += c.gap
        risk.put(rid, c)
    pooled = risk.need()  # its members' z: z_of(0.01)
    sd = math.sqrt(shape.outlook(-1, 512, 0.99).variance)
    assert pooled == 16 * math.ceil(z_of(0.01) * 8 * sd / 16)
    assert pooled < per_request / 3  # 64 sequences: sqrt(64) = 8 standard deviations' worth
    # A node of requests that can never grow needs nothing more.
    tight = NodeRisk(block=16)
    for rid in range(20):
        tight.put(
            rid, Contribution(excess=5.0, variance=1e6, gap=1e3, ceiling=10.0, seqs=1, z=2.33)
        )
    assert tight.need() == 208  # 20 x 10 tokens of max_tokens, in blocks


def test_a_stream_past_its_mean_is_kept_a_block_ahead_and_its_spread_shrinks():
    shape = OutputShape(list(range(1, 401)))
    _, o = plan_output(shape, 400, 0.01, [100], 1, 16)
    fresh = contribution(o, 1, -1, 16)
    assert fresh.excess == 0.0
    late = contribution(o, 1, 390, 16)
    assert late.variance < fresh.variance / 100
    assert late.excess >= 390 + 16 - o.covered
    # Kept a block ahead even at its cap (the node rounds each sequence to blocks), while
    # the node's margin stays within what max_tokens mode reserves (the ceiling).
    over = contribution(o, 1, 400, 16)
    assert over.excess == 400 + 16 - o.covered and over.ceiling == o.ceiling


def test_replacing_and_removing_members_returns_to_zero():
    risk = NodeRisk(block=16)
    a = Contribution(excess=3.0, variance=7.0, gap=5.0, ceiling=50.0, seqs=2)
    b = Contribution(excess=1.0, variance=2.0, gap=1.0, ceiling=20.0, seqs=1)
    risk.put(1, a)
    risk.put(2, b)
    risk.put(1, b)
    assert (risk.excess, risk.variance, risk.seqs) == (2.0, 4.0, 2)
    risk.remove(1)
    risk.remove(1)
    assert (risk.excess, risk.seqs) == (1.0, 1)
    risk.remove(2)
    assert (risk.excess, risk.variance, risk.gap, risk.ceiling, risk.seqs) == (0, 0, 0, 0, 0)
    assert risk.need() == 0 and risk.zs == {}


def test_a_learned_book_never_passes_the_max_tokens_book_near_the_cap():
    """A stream kept a block ahead past its max_tokens: 64 streams at 405 of 412 held
    33,920 tokens where max_tokens mode holds 32,768 (the README's promise)."""
    from dataclasses import replace

    from kvgateway.core.reservation import Reservation
    from tests.support.backends import admission_over, backend, demand

    rnd = random.Random(4)
    m = OutputModel(min_samples=50)
    mu = math.log(200) - 0.32
    for _ in range(512):
        m.observe("m", "k", 412, max(1, min(412, int(rnd.lognormvariate(mu, 0.8)))))
    shape = m.shape("m", "k", 412)
    assert shape is not None
    b = backend("a", kv=1_000_000, seqs=256)
    adm = admission_over([b])
    cap_book = demand_tokens([100], 412, 1, 16)
    held = []
    for _ in range(64):
        tokens, outlook = plan_output(shape, 412, 0.01, [100], 1, 16)
        r = adm.try_admit(replace(demand(100, 412), tokens=tokens, outlook=outlook))
        assert isinstance(r, Reservation)
        held.append(r)
    for generated in range(1, 413):
        for r in held:
            adm.progress(r, generated)
        assert b.reserved_tokens <= 64 * cap_book, generated
    for r in held:
        adm.release(r)
    assert b.reserved_tokens == 0


def test_a_reload_that_changes_the_risk_mid_flight_prices_the_node_at_the_most_cautious():
    """The margin took the z of whichever request last changed: one request planned at
    risk 0.3 cut a node of 32 requests at 0.01 from 1,984 tokens of margin to 464."""
    rnd = random.Random(5)
    shape = OutputShape([capped_lognormal(rnd, 512, 256) for _ in range(512)])
    _, careful = plan_output(shape, 512, 0.01, [100], 1, 16)
    _, loose = plan_output(shape, 512, 0.3, [100], 1, 16)
    risk = NodeRisk(block=16)
    for rid in range(32):
        risk.put(rid, contribution(careful, 1, -1, 16))
    before = risk.need()
    risk.put(99, contribution(loose, 1, -1, 16))
    assert risk.need() >= before
    for rid in range(32):
        risk.remove(rid)
    assert risk.zs == {loose.z: 1}  # the cautious ones gone: the loose one's own
