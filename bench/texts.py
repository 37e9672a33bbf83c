"""Deterministic prompt text of an exact token count, English prose or source code.

Both corpora ship with every Python: the English is the prose of Python's own
documentation (``pydoc_data.topics``, ~105k cl100k tokens), the code is the source of the
``asyncio`` package (~100k tokens). Nothing is downloaded and nothing is committed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from kvgateway.tokens.encoding import Encoder, EncodingCache
from kvgateway.tokens.plans import EncodingSpec


@functools.cache
def encoder() -> Encoder:
    return EncodingCache().get(EncodingSpec())


@functools.cache
def _corpus(kind: str) -> list[int]:
    if kind == "english":
        import pydoc_data.topics

        text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    elif kind == "code":
        import asyncio

        folder = os.path.dirname(asyncio.__file__)
        parts = []
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as fh:
                    parts.append(fh.read())
        text = "\n\n".join(parts)
    else:
        raise ValueError(f"unknown corpus {kind!r}")
    return encoder().encode_ordinary(text)


def text(kind: str, n_tokens: int, offset: int = 0) -> str:
    """About ``n_tokens`` tokens of ``kind`` text (``english`` or ``code``), starting at
    token ``offset`` of the corpus (wrapping around); re-encoding may differ by a few."""
    toks = _corpus(kind)
    out: list[int] = []
    pos = offset % len(toks)
    while len(out) < n_tokens:
        take = min(n_tokens - len(out), len(toks) - pos)
        out.extend(toks[pos : pos + take])
        pos = 0
    return encoder().decode(out)


def count(s: str) -> int:
    return len(encoder().encode_ordinary(s))


TextFn = Callable[[str, int, int], str]
