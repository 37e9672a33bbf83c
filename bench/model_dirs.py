"""Model tokenizer directories for the benchmarks: given, or built from PyPI by name.

``qwen``, ``llama3``, ``tekken``, ``sentencepiece`` (and ``qwen-merges``) are built from
vocabularies shipped on PyPI as the tests build them (``tests.support.vocab``: dashscope,
llama-models, mistral-common), once, under the system's temp directory; anything else
must be a directory holding ``tokenizer.json`` (or a ``*.tiktoken`` file) and a
``tokenizer_config.json`` with the chat template.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.support import vocab

ROOT = Path(tempfile.gettempdir()) / "kvgateway-bench-vocab"


def tokenizer_dir(spec: str, root: Path = ROOT) -> Path:
    """The directory named by ``spec`` (a builder name or a path)."""
    if spec in vocab.BUILDERS:
        return vocab.build(spec, root)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise SystemExit(
            f"--tokenizer {spec!r}: neither {', '.join(vocab.BUILDERS)} nor a directory"
        )
    return path.resolve()


def label(spec: str) -> str:
    """A short name for file names and tables."""
    return spec if spec in vocab.BUILDERS else Path(spec).name
