"""``truncate_prompt_tokens``: what the node keeps of each prompt (pure).

vLLM keeps a prompt's last k tokens (or first, ``truncation_side: "right"``); -1, and a
Responses request's ``truncation: "auto"``, keep as many as fit beside the output.
:mod:`.planning` counts and reserves what is kept, and keys prefix blocks on it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvgateway.server.openai_request import ParsedRequest
from kvgateway.tokens.lax import lax_int
from kvgateway.tokens.prompt_estimate import PromptEstimate


def truncation(body: dict[str, Any], longest: int) -> int:
    """How many prompt tokens the node keeps of each prompt (0: all of them):
    ``truncate_prompt_tokens`` k > 0 (-1, as many as fit, is :func:`truncates_to_fit`)."""
    keep = lax_int(body.get("truncate_prompt_tokens")) or 0
    return keep if 0 < keep < longest else 0


def truncates_to_fit(parsed: ParsedRequest) -> bool:
    """``truncate_prompt_tokens: -1`` (or a Responses request's ``truncation: "auto"``):
    vLLM keeps the prompt's last max_model_len - max_tokens tokens
    (vllm/renderers/params.py, ``_token_truncation``; ``ResponsesRequest.build_tok_params``
    passes -1 unless truncation is "disabled")."""
    body = parsed.body
    if parsed.kind == "responses":
        return body.get("truncation") == "auto"
    return lax_int(body.get("truncate_prompt_tokens")) == -1


def truncated(prompt: PromptEstimate, keep: int) -> PromptEstimate:
    """``prompt`` as the node runs it with ``truncate_prompt_tokens: keep``: each prompt's
    last ``keep`` tokens (a bound of the whole is one of its last ``keep`` too)."""
    each = tuple(min(n, keep) for n in prompt.each) or (min(prompt.longest, keep),)
    return replace(
        prompt,
        total=sum(each),
        longest=max(each),
        each=each,
        floor=min(prompt.floor, keep),
        truncated=True,
    )
