"""One model's prompt count for admission: exact when the gateway has the model's
tokenizer, otherwise the stand-in's per-request upper bound.

The proxy asks :class:`PromptEstimator` and reserves ``PromptEstimate.total``. With an
exact tokenizer that is the node's own count; without one it is
:func:`~kvgateway.tokens.standin.upper_bound` of the stand-in's count, which the
measured vocabularies never exceed. A chat the model's template refuses (an unknown role,
a missing template) is counted by the stand-in's bound: the node will answer 400, and the
count only has to be safe.

Calibration (:class:`PromptCalibration`): how the nodes' own prompt counts relate to the
gateway's count.

Fed with each response's ``usage.prompt_tokens`` next to the gateway's count, per backend
and model; read when a request is admitted, to bound its prompt. A node's count is, to a
good approximation, ``fixed + ratio * counted``: its chat template adds a fixed block (a
default system prompt, role headers) and its tokenizer splits text differently by a
roughly constant factor. The two are learned apart, so a template's 30 fixed tokens on
tiny chats are not read as a 4x ratio (which would then double every long prompt's
reservation and refuse prompts the node serves):

- ``fixed`` from small prompts (below :data:`SMALL` counted tokens), where the overhead
  dominates: an EWMA of ``reported - ratio * counted``;
- ``ratio`` from larger prompts only, on the tokens above the fixed overhead: the median
  of the last :data:`WINDOW` prompts' ratios, once :data:`MIN_RATIO_SAMPLES` were seen
  (1.0 before). The ratio differs by content, not only by node (digit runs cost a
  Qwen node 2.5x what cl100k counts, English prose 1.05x): a median is what most prompts
  see, and one digit-heavy chat does not scale every English prompt after it past the
  context. What a prompt unlike most costs is not predicted: near a limit the node is
  asked (planning and :mod:`kvgateway.upstream.node_tokenize`).

Each observation is clamped before it is used, so one odd answer moves either only so
far. Reads never go below the gateway's own count.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from kvgateway.tokens.chat_template import TemplateError
from kvgateway.tokens.counting import PromptCounter, PromptTokens
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.plans import TokenizerConfig, plan_chat, plan_completion
from kvgateway.tokens.standin import (
    BoundFactors,
    ExtraCache,
    completion_overcount,
    completion_upper_bound,
    overcount,
    upper_bound,
)

log = logging.getLogger("kvgateway.tokens")

# Stand-in counts above which the bound's character scan leaves the event loop.
INLINE_BOUND_TOKENS = 6_000


@dataclass(frozen=True, slots=True)
class PromptEstimate:
    """What to reserve for a request's prompts; reads like
    :class:`~kvgateway.tokens.counting.PromptTokens` (``total``, ``longest``, ``prompts``,
    ``each``, ``encoded_chars``).

    The counts are the node's exact counts, or the stand-in's upper bounds. ``standin``:
    the stand-in's own total (what the gateway reserved before; for metrics), equal to
    ``total`` when exact (the stand-in is then not run). ``exact``: whether the counts
    are the node's.
    """

    total: int
    longest: int
    prompts: int
    exact: bool
    standin: int
    encoded_chars: int = 0
    each: tuple[int, ...] = ()
    # A count the node's will not be below (the total when exact): a stand-in count
    # divided by how far the stand-in may overcount this content (standin.overcount).
    floor: int = 0
    # Cut to the request's truncate_prompt_tokens: the node's count says nothing of how
    # the stand-in counts (no calibration from it).
    truncated: bool = False
    # A bound that is not the stand-in's (the model's count with media of unknown size):
    # no calibration from it either.
    uncalibrated: bool = False


class PromptEstimator:
    """Counts one model's requests; build one per model (it holds the model's caches)."""

    def __init__(
        self,
        config: TokenizerConfig,
        standin: PromptCounter,
        exact: ExactCounter | None = None,
        factors: BoundFactors | None = None,
        executor: Executor | None = None,
        *,
        inline_tokens: int = INLINE_BOUND_TOKENS,
    ) -> None:
        self._config = config
        self._standin = standin
        self._exact = exact
        self._factors = factors or BoundFactors(image_tokens=config.image_tokens)
        self._extra = ExtraCache(self._factors)
        self._executor = executor
        self._inline_tokens = inline_tokens

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def exact_chat_ids(self, body: dict[str, Any]) -> tuple[list[int], PromptEstimate] | None:
        """The node's own prompt ids of a chat request (its template and tokenizer), for
        keying its KV blocks, and the count they make; None without the model's
        tokenizer, or when the template refuses the chat (counting falls back then; the
        node answers it)."""
        if self._exact is None:
            return None
        try:
            ids, counted = self._exact.counted_ids(body)
        except TemplateError:
            return None
        return ids, _exact(counted)

    def exact_completion_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The node's own ids of a completions request's single prompt; None without the
        model's tokenizer, or for a batch."""
        return self._exact.completion_ids(body) if self._exact is not None else None

    @property
    def description(self) -> str:
        if self._exact is not None:
            return f"exact ({self._exact.name})"
        return f"stand-in upper bound ({self._standin.encoding_name})"

    async def chat(self, body: dict[str, Any], limit: int | None = None) -> PromptEstimate:
        """``body``: a chat request whose ``messages`` is a list of objects. ``limit``:
        the largest context; counting may stop once the prompt is certainly past it (the
        stand-in's count past ``limit`` times how far it may overcount this content; see
        PromptCounter.count)."""
        if self._exact is not None:
            try:
                counted = await self._exact.count_chat(body)
            except TemplateError as exc:
                log.info("chat template refused a request (the node will too): %s", exc)
            else:
                return _exact(counted)
        # How far the stand-in may overcount this content: where counting may stop, and
        # the least the node may count (below the stand-in's count for CJK text...).
        factor = overcount(body)
        stop = None if limit is None else math.ceil(limit * factor)
        standin = await self._standin.count(plan_chat(body, self._config), (), stop)
        if not self._config.upper_bound or _past(standin, stop):
            return _as_counted(standin, floor=math.floor(standin.longest / factor))
        bound = await self._bound(standin.total, body)
        return PromptEstimate(
            total=bound,
            longest=bound,
            prompts=1,
            exact=False,
            standin=standin.total,
            encoded_chars=standin.encoded_chars,
            each=(bound,),
            floor=math.floor(standin.total / factor),
        )

    async def _bound(self, standin: int, body: dict[str, Any]) -> int:
        """upper_bound of a chat; a big prompt's scan (regexes over every character, ~5 ms
        per 100k characters) in the executor, without the loop-only cache."""
        if standin > self._inline_tokens and self._executor is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._executor, upper_bound, standin, body, self._factors
            )
        return upper_bound(standin, body, self._factors, self._extra)

    async def completion(self, body: dict[str, Any], limit: int | None = None) -> PromptEstimate:
        """``body``: a completions request (``prompt`` a string, ids, or a batch)."""
        if self._exact is not None:
            return _exact(await self._exact.count_completion(body))
        plan, known = plan_completion(body["prompt"])
        prompts = _prompts(body["prompt"])
        factor = completion_overcount(prompts)
        stop = None if limit is None else math.ceil(limit * factor)
        # Counting stops on the batch's total: past n prompts' worth, one of them is past
        # the limit (a total past one prompt's worth refused batches whose every prompt
        # fits).
        batch_stop = None if stop is None else stop * max(1, len(prompts))
        standin = await self._standin.count(plan, known, batch_stop)
        if not self._config.upper_bound or _past(standin, stop):
            return _as_counted(standin, floor=math.floor(standin.longest / factor))
        counts = standin.each or (standin.total,)
        if standin.total > self._inline_tokens and self._executor is not None:
            loop = asyncio.get_running_loop()
            each = await loop.run_in_executor(
                self._executor, _completion_bounds, counts, prompts, standin.total, self._factors
            )
        else:
            each = _completion_bounds(counts, prompts, standin.total, self._factors)
        return PromptEstimate(
            total=sum(each),
            longest=max(each),
            prompts=standin.prompts,
            exact=False,
            standin=standin.total,
            encoded_chars=standin.encoded_chars,
            each=each,
            floor=math.floor(standin.longest / factor),
        )


