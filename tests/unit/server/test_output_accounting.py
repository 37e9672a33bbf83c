"""Live output accounting: tokens counted from SSE chunks; a stream that outgrows its
learned reservation takes more before the node holds it."""

from __future__ import annotations

from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.routing_index import ModelIndex
from kvgateway.server.output_accounting import OutputAccounting, client_key, count_stream_tokens
from tests.support.backends import backend, demand

ROLE = b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def token(i: int = 0) -> bytes:
    return b'data: {"id":"x","choices":[{"index":%d,"delta":{"content":"a"}}]}\n\n' % i


def test_chunks_count_one_token_per_choice_and_roles_count_none():
    assert count_stream_tokens(ROLE + token() * 3) == 3
    assert count_stream_tokens(token(0) + token(1)) == 2
    usage = b'data: {"choices":[],"usage":{"completion_tokens":5}}\n\ndata: [DONE]\n\n'
    assert count_stream_tokens(usage) == 0


def test_client_key_hides_the_key_and_groups_by_it():
    a = client_key("Bearer sk-secret")
    assert a == client_key("bearer  sk-secret") and "secret" not in a
    assert a != client_key("Bearer other") and client_key("") == "*"


def test_a_stream_outgrowing_its_reservation_grows_it_ahead_of_the_output():
    b = backend("a", kv=100_000)
    idx = ModelIndex([b])
    adm = Admission(
        index_for=lambda m: idx,
        adjust=idx.adjust,
        policy=lambda: "kv_aware",
        offload_overflow=lambda: False,
        queue_size=lambda: 10,
        clock=lambda: 0.0,
    )
    d = demand(100, 20)  # reserves 128 tokens: 100 prompt + 20 learned output, in blocks
    r = adm.try_admit(d)
    assert isinstance(r, Reservation)
    acct = OutputAccounting()
    live = acct.start(r, 100, 1, 20, 16)
    for _ in range(200):
        acct.on_events(live, token())
        # What the node holds now never exceeds what the gateway reserved.
        assert b.reserved_tokens >= live.footprint
    assert acct.statistics() == {"a": 300}
    acct.end(live)
    assert acct.statistics() == {}
    adm.release(r)
    assert b.reserved_tokens == 0 and b.in_flight == 0


def test_a_run_of_many_tokens_at_once_grows_the_reservation_past_all_of_them():
    b = backend("a", kv=100_000)
    idx = ModelIndex([b])
    adm = Admission(
        index_for=lambda m: idx,
        adjust=idx.adjust,
        policy=lambda: "kv_aware",
        offload_overflow=lambda: False,
        queue_size=lambda: 10,
        clock=lambda: 0.0,
    )
    r = adm.try_admit(demand(96, 32))  # exactly 128 tokens: no rounding slack
    assert isinstance(r, Reservation)
    acct = OutputAccounting()
    live = acct.start(r, 96, 1, 32, 16)
    acct.on_events(live, token() * 70)  # one read of the stream carried 70 tokens
    assert b.reserved_tokens >= live.footprint + 1
    acct.end(live)
    adm.release(r)
    assert b.reserved_tokens == 0
