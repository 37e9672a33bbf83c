"""Validating OpenAI request bodies: the fields the gateway relies on, nothing more.

The backend validates the rest; the gateway checks what admission and routing read
(model, messages/prompt, output budget, n, stream) so a malformed request gets a 400
naming the field instead of a reservation built on garbage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from kvgateway.errors import BadRequest
from kvgateway.tokens.plans import lax_bool, lax_int

Kind = Literal["chat", "completion", "responses"]

# Keys of a content part vLLM reads as media when the part has no type.
_MEDIA_KEYS = ("image_url", "audio_url", "video_url", "input_audio", "image_embeds")
MAX_N = 128


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    n: int
    # Output tokens the client asked for, per sequence; None when it left it open
    # (absent or null: both mean "as much as fits" to vLLM).
    requested_output: int | None
    # Which field carries the output budget when the gateway has to set it.
    output_field: str
    # Sequences the node runs per prompt: n.
    sequences_per_prompt: int = 1
    # Completions with echo and max_tokens 0: the node returns the prompt and generates
    # nothing the client sees (vLLM still schedules one token).
    echo_only: bool = False


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps that keep one request cheap to look at (``admission.max_*``)."""

    max_messages: int = 4096
    max_content_parts: int = 8192


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_message_count(raw: bytes, limits: Limits) -> None:
    """Too many messages is refused before parsing: counting a key is far cheaper than
    building 800k message objects."""
    if len(raw) > 64 * limits.max_messages and raw.count(b'"role"') > limits.max_messages:
        raise _too_many("messages", limits.max_messages)


def parse_body(raw: bytes, limits: Limits = Limits(), *, messages: bool = True) -> dict[str, Any]:
    """The JSON object in ``raw``; with ``messages``, too many of them is refused first."""
    if not raw or raw.isspace():
        raise BadRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    if messages:
        check_message_count(raw, limits)
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError as exc:
        raise BadRequest(
            "The JSON body of your request is nested too deeply.", code="invalid_json"
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(
            f"We could not parse the JSON body of your request ({_short(exc)}). "
            "The body must be valid JSON.",
            code="invalid_json",
        ) from exc
    if not isinstance(body, dict):
        raise BadRequest(
            f"The request body must be a JSON object, got {type(body).__name__}.",
            code="invalid_json",
        )
    first = raw.find(b"\\")  # memchr: most bodies have few or no escapes to look at
    if first >= 0 and _SURROGATE_ESCAPE.search(raw, first):
        # A lone surrogate cannot be encoded to count it: count U+FFFD in its place.
        fixed: dict[str, Any] = _replace_lone_surrogates(body)
        return fixed
    return body


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


def _too_many(what: str, limit: int) -> BadRequest:
    return BadRequest(
        f"Too many {what} in one request: the limit is {limit}.",
        param="messages",
        code="too_many_" + what.replace(" ", "_"),
    )


def _replace_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, list):
        return [_replace_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: _replace_lone_surrogates(v) for k, v in value.items()}
    return value


def _type_error(param: str, expected: str, value: Any) -> BadRequest:
    got = "null" if value is None else type(value).__name__
    return BadRequest(
        f"Invalid type for '{param}': expected {expected}, but got {got}.",
        param=param,
        code="invalid_type",
    )


