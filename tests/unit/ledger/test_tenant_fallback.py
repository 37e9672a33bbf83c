"""What a replica takes the others to hold while Redis does not answer it: all of each
tenant's cap but its own share (1 / live replicas), or, while its lease may still be
live, what Redis records for it when that is less; the same for the fleet's budget and
slots under class floors. Pure: no Redis."""

from __future__ import annotations

from kvgateway.core.tenancy import Elsewhere
from kvgateway.ledger.fallback import (
    LIVES_SPAN_S,
    RequestLives,
    SeenBefore,
    TenantFallback,
    TenantRecord,
    over_limit,
    tenant_fallback,
)


def _record(
    tenants: dict[str, tuple[int, int]] | None = None,
    classes: tuple[int, int] = (0, 0),
    *,
    leased: bool,
) -> TenantRecord:
    return TenantRecord(tenants or {}, classes, leased)


def test_with_the_lease_gone_each_replica_keeps_its_share_alone() -> None:
    away = Elsewhere()
    caps = {"acme": (9_000, 30)}
    tenant_fallback(away, caps, None, _record({"acme": (100, 1)}, leased=False), live=3)
    # The others hold all but this replica's third, whatever Redis recorded for it.
    assert (away.tokens["acme"], away.requests["acme"]) == (6_000, 20)


def test_while_the_lease_may_be_live_the_others_count_it_at_its_record() -> None:
    """The other replicas, reaching Redis, count this one at what Redis records for it:
    it may take no more than that (if less than its share) until its lease runs out."""
    away = Elsewhere()
    caps = {"acme": (9_000, 30), "beta": (3_000, 6)}
    mine = _record({"acme": (1_000, 2), "beta": (5_000, 9)}, leased=True)
    tenant_fallback(away, caps, None, mine, live=3)
    assert (away.tokens["acme"], away.requests["acme"]) == (8_000, 28)  # its record
    assert (away.tokens["beta"], away.requests["beta"]) == (2_000, 4)  # its share: less
    # A tenant it holds nothing for: the others may hold the whole cap.
    tenant_fallback(away, {"gamma": (600, 6)}, None, mine, live=2)
    assert (away.tokens["gamma"], away.requests["gamma"]) == (600, 6)


def test_the_tenants_whose_view_fell_are_named_for_their_waiters() -> None:
    away = Elsewhere()
    away.tokens["acme"], away.requests["acme"] = 9_000, 30  # last seen: all of it held
    away.tokens["beta"], away.requests["beta"] = 0, 0
    caps = {"acme": (9_000, 30), "beta": (3_000, 6)}
    fell = tenant_fallback(away, caps, None, _record(leased=False), live=2)
    assert fell == ["acme"]  # beta's view rose from nothing: its waiters have no more room


def test_class_floors_count_the_fleet_but_this_replicas_share_in_no_known_class() -> None:
    away = Elsewhere()
    away.class_tokens["interactive"] = 50_000
    away.class_seqs["interactive"] = 40
    away.node_seqs["n1"] = away.class_seqs.copy()
    caps = {"acme": (9_000, 30)}
    fell = tenant_fallback(away, caps, (120_000, 64), _record(leased=False), live=4)
    assert not away.class_tokens and not away.class_seqs and not away.node_seqs
    assert (away.unclassed_tokens, away.unclassed_seqs) == (90_000, 48)
    assert fell == []  # 90,000 and 48 are more than the 50,000 and 40 last seen
    # Leased with little recorded: the others hold all but that little.
    leased = _record(classes=(2_000, 1), leased=True)
    fell = tenant_fallback(away, caps, (120_000, 64), leased, live=4)
    assert (away.unclassed_tokens, away.unclassed_seqs) == (118_000, 63)
    # A replica alone (live counted at least 1) leaves the others nothing of its share.
    fell = tenant_fallback(away, caps, (120_000, 64), _record(leased=False), live=0)
    assert (away.unclassed_tokens, away.unclassed_seqs) == (0, 0)
    assert fell == ["acme"]  # the fleet's view fell: every tenant's waiters ask again


