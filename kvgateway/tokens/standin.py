"""A per-request upper bound on the node's count when the gateway only has a stand-in.

Without the model's tokenizer the gateway counts with cl100k and per-message
allowances (:mod:`.counting`). That count is an estimate; admission needs a number the
node's count will not exceed. Measured against real vocabularies (Qwen 2/2.5/3, Llama
3, Mistral Tekken and SentencePiece) with their chat templates, a stand-in undercounts

- digit runs: cl100k takes up to 3 digits per token, Qwen/Mistral/SentencePiece one;
- non-ASCII text: SentencePiece vocabularies fall back to one token per UTF-8 byte for
  characters they lack (rare CJK, emoji), where cl100k often has one token;
- white space: SentencePiece has no tokens for tabs, carriage returns and line breaks
  (one byte token each) where cl100k joins "\n\n" or "\n    " into one, and its
  longest run of spaces is 16 where cl100k's is far longer (5,000 line breaks: cl100k
  157 tokens, Mistral's SentencePiece 5,001, Tekken 1,250);
- everything else by a few percent to ~30% (code and JSON punctuation on small
  vocabularies);
- the template: a default system block (Llama 3.1: ~25 tokens, Qwen: ~20), role headers
  per message, and tool schemas rendered pretty-printed (2-2.5x their compact JSON).

:func:`upper_bound` adds each of those, so that it stays at or above every measured
vocabulary's count (tested on a generated corpus) while a plain English request is
bounded within ~35% + a fixed allowance. The bound is for admission; the proxy still
learns the node's true count from its usage report or its context-length 400.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvgateway.tokens.plans import (
    call_texts,
    is_image,
    json_text,
    message_extras,
    part_text,
    rendered_texts,
    request_extras,
)

# The other way round: how many times the node's count the stand-in's may be, so that a
# prompt whose stand-in count is past a context is not refused unasked. ASCII text: about
# the same (Llama 3's vocabulary holds cl100k's; the others count ASCII text higher);
# other scripts far more (Arabic: cl100k 3.6x Tekken's count, Thai 2.9x Llama 3's,
# Cyrillic 2.5x Qwen's, emoji 2.7x Qwen's, CJK 2.1x Qwen's).
ASCII_OVERCOUNT = 1.1
MAX_OVERCOUNT = 4.0
# SentencePiece's longest run of "▁" is 16 spaces.
_SIXTEEN_SPACES = b" " * 16


@dataclass(frozen=True, slots=True)
class BoundFactors:
    """How far a worst-case vocabulary may exceed the stand-in; see the module doc."""

    # Any text: worst measured vocabulary / cl100k on prose and code, plus headroom.
    text_factor: float = 1.25
    # Per ASCII punctuation character: JSON and code on 32k SentencePiece vocabularies.
    punct_extra: float = 0.12
    # Per non-ASCII character by its UTF-8 length (2, 3, 4 bytes): SentencePiece falls
    # back to one token per byte where cl100k has a token for a whole character.
    # (3 bytes: symbols such as U+2028 or U+3000, rare CJK and Hangul between spaces;
    # 4 bytes: emoji, which Tekken spends up to 4 tokens on where cl100k spends 2.)
    non_ascii_extra: tuple[float, float, float] = (1.0, 0.75, 2.0)
    # Template tokens: once per request (default system block, generation prompt) and
    # per message (role header and end marker).
    fixed: int = 40
    per_message: int = 10
    # Per tab, carriage return, and line break followed by white space; per 16 spaces of
    # a longer run (see _space_extra).
    space_extra: float = 1.0
    # Tool schemas: rendered pretty-printed and wrapped in instructions.
    tool_factor: float = 2.6
    per_tool: int = 24
    image_tokens: int = 765


_PUNCT = re.compile(r"""[!-/:-@\[-`{-~]""")


# Each byte of a text's UTF-8 by class, so that counting is done in C, not per character:
# "d" an ASCII digit, "p" ASCII punctuation (as _PUNCT), "2"/"3"/"4" the lead byte of a
# 2/3/4-byte character, " " anything else.
_CLASSES = bytes(
    ord("d")
    if 0x30 <= b <= 0x39
    else ord("p")
    if _PUNCT.match(chr(b))
    else ord("2")
    if 0xC0 <= b <= 0xDF
    else ord("3")
    if 0xE0 <= b <= 0xEF
    else ord("4")
    if b >= 0xF0
    else ord(" ")
    for b in range(256)
)
_ONLY_DIGITS = bytes(ord("d") if b == ord("d") else ord(" ") for b in range(256))


def _space_extra(raw: bytes) -> int:
    """Tokens a byte-fallback vocabulary spends on white space that cl100k merges: every
    tab and carriage return, every line break followed by white space, and one per 16
    spaces of a run beyond the first 16 (measured on Mistral's SentencePiece: "a" + 32
    spaces + "b" is 4 tokens, cl100k 3). ``raw``: the text's UTF-8, where ASCII bytes
    stand for themselves and are searched several times faster than in a str."""
    extra = raw.count(b"\t") + raw.count(b"\r")
    if b"\n" in raw:
        # Line breaks followed by white space: a run of k breaks holds k // 2
        # non-overlapping "\n\n", and 2 * (k // 2) >= k - 1.
        extra += (
            2 * raw.count(b"\n\n") + raw.count(b"\n ") + raw.count(b"\n\t") + raw.count(b"\n\r")
        )
    # A run of k spaces holds k // 16 non-overlapping 16-space strings, >= (k - 1) // 16
    # (a regex for the runs held the GIL ~10 ms per 400k characters, stalling the event
    # loop even from a worker thread).
    return extra + raw.count(_SIXTEEN_SPACES)


def text_extra(text: str, factors: BoundFactors = BoundFactors()) -> float:
    """Tokens a worst-case vocabulary may add to ``text`` beyond ``text_factor``."""
    raw = text.encode("utf-8", "surrogatepass")
    classes = raw.translate(_CLASSES)
    extra: float = factors.punct_extra * classes.count(b"p")
    extra += factors.space_extra * _space_extra(raw)
    if b"d" in classes:
        # Runs of ASCII digits (another script's digits are non-ASCII characters below,
        # whose extra, >= 0.75, is above a digit's at most 2/3).
        for run in classes.translate(_ONLY_DIGITS).split():
            extra += len(run) - (len(run) + 2) // 3
    if not text.isascii():  # O(1) in CPython
        two, three, four = factors.non_ascii_extra
        extra += (
            two * classes.count(b"2") + three * classes.count(b"3") + four * classes.count(b"4")
        )
    return extra


class ExtraCache:
    """``text_extra`` of texts seen before (a chat's history comes back every turn),
    bounded by the characters it holds. Only the event loop's thread touches it."""

    MIN_CHARS = 256

    def __init__(self, factors: BoundFactors, max_chars: int = 8 * 1024 * 1024) -> None:
        self._factors = factors
        self._max = max_chars
        self._held = 0
        self._cache: OrderedDict[str, float] = OrderedDict()

    def __call__(self, text: str, factors: BoundFactors | None = None) -> float:
        if len(text) < self.MIN_CHARS:
            return text_extra(text, self._factors)
        got = self._cache.get(text)
        if got is not None:
            self._cache.move_to_end(text)
            return got
        got = text_extra(text, self._factors)
        self._cache[text] = got
        self._held += len(text)
        while self._held > self._max and self._cache:
            old, _ = self._cache.popitem(last=False)
            self._held -= len(old)
        return got


def _texts(body: dict[str, Any]) -> Iterator[str]:
    """Every text of a chat request the node's template may render (as :func:`plan_chat`
    counts them), tool schemas apart."""
    for msg in body.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                text = part_text(part)
                if text is not None:
                    yield text
                elif isinstance(part, dict) and not is_image(part):
                    yield json_text(part)
        yield from rendered_texts(msg.get("name"))
        yield from call_texts(msg)
        yield from message_extras(msg)
    yield from request_extras(body)


def overcount(body: dict[str, Any]) -> float:
    """How many times the node's count of a chat request the stand-in's count may be."""
    tools = body.get("tools")
    # The stand-in counts a schema with \\u escapes for non-ASCII; the template prints the text.
    if isinstance(tools, list) and tools and not json.dumps(tools, ensure_ascii=False).isascii():
        return MAX_OVERCOUNT
    if all(t.isascii() for t in _texts(body)):  # O(1) per string in CPython
        return ASCII_OVERCOUNT
    return MAX_OVERCOUNT


def completion_overcount(prompts: Iterable[Any]) -> float:
    """:func:`overcount` of a completions request's prompts (token ids count exactly)."""
    if all(not isinstance(p, str) or p.isascii() for p in prompts):
        return ASCII_OVERCOUNT
    return MAX_OVERCOUNT


def _media(body: dict[str, Any]) -> tuple[int, int]:
    """Media parts, and how many of them the stand-in already charged as images."""
    media = images = 0
    for msg in body.get("messages") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for p in content:
                if isinstance(p, dict) and part_text(p) is None:
                    media += 1
                    images += is_image(p)
    return media, images


def upper_bound(
    standin_tokens: int,
    body: dict[str, Any],
    factors: BoundFactors = BoundFactors(),
    extra_of: Callable[[str, BoundFactors], float] = text_extra,
) -> int:
    """Bound on the node's prompt tokens for a chat request the stand-in counted as
    ``standin_tokens`` (its own count, template allowances and image costs included).
    ``extra_of``: :func:`text_extra`, or an :class:`ExtraCache` of it."""
    messages = body.get("messages") or []
    media, images = _media(body)
    # Images cost the node image_tokens each, as the stand-in charged them: only the text
    # is scaled (scaling images too once bounded an image-only chat at 2.2x the node).
    text_tokens = max(0, standin_tokens - factors.image_tokens * images)
    extra = sum(extra_of(t, factors) for t in _texts(body))
    tools = body.get("tools")
    tool_tokens = 0.0
    if isinstance(tools, list) and tools:
        schema = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
        # The stand-in counted the compact schema once (in standin_tokens); the bound
        # adds what pretty-printing and instructions cost on top.
        tool_tokens = (factors.tool_factor - 1.0) * len(schema) / 3.0 + factors.per_tool * len(
            tools
        )
        extra += text_extra(schema, factors)
    return math.ceil(
        factors.text_factor * text_tokens
        + extra
        + tool_tokens
        + factors.fixed
        + factors.per_message * len(messages)
        + factors.image_tokens * media
    )


def completion_upper_bound(
    standin_tokens: int, prompt: str, factors: BoundFactors = BoundFactors()
) -> int:
    """Bound for one completions prompt (plus BOS/EOS the model may add)."""
    return math.ceil(factors.text_factor * standin_tokens + text_extra(prompt, factors) + 2)
