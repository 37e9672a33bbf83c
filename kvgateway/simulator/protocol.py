"""vLLM's OpenAI-compatible requests, read as vLLM reads them.

Pure functions; the handlers do the I/O. A body is read in vLLM's order: JSON and the
fields' types first (FastAPI and pydantic in lax mode: ``"16"`` and ``16.0`` are 16,
``"yes"`` is true; every refused field reported at once, see
:func:`~kvgateway.simulator.errors.invalid_fields`), then the request models' own
validators (``stream_options`` without ``stream``, a missing prompt). The model, the
context and the sampling parameters are checked later by the handlers, in that order.
Fields follow ``ChatCompletionRequest`` / ``CompletionRequest`` of vLLM 0.32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvgateway.simulator.errors import (
    FieldError,
    bad_request,
    below,
    body_missing,
    body_not_object,
    bool_problem,
    int_problem,
    invalid_fields,
    json_invalid,
    missing,
    not_object,
    not_string,
    vllm_check,
)
from kvgateway.simulator.tokenizer import ChatMessage
from kvgateway.tokens.plans import lax_bool, lax_int

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What both endpoints ask of the engine."""

    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    n: int
    max_tokens: int | None
    ignore_eos: bool
    min_tokens: int
    # The field that set max_tokens, as vLLM names it in its refusals.
    max_tokens_field: str = "max_tokens"
    messages: tuple[ChatMessage, ...] = ()
    # Keep only the prompt's last this many tokens (-1: max_model_len), as vLLM does.
    truncate_prompt_tokens: int | None = None
    prompt: str | None = None
    prompt_token_count: int | None = None  # prompt given as token ids
    prompt_token_ids: tuple[int, ...] | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as FastAPI reads it: no body or ``null`` is a missing body."""
    if not raw.strip():
        raise body_missing()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise json_invalid(exc.pos, exc.msg) from exc
    except UnicodeDecodeError as exc:
        raise json_invalid(exc.start, exc.reason) from exc
    if body is None:
        raise body_missing()
    if not isinstance(body, dict):
        raise body_not_object(body)
    return body


class _Fields:
    """Reads typed fields of one body, collecting pydantic's errors in field order."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.errors: list[FieldError] = []

    def integer(self, key: str, default: int | None, *, nullable: bool = True) -> int | None:
        if key not in self.body:
            return default
        raw = self.body[key]
        if raw is None and nullable:
            return None
        value = None if raw is None else lax_int(raw)
        if value is None:
            self.errors.append(int_problem(key, raw))
        return value

    def flag(self, key: str, *, nullable: bool = True) -> bool:
        raw = self.body.get(key, False)
        if raw is None and nullable:
            return False
        value = None if raw is None else lax_bool(raw)
        if value is None:
            self.errors.append(bool_problem(key, raw))
            return False
        return value

    def model(self) -> str | None:
        model = self.body.get("model")
        if model is not None and not isinstance(model, str):
            self.errors.append(not_string("model", model))
            return None
        return model

    def done(self) -> None:
        if self.errors:
            raise invalid_fields(self.errors)


def _sampling(f: _Fields, *, chat: bool) -> dict[str, Any]:
    """The fields both endpoints share, from ``n`` on (their order in vLLM's models)."""
    n = f.integer("n", 1, nullable=chat)
    stream = f.flag("stream")
    options = f.body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        f.errors.append(not_object("stream_options", options))
        options = None
    ignore_eos = f.flag("ignore_eos", nullable=False)
    min_tokens = f.integer("min_tokens", 0, nullable=False)
    truncate = f.integer("truncate_prompt_tokens", None)
    if truncate is not None and truncate < -1:
        f.errors.append(below("truncate_prompt_tokens", f.body["truncate_prompt_tokens"], -1))
    f.done()
    # The request models' own validator, run once every field is read.
    if options is not None and not stream:
        raise vllm_check("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(lax_bool((options or {}).get("include_usage")))
    return {
        "stream": stream,
        "include_usage": include_usage,
        # vLLM's should_include_usage: continuous usage only together with include_usage.
        "continuous_usage": include_usage
        and bool(lax_bool((options or {}).get("continuous_usage_stats"))),
        "n": 1 if n is None else n,
        "ignore_eos": ignore_eos,
        "min_tokens": min_tokens or 0,
        "truncate_prompt_tokens": truncate,
    }


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(part, str):
            parts.append(part)
    return "\n".join(parts)


def _message_problem(value: Any) -> FieldError | None:
    """What pydantic refuses in ``messages`` (its own message lists one error per branch
    of the message union; the first one stands for them here)."""
    if not isinstance(value, list):
        return FieldError("list_type", "body.messages", "Input should be a valid list", value)
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return not_object(f"messages.{i}", m)
        if not isinstance(m.get("role"), str):
            return missing(f"messages.{i}.role", m)
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            return not_string(f"messages.{i}.content", content)
    return None


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    problem = _message_problem(value)
    if problem is not None:
        raise invalid_fields([problem])
    return tuple(ChatMessage(m["role"], _message_text(m.get("content"))) for m in value)


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    f = _Fields(body)
    if "messages" not in body:
        f.errors.append(missing("messages", body))
    else:
        problem = _message_problem(body["messages"])
        if problem is not None:
            f.errors.append(problem)
    model = f.model()
    max_tokens = f.integer("max_tokens", None)
    completion_tokens = f.integer("max_completion_tokens", None)
    sampling = _sampling(f, chat=True)
    # vLLM: max_completion_tokens wins over the deprecated max_tokens.
    field = "max_completion_tokens" if completion_tokens is not None else "max_tokens"
    return GenerationRequest(
        model=model,
        max_tokens=completion_tokens if completion_tokens is not None else max_tokens,
        max_tokens_field=field,
        messages=parse_messages(body["messages"]),
        **sampling,
    )


# pydantic's errors for a prompt that is none of vLLM's prompt types, in its union order.
_PROMPT_UNION = (
    ("list_type", "Input should be a valid list"),
    ("list_type", "Input should be a valid list"),
    ("string_type", "Input should be a valid string"),
    ("list_type", "Input should be a valid list"),
)


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    f = _Fields(body)
    model = f.model()
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str | list):
        f.errors.extend(FieldError(k, "body.prompt", m, prompt) for k, m in _PROMPT_UNION)
    echo = f.flag("echo")
    max_tokens = f.integer("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    sampling = _sampling(f, chat=False)
    if prompt is None or prompt == "":
        raise vllm_check("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if prompt == []:
        raise bad_request("You must pass at least one prompt")
    if echo and max_tokens == 0:
        max_tokens = 1  # vLLM: the prompt back, one token scheduled
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    common = {"model": model, "max_tokens": max_tokens, **sampling}
    if isinstance(prompt, str):
        return GenerationRequest(**common, prompt=prompt)
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return GenerationRequest(
            **common, prompt_token_count=len(prompt), prompt_token_ids=tuple(prompt)
        )
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list of one of those "
        "(the simulator serves one prompt per request).",
        "prompt",
    )
