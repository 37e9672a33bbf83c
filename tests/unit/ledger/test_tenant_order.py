"""The tenants' order across replicas, without Redis: what a replica does with what the
others answered."""

from __future__ import annotations

from kvgateway.config.model import AuthConfig, ClassConfig, TenantConfig
from kvgateway.core.tenancy import Elsewhere, Tenancy
from kvgateway.ledger.tenant_order import take_floor_waits, take_grants, within_floor

AUTH = AuthConfig(
    keys=(
        TenantConfig("i", ("k-i",), class_name="interactive"),
        TenantConfig("b", ("k-b",), class_name="batch"),
    ),
    classes=(ClassConfig("interactive", floor_share=0.25), ClassConfig("batch")),
)


def test_a_class_is_within_its_floor_while_it_holds_less_than_it_anywhere() -> None:
    """Within its floor (a quarter of 16 slots, or of 1,000 KV tokens, counting what
    other replicas hold), other replicas' waiters do not hold the class off a backend;
    a class without a floor never is."""
    t = Tenancy(lambda: AUTH)
    assert within_floor(t, "interactive", 1000, 16)
    t.elsewhere.class_seqs["interactive"] = 4
    t.elsewhere.class_tokens["interactive"] = 400
    assert within_floor(t, "interactive", 1000, 16)
    t.class_seqs["interactive"] = 1
    assert not within_floor(t, "interactive", 1000, 16)
    assert not within_floor(t, "batch", 1000, 16)


def test_only_what_others_grant_after_the_first_look_moves_a_tenant_back() -> None:
    t = Tenancy(lambda: AUTH)
    seen: dict[str, int] = {}
    take_grants(t, seen, ["b"], [50_000])  # granted before this replica looked
    assert t.ticket("b", 10).start == 0
    take_grants(t, seen, ["b"], [53_000])
    assert t.ticket("b", 10).start == 3_010


def test_waiters_ask_again_once_the_others_oldest_was_served() -> None:
    away = Elsewhere()
    pair = [("batch", "m")]
    assert not take_floor_waits(away, pair, [1500])
    assert away.floor_waits == {("batch", "m"): 1.5}
    assert not take_floor_waits(away, pair, [1800])  # the same one, older
    assert take_floor_waits(away, pair, [200])  # served: a younger one is the oldest
    assert take_floor_waits(away, pair, [-1])  # none waits
    assert away.floor_waits == {}