def _completion_bounds(
    counts: tuple[int, ...], prompts: list[Any], total: int, factors: BoundFactors
) -> tuple[int, ...]:
    if len(counts) == len(prompts):
        # Each text prompt bounded on its own; token-id prompts are known exactly.
        return tuple(
            completion_upper_bound(n, p, factors) if isinstance(p, str) else n
            for n, p in zip(counts, prompts, strict=True)
        )
    # Counting stopped early: one bound over everything.
    text = "".join(p for p in prompts if isinstance(p, str))
    return (completion_upper_bound(total, text, factors),)


def _past(standin: PromptTokens, limit: int | None) -> bool:
    """The stand-in's count is past the largest context even allowing for its overcount:
    the request is refused whatever the bound says, so the bound (a scan of every
    character) is not computed."""
    return limit is not None and standin.longest > limit


def _as_counted(
    counted: PromptTokens, *, exact: bool = False, floor: int | None = None
) -> PromptEstimate:
    """A count taken as it is: the model's own (``exact``), or the stand-in's
    (``tokenizer.upper_bound: false``, or past the limit anyway; ``floor``: the least
    the node may count, the stand-in's count less what it may overcount)."""
    return PromptEstimate(
        total=counted.total,
        longest=counted.longest,
        prompts=counted.prompts,
        exact=exact,
        standin=counted.total,
        encoded_chars=counted.encoded_chars,
        each=counted.each or (counted.total,),
        floor=counted.longest if floor is None else floor,
    )


