"""UsageTap against chunks as vLLM's serving code writes them (pydantic's compact JSON,
usage last; the usage-only chunk with ``"choices":[]`` at the end)."""

from __future__ import annotations

import json

from kvgateway.plan.stream_usage import UsageAsk, UsageTap, ask_node, usage_ask

NONE = UsageAsk(include_usage=False, continuous=False)
FINAL = UsageAsk(include_usage=True, continuous=False)


def chunk(index: int, text: str, done: int, details: bool = False) -> bytes:
    usage = (
        f'{{"prompt_tokens":9,"total_tokens":{9 + done},"completion_tokens":{done},'
        + ('"completion_tokens_details":{"reasoning_tokens":2},' if details else "")
        + '"prompt_tokens_details":null}'
    )
    body = (
        f'{{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        f'[{{"index":{index},"delta":{{"content":{json.dumps(text)}}},"logprobs":null,'
        f'"finish_reason":null}}],"usage":{usage}}}'
    )
    return b"data: " + body.encode() + b"\n\n"


def final(total: int) -> bytes:
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[],"usage":{"prompt_tokens":9,"total_tokens":'
        + str(9 + total).encode()
        + b',"completion_tokens":'
        + str(total).encode()
        + b"}}\n\n"
    )


def test_per_chunk_usage_is_read_and_taken_out_for_a_client_that_did_not_ask() -> None:
    tap = UsageTap(NONE)
    out = tap.feed(chunk(0, "one two", 2) + chunk(0, " three", 3, details=True))
    assert b"usage" not in out
    for event in out.split(b"\n\n")[:-1]:
        json.loads(event[6:])  # still valid JSON
    assert tap.completion_tokens == 3
    out = tap.feed(final(3) + b"data: [DONE]\n\n")
    assert out == b"data: [DONE]\n\n"
    assert tap.completion_tokens == 3 and b'"completion_tokens":3' in tap.final


def test_include_usage_keeps_only_the_final_chunk() -> None:
    tap = UsageTap(FINAL)
    out = tap.feed(chunk(0, "a", 1) + final(1) + b"data: [DONE]\n\n")
    assert out.count(b'"usage"') == 1 and out.startswith(b"data: {") and b'"choices":[]' in out


def test_text_that_looks_like_usage_is_left_alone() -> None:
    text = ',"usage":{"completion_tokens":99}'
    tap = UsageTap(NONE)
    out = tap.feed(chunk(0, text, 1))
    assert json.loads(out[6:])["choices"][0]["delta"]["content"] == text
    assert tap.completion_tokens == 1


def test_n_choices_sum_their_own_counts() -> None:
    tap = UsageTap(NONE, choices=2)
    tap.feed(chunk(0, "a", 1) + chunk(1, "b", 1) + chunk(0, "c", 2) + chunk(1, "d", 4))
    assert tap.completion_tokens == 6


def test_a_node_without_usage_reports_nothing() -> None:
    tap = UsageTap(NONE)
    plain = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    assert tap.feed(plain) == plain and tap.completion_tokens is None


def test_the_ask_keeps_the_clients_other_options() -> None:
    body = {"stream": True, "stream_options": {"include_usage": "true", "x": 1}}
    ask = usage_ask("chat", True, body)
    assert ask == UsageAsk(include_usage=True, continuous=False)
    ask_node(body)
    assert body["stream_options"] == {
        "include_usage": True,
        "x": 1,
        "continuous_usage_stats": True,
    }
    assert usage_ask("chat", False, body) is None and usage_ask("responses", True, body) is None


def test_a_hostile_nodes_endless_numbers_are_not_read() -> None:
    """int() refuses more than 4,300 digits: such a count is no count, so settlement
    reads none instead of raising ValueError."""
    from kvgateway.upstream.client import find_usage

    digits = b"9" * 5000
    body = b'{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":' + digits + b"}}"
    usage = find_usage(body)
    assert usage is None or usage.completion_tokens is None
    tap = UsageTap(NONE)
    tap.feed(b"data: " + body + b"\n\n")
    assert tap.completion_tokens is None


FP = b',"system_fingerprint":"vllm-0.32.0-25dda68c"'


def finish(done: int) -> bytes:
    return chunk(0, "end", done).replace(b'"finish_reason":null', b'"finish_reason":"length"')


def with_fingerprint(event: bytes) -> bytes:
    return event[: event.rindex(b"}")] + FP + b"}\n\n"


def test_a_default_stream_gets_the_fingerprint_on_its_finish_chunk() -> None:
    """vLLM puts system_fingerprint on the usage chunk the gateway asked for; a client
    that did not ask for usage finds it where the node alone puts it, on the finish
    chunk, whether the usage chunk comes in the same read or a later one."""
    for split in (False, True):
        tap = UsageTap(NONE)
        got = tap.feed(chunk(0, "a", 1))
        rest = [finish(2), with_fingerprint(final(2)), b"data: [DONE]\n\n"]
        if split:
            got += tap.feed(rest[0])  # held until the usage chunk comes
            assert got.count(b"data:") == 1
            got += tap.feed(rest[1] + rest[2])
        else:
            got += tap.feed(b"".join(rest))
        events = [json.loads(e[6:]) for e in got.split(b"\n\n") if e.startswith(b"data: {")]
        assert [e["choices"][0]["finish_reason"] for e in events] == [None, "length"]
        assert events[1]["system_fingerprint"] == "vllm-0.32.0-25dda68c"
        assert "system_fingerprint" not in events[0] and got.endswith(b"data: [DONE]\n\n")


def test_a_finish_chunk_held_for_the_fingerprint_is_not_lost() -> None:
    """A stream that ends without its usage chunk (a node that sends none, or one that
    fails) still relays its finish chunk: at [DONE], or through flush() before an error."""
    tap = UsageTap(NONE)
    assert tap.feed(finish(1)) == b""
    out = tap.feed(b"data: [DONE]\n\n")
    assert b'"finish_reason":"length"' in out and out.endswith(b"data: [DONE]\n\n")
    assert b"usage" not in out and b"system_fingerprint" not in out
    tap = UsageTap(NONE)
    tap.feed(finish(1))
    assert b'"finish_reason":"length"' in tap.flush() and tap.flush() == b""


def test_a_client_asking_for_usage_or_many_choices_is_relayed_as_it_comes() -> None:
    asked = UsageTap(FINAL)
    assert b'"finish_reason":"length"' in asked.feed(finish(1))
    many = UsageTap(NONE, choices=2)
    assert b'"finish_reason":"length"' in many.feed(finish(1))