def _missing(param: str) -> BadRequest:
    return BadRequest(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _opt_positive_int(
    body: dict[str, Any], key: str, maximum: int | None = None, minimum: int = 1
) -> int | None:
    raw = body.get(key)
    if raw is None:
        return None
    value = lax_int(raw)  # as the node's pydantic reads it: 1000.0 and "1000" are 1000
    if value is None:
        raise _type_error(key, "an integer", raw)
    if value < minimum or (maximum is not None and value > maximum):
        limit = f" and at most {maximum}" if maximum else ""
        raise BadRequest(
            f"Invalid value for '{key}': expected an integer of at least {minimum}{limit}, "
            f"got {value}.",
            param=key,
            code="invalid_value",
        )
    return value


def _common(body: dict[str, Any], kind: Kind) -> tuple[str, bool, int]:
    if "model" not in body or body["model"] is None:
        raise _missing("model")
    model = body["model"]
    if not isinstance(model, str) or not model:
        raise _type_error("model", "a non-empty string", model)
    raw_stream = body.get("stream")
    stream = lax_bool(raw_stream)
    if raw_stream is not None and stream is None:
        raise _type_error("stream", "a boolean", raw_stream)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _type_error("stream_options", "an object", opts)
    n = _opt_positive_int(body, "n", MAX_N) or 1
    return model, bool(stream), n


def parse_chat(body: dict[str, Any], limits: Limits = Limits()) -> ParsedRequest:
    model, stream, n = _common(body, "chat")
    if "messages" not in body:
        raise _missing("messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise BadRequest(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
            code="empty_array",
        )
    if len(messages) > limits.max_messages:
        raise _too_many("messages", limits.max_messages)
    parts = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _type_error(where, "an object", msg)
        role = msg.get("role")
        if role is None:
            raise _missing(f"{where}.role")
        if not isinstance(role, str) or not role:
            # vLLM takes any role (its custom message param: "ipython" is Llama 3.1's tool
            # result); the model's template decides what it makes of it.
            raise _type_error(f"{where}.role", "a non-empty string", role)
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"{where}.content", "a string or an array of parts", content)
        if isinstance(content, list):
            parts += len(content)
            if parts > limits.max_content_parts:
                raise _too_many("content parts", limits.max_content_parts)
            for j, part in enumerate(content):
                # A string is a text part, and a media part may leave out its type (both
                # in vLLM's content part params).
                if not isinstance(part, str) and not (
                    isinstance(part, dict)
                    and (isinstance(part.get("type"), str) or any(k in part for k in _MEDIA_KEYS))
                ):
                    raise _type_error(
                        f"{where}.content[{j}]", "a string or an object with a 'type'", part
                    )
    for key in ("tools", "functions"):
        if body.get(key) is not None and not isinstance(body[key], list):
            raise _type_error(key, "an array", body[key])
    mct = _opt_positive_int(body, "max_completion_tokens")
    # vLLM reads max_tokens only without max_completion_tokens.
    mt = _opt_positive_int(body, "max_tokens") if mct is None else None
    requested = mct if mct is not None else mt
    field = "max_completion_tokens" if mct is not None or mt is None else "max_tokens"
    return ParsedRequest("chat", body, model, stream, n, requested, field, sequences_per_prompt=n)


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    """A completions request. ``best_of`` is not read (vLLM >= 0.32 ignores it: ``n``
    sequences run); ``prompt_embeds`` is refused (its sequences' lengths are not known
    before the node decodes the tensors, so no room can be reserved for them)."""
    model, stream, n = _common(body, "completion")
    if "n" in body and body["n"] is None:
        raise _type_error("n", "an integer", None)  # vLLM's completions take no null n
    if body.get("prompt_embeds") is not None:
        raise BadRequest(
            "'prompt_embeds' is not supported through this gateway: it cannot reserve KV "
            "cache for embeddings it cannot count. Send the prompt as text or token ids.",
            param="prompt_embeds",
            code="unsupported_parameter",
        )
    if "prompt" not in body or body["prompt"] is None:
        raise _missing("prompt")
    prompt = body["prompt"]
    if not _valid_prompt(prompt):
        raise _type_error(
            "prompt",
            "a string, an array of strings, an array of token ids or an array of those",
            prompt,
        )
    raw_echo = body.get("echo")
    echo = lax_bool(raw_echo)
    if raw_echo is not None and echo is None:
        raise _type_error("echo", "a boolean", raw_echo)
    # vLLM takes max_tokens 0 only with echo (the prompt back, nothing generated).
    requested = _opt_positive_int(body, "max_tokens", minimum=0 if echo else 1)
    return ParsedRequest(
        "completion",
        body,
        model,
        stream,
        n,
        requested,
        "max_tokens",
        sequences_per_prompt=n,
        echo_only=requested == 0,
    )


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return True
    return all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in prompt
    )


def parse_responses(body: dict[str, Any], limits: Limits = Limits()) -> ParsedRequest:
    """``POST /v1/responses``: ``instructions`` and ``input`` (a string or items: messages,
    function calls and their outputs, reasoning) are a chat prompt to the node;
    ``max_output_tokens`` is the output budget. The body is rewritten as a chat request
    only for counting (see :mod:`kvgateway.tokens.responses_input`)."""
    model, stream, _ = _common(body, "responses")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _type_error("instructions", "a string", instructions)
    raw = body.get("input")
    if raw is None:
        raise _missing("input")
    if isinstance(raw, list):
        if not raw:
            raise BadRequest("Invalid 'input': empty array.", param="input", code="empty_array")
        if len(raw) > limits.max_messages:
            raise _too_many("messages", limits.max_messages)
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise _type_error(f"input[{i}]", "an object", item)
            content = item.get("content")
            if content is not None and not isinstance(content, str | list):
                raise _type_error(f"input[{i}].content", "a string or an array of parts", content)
    elif not isinstance(raw, str):
        raise _type_error("input", "a string or an array of items", raw)
    requested = _opt_positive_int(body, "max_output_tokens")
    return ParsedRequest(
        "responses", body, model, stream, 1, requested, "max_output_tokens", sequences_per_prompt=1
    )
