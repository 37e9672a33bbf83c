"""Developer messages as vLLM >= 0.19 hands them to a chat template.

Most templates know no ``developer`` role (Qwen's skips such a message, others raise).
vLLM's renderer (``vllm/renderers/hf.py`` of vLLM 0.32, ``safe_apply_chat_template``)
therefore rewrites the conversation when a template does not name the role: each
developer message becomes a system message (its ``tools`` dropped), and then, when a
system message is not the first or there are several, all system messages are merged
into one at the front (their texts joined by a blank line; templates that allow one
system message, first, would refuse the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def knows_developer(template_source: str) -> bool:
    """vLLM's test: the template spells the role as a quoted string."""
    return '"developer"' in template_source or "'developer'" in template_source


def as_system(messages: Sequence[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
    """``messages`` (a conversation as :func:`~.conversation.conversation` builds it) as
    the template receives them."""
    if knows_developer(template_source) or not any(m["role"] == "developer" for m in messages):
        return list(messages)
    converted: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "developer":
            system = {k: v for k, v in msg.items() if k != "tools"}
            system["role"] = "system"
            converted.append(system)
        else:
            converted.append(msg)
    return _one_system_first(converted)


def _one_system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(messages):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or texts:
            merge = True
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if (isinstance(part, dict) and "text" in part) or isinstance(part, str)
            )
        if content:
            texts.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]
