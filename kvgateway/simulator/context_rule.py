"""How a node fits a request into its context, and its refusals, per vLLM release.

``overflow`` selects the release: "clamp" is vLLM >= 0.32 (a prompt that fits is served,
``max_tokens`` cut to what the context leaves: ``renderers/params.py`` checks the prompt
against the whole context, ``get_max_tokens`` cuts), "reject" is vLLM <= 0.31 (prompt +
max_tokens past the context is a 400). The checks run in vLLM's order: the requested
output against the context, the truncation size, the prompt's length, then the sampling
parameters with the cut ``max_tokens`` (``SamplingParams._verify_args``), so a prompt that
fills the whole context leaves ``max_tokens`` 0 and is refused as such.
"""

from __future__ import annotations

from kvgateway.simulator.errors import ApiError, bad_request, vllm_check


def context_length_error(
    max_model_len: int, prompt_tokens: int, requested: int | None, *, text: bool = True
) -> ApiError:
    """vLLM <= 0.31's 400 for prompt + requested output > max_model_len.

    vLLM encodes text at most ``max_input + 1`` tokens long (max_input = max_model_len -
    requested output), so an over-long text prompt is reported as "at least max_input +
    1" tokens; token ids are reported at their length ("at least" only when that length
    is max_input + 1). A prompt alone at the limit with no output requested is reported
    exactly.
    """
    out = requested or 0
    if out > max_model_len:
        return _too_many_output_tokens_031(out, max_model_len)
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


def _too_many_output_tokens_031(out: int, max_model_len: int) -> ApiError:
    return bad_request(
        f"max_tokens={out} cannot be greater than max_model_len=max_total_tokens="
        f"{max_model_len}. Please request fewer output tokens.",
        "max_tokens",
    )


def too_many_output_tokens(out: int, max_model_len: int, field: str = "max_tokens") -> ApiError:
    """vLLM >= 0.32's 400 for an output budget past the context itself, naming the field
    the request set (``max_completion_tokens`` or ``max_tokens``)."""
    return vllm_check(
        f"{field}={out} cannot be greater than max_model_len={max_model_len}. "
        "Please request fewer output tokens.",
        field,
        out,
    )


def prompt_too_long_error(max_model_len: int, prompt_tokens: int, *, text: bool = True) -> ApiError:
    """vLLM >= 0.32's 400 for a prompt that does not fit the context even without output
    (``renderers/params.py`` ``_token_len_check``): text is encoded at most
    ``max_model_len + 1`` tokens long, and a count of exactly that is "at least"."""
    count = min(prompt_tokens, max_model_len + 1) if text else prompt_tokens
    at_least = "at least " if count == max_model_len + 1 else ""
    return vllm_check(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {at_least}{count} input tokens, which exceeds this limit even "
        "without any output tokens. Please reduce the length of the input prompt.",
        "input_tokens",
        count,
    )


def output_budget(
    max_model_len: int,
    prompt_tokens: int,
    requested: int | None,
    *,
    text: bool = True,
    overflow: str = "clamp",
    field: str = "max_tokens",
) -> int:
    """The ``max_tokens`` the engine gets, or :class:`ApiError` if the context refuses it.

    ``requested`` None means the client set no limit: the context left is the limit.
    ``text``: the prompt came as text (its over-long count is cut). The result may be
    below 1 (a prompt filling the context, a negative request): :func:`check_sampling`
    refuses it then, as vLLM's SamplingParams does.
    """
    if overflow == "clamp":
        if requested is not None and requested > max_model_len:
            raise too_many_output_tokens(requested, max_model_len, field)
        if prompt_tokens > max_model_len:
            raise prompt_too_long_error(max_model_len, prompt_tokens, text=text)
        room = max_model_len - prompt_tokens
        return room if requested is None else min(requested, room)
    if requested is None:
        if prompt_tokens >= max_model_len:
            raise context_length_error(max_model_len, prompt_tokens, None, text=text)
        return max_model_len - prompt_tokens
    if requested >= 1 and prompt_tokens + requested > max_model_len:
        raise context_length_error(max_model_len, prompt_tokens, requested, text=text)
    return requested


def check_sampling(n: int, max_tokens: int, min_tokens: int) -> None:
    """vLLM's SamplingParams checks, in its order, on the budget the context left."""
    if n < 1:
        raise vllm_check(f"n must be at least 1, got {n}.")
    if max_tokens < 1:
        raise vllm_check(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if min_tokens < 0:
        raise vllm_check(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise vllm_check(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )


def check_request_limits(
    max_model_len: int,
    requested: int | None,
    truncate: int | None,
    *,
    overflow: str = "clamp",
    field: str = "max_tokens",
) -> None:
    """vLLM's checks before it tokenizes (``TokenizeParams``): the requested output and
    the truncation size against the context."""
    if overflow == "clamp" and requested is not None and requested > max_model_len:
        raise too_many_output_tokens(requested, max_model_len, field)
    if truncate is not None and truncate > max_model_len:
        raise truncation_too_large(truncate, max_model_len, overflow)


def check_characters(chars: int, max_model_len: int, max_chars_per_token: int) -> None:
    """vLLM >= 0.32's check before it tokenizes a text prompt (``_text_len_check``): more
    characters than ``max_model_len`` tokens of the longest spelling can hold."""
    limit = max_model_len * max_chars_per_token
    if chars > limit:
        raise vllm_check(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {chars} characters (more than {limit} characters, which is "
            f"the upper bound for {max_model_len} input tokens). Please reduce the length "
            "of the input prompt.",
            "input_text",
            chars,
        )


def check_token_ids(ids: list[int], max_token_id: int) -> None:
    """Prompt token ids outside the vocabulary (``validate_token_ids``)."""
    for bad in (min(ids), max(ids)):
        if bad < 0 or bad > max_token_id:
            raise bad_request(f"Token id {bad} is out of vocabulary")


def truncated(
    ids: list[int],
    keep: int | None,
    max_model_len: int,
    max_tokens: int | None,
    overflow: str = "clamp",
) -> list[int]:
    """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as fit
    beside ``max_tokens`` in vLLM <= 0.31; the context less one in vLLM >= 0.32, which
    then cuts max_tokens to fit; vllm/renderers/params.py ``_token_truncation``; a
    ``keep`` past the context is refused first, :func:`check_request_limits`); vLLM
    truncates on the left."""
    if keep is None or keep == 0:
        return ids
    if keep == -1:
        if overflow == "clamp":
            keep = max(1, max_model_len - 1)
        else:
            keep = max(1, max_model_len - (max_tokens or 0))
    return ids[-keep:] if len(ids) > keep else ids


def truncation_too_large(keep: int, max_model_len: int, overflow: str = "clamp") -> ApiError:
    if overflow == "clamp":
        return vllm_check(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
            f"{max_model_len}. Please request a smaller truncation size.",
            "truncate_prompt_tokens",
            keep,
        )
    return bad_request(
        f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
        f"({max_model_len}). Please, select a smaller truncation size.",
        "truncate_prompt_tokens",
    )
