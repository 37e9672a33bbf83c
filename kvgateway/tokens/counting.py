"""Counting prompt tokens cheaply enough to do on every request.

A request is first reduced (pure, no encoding, :mod:`.plans`) to a :class:`CountPlan`: the text pieces
to encode plus the tokens the chat template and images add. Pieces are then looked up in
a bounded :class:`TextCache`: a multi-turn chat resends its whole history every
turn, so only the newest message costs an encode. Uncached text below
``inline_chars`` is encoded on the event loop (a thread hop costs more than encoding a
few KB); larger text goes to a worker thread (tiktoken releases the GIL while it
encodes), so a 200k-token prompt never stalls other requests.
"""

from __future__ import annotations

import asyncio
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvgateway.tokens.encoding import Encoder
from kvgateway.tokens.plans import CountPlan

V = TypeVar("V")

# Text shorter than this is cheaper to re-encode than to keep in the cache.
_MIN_CACHED_CHARS = 256

# Long texts are counted in chunks cut where a line starts with a letter or digit: no
# piece of the cl100k/o200k/p50k split patterns spans "\n" followed by one (their optional
# one-character prefix excludes newlines), so the counts of the chunks add up to the
# count of the whole text (property-tested). A chunk seen before -- a shared system
# prompt, a document pasted into many requests -- is not encoded again. Cuts are chosen
# by content (a hash of the text after the cut), so an edit early in a document does not
# shift the chunks after it.
_BOUNDARY = re.compile(r"\n(?=[A-Za-z0-9])")
CHUNK_MIN = 1024
CHUNK_MAX = 8192

# A run of this many characters without white space is one piece to a BPE split pattern,
# and BPE merges cost superlinear time and memory in a piece's length (a 31 MB word took
# 25 s and 1.5 GB). Such runs are counted in slices of RUN_SLICE characters, one token
# added per cut: slicing only loses merges across the cut, so the sum is an over-count
# (safe for admission) and the cost is linear.
LONG_RUN = 4096
RUN_SLICE = 1024
_LONG_RUN = re.compile(rf"\S{{{LONG_RUN},}}")
# Uncached text above this many characters is counted on its own single-thread lane, so
# one client's giant prompts cannot occupy every counting thread.
HUGE_CHARS = 1_000_000


def split_chunks(text: str, min_chars: int = CHUNK_MIN, max_chars: int = CHUNK_MAX) -> list[str]:
    """Cut ``text`` at safe boundaries into chunks of roughly min..max characters."""
    if len(text) < 2 * min_chars:
        return [text]
    out: list[str] = []
    start = 0
    # Boundaries closer than min_chars to the last cut are never cuts: searched past.
    pos = min_chars - 1
    while (m := _BOUNDARY.search(text, pos)) is not None:
        cut = m.end()
        # crc32, not hash(): str hashes change with every process (PYTHONHASHSEED).
        if cut - start >= max_chars or zlib.crc32(text[cut : cut + 16].encode()) % 4 == 0:
            out.append(text[start:cut])
            start = cut
            pos = cut + min_chars - 1
        else:
            pos = cut
    out.append(text[start:])
    return out


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """Counted prompt: ``total`` over all prompts, ``longest`` single prompt."""

    total: int
    longest: int
    prompts: int
    encoded_chars: int = 0
    # Each prompt's own count (a completions request may batch several).
    each: tuple[int, ...] = ()
    # Set when the count is a bound (an image of unknown size priced at its largest):
    # the least the node may count.
    floor: int | None = None


class TextCache(Generic[V]):
    """LRU of text -> what it encodes to (a count, or ids), bounded by the characters
    held. Locked: the event loop and the counting pool's threads share it."""

    def __init__(self, max_chars: int = 32 * 1024 * 1024) -> None:
        self._max_chars = max_chars
        self._chars = 0
        self._data: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> V | None:
        with self._lock:
            value = self._data.get(text)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(text)
            self.hits += 1
            return value

    def put(self, text: str, value: V) -> None:
        if len(text) < _MIN_CACHED_CHARS or len(text) > min(HUGE_CHARS, self._max_chars // 4):
            return
        with self._lock:
            if text in self._data:
                return
            self._data[text] = value
            self._chars += len(text)
            while self._chars > self._max_chars:
                old, _ = self._data.popitem(last=False)
                self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._data)


# A text's token count (the stand-in's pieces).
TextCountCache = TextCache[int]


def _may_hold_long_run(text: str) -> bool:
    """False when ``text`` certainly has no run of LONG_RUN non-space characters: such a
    run covers a whole aligned block of LONG_RUN // 2, and every block here holds a space
    or a line break (a few C-speed ``in`` tests instead of a regex pass)."""
    half = LONG_RUN // 2
    for start in range(0, len(text) - half + 1, half):
        block = text[start : start + half]
        if " " not in block and "\n" not in block:
            return True
    return False


