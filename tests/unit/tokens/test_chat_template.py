"""Chat template rendering: the environment, globals and request fields transformers and
vLLM give a template."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import jinja2.exceptions
import jinja2.sandbox
import pytest

from kvgateway.tokens.chat_template import ChatTemplate, TemplateError, new_environment
from kvgateway.tokens.conversation import conversation, tool_schemas
from kvgateway.tokens.exact import ExactCounter, template_arguments
from kvgateway.tokens.modeldir import ModelTokenizer
from tests.support import templates

USER = [{"role": "user", "content": "héllo"}]


def render(source: str, messages: list[dict[str, Any]] | None = None, **kw: object) -> str:
    tpl = ChatTemplate(source)
    conv = conversation(messages or USER, tpl.content_format)
    return tpl.render(conv.messages, **kw)  # type: ignore[arg-type]


def test_trim_and_lstrip_blocks() -> None:
    source = "  {% for m in messages %}\n[{{ m.content }}]\n  {% endfor %}\n"
    assert render(source) == "[héllo]\n"


def test_tojson_is_transformers_version() -> None:
    assert render("{{ messages[0] | tojson }}") == '{"role": "user", "content": "héllo"}'
    assert render("{{ {'b': 1, 'a': [1]} | tojson(indent=2, sort_keys=true) }}") == (
        '{\n  "a": [\n    1\n  ],\n  "b": 1\n}'
    )
    assert render("{{ {'a': 1} | tojson(separators=(',', ':')) }}") == '{"a":1}'


def test_globals_and_extensions() -> None:
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    with pytest.raises(TemplateError, match="no system"):
        render("{{ raise_exception('no system') }}")
    assert render("{% generation %}G{{ 1 + 1 }}{% endgeneration %}") == "G2"
    assert (
        render("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}")
        == "01"
    )


def test_sandbox_refuses_mutation() -> None:
    with pytest.raises(TemplateError):
        render("{% set x = [] %}{{ x.append(1) }}")


def test_attribute_reads_on_dicts_are_jinjas_sandbox_reads() -> None:
    """``m.key`` on a message is read at once (chat_template._Sandbox); what jinja's own
    sandbox gives for every other read stays: dict's methods before keys, an undefined
    for a missing key, nothing unsafe."""
    msg = {"role": "user", "content": "c", "items": "as a key", "__class__": "k", "n": None}
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment()
    ours = new_environment()
    for expr in (
        "m.role",
        "m.content",
        "m.n is none",
        "m.items is callable",
        "m['items']",
        "m.missing is defined",
        "m.__class__ is defined",
        "m.get('role')",
        "m.keys() | list | length",
        "m.role.upper()",
    ):
        source = "{{ " + expr + " }}"
        expect = plain.from_string(source).render(m=msg)
        assert ours.from_string(source).render(m=msg) == expect, expr
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.from_string("{{ m.__class__.__subclasses__() }}").render(m=msg)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.from_string("{{ m.update({'a': 1}) }}").render(m=msg)


def test_generation_prompt_kwargs_and_special_tokens() -> None:
    source = (
        "{{ bos_token }}{{ flavour | default('plain') }}{% if add_generation_prompt %}>{% endif %}"
    )
    assert render(source, special_tokens={"bos_token": "<s>"}) == "<s>plain>"
    out = render(
        source,
        special_tokens={"bos_token": "<s>"},
        kwargs={"flavour": "spicy", "bos_token": "B"},
        add_generation_prompt=False,
    )
    assert out == "Bspicy"
    with pytest.raises(TemplateError, match="may not set 'tools'"):
        render(source, kwargs={"tools": []})
    # chat_template and tokenize are vLLM's own arguments, never template variables.
    assert render("{{ tokenize is defined }}", kwargs={"tokenize": True}) == "False"


def test_continue_final_message_cuts_after_the_last_text() -> None:
    messages = [
        {"role": "user", "content": "Say a word"},
        {"role": "assistant", "content": "The word is "},
    ]
    out = render(templates.QWEN, messages, add_generation_prompt=False, continue_final_message=True)
    # The template kept the trailing space, so the cut keeps it too.
    assert out.endswith("<|im_start|>assistant\nThe word is ")
    trimmed = render(
        templates.LLAMA31, messages, add_generation_prompt=False, continue_final_message=True
    )
    # Llama's template trims content: the cut comes right after the stripped text.
    assert trimmed.endswith("assistant<|end_header_id|>\n\nThe word is")
    with pytest.raises(TemplateError, match="not compatible"):
        render(templates.QWEN, messages, add_generation_prompt=True, continue_final_message=True)


def test_content_format_detection_and_parts() -> None:
    openai_style = (
        "{% for m in messages %}{% for c in m['content'] %}<{{ c.type }}>{% endfor %}{% endfor %}"
    )
    string_style = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(openai_style).content_format == "openai"
    assert ChatTemplate(string_style).content_format == "string"
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "b"},
            ],
        }
    ]
    assert render(openai_style, parts) == "<text><image><text>"
    assert render(string_style, parts) == "a\nb"
    assert conversation(parts, "string").media == 1


def test_conversation_follows_vllm() -> None:
    msgs = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": "not json"},
                },
            ],
            "extra": "dropped",
        },
        {"role": "assistant", "content": "ok", "tool_calls": []},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
        },
    ]
    conv = conversation(msgs, "string").messages
    assert conv[0]["content"] == "" and "extra" not in conv[0]
    assert conv[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert conv[0]["tool_calls"][1]["function"]["arguments"] == {}
    assert "tool_calls" not in conv[1]
    assert conv[2] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"}
    # The request itself is not modified.
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # type: ignore[index]


def test_tools_are_dumped_with_nulls_as_vllm_does() -> None:
    dumped = tool_schemas([{"type": "function", "function": {"name": "f", "strict": True}}])
    assert dumped == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None, "strict": True},
        }
    ]
    assert tool_schemas(None) is None


def test_request_templates_only_when_trusted(
    gateway_tokenizer: Callable[[str], ModelTokenizer],
) -> None:
    tok = gateway_tokenizer("qwen")
    body = {"messages": USER, "chat_template": "X{{ messages | length }}"}
    assert ExactCounter(tok).render_chat(body).text.startswith("<|im_start|>system")
    trusted = ExactCounter(tok, trust_request_chat_template=True)
    assert trusted.render_chat(body).text == "X1"


def test_trusted_request_templates_render_from_many_threads_at_once(
    gateway_tokenizer: Callable[[str], ModelTokenizer],
) -> None:
    """Big prompts are rendered in worker threads: requests bringing more templates
    than are kept, from several threads, each render with their own."""
    trusted = ExactCounter(gateway_tokenizer("qwen"), trust_request_chat_template=True)
    bodies = [
        {"messages": USER, "chat_template": f"T{i % 24}:{{{{ messages | length }}}}"}
        for i in range(600)
    ]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda b: trusted.render_chat(b).text, bodies))
    assert texts == [f"T{i % 24}:1" for i in range(600)]


@pytest.mark.parametrize("source", [templates.QWEN, templates.LLAMA31, templates.MISTRAL])
def test_family_templates_render_tools_and_defaults(source: str) -> None:
    tools = tool_schemas(
        [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"type": "object"}},
            }
        ]
    )
    out = render(
        source,
        [{"role": "user", "content": "Weather in Zürich?"}],
        tools=tools,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert "get_weather" in out and "Zürich" in out
    plain = render(
        source,
        [{"role": "user", "content": "hi"}],
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    if source is templates.LLAMA31:
        assert "Cutting Knowledge Date" in plain
    if source is templates.QWEN:
        assert "You are a helpful assistant." in plain


def test_request_fields_override_chat_template_kwargs_as_vllm_does() -> None:
    body = {
        "messages": USER,
        "documents": None,
        "chat_template_kwargs": {
            "add_generation_prompt": False,
            "documents": [{"title": "t", "text": "x"}],
            "flavour": 1,
        },
    }
    assert template_arguments(body) == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "documents": [{"title": "t", "text": "x"}],
        "flavour": 1,
    }
    thinking = template_arguments({"reasoning_effort": "none"})
    assert thinking["enable_thinking"] is False and thinking["reasoning_effort"] == "none"
    kept = template_arguments(
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert kept["enable_thinking"] is False and kept["reasoning_effort"] == "high"


def test_messages_as_vllm_and_transformers_4_pass_them() -> None:
    """vLLM passes reasoning as ``reasoning`` and ``reasoning_content`` (and reads a
    message's ``reasoning_content`` when ``reasoning`` is None); transformers 4.x adds no
    ``thinking`` alias and keeps None-valued keys (5.x would do both)."""
    source = (
        "{% for m in messages %}{{ m.thinking | default('-') }}|{{ m.reasoning_content }}"
        "|{{ m.tool_call_id is defined }}:{{ m.tool_call_id }};{% endfor %}"
    )
    msgs: list[dict[str, Any]] = [
        {"role": "assistant", "content": "a", "reasoning": "why"},
        {"role": "assistant", "content": "b", "reasoning": None, "reasoning_content": "old"},
        {"role": "tool", "content": "r", "tool_call_id": None},
    ]
    assert render(source, msgs) == "-|why|False:;-|old|False:;-||True:None;"
    with pytest.raises(TemplateError, match="empty conversation"):
        ChatTemplate(source).render([])
    # messages only collides when the template reads it (vLLM drops unread kwargs).
    assert render("{{ x }}", kwargs={"messages": [], "x": 1}) == "1"
    with pytest.raises(TemplateError, match="may not set 'messages'"):
        render(source, kwargs={"messages": []})


def test_continue_final_message_with_an_empty_or_spaced_prefix() -> None:
    def cont(content: str) -> str:
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
        return render(
            templates.QWEN, msgs, add_generation_prompt=False, continue_final_message=True
        )

    # transformers cuts where its tag lands: right after the header for an empty prefix,
    # and after the trailing spaces the template kept.
    assert cont("").endswith("<|im_start|>assistant\n")
    assert cont("  pad  ").endswith("<|im_start|>assistant\n  pad  ")


def test_vllms_tool_reference_part_is_the_tools_name() -> None:
    """vLLM's own content part ``{"type": "tool_reference", "name": ...}`` renders as the
    tool's name (dropped, the count would be 5 tokens under the node's on Qwen3)."""
    parts = [{"type": "text", "text": "Load the tool"}, {"type": "tool_reference", "name": "f"}]
    msgs = [{"role": "user", "content": parts}]
    assert conversation(msgs, "string").messages[0]["content"] == "Load the tool\nf"
    assert conversation(msgs, "openai").messages[0]["content"][1] == {
        "type": "tool_reference",
        "name": "f",
    }
