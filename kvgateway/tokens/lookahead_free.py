r"""Split patterns without their one lookahead: the same pieces, found faster.

The pre-tokenizer patterns of Llama 3, Qwen 2/2.5/3, Mistral's Tekken and OpenAI's
o200k and cl100k all end in a whitespace rule with a lookahead, ``\s+(?!\S)``. That one
lookahead makes tiktoken run the whole pattern in fancy-regex's backtracking engine;
without it the pattern is a plain regular expression that runs in the ``regex``
crate's automaton. ``python -m bench.tokenizer_cost`` (section 1) prints encode
throughput with Qwen's vocabulary both ways, cuts included: 1.3x on prose, 1.6x on
code, 3x on numbers, 1.1x on the overhead benchmark's chats (non-ASCII, many double
spaces: finding the cuts costs most of the gain there), 0.9x on CJK (where the
automaton is no faster than fancy-regex); more for cl100k, whose pattern as given also
has possessive quantifiers.

What the lookahead does: a run of whitespace that a non-space follows keeps its last
character for the next piece (``"a   b"`` is ``"a"``, ``"  "``, ``" b"``). It decides a
piece only in one place: the *stretch* of two or more whitespace characters other than
``\r``/``\n`` that ends a whitespace run (after the run's last ``\r``/``\n``, if any)
and that a non-space follows. Everywhere else the rule's alternatives match the same
spans with or without it: a stretch of one character is matched whole either way, a run
at the end of the text is matched whole either way, and a run holding a newline up to
its last ``\r``/``\n`` belongs to the ``\s*[\r\n]`` rule, which comes first.

So the text is cut right before the last character of every such stretch: the pattern
ends a piece there (the stretch's start is a piece boundary, and the lookahead rule
gives the stretch but its last character), no piece of the pattern crosses the cut, and
matching is position-local (no lookbehind), so each part's pieces are the pieces of
the whole text. Each part is then encoded with the lookahead rule replaced by ``\s+``:
inside a part every such stretch is at the part's end, where the two rules agree. The
cl100k form also has ``\s++$``, which at a part's end would swallow a newline that the
whole text gives to ``\s*[\r\n]``; for it the text is also cut at the start of the
stretch when a newline precedes it. Patterns outside the known family keep their
lookahead (tiktoken runs them as given); ``tests/unit/tokens/test_lookahead_free.py``
checks every known pattern against its original on generated text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import tiktoken

# The heads (everything before the whitespace rules) of the patterns this applies to,
# each as the tokenizer files spell it. The whitespace rules follow.
_NEWLINE_RULES = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
_LETTERS_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# OpenAI's o200k (gpt-4o, gpt-oss), and cl100k as tiktoken spells it: the stand-in's.
O200K = (
    "|".join(f"{letters}{_CONTRACTION}?" for letters in _LETTERS_O200K)
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    + _NEWLINE_RULES
)
_HEADS = frozenset(
    {
        # Qwen 2 / 2.5 / 3 (tokenizer.json)
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
        # Llama 3 / 3.1 / 3.2 / 3.3 (tokenizer.json)
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
        # Mistral Tekken (tekken_*.json)
        "|".join(_LETTERS_O200K) + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*",
        O200K.removesuffix(_NEWLINE_RULES),
    }
)
# cl100k as tiktoken spells it (possessive quantifiers, and ``\s++$`` before the
# newline rule); without the possessives it matches the same (nothing after them can
# take back what they hold: each is the end of its alternative or stops at a disjoint
# class), and without the lookahead the last rule becomes ``\s+``.
CL100K = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_CL100K_FREE = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s+$|\s*[\r\n]|\s+"""
)

# Unicode White_Space, which is what ``\s`` means to the regex crate (Python's
# str.isspace() adds U+001C-U+001F), less " ", "\r" and "\n": with " ", the characters a
# stretch is made of.
_INLINE_WS = "\t\x0b\x0c\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(
    chr(c) for c in range(0x2000, 0x200B)
)
_INLINE = f"[ {_INLINE_WS}]"
_NOT_WS = f"[^ \r\n{_INLINE_WS}]"
_INLINE_NON_SPACE = re.compile(f"[{_INLINE_WS}]")

# The cut before a stretch's last character is found by its last two characters and
# what follows them. When spaces are the only inline white space (the common case) the
# pattern starts with a literal, which the regex engine skips ahead to; a class costs
# ~4x more, so it is only used for texts that hold other inline white space.
_LAST_TWO_SPACES = re.compile(r"  (?=[^ \r\n])")
_SPACE_RUN = re.compile(" {2,}")  # a stretch's candidates in a text whose inline ws is " "
_INLINE_RUN = re.compile(f"{_INLINE}{{2,}}")  # the same in any text (a class: slower)