class PromptCounter:
    """Counts prompts with one encoding, a shared cache and an executor for big text."""

    def __init__(
        self,
        encoder: Encoder,
        cache: TextCountCache,
        executor: Executor | None,
        *,
        inline_chars: int = 24_000,
        chunked: bool = False,
        huge_executor: Executor | None = None,
        known: Callable[[str], int | None] | None = None,
    ) -> None:
        self._encoder = encoder
        # Counts of texts whose ids are already held elsewhere (prefix-aware routing
        # encodes a prompt's texts to key its blocks): len(ids) is their count.
        self._known = known
        # The lookahead-free encoding counts without building the id list it would filter.
        fast = getattr(encoder, "count_ordinary", None)
        self._count: Callable[[str], int] = (
            fast if callable(fast) else lambda text: len(encoder.encode_ordinary(text))
        )
        self._cache = cache
        self._executor = executor
        self._huge_executor = huge_executor or executor
        self._inline_chars = inline_chars
        # Only for encodings whose split pattern makes chunk counts additive.
        self._chunked = chunked

    @property
    def encoding_name(self) -> str:
        return self._encoder.name

    def count_text(self, text: str) -> int:
        """Synchronous count of one text (used by tools and tests)."""
        return self._count(text)

    async def count(
        self, plan: CountPlan, known: Sequence[int] = (), limit: int | None = None
    ) -> PromptTokens:
        """Count ``plan``. With ``limit``, counting may stop once the total is past it
        (the request cannot fit anywhere): the total returned is then above ``limit``
        but not exact, and nothing of the uncounted rest is cached."""
        piece_tokens: list[int] = [0] * len(plan.pieces)
        # A piece counted before (the history of a chat) is one lookup. Other pieces are
        # looked up chunk by chunk (a known document inside a new message) and whatever
        # is still unknown is encoded.
        units: list[str] = []
        owner: list[int] = []
        split: list[int] = []
        missed: list[int] = []
        for i, piece in enumerate(plan.pieces):
            if len(piece) > HUGE_CHARS:
                # Not hashed, split or cached on the event loop (tens of ms for 16 MB):
                # straight to the counting lane for giant texts.
                units.append(piece)
                owner.append(i)
                continue
            whole = self._cache.get(piece)
            if whole is None and self._known is not None:
                whole = self._known(piece)
            if whole is not None:
                piece_tokens[i] = whole
            else:
                missed.append(i)
        cuts = await self._split([plan.pieces[i] for i in missed])
        for i, parts in zip(missed, cuts, strict=True):
            if len(parts) > 1:
                split.append(i)
                counts = [self._cache.get(u) for u in parts]
            else:
                counts = [None]  # the whole piece was just looked up
            for u, c in zip(parts, counts, strict=True):
                if c is None:
                    units.append(u)
                    owner.append(i)
                else:
                    piece_tokens[i] += c
        chars = sum(len(u) for u in units)
        budget = None if limit is None else limit - sum(piece_tokens) - sum(known) - sum(plan.fixed)
        complete = True
        if units:
            if chars > self._inline_chars and self._executor is not None:
                pool = self._huge_executor if chars > HUGE_CHARS else self._executor
                loop = asyncio.get_running_loop()
                fresh = await loop.run_in_executor(pool, self._encode_many, units, budget)
            else:
                fresh = self._encode_many(units, budget)
            complete = len(fresh) == len(units)
            for u, i, n in zip(units, owner, fresh, strict=False):
                piece_tokens[i] += n
                self._cache.put(u, n)
        if complete:
            for i in split:
                self._cache.put(plan.pieces[i], piece_tokens[i])
        per_prompt = []
        for g, group in enumerate(plan.groups):
            n = plan.fixed[g] + sum(piece_tokens[i] for i in group)
            if g < len(known):
                n += known[g]
            per_prompt.append(n)
        if not complete and limit is not None:
            # Past the limit before the end: report one prompt above it, so no per-prompt
            # count of an unfinished batch can look as if it fits.
            over = max(sum(per_prompt), limit + 1)
            return PromptTokens(over, over, len(per_prompt), chars, (over,))
        return PromptTokens(
            total=sum(per_prompt),
            longest=max(per_prompt, default=0),
            prompts=len(per_prompt),
            encoded_chars=chars,
            each=tuple(per_prompt),
        )

    async def _split(self, pieces: list[str]) -> list[list[str]]:
        """Each piece cut into chunks (when chunked): a regex pass over every character
        (~5 ms per 100k tokens), so big pieces are cut in the executor."""
        if not self._chunked:
            return [[p] for p in pieces]
        size = sum(map(len, pieces))
        if size > self._inline_chars and self._executor is not None:
            pool = self._huge_executor if size > HUGE_CHARS else self._executor
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(pool, lambda: [split_chunks(p) for p in pieces])
        return [split_chunks(p) for p in pieces]

    def _encode_many(self, texts: list[str], budget: int | None = None) -> list[int]:
        """Counts of ``texts`` in order; with ``budget``, stops after the first count that
        takes the running total past it (fewer counts than texts come back)."""
        out: list[int] = []
        total = 0
        for t in texts:
            n = self._count_bounded(t, None if budget is None else budget - total)
            out.append(n)
            total += n
            if budget is not None and total > budget:
                break
        return out

    def _count_bounded(self, text: str, budget: int | None = None) -> int:
        """Count ``text``, long runs without white space in slices (see LONG_RUN); with
        ``budget``, a long run stops being counted once the count is past it."""
        count = self._count
        if len(text) < LONG_RUN:
            return count(text)
        if len(text) > HUGE_CHARS:
            # A giant text is sliced without looking for runs: one regex pass over it
            # would hold the GIL for tens of ms; slices let other threads (the event loop)
            # in between. Each cut costs at most one token more: an over-count of ~0.4%.
            total = 0
            for start in range(0, len(text), RUN_SLICE):
                total += count(text[start : start + RUN_SLICE]) + 1
                if budget is not None and total > budget:
                    break
            return total
        if not _may_hold_long_run(text):
            return count(text)
        total = 0
        last = 0
        for m in _LONG_RUN.finditer(text):
            total += count(text[last : m.start()])
            for start in range(m.start(), m.end(), RUN_SLICE):
                total += count(text[start : min(m.end(), start + RUN_SLICE)]) + 1
                if budget is not None and total > budget:
                    return total
            last = m.end()
        return total + count(text[last:])
