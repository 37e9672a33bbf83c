"""One model's prompt count for admission: exact when the gateway has the model's
tokenizer, otherwise the stand-in's per-request upper bound.

The proxy asks :class:`PromptEstimator` and reserves ``PromptEstimate.total``. With an
exact tokenizer that is the node's own count; without one it is
:func:`~kvgateway.tokens.standin.upper_bound` of the stand-in's count, which the
measured vocabularies never exceed. A chat the model's template refuses (an unknown role,
a missing template) is counted by the stand-in's bound: the node will answer 400, and the
count only has to be safe.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from kvgateway.tokens.chat_template import TemplateError
from kvgateway.tokens.counting import PromptCounter, PromptTokens, plan_chat, plan_completion
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.spec import TokenizerConfig
from kvgateway.tokens.standin import BoundFactors, text_extra, upper_bound

log = logging.getLogger("kvgateway.tokens")


@dataclass(frozen=True, slots=True)
class PromptEstimate:
    """What to reserve for a request's prompts.

    ``total``/``longest``: the exact count, or the stand-in's upper bound. ``standin``: the
    stand-in's own count (what the gateway reserved before; for metrics), equal to
    ``total`` when exact (the stand-in is then not run). ``exact``: whether ``total`` is
    the node's count.
    """

    total: int
    longest: int
    prompts: int
    exact: bool
    standin: int
    encoded_chars: int = 0


class PromptEstimator:
    """Counts one model's requests; build one per model (it holds the model's caches)."""

    def __init__(
        self,
        config: TokenizerConfig,
        standin: PromptCounter,
        exact: ExactCounter | None = None,
        factors: BoundFactors | None = None,
    ) -> None:
        self._config = config
        self._standin = standin
        self._exact = exact
        self._factors = factors or BoundFactors(image_tokens=config.image_tokens)

    @property
    def exact(self) -> bool:
        return self._exact is not None

    @property
    def description(self) -> str:
        if self._exact is not None:
            return f"exact ({self._exact.name})"
        return f"stand-in upper bound ({self._standin.encoding_name})"

    async def chat(self, body: dict[str, Any]) -> PromptEstimate:
        """``body``: a chat request whose ``messages`` is a list of objects."""
        if self._exact is not None:
            try:
                counted = await self._exact.count_chat(body)
            except TemplateError as exc:
                log.info("chat template refused a request (the node will too): %s", exc)
            else:
                return _estimate(counted, exact=True, standin=counted.total)
        standin = await self._standin.count(plan_chat(body, self._config))
        bound = upper_bound(standin.total, body, self._factors)
        return PromptEstimate(
            total=bound,
            longest=bound,
            prompts=1,
            exact=False,
            standin=standin.total,
            encoded_chars=standin.encoded_chars,
        )

    async def completion(self, body: dict[str, Any]) -> PromptEstimate:
        """``body``: a completions request (``prompt`` a string, ids, or a batch)."""
        if self._exact is not None:
            counted = await self._exact.count_completion(body)
            return _estimate(counted, exact=True, standin=counted.total)
        plan, known = plan_completion(body["prompt"])
        standin = await self._standin.count(plan, known)
        extras = [text_extra(t, self._factors) for t in _prompt_texts(body["prompt"])]
        f = self._factors.text_factor
        # completion_upper_bound is f * count + extra(text) + 2 per prompt: linear, so a
        # batch's total is bounded by f * total + the sum of extras, and its longest by
        # f * longest + the largest extra. (Token-id prompts are known exactly; bounding
        # them too only over-reserves.)
        total = math.ceil(f * standin.total + sum(extras) + 2 * standin.prompts)
        longest = math.ceil(f * standin.longest + max(extras, default=0.0) + 2)
        return PromptEstimate(
            total=max(total, longest),
            longest=longest,
            prompts=standin.prompts,
            exact=False,
            standin=standin.total,
            encoded_chars=standin.encoded_chars,
        )


def _estimate(counted: PromptTokens, *, exact: bool, standin: int) -> PromptEstimate:
    return PromptEstimate(
        total=counted.total,
        longest=counted.longest,
        prompts=counted.prompts,
        exact=exact,
        standin=standin,
        encoded_chars=counted.encoded_chars,
    )


def _prompt_texts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return [p for p in prompt if isinstance(p, str)]
    return []
