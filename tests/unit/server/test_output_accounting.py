"""Live output accounting: tokens counted from SSE chunks; a stream that outgrows its
learned reservation takes more before the node holds it."""

from __future__ import annotations

from dataclasses import replace

from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.backends import Backend
from kvgateway.core.output_model import OutputShape
from kvgateway.core.output_risk import OutputOutlook, plan_output
from kvgateway.server.output_accounting import OutputAccounting, client_key, count_stream_tokens
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


def _one_node() -> tuple[Backend, Admission]:
    b = backend("a", kv=100_000)
    adm = admission_over([b], queue_size=10)
    return b, adm


def _admit_pooled(adm: Admission) -> tuple[Reservation, OutputOutlook]:
    """A 100-token prompt with max_tokens 400, admitted on a learned output shape with
    the node's pooled margin (risk 0.01)."""
    shape = OutputShape([10 + i % 40 for i in range(200)])
    tokens, outlook = plan_output(shape, 400, 0.01, [100], 1, 16)
    r = adm.try_admit(replace(demand(100, 400), tokens=tokens, outlook=outlook))
    assert isinstance(r, Reservation)
    return r, outlook


def test_a_stream_outgrowing_its_reservation_grows_it_ahead_of_the_output():
    b, adm = _one_node()
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


def test_one_read_of_many_tokens_grows_the_reservation_past_all_of_them():
    # A loaded machine reads a node's stream in bursts: 40 tokens in one read must not
    # leave the node holding more than the reservation until the next read.
    b, adm = _one_node()
    r = adm.try_admit(demand(100, 20))
    assert isinstance(r, Reservation)
    acct = OutputAccounting()
    live = acct.start(r, 100, 1, 20, 16)
    for _ in range(6):
        acct.on_events(live, token() * 40)
        assert b.reserved_tokens >= live.footprint
    acct.end(live)
    adm.release(r)


def test_a_stream_at_its_max_tokens_does_not_grow() -> None:
    """max_tokens mode reserves the whole output: a stream that reaches it grew the node's
    book by a block per sequence anyway (n=4, max_tokens 64: 64 more than needed)."""
    b, adm = _one_node()
    r = adm.try_admit(demand(100, 64, n=4))
    assert isinstance(r, Reservation)
    held = b.reserved_tokens
    acct = OutputAccounting()
    live = acct.start(r, 100, 4, 64, 16, max_output=64)
    for _ in range(64):
        acct.on_events(live, b"".join(token(k) for k in range(4)))
        assert b.reserved_tokens >= live.footprint
    assert live.generated == 256 and b.reserved_tokens == held and live.grown == 0
    # Learned: grows as it must, but never past what max_tokens needs.
    r2 = adm.try_admit(demand(100, 20))
    assert isinstance(r2, Reservation)
    live2 = acct.start(r2, 100, 1, 20, 16, max_output=40)
    acct.on_events(live2, token() * 400)
    assert live2.generated == 40 and live2.grown == 32  # 20 + 32 covers 40, in blocks


def test_a_pooled_stream_moves_its_nodes_margin_and_stays_covered():
    b, adm = _one_node()
    r, outlook = _admit_pooled(adm)
    acct = OutputAccounting()
    live = acct.start(r, 100, 1, outlook.covered, 16)
    acct.on_events(live, ROLE)  # no token: nothing moves
    assert live.grown == 0
    for _ in range(120):
        acct.on_events(live, token() * 3)
        assert b.reserved_tokens >= live.footprint + 1
    assert live.grown > 0 and r.grown == 0  # the node's margin grew, not the request
    acct.end(live)
    adm.release(r)
    assert b.reserved_tokens == 0 and b.in_flight == 0


def test_a_pooled_stream_recomputes_its_nodes_margin_every_half_block_not_every_read():
    b, adm = _one_node()
    r, outlook = _admit_pooled(adm)
    calls: list[int] = []

    class Counting:
        def progress(self, reservation: Reservation, generated: int) -> int:
            calls.append(generated)
            return adm.progress(reservation, generated)

    r.owner = Counting()  # type: ignore[assignment]
    acct = OutputAccounting()
    live = acct.start(r, 100, 1, outlook.covered, 16)
    for _ in range(160):
        acct.on_events(live, token())
        assert b.reserved_tokens >= live.footprint + 8  # still ahead between calls
    assert calls == list(range(1, 161, 8))
    adm.release(r)
    assert b.reserved_tokens == 0


def test_a_speculative_nodes_choices_count_as_many_tokens_as_a_step_may_emit():
    # With num_speculative_tokens 3 one streamed choice may carry 4 tokens: the live
    # count is that bound (never under what the node holds), capped at max_tokens.
    b, adm = _one_node()
    r = adm.try_admit(demand(100, 20))
    assert isinstance(r, Reservation)
    acct = OutputAccounting()
    live = acct.start(r, 100, 1, 20, 16, max_output=400, tokens_per_event=4)
    for i in range(150):
        acct.on_events(live, token())
        assert live.generated == min(4 * (i + 1), 400)
        assert b.reserved_tokens >= live.footprint
    acct.end(live)
    adm.release(r)
    assert b.reserved_tokens == 0


def test_a_streamed_tool_calls_own_index_is_not_a_token() -> None:
    """vLLM's tool-call chunks carry the choice's "index" and the tool call's: counted
    twice, a stream without usage was charged (and taught) twice its output."""
    first = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"c1","type":"function",'
        b'"index":0,"function":{"name":"f","arguments":""}}]},"finish_reason":null}]}\n\n'
    )
    more = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        b'{"arguments":"\\"ci"}}]},"finish_reason":null}]}\n\n'
    )
    assert count_stream_tokens(first + more * 9) == 10
