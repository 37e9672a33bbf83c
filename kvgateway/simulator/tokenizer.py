"""The simulated node's own token counting.

A real node counts with the model's tokenizer and chat template. With ``tokenizer: DIR``
the simulated node does the same: it renders the model's chat template and tokenizes
with the ``tokenizers`` library, as vLLM does (never with tiktoken, so a gateway that
counts with tiktoken is checked against an independent implementation). Without it,
counting is configurable apart from the gateway's: another tiktoken encoding, or a
plain bytes-per-token ratio, scaled by ``tokenizer_scale``, plus a chat-template
overhead per message and per request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgateway.simulator.settings import NodeSettings
from kvgateway.tokens.chat_template import TemplateError
from kvgateway.tokens.encoding import Encoder, EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.plans import EncodingSpec

# Texts longer than this are tokenized in a worker thread so health probes and
# streams on the same loop keep flowing (tiktoken releases the GIL while encoding).
_THREAD_THRESHOLD_CHARS = 32_000

# Ids used for template tokens in /tokenize output (Llama 3 header/eot ids).
_TEMPLATE_ID = 128_006


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    text: str


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What vLLM's tokenizer wrapper derives from the vocabulary (``tokenizers/hf.py``):
    the largest id a prompt may hold (the model's vocab_size counts too) and the longest
    token's spelling, which bounds the characters ``max_model_len`` tokens can hold."""

    max_token_id: int
    max_chars_per_token: int


