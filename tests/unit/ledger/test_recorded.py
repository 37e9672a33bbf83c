from kvgateway.core.reservation import Amount
from kvgateway.ledger.recorded import Recorded


def test_grants_and_releases_net_out_and_never_read_below_zero() -> None:
    r = Recorded()
    r.add("a", 1_000, 2)
    r.give_back([("a", 400, 1), ("b", 50, 0)])
    assert r.on("a") == Amount(600, 1)
    # More given back than recorded (a copy its payer recorded): read as nothing held.
    assert r.on("b") == Amount(0, 0)
    assert r.caps() == {"a": Amount(600, 1), "b": Amount(0, 0)}


def test_a_sync_rewrites_and_forgets_gone_names_with_nothing_held() -> None:
    r = Recorded()
    r.add("old", 10, 1)
    r.add("gone", 5, 0)
    r.rewrite(["kept", "gone", "held"], [Amount(0, 0), Amount(0, 0), Amount(7, 1)], {"kept"})
    assert r.names() == {"kept", "held"}
    assert "gone" not in r and "old" not in r
    assert r.on("held") == Amount(7, 1)
