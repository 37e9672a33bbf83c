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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests here get 180 s, not 60: the first in a worker loads multi-megabyte
    vocabularies (proving merges, compiling templates), and in ``make test`` that runs
    while the real-vLLM nodes start beside the fast tier on the same two cores."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(180))