def _only_spaces(text: str) -> bool:
    """Whether " " is the only inline whitespace character in ``text``."""
    if text.isascii():
        return "\t" not in text and "\x0b" not in text and "\x0c" not in text
    return _INLINE_NON_SPACE.search(text) is None


def _runs(text: str) -> Iterator[re.Match[str]]:
    """Runs of two or more inline white space characters, as matches whose spans are
    positions in ``text``: found in a copy with tabs as spaces when the text is ASCII
    (literal searches skip ahead), with a character class otherwise."""
    if text.isascii():
        spaced = text.replace("\t", " ").replace("\x0b", " ").replace("\x0c", " ")
        return _SPACE_RUN.finditer(spaced)
    if _INLINE_NON_SPACE.search(text) is None:
        return _SPACE_RUN.finditer(text)
    return _INLINE_RUN.finditer(text)


@dataclass(frozen=True, slots=True)
class LookaheadFree:
    """A known pattern rewritten without its lookahead, and how to cut text for it."""

    pattern: str
    cut_stretch_start: bool  # the cl100k form: also cut where a stretch follows a newline

    def mark(self, text: str, marker: str) -> tuple[str, int] | None:
        """``text`` with ``marker`` at every cut and the number of cuts; None if the
        text holds the marker itself. Encoded in one call with the marker as a special
        token, the pieces between markers are those of :meth:`parts`."""
        if marker in text:
            return None
        if not _only_spaces(text):
            parts = self.parts(text)
            return marker.join(parts), len(parts) - 1
        # The common case, all in the regex engine (~1 us a cut, no Python step).
        literal = marker.replace("\\", "\\\\")  # a template: the marker taken as is
        marked, cuts = _LAST_TWO_SPACES.subn(" " + literal + " ", text)
        if cuts and self.cut_stretch_start:
            # A stretch right after a line break is also cut where it starts: at a line
            # break that spaces and a marker follow (literal-led patterns: fast).
            ahead = f"(?= +{re.escape(marker)})"
            for brk in ("\n", "\r"):
                if brk in marked:
                    marked, more = re.subn(brk + ahead, brk + literal, marked)
                    cuts += more
        return marked, cuts

    def parts(self, text: str) -> list[str]:
        """``text`` cut so that the lookahead-free pattern, run on each part, gives the
        original pattern's pieces of the whole text."""
        parts: list[str] = []
        start = 0
        n = len(text)
        for m in _runs(text):
            i, j = m.span()
            # A stretch only if a non-space follows ("\r", "\n" or the end: not one).
            if j >= n or text[j] in "\r\n":
                continue
            if self.cut_stretch_start and i > start and text[i - 1] in "\r\n":
                parts.append(text[start:i])
                start = i
            parts.append(text[start : j - 1])
            start = j - 1
        parts.append(text[start:])
        return parts


WINDOW = 4_096


# Where a long text may be cut into windows: after a character that is not white space
# and before inline white space, or after an ASCII letter or digit and before a line
# break. Such a
# position is a piece boundary of every known pattern (only a run of white space holds
# white space past its first character, and no rule takes a line break after a letter
# or digit: only punctuation's ``[\r\n]*`` does), and matching from it depends on
# nothing before it (no rule looks behind).
_WINDOW_CUT = re.compile(f"{_NOT_WS}(?={_INLINE})|[A-Za-z0-9](?=[\r\n])")


def windows(text: str) -> list[str]:
    """A long ``text`` in windows of at least :data:`WINDOW` characters, cut where
    :data:`_WINDOW_CUT` allows, so that the windows encode to the text's ids. Between
    windows tiktoken releases the GIL, so marking a 100k-token prompt on a worker
    thread holds the event loop for one window's Python work at a time. The search is
    one regex per window (a text of a million spaces is not walked in Python); a text
    with no such position is one window."""
    n = len(text)
    if n <= 2 * WINDOW:
        return [text]
    out: list[str] = []
    start = 0
    while n - start > 2 * WINDOW:
        # At most 2 windows' worth of characters searched (~2 ms): past that, the rest
        # is one window rather than a long scan holding the GIL.
        m = _WINDOW_CUT.search(text, start + WINDOW, min(n - WINDOW, start + 3 * WINDOW))
        if m is None:
            break
        out.append(text[start : m.end()])
        start = m.end()
    out.append(text[start:])
    return out


def lookahead_free(pattern: str) -> LookaheadFree | None:
    """The pattern without its lookahead if it is one of the known family, else None."""
    if pattern == CL100K:
        return LookaheadFree(_CL100K_FREE, cut_stretch_start=True)
    head = pattern.removesuffix(_NEWLINE_RULES)
    if head == pattern or head not in _HEADS:
        return None
    return LookaheadFree(head + r"|\s*[\r\n]+|\s+", cut_stretch_start=False)


