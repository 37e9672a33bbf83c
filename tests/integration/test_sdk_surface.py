"""What the official ``openai`` SDK sees of the gateway's own answers: a refusal that can
never succeed is not retried, every answer names its request, an error names the field
the SDK's call sent, and the model name an answer carries is one the gateway serves."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.fleet import MODEL, StartFleet

SMALL: list[tuple[str, str, str, dict[str, Any]]] = [("small-1", "small", "gpu24-8b", {})]
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def test_a_429_that_can_never_succeed_is_not_retried_by_the_sdk(
    start_fleet: StartFleet,
) -> None:
    """1,200 output tokens against a 1,000-a-minute limit can never fit: the answer says
    ``x-should-retry: false``, and the SDK (retries on by default) sends it once."""
    limits = {"output_tokens_per_minute": 1000}
    auth = {"keys": [{"name": "etl", "key": "k-etl", "limits": limits}]}
    fleet = await start_fleet(SMALL, time_scale=200, gateway={"auth": auth})
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="k-etl")
    try:
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1200)
    finally:
        await client.close()
    assert "never fit" in err.value.message
    refused = {"reason": "rate_limited"}
    registry = fleet.state.metrics.registry
    assert registry.get_sample_value("gateway_rejections_total", refused) == 1


async def test_an_answer_names_its_request_and_its_model_is_served(
    start_fleet: StartFleet,
) -> None:
    """``/v1/models`` carries ``x-request-id`` (the SDK's ``_request_id``); the model an
    answer names (the nodes' served name) can be retrieved and asked for again."""
    fleet = await start_fleet(SMALL, time_scale=200)
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    try:
        listed = await client.models.with_raw_response.list()
        assert listed.headers.get("x-request-id")
        answer = await client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        assert answer.model != MODEL  # the served name
        assert (await client.models.retrieve(answer.model)).id == answer.model
        await client.chat.completions.create(model=answer.model, messages=MSG, max_tokens=2)
    finally:
        await client.close()


async def test_a_responses_prompt_past_the_context_names_input(start_fleet: StartFleet) -> None:
    fleet = await start_fleet(SMALL, time_scale=200)
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input="hello " * 9000, max_output_tokens=10)
    finally:
        await client.close()
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "input")
