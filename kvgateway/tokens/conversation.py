"""A chat request's messages as vLLM hands them to the chat template.

vLLM joins a message's content parts into one string (or keeps them as a list of parts
when the template loops over content: the "openai" content format), parses tool-call
arguments from JSON, keeps a message's known keys only and reads ``reasoning_content``
as ``reasoning``. Media parts are not rendered: they are counted and kept in order for
the counter to price (see :mod:`.images`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
    }
)


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages as the template sees them, and the media items they carried."""

    messages: list[dict[str, Any]]
    media: int
    # The media parts themselves, in order (an image's cost may depend on its size).
    media_parts: tuple[Any, ...] = ()


def _parse_content(content: Any, fmt: ContentFormat, media_parts: list[Any]) -> tuple[Any, int]:
    if isinstance(content, str):  # the common case, as the general path below has it
        return ([{"type": "text", "text": content}] if fmt == "openai" else content), 0
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, list):
        parts = content
    else:
        parts = [{"type": "text", "text": str(content)}]
    texts: list[Any] = []
    media = 0
    for part in parts:
        if isinstance(part, str):
            if fmt == "openai":
                texts.append({"type": "text", "text": part})
            elif part:  # vLLM keeps a part only if it is truthy: "" adds no "\n"
                texts.append(part)
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is not None:
            text = part.get(field)
            if isinstance(text, str) and fmt == "openai":
                texts.append({"type": "text", "text": text})
            elif isinstance(text, str) and text:
                texts.append(text)
        elif kind == "tool_reference" and isinstance(part.get("name"), str):
            # vLLM's own part type: the tool's name stands in for it.
            name = part["name"]
            if fmt == "openai":
                texts.append({"type": "tool_reference", "name": name})
            elif name:
                texts.append(name)
        elif kind in _MEDIA_PARTS or any(k in part for k in _MEDIA_PARTS):
            media += 1
            media_parts.append(part)
            if fmt == "openai":
                texts.append({"type": "audio" if "audio" in str(kind) else "image"})
    if fmt == "openai":
        return texts, media
    return "\n".join(texts), media


def conversation(messages: Sequence[Any], fmt: ContentFormat) -> Conversation:
    """The request's messages turned into what vLLM hands the template."""
    out: list[dict[str, Any]] = []
    media = 0
    parts: list[Any] = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            continue
        role = msg["role"]
        content, n = _parse_content(msg.get("content"), fmt, parts)
        media += n
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if isinstance(calls, list) and calls:
                item["tool_calls"] = [_tool_call(c) for c in calls]
            # vLLM reads a message's deprecated reasoning_content as its reasoning when
            # that is None (vllm/entrypoints/openai/chat_completion/protocol.py
            # @002032ee18, ChatCompletionRequest._normalize_messages_before).
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                item["reasoning"] = item["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                item["tool_call_id"] = msg["tool_call_id"]
            if isinstance(content, list) and all(c.get("type") == "text" for c in content):
                item["content"] = "\n".join(c["text"] for c in content)
        if isinstance(msg.get("name"), str):
            item["name"] = msg["name"]
        if role == "developer":
            item["tools"] = msg.get("tools")
        out.append(item)
    return Conversation(out, media, tuple(parts))


def _tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    call = dict(call)  # only "function"'s "arguments" changes: a shallow copy each
    fn = call.get("function")
    if isinstance(fn, dict):
        fn = call["function"] = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError:
                fn["arguments"] = {}
        elif not isinstance(args, dict | list):
            fn["arguments"] = {}
    return call


def tool_schemas(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM dumps its parsed tool objects (absent fields become null)."""
    if not isinstance(tools, list):
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        fn = fn if isinstance(fn, dict) else {}
        dumped_fn = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
            **{k: v for k, v in fn.items() if k not in ("name", "description", "parameters")},
        }
        out.append(
            {
                "type": tool.get("type", "function"),
                "function": dumped_fn,
                **{k: v for k, v in tool.items() if k not in ("type", "function")},
            }
        )
    return out
