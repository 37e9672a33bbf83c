"""A request's prefix hint for routing: its prompt's block keys, as vLLM's prefix cache
keys them, and its session."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgateway.config.model import ModelConfig
from kvgateway.core.demand import PrefixHint
from kvgateway.core.prefix_keys import block_keys
from kvgateway.plan.budget import truncates_to_fit, truncation
from kvgateway.plan.openai_request import ParsedRequest
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.plans import part_text
from kvgateway.tokens.prompt_estimate import PromptEstimate

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
        keys = tuple(block_keys(found, block, max_blocks=max(0, shareable)))
    return PrefixHint(
        keys,
        block,
        session[:256] if session else None,
        credit=own and not cut and _shares_as_keyed(body),
    )


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def _shares_as_keyed(body: dict[str, Any]) -> bool:
    """Does the node share this prompt's blocks exactly as its ids say? Not with images
    or other media (vLLM's block hashes carry each item's content hash; the ids hold
    placeholders), a ``cache_salt`` (its first block's hash carries the salt), or
    ``prompt_logprobs`` (vLLM then reads nothing from its prefix cache)."""
    if body.get("cache_salt") is not None or body.get("prompt_logprobs") is not None:
        return False
    for source in (body.get("messages"), body.get("input")):
        if not isinstance(source, list):
            continue
        for msg in source:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list) and any(part_text(p) is None for p in content):
                return False
    return True