def load_vocabulary(directory: str) -> Vocabulary | None:
    """The vocabulary of ``directory``'s tokenizer.json (None without one)."""
    path = os.path.join(os.path.expanduser(directory), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    vocab = tok.get_vocab(with_added_tokens=True)
    largest = max(vocab.values())
    max_id = max(largest, tok.get_vocab_size(with_added_tokens=False) - 1)
    config = os.path.join(os.path.dirname(path), "config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            model_vocab = json.load(f).get("vocab_size")
        if isinstance(model_vocab, int):
            max_id = max(max_id, model_vocab - 1)
    return Vocabulary(max_id, max(len(t) for t in vocab))


class NodeTokenizer:
    def __init__(self, settings: NodeSettings, encodings: EncodingCache) -> None:
        self._bytes_per_token = settings.tokenizer_bytes_per_token
        self._scale = settings.tokenizer_scale
        self._per_message = settings.chat_overhead_per_message
        self._fixed = settings.chat_overhead_fixed
        self._encoder: Encoder | None = None
        self._directory = settings.tokenizer
        self.exact: ExactCounter | None = None
        if settings.tokenizer is not None:
            model = encodings.model(settings.tokenizer, engine="tokenizers")
            defaults = settings.default_chat_template_kwargs
            self.exact = ExactCounter(
                model, template_defaults=json.loads(defaults) if defaults else None
            )
        elif self._bytes_per_token is None:
            self._encoder = encodings.get(EncodingSpec(name=settings.tokenizer_encoding))

    @functools.cached_property
    def vocabulary(self) -> Vocabulary | None:
        """The model tokenizer's vocabulary; None when the node counts without one (its
        ids are then synthetic and nothing is checked against a vocabulary)."""
        return None if self._directory is None else load_vocabulary(self._directory)

    def rendered_chars(self, body: dict[str, Any]) -> int:
        """Characters of the chat prompt the template renders (TemplateError if it
        refuses); 0 without a model tokenizer."""
        return 0 if self.exact is None else len(self.exact.render_chat(body).text)

    def describe(self) -> str:
        if self.exact is not None:
            return f"{self.exact.name} with its chat template ({self.exact.tokenizer.path})"
        base = (
            f"{self._bytes_per_token:g} bytes/token"
            if self._bytes_per_token is not None
            else self._encoder.name
            if self._encoder is not None
            else "?"
        )
        return f"{base} x{self._scale:g}, +{self._per_message}/message +{self._fixed}/chat"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (synthetic ids when counting is by ratio or scaled)."""
        if self.exact is not None:
            return self.exact.tokenizer.engine.encode(text)
        if self._encoder is not None and self._scale == 1.0:
            return self._encoder.encode_ordinary(text)
        return list(range(1000, 1000 + self._count_text(text)))

    def decode(self, tokens: list[int]) -> str:
        """The text of ``tokens``: real BPE where ``encode`` is real, filler otherwise."""
        if self.exact is not None:
            try:
                return self.exact.tokenizer.engine.decode(tokens)
            except (OverflowError, TypeError, ValueError) as exc:
                raise ValueError(f"not tokens of {self.exact.name}: {exc}") from exc
        if self._encoder is not None and self._scale == 1.0:
            try:
                return self._encoder.decode(tokens)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"not a token of {self._encoder.name}: {exc}") from exc
        return " x" * len(tokens)

    def token_str(self, token: int) -> str:
        """transformers' convert_ids_to_tokens for one id (what /tokenize's token_strs holds)."""
        if self.exact is not None:
            spelled = self.exact.tokenizer.engine.token_str(token)
            if spelled is None:
                raise ValueError(f"token id {token} is not in the vocabulary")
            return spelled
        return self.decode([token])

    def _count_text(self, text: str) -> int:
        if not text:
            return 0
        if self.exact is not None:
            return len(self.exact.tokenizer.engine.encode(text))
        if self._encoder is not None:
            base = len(self._encoder.encode_ordinary(text))
        else:
            assert self._bytes_per_token is not None
            base = math.ceil(len(text.encode()) / self._bytes_per_token)
        return base if self._scale == 1.0 else max(1, round(base * self._scale))

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completions prompt's ids (with BOS as the model adds it, when exact)."""
        if self.exact is not None:
            return self.exact.tokenizer.encode_prompt(prompt)
        return self.encode(prompt)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        if self.exact is not None:
            body = {"messages": [{"role": m.role, "content": m.text} for m in messages]}
            return self.exact.prompt_ids(body)
        # Laid out as vLLM renders a Llama-3-style template: the fixed part (BOS and the
        # first header) first, then each message's text followed by its share of the
        # template (its end-of-turn and the next header; after the last message, the
        # assistant's header, i.e. the generation prompt). So a prompt ends where the
        # answer begins and the next turn repeats prompt + answer: the blocks the
        # answer's generation cached are hit, as on a vLLM node.
        ids: list[int] = [_TEMPLATE_ID] * self._fixed
        for message in messages:
            ids.extend(self.encode(message.text))
            ids.extend([_TEMPLATE_ID] * self._per_message)
        return ids

    def count_prompt(self, prompt: str) -> int:
        if self.exact is not None:
            return len(self.encode_prompt(prompt))
        return self._count_text(prompt)

    def count_chat(self, messages: Sequence[ChatMessage]) -> int:
        if self.exact is not None:
            return len(self.encode_chat(messages))
        return self._fixed + sum(self._per_message + self._count_text(m.text) for m in messages)

    async def count_prompt_async(self, prompt: str) -> int:
        if len(prompt) < _THREAD_THRESHOLD_CHARS:
            return self.count_prompt(prompt)
        return await asyncio.to_thread(self.count_prompt, prompt)

    # -- whole requests (the model's template, tools, kwargs... when the node has one) --

    def check_request_template(self, body: dict[str, Any]) -> None:
        """vLLM refuses a request's own chat template unless started with
        --trust-request-chat-template (the simulator never is)."""
        kwargs = body.get("chat_template_kwargs")
        if self.exact is not None and (
            body.get("chat_template") is not None
            or (isinstance(kwargs, dict) and "chat_template" in kwargs)
        ):
            raise TemplateError(
                "Chat template is passed with request, but --trust-request-chat-template "
                "is not set. Refused request with untrusted chat template."
            )

    def encode_chat_request(
        self, body: dict[str, Any], messages: Sequence[ChatMessage]
    ) -> list[int]:
        """Prompt ids of a chat request: the whole prompt encoded at once, no cache (what
        vLLM does, and independent of the gateway's piecewise counting); TemplateError
        when the template refuses it."""
        if self.exact is not None:
            self.check_request_template(body)
            return self.exact.prompt_ids(body)
        return self.encode_chat(messages)

    def encode_completion_request(self, body: dict[str, Any], prompt: str) -> list[int]:
        if self.exact is not None:
            add = body.get("add_special_tokens")
            return self.exact.tokenizer.encode_prompt(
                prompt, add_special_tokens=add if isinstance(add, bool) else True
            )
        return self.encode_prompt(prompt)

    async def encode_chat_request_async(
        self, body: dict[str, Any], messages: Sequence[ChatMessage]
    ) -> list[int]:
        if sum(len(m.text) for m in messages) < _THREAD_THRESHOLD_CHARS:
            return self.encode_chat_request(body, messages)
        return await asyncio.to_thread(self.encode_chat_request, body, messages)

    async def encode_completion_request_async(self, body: dict[str, Any], prompt: str) -> list[int]:
        if len(prompt) < _THREAD_THRESHOLD_CHARS:
            return self.encode_completion_request(body, prompt)
        return await asyncio.to_thread(self.encode_completion_request, body, prompt)


__all__ = ["ChatMessage", "NodeTokenizer", "TemplateError"]
