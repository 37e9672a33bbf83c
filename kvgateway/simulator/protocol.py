"""vLLM's OpenAI-compatible wire format: request parsing, error bodies, response shapes.

Pure functions; the handlers in ``server.py`` and ``completions.py`` do the I/O. Shapes
follow ``vllm/entrypoints/openai/protocol.py`` and ``serving_chat.py`` /
``serving_completion.py``; error texts follow VLLM.md (the project's reference page).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvgateway.simulator.tokenizer import ChatMessage
from kvgateway.tokens.lax import lax_bool, lax_int


class ApiError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def model_not_found(model: str, served: str | None = None) -> ApiError:
    """vLLM's 404; its generation endpoints name the served models (``_check_model``)."""
    aliases = f" Valid aliases: {served}." if served is not None else ""
    return ApiError(404, f"The model `{model}` does not exist.{aliases}", "NotFoundError", "model")


def queue_full(in_flight: int, limit: int) -> ApiError:
    return ApiError(
        503,
        f"The server is at capacity: {in_flight} requests in flight "
        f"(--max-num-queued-reqs={limit}). Please retry later.",
        "ServiceUnavailableError",
    )


_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def injected_error(status: int) -> ApiError:
    return ApiError(
        status,
        f"Simulated failure (HTTP {status}) injected by /sim/fault.",
        _STATUS_TYPES.get(status, "InternalServerError"),
    )


def context_length_error(
    max_model_len: int, prompt_tokens: int, requested: int | None, *, text: bool = True
) -> ApiError:
    """vLLM <= 0.31's 400 for prompt + requested output > max_model_len
    (``renderers/params.py``).

    vLLM encodes text at most ``max_input + 1`` tokens long (max_input = max_model_len -
    requested output), so an over-long text prompt is reported as "at least max_input +
    1" tokens; token ids are reported at their length ("at least" only when that length
    is max_input + 1). A prompt alone at the limit with no output requested is reported
    exactly.
    """
    out = requested or 0
    if out > max_model_len:
        return _too_many_output_tokens(out, max_model_len)
    max_input = max_model_len - out
    count = min(prompt_tokens, max_input + 1) if text else prompt_tokens
    at_least = "at least " if count > max_input and count == max_input + 1 else ""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {out} output tokens and your prompt contains {at_least}{count} input "
        f"tokens, for a total of {at_least}{count + out} tokens. Please reduce the length "
        f"of the input prompt or the number of requested output tokens. "
        f"(parameter=input_tokens, value={count})"
    )
    return bad_request(message, "input_tokens")


def _too_many_output_tokens(out: int, max_model_len: int) -> ApiError:
    return bad_request(
        f"max_tokens={out} cannot be greater than max_model_len=max_total_tokens="
        f"{max_model_len}. Please request fewer output tokens.",
        "max_tokens",
    )


def prompt_too_long_error(max_model_len: int, prompt_tokens: int, *, text: bool = True) -> ApiError:
    """vLLM >= 0.32's 400 for a prompt that does not fit the context even without output
    (``renderers/params.py`` ``_token_len_check``; text is encoded at most
    ``max_model_len + 1`` tokens long), and for one exactly at the limit (the engine's
    ``_validate_prompt_len``: no room for one output token)."""
    if prompt_tokens == max_model_len:
        return bad_request(
            f"The decoder prompt (length {prompt_tokens}) plus the number of requested "
            f"output tokens (at least 1) is longer than the maximum model length of "
            f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number "
            "of text tokens (prompt + requested output tokens).",
            None,
        )
    count = min(prompt_tokens, max_model_len + 1) if text else prompt_tokens
    at_least = "at least " if text and count == max_model_len + 1 else ""
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {at_least}{count} input tokens, which exceeds this limit even "
        "without any output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={count})",
        "input_tokens",
    )


