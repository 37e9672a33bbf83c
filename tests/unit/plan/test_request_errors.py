"""Every malformed request is refused before anything is counted or reserved, as a 400
whose ``param`` names the field and whose ``code`` says what is wrong (what OpenAI SDKs
show their callers)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgateway.errors import BadRequest
from kvgateway.plan.openai_request import (
    Limits,
    parse_body,
    parse_chat,
    parse_completion,
    parse_responses,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TINY = Limits(max_messages=2, max_content_parts=2)


def _refused(parse: Any, body: dict[str, Any], *args: Any) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse(body, *args)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("raw", [b"", b"  \n", b"[1, 2]", b"{bad json", b'{"x": NaN}'])
def test_a_body_that_is_not_one_json_object(raw: bytes) -> None:
    with pytest.raises(BadRequest) as err:
        parse_body(raw)
    assert err.value.code == "invalid_json"


def test_too_many_messages_is_refused_before_parsing() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 64}] * 3}
    raw = json.dumps(body).encode()
    with pytest.raises(BadRequest) as err:
        parse_body(raw, TINY)
    assert (err.value.param, err.value.code) == ("messages", "too_many_messages")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream_options": "yes"}, "stream_options"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"functions": "f"}, "functions"),
        ({"messages": [{"role": "user", "content": "a"}] * 3}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}]},
            "messages",
        ),
    ],
)
def test_chat_fields_of_the_wrong_shape(change: dict[str, Any], param: str) -> None:
    err = _refused(parse_chat, {**CHAT, **change}, TINY)
    assert err.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": None}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt"),
        ({"model": "m", "prompt": [[1, 2], []]}, "prompt"),
        ({"model": "m", "prompt": [True, 2]}, "prompt"),
        ({"model": "m", "prompt": "hi", "echo": "maybe"}, "echo"),
    ],
)
def test_completion_prompts_vllm_would_not_take(body: dict[str, Any], param: str) -> None:
    assert _refused(parse_completion, body).param == param


def test_completion_prompts_vllm_takes() -> None:
    for prompt in ("hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse_completion({"model": "m", "prompt": prompt}).kind == "completion"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"instructions": 3}, "instructions"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": "a"}] * 3}, "messages"),
        ({"input": ["not an item"]}, "input[0]"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": 42}, "input"),
    ],
)
def test_responses_inputs_of_the_wrong_shape(change: dict[str, Any], param: str) -> None:
    body = {"model": "m", "input": "hi", **change}
    if change.get("input", "x") is None:
        del body["input"]
    assert _refused(parse_responses, body, TINY).param == param


def test_a_responses_request_is_a_prompt_with_an_output_budget() -> None:
    parsed = parse_responses({"model": "m", "input": "hi", "max_output_tokens": 64})
    assert (parsed.kind, parsed.requested_output, parsed.output_field) == (
        "responses",
        64,
        "max_output_tokens",
    )
