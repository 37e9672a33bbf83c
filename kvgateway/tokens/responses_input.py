"""A Responses API request as the chat request vLLM renders for it.

vLLM (models without the harmony format) turns ``POST /v1/responses`` into chat messages
and chat-form tools, then applies the chat template as for a chat completion. The gateway
counts that chat and the simulator renders it, so both take it from here (the simulator
may not import the gateway's request path, and this module imports nothing of either).

Mirrors vllm-project/vllm (the search index's versions of these files):
``vllm/entrypoints/openai/responses/utils.py`` @01ca842df5 (``construct_input_messages``,
``construct_chat_messages_with_tool_call``, ``_construct_message_from_response_item``,
``should_continue_final_message``, ``construct_tool_dicts``,
``convert_tool_responses_to_completions_format``); ``vllm/tool_parsers/utils.py``
@0064cc9cb1 (``iter_response_function_tool_dicts``, ``flat_namespace_tool_name``);
``vllm/entrypoints/openai/responses/protocol.py`` @010a69cea9
(``ResponsesRequest.build_chat_params``, ``function_call_parsing``).
"""

from __future__ import annotations

from typing import Any

# vLLM names a namespaced function "<namespace>__<name>" in the prompt.
_NAMESPACE_SEPARATOR = "__"
# A partial assistant message or reasoning item at the end is continued, not answered.
_PARTIAL = ("in_progress", "incomplete")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM builds from ``instructions`` and ``input``.

    ``previous_response_id``: vLLM puts the stored conversation of that response between
    the instructions and the input. The gateway never sees it, so it is not here: with
    one, these messages are only the part of the node's prompt the request carries (vLLM
    stores nothing and answers 404 unless started with VLLM_ENABLE_RESPONSES_API_STORE).
    """
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:  # vLLM skips an empty one
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        # Items merge only with messages built from the input, as in vLLM.
        converted: list[dict[str, Any]] = []
        for item in raw:
            if isinstance(item, dict):
                message = _message(item, converted[-1] if converted else None)
                if message is not None:
                    converted.append(message)
        messages.extend(converted)
    return messages


def _message(item: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a new message, or None when it was merged into ``prev`` (an
    assistant turn spans its reasoning, text and tool-call items)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        name = item.get("name")
        namespace = item.get("namespace")
        if namespace:
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
        call = {
            "id": item.get("call_id"),
            "function": {"name": name, "arguments": item.get("arguments")},
            "type": "function",
        }
        if assistant is not None:
            calls = assistant.get("tool_calls")
            if calls is None:
                assistant["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                calls.append(call)
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        content = item.get("content")
        reasoning = _first_text(content if content else item.get("summary"))
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        # Only the first content part's text: vLLM drops the rest.
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    # User, system and developer messages go to the template as they are (their
    # input_text parts are parsed like chat text parts); so does any other item.
    return dict(item)


def _first_text(parts: Any) -> Any:
    """The text of the first part of a non-empty list ("" otherwise), as vLLM reads a
    reasoning item's content or summary and an assistant message's content."""
    if not isinstance(parts, list) or not parts:
        return ""
    first = parts[0]
    return first.get("text", "") if isinstance(first, dict) else first


def continue_final(raw: Any) -> bool:
    """Whether vLLM continues the last input item (a partial assistant message or
    reasoning item) instead of adding the generation prompt."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[-1], dict):
        return False
    last = raw[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in _PARTIAL


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The Responses API's flat function tools (``{"type": "function", "name": ...}``,
    and the functions of ``namespace`` tools) in chat form, as vLLM hands them to the
    template; other tool types (web search, MCP...) are not rendered.

    vLLM dumps its parsed tool objects, so a field the request left out is null. Only
    the fields every openai version declares are filled in here (``description``,
    ``parameters``, ``strict``); newer ones (``defer_loading``...) depend on the openai
    package on the node, and a template that prints whole tools shows them as nulls.
    """
    if not isinstance(tools, list) or not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "function":
            out.append(_chat_tool(tool, tool.get("name")))
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    name = f"{tool.get('name')}{_NAMESPACE_SEPARATOR}{inner.get('name')}"
                    out.append(_chat_tool(inner, name))
    return out


def _chat_tool(tool: dict[str, Any], name: Any) -> dict[str, Any]:
    fields = {k: v for k, v in tool.items() if k not in ("type", "name")}
    fields.setdefault("parameters", None)
    fields.setdefault("strict", None)
    described = fields.pop("description", None)
    parameters = fields.pop("parameters")
    # vLLM's FunctionDefinition: its declared fields first, then the rest as given.
    function = {"name": name, "description": described, "parameters": parameters, **fields}
    return {"type": "function", "function": function}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request vLLM renders for a Responses request: messages, tools and the
    template arguments vLLM sets (``ResponsesRequest.build_chat_params``). The rendering
    is tokenized with special tokens: ``ResponsesRequest.build_tok_params`` (vLLM 0.32)
    leaves ``TokenizeParams.add_special_tokens`` at its default, true, so a BOS model
    gets its BOS before the template's own (Llama 3, Tekken: one more than a chat)."""
    cont = continue_final(body.get("input"))
    chat: dict[str, Any] = {
        "messages": chat_messages(body),
        "tools": chat_tools(body.get("tools")),
        "add_generation_prompt": not cont,
        "continue_final_message": cont,
        "add_special_tokens": True,
    }
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None and effort != "auto":
        # A template kwarg only: unlike a chat request's reasoning_effort, vLLM's
        # Responses path does not derive enable_thinking from it.
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    return chat
