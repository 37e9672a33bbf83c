"""What a request reserves and what fits a context (pure): the prompt each sequence holds,
its output budget, the prompt kept under ``truncate_prompt_tokens``, and when a node's own
count is worth asking for; and its prefix hint, the prompt's block keys as vLLM's prefix
cache keys them, which routing places and credits shared blocks by.

vLLM keeps a prompt's last k tokens (or first, ``truncation_side: "right"``); -1, and a
Responses request's ``truncation: "auto"``, keep as many as fit beside the output.
:mod:`.planner` counts and reserves what is kept, and keys prefix blocks on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from kvgateway.config.model import GatewayConfig, ModelConfig
from kvgateway.core.demand import PrefixHint
from kvgateway.core.prefix_keys import block_keys
from kvgateway.plan.openai_request import ParsedRequest
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.plans import flag, lax_bool, lax_int, part_text
from kvgateway.tokens.prompt_estimate import PromptCalibration, PromptEstimate

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's documented default
# Ask a node for its count when the bound plus the output would pass this share of the
# largest context.
NEAR = 0.9


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
        return bool(body.get("truncation", "disabled") != "disabled")  # null truncates too
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


def worth_asking(
    bound: int, floor: int, output: int, largest_context: int, *, fit_output: int | None = None
) -> bool:
    """The bound comes near the largest context while the lowest count the node may
    have (``floor``: the stand-in's count less what it may overcount, e.g. CJK or
    Arabic text) does not pass it (past it, the node would refuse the prompt anyway).
    ``fit_output``: the output the node needs beside the prompt when it is less than
    ``output`` (1 where the node cuts max_tokens to what the context leaves)."""
    needed = output if fit_output is None else fit_output
    return (
        largest_context > 0
        and bound + output > NEAR * largest_context
        and floor + needed <= largest_context
    )


def output_is_set(body: dict[str, Any]) -> bool:
    """Does the request fix its output length, so that no learned length applies?
    ``ignore_eos`` runs to ``max_tokens`` (unless a stop string ends it), ``min_tokens``
    sets a floor the learned lengths know nothing of: both reserve ``max_tokens``."""
    min_tokens = lax_int(body.get("min_tokens"))
    return flag(body, "ignore_eos", False) or (min_tokens is not None and min_tokens > 0)


def reserved_prompts(
    prompt: PromptEstimate, model: ModelConfig, calibration: PromptCalibration
) -> list[int]:
    """What to reserve for each prompt. The model's own count is exact and taken as it is.
    Otherwise the stand-in's bound, and never less than what the nodes' reports say the
    stand-in's count grows to (calibration: template overhead, tokenizer ratio)."""
    each = list(prompt.each or (prompt.total,))
    if prompt.exact:
        return each
    margin = model.tokenizer.estimate_margin
    if len(each) == 1:
        return [max(each[0], calibration.scaled(model.name, prompt.standin, margin))]
    return [calibration.scaled(model.name, n, margin) for n in each]


# Usage reports of a model before learned mode reserves prompts by what they predict.
LEARNED_PROMPT_SAMPLES = 50


def learned_prompts(
    prompt: PromptEstimate,
    model: ModelConfig,
    calibration: PromptCalibration,
    bounds: list[int],
) -> list[int]:
    """KV to reserve for a single prompt in learned mode: the nodes' predicted count of
    it (template overhead and tokenizer ratio learned from their usage reports) instead
    of the worst-case vocabulary bound, never more than the bound; the bound until
    :data:`LEARNED_PROMPT_SAMPLES` reports were seen. Exact counts and batched prompts
    (already reserved by the prediction) stay as they are."""
    if prompt.exact or prompt.uncalibrated or prompt.truncated or len(bounds) != 1:
        return bounds  # no stand-in count to predict from (standin 0 or cut)
    margin = model.tokenizer.estimate_margin
    guess = calibration.learned(model.name, prompt.standin, margin, LEARNED_PROMPT_SAMPLES)
    return bounds if guess is None else [min(bounds[0], guess)]


def output_budget(
    parsed: ParsedRequest, config: GatewayConfig, prompt_bound: int, largest_context: int
) -> tuple[int, int | None]:
    """Output tokens to reserve per sequence, and the ``max_tokens`` to send when the
    client left it open or asked for more than the largest context leaves (None: the
    body goes unchanged).

    A client-given budget is kept, unless it does not fit beside the prompt in the
    largest context but does fit the context itself: with ``admission.context_overflow:
    clamp`` (vLLM >= 0.32) it is cut to what the context leaves, as the node would cut
    it. Left open (absent or ``null``), vLLM would allow "the
    rest of the context" (chat, and completions with an explicit null) or 16
    (completions, absent): the gateway sends the node what it reserves, the default capped
    at what the largest context leaves after the prompt, so the cap never turns a request
    the node could serve into a 400. With ``inject_default_output: false`` the body goes
    unchanged and the gateway reserves what vLLM would allow.
    """
    if parsed.echo_only:
        return 1, None  # vLLM schedules one token for an echo of the prompt
    requested = parsed.requested_output
    if requested is not None:
        left = largest_context - prompt_bound
        if (
            config.admission.context_overflow == "clamp"
            and largest_context
            and 0 < left < requested <= largest_context
        ):
            # vLLM >= 0.32 serves it with max_tokens cut to what the context leaves
            # (get_max_tokens); the node is sent the cut, so the reservation holds
            # whatever its count of the prompt.
            return left, left
        return requested, None
    room = max(1, largest_context - prompt_bound) if largest_context else None
    if parsed.kind != "completion":
        default = config.admission.default_output_tokens
        vllm_allows = room
    else:  # vLLM reads a completion's null max_tokens as its default too
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
        vllm_allows = COMPLETIONS_DEFAULT_MAX_TOKENS
    if not config.admission.inject_default_output:
        return (vllm_allows or default), None
    # Never below min_tokens: the node refuses max_tokens < min_tokens.
    default = max(default, lax_int(parsed.body.get("min_tokens")) or 0)
    budget = min(default, room) if room is not None else default
    return budget, budget


