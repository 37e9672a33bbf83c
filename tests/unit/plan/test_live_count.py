"""Live output accounting: tokens counted from SSE chunks (or the node's own count),
reported to admission as each request's progress."""

from __future__ import annotations

from dataclasses import replace

from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.backends import Backend
from kvgateway.core.flight import Flight
from kvgateway.core.output_model import client_key
from kvgateway.plan.stream_usage import count_stream_tokens, live_request
from tests.support.backends import admission_over, backend, demand

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


def started(f: Flight) -> bool:
    # Read through a call: mypy would keep ``not r.flight.started`` narrowed across feed().
    return f.started


def _projected_node() -> tuple[Backend, Admission]:
    b = backend("a", kv=4096)
    adm = admission_over([b], queue_size=10)
    return b, adm


def _admit(adm: Admission, prompt: int = 100, output: int = 400) -> Reservation:
    r = adm.try_admit(replace(demand(prompt, output), projected=True))
    assert isinstance(r, Reservation)
    return r


def test_a_streams_count_moves_its_flight_and_the_nodes_book() -> None:
    """Each count reaches the projection as the request's progress; the node's book holds
    what its flights hold now, in whole blocks, never less than the stream itself."""
    b, adm = _projected_node()
    r = _admit(adm)
    assert r.flight is not None and not r.flight.started
    live = live_request(r, 1, max_output=400)
    for i in range(1, 200):
        live.feed(token())
        assert started(r.flight) and r.flight.generated == i
        assert b.reserved_tokens >= 100 + i
        assert b.reserved_tokens % 16 == 0
    adm.release(r)
    assert (b.reserved_tokens, b.projected_tokens, len(b.projection)) == (0, 0, 0)


def test_the_nodes_own_count_is_taken_as_it_is_and_never_goes_back() -> None:
    _, adm = _projected_node()
    r = _admit(adm)
    live = live_request(r, 1, max_output=400)
    live.feed(b"", reported=0)
    assert r.flight is not None and r.flight.started and r.flight.generated == 0
    live.feed(token() * 3, reported=41)
    assert r.flight.generated == 41 and live.exact
    live.feed(token(), reported=40)
    assert r.flight.generated == 41
    adm.release(r)


def test_a_speculative_nodes_choices_count_as_many_tokens_as_a_step_may_emit():
    # With num_speculative_tokens 3 one streamed choice may carry 4 tokens: the live
    # count is that bound (never under what the node holds), capped at max_tokens.
    b, adm = _projected_node()
    r = _admit(adm, 100, 400)
    live = live_request(r, 1, max_output=400, tokens_per_event=4)
    for i in range(150):
        live.feed(token())
        assert live.generated == min(4 * (i + 1), 400)
        assert b.reserved_tokens >= 100 + live.generated
    adm.release(r)
    assert b.reserved_tokens == 0


def test_a_streamed_tool_calls_own_index_is_not_a_token() -> None:
    """vLLM's tool-call chunks carry the choice's "index" and the tool call's; only the
    choice's counts: counted twice, a stream without usage would be charged (and taught)
    twice its output."""
    first = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"c1","type":"function",'
        b'"index":0,"function":{"name":"f","arguments":""}}]},"finish_reason":null}]}\n\n'
    )
    more = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        b'{"arguments":"\\"ci"}}]},"finish_reason":null}]}\n\n'
    )
    assert count_stream_tokens(first + more * 9) == 10
