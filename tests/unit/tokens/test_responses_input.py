"""A Responses request is counted as the chat vLLM renders for it: function calls, their
outputs and reasoning items become the assistant and tool messages vLLM builds, not empty
user messages (as an empty user message, a 10,000-digit tool output would count as 32
tokens).

Expected messages are written by hand from vllm-project/vllm
``vllm/entrypoints/openai/responses/utils.py`` @01ca842df5
(``construct_input_messages``, ``_construct_message_from_response_item``,
``construct_tool_dicts``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgateway.plan.openai_request import parse_responses
from kvgateway.simulator.profiles import TINY
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.responses_input import chat_body, chat_messages, chat_tools
from tests.support.sim import SimFactory

DIGITS = "1234567890" * 1000  # 10,000 digits

TOOL_ROUND: dict[str, Any] = {
    "model": "m",
    "max_output_tokens": 4,
    "input": [
        {"role": "user", "content": "look it up"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "x"}'},
        {"type": "function_call_output", "call_id": "c1", "output": DIGITS},
    ],
}
# What vLLM builds for TOOL_ROUND.
TOOL_ROUND_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "look it up"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "function": {"name": "lookup", "arguments": '{"q": "x"}'},
                "type": "function",
            }
        ],
    },
    {"role": "tool", "content": DIGITS, "tool_call_id": "c1"},
]


def test_function_call_and_its_output_become_assistant_and_tool_messages() -> None:
    parse_responses(TOOL_ROUND)
    assert chat_messages(TOOL_ROUND) == TOOL_ROUND_MESSAGES


def test_an_assistant_turn_spanning_reasoning_text_and_calls_is_one_message() -> None:
    call = {"type": "function_call", "arguments": "{}"}
    body = {
        "instructions": "be brief",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "ignored: content wins"}],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "calling", "annotations": []},
                    {"type": "output_text", "text": "only the first part counts"},
                ],
            },
            {**call, "call_id": "a", "name": "f"},
            {**call, "call_id": "b", "name": "g", "namespace": "ns"},
            {"type": "function_call_output", "call_id": "a", "output": "A"},
            {
                "type": "function_call_output",
                "call_id": "b",
                "output": [{"type": "input_text", "text": "B"}],
            },
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "reasoning", "id": "rs_3", "summary": [], "content": []},
        ],
    }
    before = copy.deepcopy(body)
    parse_responses({**body, "model": "m"})

    def tool_call(call_id: str, name: str) -> dict[str, Any]:
        return {"id": call_id, "function": {"name": name, "arguments": "{}"}, "type": "function"}

    assert chat_messages(body) == [
        {"role": "system", "content": "be brief"},
        # Message items with a role other than assistant go to the template as they are.
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {
            "role": "assistant",
            "reasoning": "think",
            "content": "calling",
            "tool_calls": [tool_call("a", "f"), tool_call("b", "ns__g")],
        },
        {"role": "tool", "content": "A", "tool_call_id": "a"},
        {"role": "tool", "content": [{"type": "input_text", "text": "B"}], "tool_call_id": "b"},
        # Summary text when there is no content; reasoning after a message that has
        # reasoning starts a new assistant message.
        {"role": "assistant", "reasoning": "s"},
        {"role": "assistant", "reasoning": ""},
    ]
    assert body == before  # the forwarded body is never changed


def test_instructions_and_string_input() -> None:
    assert chat_messages({"instructions": "", "input": "hi"}) == [{"role": "user", "content": "hi"}]
    assert chat_messages({"instructions": "sys", "input": "hi"}) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]


def test_flat_responses_tools_become_chat_tools() -> None:
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [
        {"type": "function", "name": "lookup", "description": "find", "parameters": params},
        {"type": "web_search_preview"},
        {
            "type": "namespace",
            "name": "ns",
            "tools": [{"type": "function", "name": "g", "strict": True}],
        },
    ]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "find",
                "parameters": params,
                "strict": None,
            },
        },
        {
            "type": "function",
            "function": {"name": "ns__g", "description": None, "parameters": None, "strict": True},
        },
    ]
    assert chat_tools([]) is None and chat_tools(None) is None
    assert chat_tools([{"type": "web_search_preview"}]) == []


def test_chat_body_template_arguments() -> None:
    partial = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "message", "role": "assistant", "status": "incomplete", "content": "Hal"},
        ],
        "reasoning": {"effort": "low"},
    }
    chat = chat_body(partial)
    assert chat["messages"][-1] == {"role": "assistant", "content": "Hal"}
    assert chat["add_generation_prompt"] is False and chat["continue_final_message"] is True
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low"}
    plain = chat_body({"input": "hi", "reasoning": {"effort": None}, "tools": []})
    assert plain["add_generation_prompt"] is True and plain["continue_final_message"] is False
    assert "chat_template_kwargs" not in plain and plain["tools"] is None


async def test_a_10k_digit_tool_output_is_counted_as_vllm_counts_it(
    vocab_dirs: Callable[[str], Path], encodings: EncodingCache
) -> None:
    counter = ExactCounter(encodings.model(str(vocab_dirs("qwen"))))
    counted = await counter.count_chat({"messages": chat_messages(TOOL_ROUND)})
    expected = await counter.count_chat({"messages": TOOL_ROUND_MESSAGES})
    assert counted.total == expected.total > 10_000


async def test_the_simulated_node_counts_what_vllm_counts(
    sim: SimFactory, vocab_dirs: Callable[[str], Path], encodings: EncodingCache
) -> None:
    directory = str(vocab_dirs("qwen"))
    node = await sim(tokenizer=directory, max_model_len=16384, num_gpu_blocks=2048)
    counter = ExactCounter(encodings.model(directory))
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    body = {**TOOL_ROUND, "model": TINY.model, "tools": tools}
    status, reply = await node.post("/v1/responses", body)
    assert status == 200, reply
    chat_tools_ = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": None,
                "parameters": {"type": "object"},
                "strict": None,
            },
        }
    ]
    expected = counter.count_chat_sync({"messages": TOOL_ROUND_MESSAGES, "tools": chat_tools_})
    assert reply["usage"]["input_tokens"] == expected > 10_000
    await node.wait_idle()


def test_a_responses_prompt_gets_the_models_bos_as_vllm_tokenizes_it(
    vocab_dirs: Callable[[str], Path], encodings: EncodingCache
) -> None:
    """vLLM tokenizes a Responses rendering with special tokens, and so does the
    gateway: on Llama 3 that is one token more than the same chat (the tokenizer's BOS
    before the template's)."""
    counter = ExactCounter(encodings.model(str(vocab_dirs("llama3"))))
    body = {"instructions": "Be brief.", "input": "Why is the sky blue?"}
    chat = chat_body(body)
    assert chat["add_special_tokens"] is True
    as_chat = {k: v for k, v in chat.items() if k != "add_special_tokens"}
    assert counter.count_chat_sync(chat) == counter.count_chat_sync(as_chat) + 1
    ids = counter.prompt_ids(chat)
    assert ids[:2] == [128000, 128000]  # the tokenizer's BOS, then the template's
