"""Running a Hugging Face byte-level BPE ``tokenizer.json`` with tiktoken, when exact.

Byte-level BPE vocabularies that came from tiktoken-style training (Llama 3, Qwen 2/2.5/3,
Mistral Tekken) store every token as a string in GPT-2's
byte-to-unicode alphabet plus a merge list. tiktoken encodes such a vocabulary 3-6x
faster than the ``tokenizers`` library, but its algorithm is "merge the adjacent pair
whose concatenation has the lowest rank", while ``tokenizers`` applies the listed
merges in list order. The two agree when

- for every token, the pair tiktoken merges last to build it (:func:`last_merge`) is a
  listed merge (so tiktoken never merges a pair that ``tokenizers`` would not), and
- merges are listed in the order of the ids of what they produce (so "lowest rank
  first" and "earliest merge first" are the same order),

which :func:`to_tiktoken_ranks` checks (about 1 s for 150k tokens), along with the pre-tokenizer (a split regex
tiktoken can run), the normalizer (none, or NFC which we apply ourselves) and the added
tokens (matched literally, no stripping). When any check fails the caller uses the
``tokenizers`` library, which runs every vocabulary as the node does.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

# GPT-2's byte-level pre-tokenizer regex: what `ByteLevel(use_regex=true)` splits with.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class NotExact(ValueError):
    """tiktoken would not reproduce this tokenizer.json exactly; the message says why."""


@cache
def unicode_to_byte() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@cache
def _to_latin1() -> dict[int, int]:
    return {ord(ch): b for ch, b in unicode_to_byte().items()}


@cache
def _byte_chars() -> tuple[str, ...]:
    inverse = {b: ch for ch, b in unicode_to_byte().items()}
    return tuple(inverse[b] for b in range(256))


def byte_level_str(raw: bytes) -> str:
    """``raw`` spelled in the byte-level alphabet, as tokenizer.json stores tokens."""
    chars = _byte_chars()
    return "".join([chars[b] for b in raw])


def token_bytes(token: str) -> bytes:
    try:
        return token.translate(_to_latin1()).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise NotExact(f"token {token!r} is not in the byte-level alphabet") from exc


@dataclass(frozen=True, slots=True)
class TiktokenParts:
    """What ``tiktoken.Encoding`` needs, plus whether input must be NFC-normalized."""

    pattern: str
    ranks: dict[bytes, int]
    nfc: bool


def split_pattern(pre: Any) -> str:
    """The regex a byte-level ``pre_tokenizer`` splits with, or :class:`NotExact`."""
    if not isinstance(pre, dict):
        raise NotExact("no pre_tokenizer")
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise NotExact("ByteLevel pre_tokenizer with add_prefix_space or without a regex")
        return GPT2_PATTERN
    if kind != "Sequence":
        raise NotExact(f"pre_tokenizer {kind!r}")
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        raise NotExact(f"pre_tokenizer sequence of {len(steps)} steps")
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(split.get("pattern"), dict)
        or "Regex" not in split["pattern"]
    ):
        raise NotExact("first pre_tokenizer step is not an isolating regex Split")
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        raise NotExact("second pre_tokenizer step is not a plain ByteLevel")
    pattern: str = split["pattern"]["Regex"]
    return pattern


def _normalizer_nfc(norm: Any) -> bool:
    if norm is None:
        return False
    if isinstance(norm, dict) and norm.get("type") == "NFC":
        return True
    if isinstance(norm, dict) and norm.get("type") == "Sequence" and not norm.get("normalizers"):
        return False
    raise NotExact(f"normalizer {norm.get('type') if isinstance(norm, dict) else norm!r}")


def _merge_pair(merge: Any) -> tuple[str, str]:
    if isinstance(merge, str):
        a, _, b = merge.partition(" ")
        return a, b
    if isinstance(merge, list) and len(merge) == 2:
        return str(merge[0]), str(merge[1])
    raise NotExact(f"merge {merge!r} is neither 'a b' nor [a, b]")


class MergeProofs:
    """What the merge check found of each vocabulary and merge list it read, by their
    digest: the same tokenizer (read again on a reload, or held by a second model
    directory) is checked once (the digest takes ~0.1 s where the check takes ~1 s for
    150k tokens). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: dict[bytes, str | None] = {}

    def check(self, merges: list[Any], vocab: dict[str, int], *, ignore_merges: bool) -> None:
        """:func:`_check_merges`, or raise what it raised on the same input before."""
        key = hashlib.blake2b(repr((ignore_merges, merges, vocab)).encode()).digest()
        with self._lock:
            known = key in self._found
            found = self._found.get(key)
        if not known:
            try:
                _check_merges(merges, vocab, ignore_merges=ignore_merges)
                found = None
            except NotExact as exc:
                found = str(exc)
            with self._lock:
                self._found[key] = found
        if found is not None:
            raise NotExact(found)


