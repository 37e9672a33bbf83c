"""The node's own prompt count: from its context-length 400, or asked via /tokenize.

A gateway counting with a stand-in learns the node's exact count two ways: vLLM's
``POST /tokenize`` (asked before forwarding a request whose bound comes near a limit;
:func:`tokenize_body` and :func:`tokenize_count`), and the 400 a node answers when a
prompt does not fit (:func:`parse_context_length_error`).

vLLM has worded this refusal several ways over its releases; each carries the node's
count of the prompt (exactly, or as a lower bound when vLLM stopped tokenizing early):

- "This model's maximum context length is L tokens. However, you requested M output
  tokens and your prompt contains at least N input tokens, for a total of at least T
  tokens." (vLLM tokenizes at most max_model_len - M + 1 tokens: N is a lower bound)
- "... your prompt contains N input tokens, for a total of T tokens." (exact)
- "This model's maximum context length is L tokens. However, you requested T tokens
  (N in the messages, M in the completion)." (exact; chat) and "... however you
  requested T tokens (N in your prompt; M for the completion)." (exact; completions)
- "This model's maximum context length is L tokens. However, you requested N tokens in
  the messages, Please reduce the length of the messages." (exact, prompt alone)
- vLLM >= 0.32 (which cuts max_tokens to what the context leaves instead of refusing):
  "This model's maximum context length is L tokens. However, your prompt contains [at
  least] N input tokens, which exceeds this limit even without any output tokens." and,
  before tokenizing, "... your prompt contains C characters (more than ...)" (the
  prompt is longer than L tokens);
- vLLM >= 0.32, a prompt of exactly the context (max_tokens cut to 0): "max_tokens
  must be at least 1, got 0." (the count is the refusing node's context);
- engine-level: "The decoder prompt (length N) is longer than the maximum model length
  of L.", "The decoder prompt (length N) plus the number of requested output tokens (at
  least 1) is longer than the maximum model length of L." and "Input prompt (N tokens)
  is too long and exceeds limit of L".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvgateway.tokens.exact import template_arguments


@dataclass(frozen=True, slots=True)
class NodeCount:
    """The node's prompt count from a refusal.

    ``at_least``: the node stopped counting early, so the prompt is N *or more* tokens.
    ``max_model_len`` is None when the wording does not state it.
    """

    prompt_tokens: int
    at_least: bool
    max_model_len: int | None
    requested_output: int | None = None


_MAX_LEN = re.compile(r"maximum context length is (\d+) tokens", re.IGNORECASE)
_PATTERNS: tuple[tuple[re.Pattern[str], bool], ...] = (
    (
        re.compile(
            r"requested (\d+) output tokens and your prompt contains at least (\d+) input tokens",
            re.IGNORECASE,
        ),
        True,
    ),
    (
        re.compile(
            r"requested (\d+) output tokens and your prompt contains (\d+) input tokens",
            re.IGNORECASE,
        ),
        False,
    ),
)
_OLD_SPLIT = re.compile(
    r"requested \d+ tokens \((\d+) in (?:the messages|your prompt)[,;] (\d+) (?:in|for) the completion\)",
    re.IGNORECASE,
)
_OLD_MESSAGES = re.compile(r"requested (\d+) tokens in the messages", re.IGNORECASE)
_ENGINE = (
    re.compile(r"decoder prompt \(length (\d+)\) is longer than the maximum model length of (\d+)"),
    re.compile(
        r"decoder prompt \(length (\d+)\) plus the number of requested output tokens "
        r"\(at least 1\) is longer than the maximum model length of (\d+)"
    ),
    re.compile(r"Input prompt \((\d+) tokens\) is too long and exceeds limit of (\d+)"),
    # vLLM >= 0.32's Responses API, a prompt of the whole context or more.
    re.compile(r"engine prompt length (\d+) exceeds the max_model_len (\d+)"),
)
# vLLM >= 0.32: the prompt alone is past the context (text is counted to L + 1 at most).
_NO_OUTPUT = re.compile(
    r"your prompt contains (at least )?(\d+) input tokens, which exceeds this limit",
    re.IGNORECASE,
)
# vLLM >= 0.32's character pre-check: more characters than L input tokens can hold, so
# the prompt is longer than L tokens.
_CHARACTERS = re.compile(r"your prompt contains \d+ characters \(more than", re.IGNORECASE)
# vLLM >= 0.32, a prompt of exactly the context: max_tokens cut to 0.
_NOTHING_LEFT = re.compile(r"max_tokens must be at least 1, got 0(?![.\d]*[1-9])")


def parse_context_length_error(message: str, context: int | None = None) -> NodeCount | None:
    """The node's count from a context-length refusal, or None for any other message.

    ``context``: the refusing node's max_model_len. vLLM >= 0.32 cuts max_tokens to what
    the context leaves; a prompt of exactly the context leaves 0, refused as "max_tokens
    must be at least 1, got 0" (the gateway never sends 0 itself): the prompt is the
    context, which only the node's own limit says."""
    if context is not None and _NOTHING_LEFT.search(message):
        return NodeCount(context, False, context, 0)
    max_len_match = _MAX_LEN.search(message)
    max_len = int(max_len_match.group(1)) if max_len_match else None
    for pattern, at_least in _PATTERNS:
        m = pattern.search(message)
        if m:
            return NodeCount(int(m.group(2)), at_least, max_len, int(m.group(1)))
    m = _NO_OUTPUT.search(message)
    if m:
        return NodeCount(int(m.group(2)), m.group(1) is not None, max_len, 0)
    if max_len is not None and _CHARACTERS.search(message):
        return NodeCount(max_len + 1, True, max_len, 0)
    m = _OLD_SPLIT.search(message)
    if m:
        return NodeCount(int(m.group(1)), False, max_len, int(m.group(2)))
    m = _OLD_MESSAGES.search(message)
    if m:
        return NodeCount(int(m.group(1)), False, max_len, None)
    for pattern in _ENGINE:
        m = pattern.search(message)
        if m:
            return NodeCount(int(m.group(1)), False, int(m.group(2)), None)
    return None


