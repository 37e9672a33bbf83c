"""Loaded model tokenizers for the real vocabularies, once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.modeldir import ModelTokenizer

KINDS = ("qwen", "qwen-merges", "llama3", "tekken", "sentencepiece")


@pytest.fixture(scope="session")
def gateway_tokenizer(
    vocab_dirs: Callable[[str], Path], encodings: EncodingCache
) -> Callable[[str], ModelTokenizer]:
    """What the gateway loads: tiktoken where proven exact."""
    return lambda kind: encodings.model(str(vocab_dirs(kind)))


@pytest.fixture(scope="session")
def node_tokenizer(
    vocab_dirs: Callable[[str], Path], encodings: EncodingCache
) -> Callable[[str], ModelTokenizer]:
    """What the simulated node (and vLLM) runs: the tokenizers library."""
    return lambda kind: encodings.model(str(vocab_dirs(kind)), engine="tokenizers")
