"""One :class:`PromptCounter` per encoding, sharing the worker pool for big prompts, and
a prompt's token ids for keying its KV blocks (prefix-aware routing).

Counting (:mod:`.counting`) needs only lengths; prefix-aware routing needs the ids
themselves, in prompt order, so that two requests sharing a history share their leading
block keys. The chat template is not known exactly: each message is laid out as
``per_message_tokens + 1`` template ids, then its text's ids, and the reply priming
goes last, as real templates put it. The layout only has to be stable (a follow-up turn
repeats its history's ids); matching a node's own ids (precise mode, KV events) needs
the node's tokenizer and template, which completions prompts given as text or ids have.

Encoded texts are kept in a small LRU (a chat's history comes back every turn), behind a
lock: long prompts are encoded in the counting pool's threads. Counting reads the LRU
first (:meth:`PromptIds.known_count`), so a prompt encoded for routing is not encoded
again.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from kvgateway.tokens.counting import PromptCounter, TextCache, TextCountCache
from kvgateway.tokens.encoding import Encoder, EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.plans import CountPlan, EncodingSpec, TokenizerConfig, content_text
from kvgateway.tokens.prompt_estimate import PromptEstimator

# Stand-in ids for template tokens and images: outside every common vocabulary's text.
TEMPLATE_ID = -1
IMAGE_ID = -2


class PromptIds:
    """Token ids of prompts in one encoding, with an LRU of encoded texts."""

    def __init__(self, encoder: Encoder, max_ids: int = 4_000_000) -> None:
        self._encoder = encoder
        self._max_ids = max_ids
        self._held = 0
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def text(self, text: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                return ids
        ids = tuple(self._encoder.encode_ordinary(text))
        with self._lock:
            if len(ids) * 4 > self._max_ids or text in self._cache:
                return ids
            self._cache[text] = ids
            self._held += len(ids)
            while self._held > self._max_ids:
                _, old = self._cache.popitem(last=False)
                self._held -= len(old)
        return ids

    def known_count(self, text: str) -> int | None:
        """Tokens of ``text`` if its ids are held (encoded for routing): counting then
        encodes nothing again."""
        with self._lock:
            ids = self._cache.get(text)
        return None if ids is None else len(ids)

    def chat(self, body: dict[str, Any], cfg: TokenizerConfig) -> list[int]:
        """Ids of a chat request (``messages`` already validated as a list of dicts)."""
        out: list[int] = []
        for msg in body["messages"]:
            out.extend([TEMPLATE_ID] * (cfg.per_message_tokens + 1))
            part = CountPlan()
            part.new_group()
            content_text(part, msg.get("content"), cfg)
            name = msg.get("name")
            if isinstance(name, str):
                part.add_text(name)
            for piece in part.pieces:
                out.extend(self.text(piece))
            out.extend([IMAGE_ID] * part.fixed[0])
            calls = msg.get("tool_calls")
            if isinstance(calls, list) and calls:
                out.extend(self.text(json.dumps(calls, separators=(",", ":"), sort_keys=True)))
        for key in ("tools", "functions"):
            schemas = body.get(key)
            if isinstance(schemas, list) and schemas:
                out.extend(self.text(json.dumps(schemas, separators=(",", ":"), sort_keys=True)))
        out.extend([TEMPLATE_ID] * cfg.reply_priming_tokens)
        return out

    def completion(self, prompt: Any) -> list[int] | None:
        """Ids of a single completions prompt (text or ids); None for a batch."""
        if isinstance(prompt, str):
            return list(self.text(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.completion(prompt[0])
        return None


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
                TextCache(self.cache_chars),
                self.executor,
            )
            estimator = PromptEstimator(
                tokenizer, self.for_tokenizer(tokenizer), exact, executor=self.executor
            )
            self._estimators[key] = estimator
        return estimator
