"""What vLLM hands a chat template besides the messages: the request's fields over its
chat_template_kwargs over the node's --default-chat-template-kwargs."""

from __future__ import annotations

from kvgateway.tokens.exact import template_arguments

DEFAULTS = {"enable_thinking": False, "house_style": "terse"}


def test_a_null_or_auto_kwarg_leaves_the_nodes_default() -> None:
    # vLLM's merge_kwargs drops override values that are None or "auto".
    for value in (None, "auto"):
        args = template_arguments({"chat_template_kwargs": {"enable_thinking": value}}, DEFAULTS)
        assert args["enable_thinking"] is False and args["house_style"] == "terse"
    args = template_arguments({"chat_template_kwargs": {"enable_thinking": True}}, DEFAULTS)
    assert args["enable_thinking"] is True


def test_request_fields_win_over_kwargs_and_defaults() -> None:
    args = template_arguments({"reasoning_effort": "high"}, DEFAULTS)
    assert args["enable_thinking"] is True and args["reasoning_effort"] == "high"
    body = {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert template_arguments(body, DEFAULTS)["enable_thinking"] is False
    assert template_arguments({}, None) == {
        "add_generation_prompt": True,
        "continue_final_message": False,
    }