def _exact(counted: PromptTokens) -> PromptEstimate:
    if counted.floor is not None:
        # A bound, not a count (an image of unknown size at its largest): reserved as
        # counted, but the node's count decides near a limit (its /tokenize, or its
        # context-length 400), and nothing is calibrated from it.
        return replace(
            _as_counted(counted, exact=False),
            standin=0,
            floor=counted.floor,
            uncalibrated=True,
        )
    return _as_counted(counted, exact=True)


def _prompts(prompt: Any) -> list[Any]:
    """The prompts of a completions ``prompt`` in plan_completion's order."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt) if isinstance(prompt, list) else []


MAX_RATIO = 4.0
MAX_FIXED = 4096.0
SMALL = 256  # counted tokens below which a prompt teaches the fixed overhead
WINDOW = 31  # large prompts whose ratios the median is taken over
MIN_RATIO_SAMPLES = 3  # large prompts seen before their median is used
FIXED_ALPHA = 0.2


@dataclass(slots=True)
class _Fit:
    fixed: float = 0.0
    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    samples: int = 0  # reports seen
    # The ratios' median once MIN_RATIO_SAMPLES are seen (1.0 before), kept as they
    # change: every request reads every fit of its model.
    ratio: float = 1.0

    def add(self, counted: int, reported: int) -> None:
        self.samples += 1
        if counted < SMALL:
            sample = min(max(reported - self.ratio * counted, 0.0), MAX_FIXED)
            self.fixed += FIXED_ALPHA * (sample - self.fixed)
            return
        r = (reported - self.fixed) / counted
        self.ratios.append(min(max(r, 1.0 / MAX_RATIO), MAX_RATIO))
        if len(self.ratios) >= MIN_RATIO_SAMPLES:
            self.ratio = statistics.median(self.ratios)


class PromptCalibration:
    def __init__(self, observe: Callable[[str, float], None] | None = None) -> None:
        # By model, then backend: a request reads its model's fits only.
        self._fits: dict[str, dict[str, _Fit]] = {}
        # By model: the reports its fits saw (kept, not summed per request).
        self._samples: dict[str, int] = {}
        self._observe = observe

    def _model_fits(self, model: str) -> Iterable[_Fit]:
        return self._fits.get(model, {}).values()

    def backends(self) -> set[str]:
        """The backends with a fit (any model)."""
        return {name for fits in self._fits.values() for name in fits}

    def keep_backends(self, present: set[str]) -> None:
        """Forget the fits of backends gone from the fleet: DNS members come and go as
        new names, and every request reads its model's fits (and a gone node's ratio
        would bound every prompt for good)."""
        for model, fits in list(self._fits.items()):
            for name in [n for n in fits if n not in present]:
                self._samples[model] -= fits.pop(name).samples
            if not fits:
                del self._fits[model]
                del self._samples[model]

    def ratio(self, model: str) -> float:
        """The largest learned tokenizer ratio among ``model``'s backends (1.0 unknown)."""
        return max((f.ratio for f in self._model_fits(model)), default=1.0)

    def fixed(self, model: str) -> float:
        """The largest learned fixed template overhead among ``model``'s backends."""
        return max((f.fixed for f in self._model_fits(model)), default=0.0)

    def scaled(self, model: str, counted: int, margin: float) -> int:
        """A bound on what ``model``'s backends will count for a prompt the gateway
        counted as ``counted``: the configured margin, then the largest prediction of any
        backend's fit (the backend is not chosen yet)."""
        base = counted * (1.0 + margin)
        predicted = max(
            (f.fixed + max(1.0, f.ratio) * base for f in self._model_fits(model)), default=base
        )
        return math.ceil(max(base, predicted) - 1e-9)

    def learned(self, model: str, counted: int, margin: float, min_samples: int) -> int | None:
        """What ``model``'s backends are predicted to count for a prompt the stand-in
        counted as ``counted`` (:meth:`scaled`), once they reported ``min_samples``
        prompts; None before. No worst-case vocabulary bound: for reservations that
        trade the guarantee for capacity (``output_reservation: learned``)."""
        if self._samples.get(model, 0) < min_samples:
            return None
        return self.scaled(model, counted, margin)

    def observe(self, backend: str, model: str, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        if self._observe is not None:
            self._observe(model, reported / estimated)
        self._fits.setdefault(model, {}).setdefault(backend, _Fit()).add(estimated, reported)
        self._samples[model] = self._samples.get(model, 0) + 1