def output_budget(
    max_model_len: int,
    prompt_tokens: int,
    requested: int | None,
    *,
    text: bool = True,
    overflow: str = "clamp",
) -> int:
    """Tokens the request may generate, or :class:`ApiError` if it cannot fit.

    ``requested`` None means the client set no limit: vLLM then allows
    ``max_model_len - prompt_tokens``, which needs at least one token of room.
    ``text``: the prompt came as text (its over-long count is cut).
    ``overflow``: "clamp" (vLLM >= 0.32: a prompt that fits is served, ``max_tokens``
    cut to what the context leaves, ``get_max_tokens``) or "reject" (vLLM <= 0.31:
    prompt + max_tokens past the context is a 400).
    """
    if overflow == "clamp":
        if requested is not None and requested > max_model_len:
            raise _too_many_output_tokens(requested, max_model_len)
        if prompt_tokens >= max_model_len:
            raise prompt_too_long_error(max_model_len, prompt_tokens, text=text)
        room = max_model_len - prompt_tokens
        return room if requested is None else min(requested, room)
    if requested is None:
        if prompt_tokens >= max_model_len:
            raise context_length_error(max_model_len, prompt_tokens, None, text=text)
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise context_length_error(max_model_len, prompt_tokens, requested, text=text)
    return requested


# -- request parsing -------------------------------------------------------------------


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
    messages: tuple[ChatMessage, ...] = ()
    # Keep only the prompt's last this many tokens (-1: max_model_len), as vLLM does.
    truncate_prompt_tokens: int | None = None
    prompt: str | None = None
    prompt_token_count: int | None = None  # prompt given as token ids
    prompt_token_ids: tuple[int, ...] | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    raw = body.get(key)
    if raw is None:
        return None
    value = lax_int(raw)  # vLLM's pydantic models are lax: 1000.0 and "1000" are 1000
    if value is None:
        raise bad_request(f"{key} must be an integer, got {raw!r}.", key)
    if value < minimum:
        raise bad_request(f"{key} must be at least {minimum}, got {value}.", key)
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    raw = body.get(key, False)
    if raw is None:
        return False
    value = lax_bool(raw)  # lax, as vLLM's pydantic: "true", 1, "yes"...
    if value is None:
        raise bad_request(f"{key} must be a boolean, got {raw!r}.", key)
    return value


def _common(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string.", "model")
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object.", "stream_options")
    if options and not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return {
        "model": model,
        "stream": stream,
        "include_usage": bool(options.get("include_usage")),
        # vLLM's should_include_usage: continuous usage only together with include_usage.
        "continuous_usage": bool(options.get("include_usage"))
        and bool(options.get("continuous_usage_stats")),
        "n": _opt_int(body, "n", 1) or 1,
        "max_tokens": max_tokens,
        "ignore_eos": _bool(body, "ignore_eos"),
        "min_tokens": _opt_int(body, "min_tokens", 0) or 0,
        "truncate_prompt_tokens": _opt_int(body, "truncate_prompt_tokens", -1),
    }


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of parts.", "messages")


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list.", "messages")
    messages: list[ChatMessage] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role.", "messages")
        messages.append(ChatMessage(m["role"], _message_text(m.get("content"), i)))
    return tuple(messages)


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    # vLLM: max_completion_tokens wins over the deprecated max_tokens.
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    return GenerationRequest(
        **_common(body, max_tokens), messages=parse_messages(body.get("messages"))
    )


COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    echo = _bool(body, "echo")
    # vLLM: max_tokens 0 is allowed with echo (the prompt back); it schedules one token.
    max_tokens = _opt_int(body, "max_tokens", 0 if echo else 1)
    if "max_tokens" not in body:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    elif max_tokens == 0:
        max_tokens = 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return GenerationRequest(**_common(body, max_tokens), prompt=prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return GenerationRequest(
            **_common(body, max_tokens),
            prompt_token_count=len(prompt),
            prompt_token_ids=tuple(prompt),
        )
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list of one of those "
        "(the simulator serves one prompt per request).",
        "prompt",
    )


# -- responses -------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_ts() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def models_body(model: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": new_id("modelperm"),
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


def chat_message_choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "message": {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        },
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


def completion_choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def json_response(body: Any, *, status: int = 200) -> web.Response:
    """A JSON response serialized compactly, as vLLM (FastAPI/pydantic) does."""
    return web.json_response(body, status=status, dumps=_compact)
