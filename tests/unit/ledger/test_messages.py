"""The released channel's two messages, as the Lua scripts publish them."""

from __future__ import annotations

from kvgateway.ledger.scripts import Refused, Released, parse_message


def test_release_and_refusal_messages_parse_and_garbage_does_not():
    assert parse_message(b"n1\t4000\t3\thost:8080") == Released("n1", 4000, 3, "host:8080")
    assert parse_message(b"wait\tn1\thost:8080/w1") == Refused("n1", "host:8080/w1")
    assert parse_message(b"n1\tmany\t3\thost") is None
    assert parse_message(b"\xff\xfe") is None
