"""The simulated node's own token counting.

A real node counts with the model's tokenizer and chat template, which the gateway can
only estimate. To test estimation error the node's counting is configurable apart from
the gateway's: another tiktoken encoding, or a plain bytes-per-token ratio, scaled by
``tokenizer_scale``, plus a chat-template overhead per message and per request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgateway.simulator.settings import NodeSettings
from kvgateway.tokens.encoding import Encoder, EncodingCache, EncodingSpec

# Texts longer than this are tokenized in a worker thread so health probes and
# streams on the same loop keep flowing (tiktoken releases the GIL while encoding).
_THREAD_THRESHOLD_CHARS = 32_000

# Ids used for template tokens in /tokenize output (Llama 3 header/eot ids).
_TEMPLATE_ID = 128_006


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    text: str


class NodeTokenizer:
    def __init__(self, settings: NodeSettings, encodings: EncodingCache) -> None:
        self._bytes_per_token = settings.tokenizer_bytes_per_token
        self._scale = settings.tokenizer_scale
        self._per_message = settings.chat_overhead_per_message
        self._fixed = settings.chat_overhead_fixed
        self._encoder: Encoder | None = None
        if self._bytes_per_token is None:
            self._encoder = encodings.get(EncodingSpec(name=settings.tokenizer_encoding))

    def describe(self) -> str:
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
        if self._encoder is not None and self._scale == 1.0:
            return self._encoder.encode_ordinary(text)
        return list(range(1000, 1000 + self._count_text(text)))

    def decode(self, tokens: list[int]) -> str:
        """The text of ``tokens``: real BPE where ``encode`` is real, filler otherwise."""
        if self._encoder is not None and self._scale == 1.0:
            try:
                return self._encoder.decode(tokens)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"not a token of {self._encoder.name}: {exc}") from exc
        return " x" * len(tokens)

    def _count_text(self, text: str) -> int:
        if not text:
            return 0
        if self._encoder is not None:
            base = len(self._encoder.encode_ordinary(text))
        else:
            assert self._bytes_per_token is not None
            base = math.ceil(len(text.encode()) / self._bytes_per_token)
        return base if self._scale == 1.0 else max(1, round(base * self._scale))

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.encode(prompt)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        ids: list[int] = [_TEMPLATE_ID] * self._fixed
        for message in messages:
            ids.extend([_TEMPLATE_ID] * self._per_message)
            ids.extend(self.encode(message.text))
        return ids

    def count_prompt(self, prompt: str) -> int:
        return self._count_text(prompt)

    def count_chat(self, messages: Sequence[ChatMessage]) -> int:
        return self._fixed + sum(self._per_message + self._count_text(m.text) for m in messages)

    async def count_prompt_async(self, prompt: str) -> int:
        if len(prompt) < _THREAD_THRESHOLD_CHARS:
            return self.count_prompt(prompt)
        return await asyncio.to_thread(self.count_prompt, prompt)

    async def count_chat_async(self, messages: Sequence[ChatMessage]) -> int:
        if sum(len(m.text) for m in messages) < _THREAD_THRESHOLD_CHARS:
            return self.count_chat(messages)
        return await asyncio.to_thread(self.count_chat, messages)

    async def encode_prompt_async(self, prompt: str) -> list[int]:
        if len(prompt) < _THREAD_THRESHOLD_CHARS:
            return self.encode_prompt(prompt)
        return await asyncio.to_thread(self.encode_prompt, prompt)

    async def encode_chat_async(self, messages: Sequence[ChatMessage]) -> list[int]:
        if sum(len(m.text) for m in messages) < _THREAD_THRESHOLD_CHARS:
            return self.encode_chat(messages)
        return await asyncio.to_thread(self.encode_chat, messages)