# Marks a cut in a text (two private-use characters of plane 15); a text that holds it
# is encoded part by part instead.
_CUT_MARKER = "\U000f8a5b\U000f8a5c"
_MARKERS = frozenset({_CUT_MARKER})


def _repaired(text: str) -> str:
    """``text`` as tiktoken encodes it: a text that UTF-8 cannot hold (lone surrogates,
    which ``json.loads`` of a request's bytes lets through) is first passed through
    UTF-16, which joins surrogate pairs into the characters they spell. Done before the
    cuts, so that a pair spelling the cut marker is seen as the marker (and the text
    then encoded part by part), not joined behind the check into a special token."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class FastEncoding:
    """A tiktoken encoding whose split pattern, if a known one, runs without its
    lookahead: the ids of the pattern as given. The cuts are marked in the text with a
    special token of the encoding's own (never one of the vocabulary's), so a text is
    encoded in one call."""

    def __init__(
        self, name: str, pattern: str, ranks: dict[bytes, int], special_tokens: Mapping[str, int]
    ) -> None:
        self._free = lookahead_free(pattern)
        specials = dict(special_tokens)
        self._marker_id = max([*ranks.values(), *specials.values()], default=0) + 1
        if self._free is not None:
            specials[_CUT_MARKER] = self._marker_id
        self.encoding = tiktoken.Encoding(
            name=name,
            pat_str=pattern if self._free is None else self._free.pattern,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )

    @classmethod
    def of(cls, encoding: tiktoken.Encoding) -> FastEncoding | None:
        """``encoding`` rebuilt lookahead-free (its ranks are shared, not copied); None
        when its pattern is not one of the known family, or when tiktoken no longer
        shows the attributes its README extends encodings from."""
        pattern = getattr(encoding, "_pat_str", None)
        ranks = getattr(encoding, "_mergeable_ranks", None)
        specials = getattr(encoding, "_special_tokens", None)
        if not isinstance(pattern, str) or ranks is None or specials is None:
            return None
        if lookahead_free(pattern) is None:
            return None
        return cls(encoding.name, pattern, ranks, specials)

    @property
    def name(self) -> str:
        return self.encoding.name

    @property
    def lookahead_free(self) -> bool:
        return self._free is not None

    def encode_ordinary(self, text: str) -> list[int]:
        ids, cuts = self._encode_cut(text)
        if not cuts:
            return ids
        # The runs between markers, found by list.index (a C scan): ~2x faster than
        # filtering every id through a Python-level comparison.
        out: list[int] = []
        marker = self._marker_id
        start = 0
        for _ in range(cuts):
            at = ids.index(marker, start)
            out += ids[start:at]
            start = at + 1
        out += ids[start:]
        return out

    def count_ordinary(self, text: str) -> int:
        ids, cuts = self._encode_cut(text)
        return len(ids) - cuts

    def encode_ordinary_batch(self, text: list[str], *, num_threads: int = 8) -> list[list[int]]:
        return [self.encode_ordinary(t) for t in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.encoding.decode(list(tokens))

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        return self.encoding.decode_bytes(list(tokens))

    def decode_single_token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token)

    def _encode_cut(self, text: str) -> tuple[list[int], int]:
        """Ids of ``text`` with one marker id at each cut, and the number of cuts."""
        free = self._free
        if free is None:
            return self.encoding.encode_ordinary(text), 0
        if not text.isascii():
            text = _repaired(text)
        if len(text) <= 2 * WINDOW:
            return self._encode_window(text, free)
        ids: list[int] = []
        cuts = 0
        for window in windows(text):
            more, n = self._encode_window(window, free)
            ids += more
            cuts += n
        return ids, cuts

    def _encode_window(self, text: str, free: LookaheadFree) -> tuple[list[int], int]:
        encode = self.encoding.encode_ordinary
        marked = free.mark(text, _CUT_MARKER)
        if marked is None:  # the text holds the marker: its parts one by one
            ids: list[int] = []
            for part in free.parts(text):
                ids += encode(part)
            return ids, 0
        marked_text, cuts = marked
        if not cuts:
            return encode(text), 0
        ids = self.encoding.encode(marked_text, allowed_special=_MARKERS, disallowed_special=())
        return ids, cuts


# Split patterns of the public OpenAI encodings, by family name. A user pointing
# at their own BPE file picks one of these (or gives a raw regex). cl100k and o200k are
# spelled above, beside their lookahead-free forms.
_P50K_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)

PATTERNS: dict[str, str] = {
    "cl100k": CL100K,
    "o200k": O200K,
    "p50k": _P50K_PATTERN,
    "r50k": _P50K_PATTERN,
}
