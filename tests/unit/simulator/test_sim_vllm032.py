"""Answers as a real vLLM 0.32 node gives them, refusals word for word (captured from
one; the real-vLLM tier's test_simulator_parity.py holds the whole set against a live
node)."""

from __future__ import annotations

import json

import pytest

from tests.support.sim import SimFactory, chat

PYDANTIC_REFUSALS = [
    (
        chat(max_tokens="x", n=1.5),
        "2 validation errors:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': "
        "'Input should be a valid integer, unable to parse string as an integer', 'input': "
        "'x'}\n  {'type': 'int_from_float', 'loc': 'body.n', 'msg': 'Input should be a valid "
        "integer, got a number with a fractional part', 'input': '1.5'}",
        "body.max_tokens",
    ),
    (
        chat(truncate_prompt_tokens=-2),
        "1 validation error:\n  {'type': 'greater_than_equal', 'loc': "
        "'body.truncate_prompt_tokens', 'msg': 'Input should be greater than or equal to -1', "
        "'input': '-2', 'ctx': {'ge': -1}}",
        "body.truncate_prompt_tokens",
    ),
    (
        chat(ignore_eos=None),
        "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.ignore_eos', 'msg': "
        "'Input should be a valid boolean', 'input': 'None'}",
        "body.ignore_eos",
    ),
]


@pytest.mark.parametrize(("body", "message", "param"), PYDANTIC_REFUSALS)
async def test_field_types_refused_as_fastapi_does(
    sim: SimFactory, body: dict[str, object], message: str, param: str
) -> None:
    node = await sim()
    status, answer = await node.post("/v1/chat/completions", body)
    assert (status, answer) == (
        400,
        {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}},
    )


async def test_a_prompt_filling_the_context_is_refused_as_max_tokens_0(sim: SimFactory) -> None:
    """vLLM >= 0.32 cuts max_tokens to the room left; at none, SamplingParams refuses."""
    node = await sim()  # max_model_len 512
    for body in ({"prompt": [7] * 512, "max_tokens": 9}, {"prompt": [7] * 512}):
        status, answer = await node.post("/v1/completions", body)
        assert (status, answer["error"]["message"]) == (
            400,
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        )
    status, answer = await node.post("/v1/completions", {"prompt": [7] * 500, "min_tokens": 13})
    assert answer["error"] == {
        "message": "min_tokens must be less than or equal to max_tokens=12, got 13.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


async def test_every_choices_role_comes_first(sim: SimFactory) -> None:
    """vLLM sends each choice's role chunk with the request's first output, before any
    choice's text (serving_chat's first_iteration)."""
    node = await sim(output_dist="fixed", output_mean=3.0)
    body = chat("hi", max_tokens=3, stream=True, n=3)
    async with node.session.post(node.url + "/v1/chat/completions", json=body) as r:
        text = await r.text()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1, 2]
    assert all("role" in e["choices"][0]["delta"] for e in events[:3])
