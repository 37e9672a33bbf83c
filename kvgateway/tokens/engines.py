"""The two ways a model's text is turned into token ids: tiktoken and ``tokenizers``.

Both recognise the model's added (special) tokens anywhere in the text, as the
``tokenizers`` library does and so vLLM does: the text is cut at every added token
(leftmost, longest first) and each piece between them is encoded on its own. Neither
adds BOS/EOS; :class:`~kvgateway.tokens.modeldir.ModelTokenizer` does that.

Which is used when (measured by ``bench/tokenizer_cost.py``): tiktoken runs a byte-level
BPE vocabulary several times faster than ``tokenizers``, so it is used whenever
:mod:`kvgateway.tokens.bytelevel` proves it exact; everything else (SentencePiece-style
vocabularies with byte fallback and a metaspace, WordPiece, Unigram, byte-level files
whose merge list tiktoken cannot reproduce) runs in ``tokenizers``.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvgateway.tokens.bytelevel import byte_level_str
from kvgateway.tokens.lookahead_free import FastEncoding


class TextEngine(Protocol):
    """Encodes text to ids with the model's added tokens recognised; adds nothing."""

    @property
    def name(self) -> str: ...

    @property
    def segment_additive(self) -> bool:
        """Whether pieces between added tokens encode alike wherever they stand.

        True lets a counter cache those pieces across requests (a chat's history).
        """
        ...

    def encode(self, text: str) -> list[int]: ...

    def split_added(self, text: str) -> list[str]:
        """``text`` cut into added tokens and the pieces between them, in order."""
        ...

    def is_added(self, piece: str) -> bool: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_str(self, token: int) -> str | None:
        """The vocabulary's own spelling of one id (transformers' convert_ids_to_tokens:
        byte-level "Ġword", SentencePiece "▁word"), None if unknown."""
        ...


def added_token_regex(added: Mapping[str, int]) -> re.Pattern[str] | None:
    """A regex matching any added token, leftmost-longest as HF's matcher does.

    Written as a trie (``<(?:s>|/s>|unk>)``): an alternation of a thousand literals
    (Tekken reserves 1000 ids) is tried branch by branch at every position, a trie
    checks one character.
    """
    if not added:
        return None
    trie: dict[str, Any] = {}
    for token in added:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = {}
    return re.compile("(" + _trie_pattern(trie) + ")")


def _trie_pattern(node: dict[str, Any]) -> str:
    branches = [re.escape(ch) + _trie_pattern(child) for ch, child in node.items() if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    if "" in node:  # a token ends here: longer ones first (greedy), then this one
        return ("(?:" + body + ")" if len(branches) == 1 else body) + "?"
    return body


class _AddedTokens:
    """The model's added tokens (specials like ``<|im_start|>``), which split text before
    the vocabulary runs: shared by both engines."""

    _added: dict[str, int]
    _added_regex: re.Pattern[str] | None

    def split_added(self, text: str) -> list[str]:
        if self._added_regex is None:
            return [text]
        return [p for p in self._added_regex.split(text) if p]

    def is_added(self, piece: str) -> bool:
        return piece in self._added


class TiktokenEngine(_AddedTokens):
    """A byte-level BPE vocabulary run by tiktoken, with the model's added tokens."""

    def __init__(
        self,
        name: str,
        pattern: str,
        ranks: dict[bytes, int],
        added: Mapping[str, int],
        *,
        nfc: bool = False,
    ) -> None:
        self._name = name
        self._added = dict(added)
        self._added_regex = added_token_regex(self._added)
        self._nfc = nfc
        # Known split patterns run without their lookahead (see lookahead_free): same ids.
        self._enc = FastEncoding(name, pattern, ranks, self._added)
        self._by_id = {i: t.encode() for t, i in self._added.items()}

    @property
    def name(self) -> str:
        return f"tiktoken:{self._name}"

    @property
    def segment_additive(self) -> bool:
        return True

    @property
    def lookahead_free(self) -> bool:
        """Whether the split pattern runs without its lookahead (faster, same ids)."""
        return self._enc.lookahead_free

    def _ordinary(self, text: str) -> list[int]:
        if self._nfc and not text.isascii():
            text = unicodedata.normalize("NFC", text)
        return self._enc.encode_ordinary(text)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.split_added(text):
            special = self._added.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(self._ordinary(piece))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        plain: list[int] = []
        for i in ids:
            special = self._by_id.get(i)
            if special is None:
                plain.append(i)
                continue
            if plain:
                out += self._enc.decode_bytes(plain)
                plain = []
            out += special
        if plain:
            out += self._enc.decode_bytes(plain)
        return out.decode("utf-8", errors="replace")

    def token_str(self, token: int) -> str | None:
        special = self._by_id.get(token)
        if special is not None:
            return special.decode()
        try:
            raw = self._enc.decode_single_token_bytes(token)
        except KeyError:
            return None
        return byte_level_str(raw)


def _position_independent(spec: Mapping[str, Any]) -> bool:
    """Whether ``tokenizers`` encodes the text between two added tokens alike wherever
    it stands: added tokens are cut out first and each piece is normalized and
    pre-tokenized on its own, so only a pre-tokenizer that treats "the start of the
    text" specially (Metaspace with prepend_scheme "first") or an added token that eats
    its neighbours' whitespace makes a piece's count depend on its position."""
    for tok in spec.get("added_tokens") or []:
        if (
            tok.get("lstrip")
            or tok.get("rstrip")
            or tok.get("single_word")
            or tok.get("normalized")
        ):
            return False
    pre = spec.get("pre_tokenizer")
    steps = (
        [pre]
        if not isinstance(pre, dict) or pre.get("type") != "Sequence"
        else pre.get("pretokenizers") or []
    )
    for step in steps:
        if isinstance(step, dict) and step.get("type") == "Metaspace":
            scheme = step.get(
                "prepend_scheme", "always" if step.get("add_prefix_space") else "never"
            )
            if scheme == "first":
                return False
    return True


# Texts above this many characters are encoded without holding the GIL.
_GIL_FREE_CHARS = 8192


class HfEngine(_AddedTokens):
    """Any ``tokenizer.json``, run by the ``tokenizers`` library as the node runs it."""

    def __init__(self, name: str, spec_text: str, added: Mapping[str, int]) -> None:
        from tokenizers import AddedToken, Tokenizer

        self._name = name
        self._tok = Tokenizer.from_str(spec_text)
        spec = json.loads(spec_text)
        # transformers also registers tokenizer_config's added_tokens_decoder entries
        # that tokenizer.json lacks; so does the node.
        known = {t.get("content") for t in spec.get("added_tokens") or []}
        extra = [t for t in added if t not in known]
        if extra:
            self._tok.add_special_tokens([AddedToken(t, normalized=False) for t in extra])
        self._added = dict(added)
        self._added_regex = added_token_regex(self._added)
        self._additive = _position_independent(spec)

    @property
    def name(self) -> str:
        return f"tokenizers:{self._name}"

    @property
    def segment_additive(self) -> bool:
        return self._additive

    def encode(self, text: str) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # encode() holds the GIL for its whole run (~0.4 s per 100k tokens), which
            # would stall the event loop while a worker thread counts; encode_batch
            # releases it.
            (batch,) = self._tok.encode_batch([text], add_special_tokens=False)
            big: list[int] = batch.ids
            return big
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def token_str(self, token: int) -> str | None:
        spelled: str | None = self._tok.id_to_token(token)
        return spelled
