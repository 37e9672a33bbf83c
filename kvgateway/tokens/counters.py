"""One :class:`PromptCounter` per encoding, sharing the worker pool for big prompts."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvgateway.tokens.counting import PromptCounter, TextCountCache
from kvgateway.tokens.encoding import EncodingCache, EncodingSpec
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.prompt_estimate import PromptEstimator
from kvgateway.tokens.prompt_ids import PromptIds
from kvgateway.tokens.spec import TokenizerConfig


@dataclass(slots=True)
class TokenCounters:
    """Built with its worker pool (prompts above ``inline_chars`` are counted there, off
    the event loop); counters are made on first use per encoding and kept."""

    encodings: EncodingCache
    executor: Executor
    # Where prompts above HUGE_CHARS are counted (one thread: they queue behind each other,
    # not in front of everyone else's).
    huge_executor: Executor | None = None
    cache_chars: int = 32 * 1024 * 1024
    inline_chars: int = 24_000
    _by_spec: dict[EncodingSpec, PromptCounter] = field(default_factory=dict)
    _estimators: dict[tuple[TokenizerConfig, int], PromptEstimator] = field(default_factory=dict)
    _ids_by_spec: dict[EncodingSpec, PromptIds] = field(default_factory=dict)

    def ids_for(self, tokenizer: TokenizerConfig) -> PromptIds:
        """Token ids of prompts (prefix-aware routing keys blocks with them)."""
        spec = tokenizer.encoding
        ids = self._ids_by_spec.get(spec)
        if ids is None:
            ids = self._ids_by_spec[spec] = PromptIds(self.encodings.get(spec))
        return ids

    def for_tokenizer(self, tokenizer: TokenizerConfig) -> PromptCounter:
        spec = tokenizer.encoding
        counter = self._by_spec.get(spec)
        if counter is None:
            counter = PromptCounter(
                self.encodings.get(spec),
                TextCountCache(self.cache_chars),
                self.executor,
                inline_chars=self.inline_chars,
                chunked=spec.chunk_safe,
                huge_executor=self.huge_executor,
                known=self.ids_for(tokenizer).known_count,
            )
            self._by_spec[spec] = counter
        return counter

    def estimator_for(self, tokenizer: TokenizerConfig) -> PromptEstimator:
        """What admission reserves for a model: its exact count when the config gave its
        tokenizer directory (``tokenizer.path``), else the stand-in's upper bound. Kept
        per config (a reload that loads the directory anew gets a fresh one)."""
        key = (tokenizer, id(tokenizer.model))
        estimator = self._estimators.get(key)
        if estimator is None:
            exact = ExactCounter.for_model(
                tokenizer,
                TextCountCache(self.cache_chars),
                self.executor,
            )
            estimator = PromptEstimator(
                tokenizer, self.for_tokenizer(tokenizer), exact, executor=self.executor
            )
            self._estimators[key] = estimator
        return estimator