def to_tiktoken_ranks(spec: dict[str, Any], *, proofs: MergeProofs | None = None) -> TiktokenParts:
    """Ranks and split pattern from a parsed ``tokenizer.json``, or :class:`NotExact`;
    ``proofs`` holds merge checks already made."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NotExact(f"model type {model.get('type')!r}")
    if model.get("byte_fallback") or model.get("dropout") or model.get("continuing_subword_prefix"):
        raise NotExact("BPE with byte_fallback, dropout or a subword prefix")
    if model.get("end_of_word_suffix"):
        raise NotExact("BPE with an end-of-word suffix")
    nfc = _normalizer_nfc(spec.get("normalizer"))
    pattern = split_pattern(spec.get("pre_tokenizer"))
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            raise NotExact(f"added token {added.get('content')!r} strips or matches words")
        if added.get("normalized") and not added.get("special"):
            raise NotExact(f"added token {added.get('content')!r} is matched after normalizing")
    added_ids = {a.get("id") for a in spec.get("added_tokens") or []}
    vocab: dict[str, int] = model.get("vocab") or {}
    ranks: dict[bytes, int] = {}
    for text, rank in vocab.items():
        if rank in added_ids:
            continue
        raw = token_bytes(text)
        if raw in ranks:
            raise NotExact(f"two tokens decode to the bytes {raw!r}")
        ranks[raw] = rank
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        raise NotExact("the vocabulary lacks some single bytes")
    merges = model.get("merges") or []
    ignore_merges = bool(model.get("ignore_merges"))
    plain = {t: r for t, r in vocab.items() if r not in added_ids}
    if proofs is not None:
        proofs.check(merges, plain, ignore_merges=ignore_merges)
    else:
        _check_merges(merges, plain, ignore_merges=ignore_merges)
    return TiktokenParts(pattern=pattern, ranks=ranks, nfc=nfc)


def _check_merges(merges: list[Any], vocab: dict[str, int], *, ignore_merges: bool = False) -> None:
    """The conditions of the module docstring, on the byte-level strings (one character
    per byte, so their splits are the byte splits)."""
    listed: set[tuple[str, str]] = set()
    last = -1
    for merge in merges:
        pair = _merge_pair(merge)
        made = vocab.get(pair[0] + pair[1])
        if made is None:
            raise NotExact(f"merge {pair[0]!r} + {pair[1]!r} makes no token")
        if made < last:
            raise NotExact("merges are not listed in the order of the tokens they make")
        last = made
        listed.add(pair)
    for token in vocab:
        if len(token) < 2:
            continue
        made_from = last_merge(token, vocab)
        if made_from is None:
            # Only a whole pre-tokenized piece can be this token: tiktoken looks pieces
            # up whole, and so does tokenizers with ignore_merges.
            if not ignore_merges:
                raise NotExact(f"{token!r} is unreachable by merges and ignore_merges is off")
        elif made_from not in listed:
            raise NotExact(
                f"tiktoken makes {token!r} from {made_from}, which is not a listed merge"
            )


def last_merge(token: str, vocab: dict[str, int]) -> tuple[str, str] | None:
    """The pair tiktoken merges last when it builds ``token`` from its bytes; None if
    merging its bytes never gets there.

    Inside a prompt, tiktoken builds a token only out of pieces within its span (a merge
    across the span's edge could not be undone) and merges the lowest rank first, so the
    merges inside the span are the ones it does on the token's bytes alone, and it
    always makes ``token`` from this same pair. If every token's pair is a listed merge
    and merges are listed in rank order, ``tokenizers`` makes the same choice at every
    step. This covers both merge lists in use: one merge per token (GPT-2 style, as in
    Qwen2's) and every split of every token (transformers' tiktoken converter, as in
    Llama 3's).
    """
    parts = list(token)
    while len(parts) > 2:
        best = -1
        at = -1
        for i in range(len(parts) - 1):
            r = vocab.get(parts[i] + parts[i + 1])
            if r is not None and (at < 0 or r < best):
                best, at = r, i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1])