def test_what_the_others_held_when_redis_went_counts_while_it_may_still_run() -> None:
    """A replica that held more than its share when Redis went keeps it until its
    requests end: the others are taken to hold at least what they were seen holding
    (never more than the cap), their share notwithstanding, lease or none."""
    away = Elsewhere()
    away.tokens["acme"], away.requests["acme"] = 3_000, 3  # last seen
    seen = SeenBefore.of(away, ["acme"])
    caps = {"acme": (4_000, 4)}
    tenant_fallback(away, caps, None, _record({"acme": (1_000, 1)}, leased=True), 2, seen)
    assert (away.tokens["acme"], away.requests["acme"]) == (3_000, 3)
    tenant_fallback(away, caps, None, _record(leased=False), 2, seen)
    assert (away.tokens["acme"], away.requests["acme"]) == (3_000, 3)
    # Once what they held then has surely ended: the share alone.
    fell = tenant_fallback(away, caps, None, _record(leased=False), 2)
    assert (away.tokens["acme"], away.requests["acme"]) == (2_000, 2) and fell == ["acme"]
    # Seen holding more than the cap (a cap lowered meanwhile): the cap.
    tenant_fallback(away, {"acme": (2_000, 2)}, None, _record(leased=False), 2, seen)
    assert (away.tokens["acme"], away.requests["acme"]) == (2_000, 2)


def test_what_the_others_held_may_run_as_long_as_this_replicas_requests_lately() -> None:
    """The window is the longest life of a request that ended here in the last span or
    the one before, never past the cap; nothing ended yet: none."""
    lives = RequestLives(lambda: 30.0)
    assert lives.window(0.0) == 0.0
    lives.born(1, 0.0)
    lives.born(2, 1.0)
    lives.born(3, 1.0)
    lives.ended(1, 4.0)
    lives.ended(2, 3.0)
    lives.forget(3)
    assert lives.window(5.0) == 4.0
    lives.ended(3, 100.0)  # forgotten: its end counts for nothing
    assert lives.window(100.0) == 4.0
    lives.born(4, 10.0)
    lives.ended(4, 60.0)
    assert lives.window(60.0) == 30.0  # capped: no request outlives its total timeout
    assert lives.window(60.0 + LIVES_SPAN_S) == 30.0  # the span before still counts
    assert lives.window(60.0 + 3 * LIVES_SPAN_S) == 0.0


def test_what_the_others_held_when_redis_went_holds_for_the_window_of_each_fallback() -> None:
    """The first view of a fallback keeps what the others held then, for as long as a
    request here lived lately; past that, the share alone; once Redis answered, the next
    fallback keeps what the others hold when it begins."""
    lives = RequestLives(lambda: 900.0)
    lives.born(1, 0.0)
    lives.ended(1, 5.0)  # a request here lived 5 s
    fallback = TenantFallback(lives)
    caps = {"acme": (4_000, 4)}
    mine = _record(leased=False)
    away = Elsewhere()
    away.tokens["acme"], away.requests["acme"] = 3_500, 3
    fallback.apply(away, caps, None, mine, 2, now=10.0)
    assert (away.tokens["acme"], away.requests["acme"]) == (3_500, 3)
    fallback.apply(away, caps, None, mine, 2, now=14.9)  # still kept: 3,500, not 2,000
    assert (away.tokens["acme"], away.requests["acme"]) == (3_500, 3)
    assert fallback.apply(away, caps, None, mine, 2, now=15.0) == ["acme"]
    assert (away.tokens["acme"], away.requests["acme"]) == (2_000, 2)
    fallback.answered()
    away.tokens["acme"], away.requests["acme"] = 3_000, 4
    fallback.apply(away, caps, None, mine, 2, now=100.0)
    assert (away.tokens["acme"], away.requests["acme"]) == (3_000, 4)


def test_a_hold_in_the_fallback_is_over_a_limit_counting_both_sides() -> None:
    """Caps, this replica's holding and the others' are each (KV tokens, requests): the
    request cap counts requests on both sides, the token cap tokens, and a tenant holding
    nothing anywhere may run one request however large."""
    caps = (1_000, 3)
    assert not over_limit(None, (10**9, 10**9), (0, 0), 1)
    assert over_limit(caps, (100, 2), (100, 1), 10)  # the 4th request of 3
    assert not over_limit(caps, (100, 1), (100, 1), 10)  # the 3rd
    assert over_limit(caps, (600, 1), (300, 0), 200)  # 900 + 200 tokens > 1,000
    assert not over_limit(caps, (600, 1), (300, 0), 100)
    assert not over_limit(caps, (0, 0), (0, 0), 5_000)  # nothing held: one may run
    assert not over_limit((1_000, -1), (0, 50), (0, 50), 10)  # no request cap