def readmission_prompt_tokens(
    count: NodeCount, *, asked: int | None, largest_context: int, output: int
) -> int:
    """Prompt tokens to re-admit a refused request with: the node's count, never a lower
    bound of it.

    An exact count is used as it is. "At least N" only says the prompt did not fit the
    refusing node (vLLM stopped counting past its context: a 9,028-token prompt was
    refused as "at least 4097"); the request can only go to a node with a longer
    context, whose own count is asked first (``asked``: its /tokenize count). Without
    one, the most a node that may serve it can hold: the largest context less the
    output reserved beside it (a longer prompt is refused there too, and that refusal
    is the client's answer), and never less than N.
    """
    if not count.at_least:
        return count.prompt_tokens
    if asked is not None:
        return max(asked, count.prompt_tokens)
    return max(count.prompt_tokens, largest_context - output)


# Fields of vLLM's TokenizeChatRequest / TokenizeCompletionRequest that change the count.
_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)
_COMPLETION_FIELDS = ("prompt", "add_special_tokens")
# Set as template arguments by TokenizeChatRequest's own fields.
_OWN_ARGUMENTS = ("add_generation_prompt", "continue_final_message")


def tokenize_body(request: dict[str, Any], served_model: str, *, chat: bool) -> dict[str, Any]:
    """The ``/tokenize`` body that counts ``request`` (a chat or completions body) as the
    node will count it when it is forwarded. A chat request's ``documents`` and
    ``reasoning_effort`` (with the ``enable_thinking`` it implies) are not fields of
    vLLM's TokenizeChatRequest: they go in its ``chat_template_kwargs``, merged as the
    chat endpoint merges them (:func:`~kvgateway.tokens.exact.template_arguments`)."""
    fields = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    body = {k: request[k] for k in fields if k in request}
    if chat:
        kwargs = template_arguments(request)
        for key in _OWN_ARGUMENTS:
            kwargs.pop(key, None)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
    body["model"] = served_model
    return body


def tokenize_count(response: Any) -> int | None:
    """``count`` from a /tokenize response body, or None if it is not one."""
    if not isinstance(response, dict):
        return None
    count = response.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    tokens = response.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None