# Prompts above this are turned into token ids in the counting pool, not on the loop.
IDS_INLINE_BYTES = 24_000


async def prompt_ids(
    parsed: ParsedRequest,
    counted_body: dict[str, Any],
    model: ModelConfig,
    counters: TokenCounters,
    size: int,
) -> tuple[list[int] | None, bool, PromptEstimate | None]:
    """The prompt's ids (a single prompt only), whether they are the node's own, and a
    chat's count when they are (the same rendering, not counted again). Taken before
    the prompt is counted: the stand-in's count of a text whose ids are held is their
    length (:meth:`PromptIds.known_count`), so nothing is encoded twice."""
    ids_of = counters.ids_for(model.tokenizer)
    body = parsed.body

    estimator = counters.estimator_for(model.tokenizer)

    def ids() -> tuple[list[int] | None, bool, PromptEstimate | None]:
        if parsed.kind == "completion":
            prompt = body.get("prompt")
            exact = estimator.exact_completion_ids(body)
            if exact is not None:
                return exact, True, None
            # Token ids are the node's; a text is encoded with the stand-in here.
            return ids_of.completion(prompt), _token_ids(prompt), None
        # Chat (or responses as chat): the node's own ids when the model's tokenizer is
        # configured (KV events then match), else a stable stand-in layout.
        counted = estimator.exact_chat_ids(counted_body)
        if counted is not None:
            return counted[0], True, counted[1]
        return ids_of.chat(counted_body, model.tokenizer), False, None

    if size > IDS_INLINE_BYTES:
        return await asyncio.get_running_loop().run_in_executor(counters.executor, ids)
    return ids()


def prefix_hint(
    parsed: ParsedRequest,
    found: list[int] | None,
    own: bool,
    block: int,
    longest: int,
    session: str | None,
) -> PrefixHint:
    """The prompt's block keys (from its ids, ``own`` when they are the node's) and its
    session, for routing.

    Keys stop at the prompt's full blocks before its last token's (what vLLM can take
    from its cache), so a credit for shared blocks can never exceed what the demand
    reserved for the prompt, nor what the node shares."""
    body = parsed.body
    user = body.get("user")
    session = session or (user if isinstance(user, str) and user else None)
    keys: tuple[int, ...] = ()
    cut = False
    keep = truncation(body, len(found)) if found else 0
    if found and not keep and truncates_to_fit(parsed) and len(found) > longest:
        keep = longest
    if found and keep:
        # The node keeps the prompt's last `keep` tokens (or first, truncation_side
        # "right"): their blocks chain from another first block than the whole prompt's.
        # Keyed as kept for routing; no credit (the node's hashes of a cut prompt are not
        # worth the risk of one wrong block).
        found = found[:keep] if body.get("truncation_side") == "right" else found[-keep:]
        cut = True
    if found:
        # vLLM recomputes a prompt's last token (for its logits) and so never takes the
        # block holding it from the cache: of a prompt of exactly k full blocks, k - 1 can
        # be shared. The keys stop there (the last block's credit made a node preempt).
        shareable = (min(len(found), longest) - 1) // block
        # A cache_salt is in the first block's hash (and in its events' extra keys).
        salt = body.get("cache_salt")
        extra = [(salt,)] if isinstance(salt, str) and salt else None
        keys = tuple(block_keys(found, block, max_blocks=max(0, shareable), extra_keys=extra))
    return PrefixHint(
        keys,
        block,
        session[:256] if session else None,
        credit=own and not cut and _shares_as_keyed(parsed),
    )


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def _shares_as_keyed(parsed: ParsedRequest) -> bool:
    """Does the node share this prompt's blocks exactly as its ids say? Not with images
    or other media (vLLM's block hashes carry each item's content hash; the ids hold
    placeholders), a ``cache_salt`` (its first block's hash carries the salt), or prompt
    logprobs (vLLM then reads nothing from its prefix cache): asked for, or implied by
    ``echo`` (a chat's takes ``top_logprobs``, 0 by default; a completion's ``logprobs``
    when set)."""
    body = parsed.body
    if any(body.get(k) is not None for k in ("cache_salt", "prompt_logprobs")):
        return False
    if body.get("prompt_logprob_token_ids") is not None:
        return False
    if lax_bool(body.get("echo")) and (parsed.kind == "chat" or body.get("logprobs") is not None):
        return False
    for source in (body.get("messages"), body.get("input")):
        if not isinstance(source, list):
            continue
        for msg in source:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list) and any(part_text(p) is None for p in content):
                return False
    return True
