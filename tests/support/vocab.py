"""Model tokenizer directories built at test time from real vocabularies shipped on PyPI.

- Qwen 2/2.5/3: ``qwen.tiktoken`` from the ``dashscope`` package;
- Llama 3/3.1: Meta's ``tokenizer.model`` from the ``llama-models`` package;
- Mistral Tekken: ``tekken_240911.json`` from ``mistral-common``;
- Mistral SentencePiece (v3, 32768 pieces): ``*.model.v3`` from ``mistral-common``.

Each is written as a Hugging Face ``tokenizer.json`` the way transformers' converters
write them (byte-level BPE with a merge for every two-part split, ordered by the rank
of what it makes; SentencePiece BPE with byte fallback and a "▁" prefix), plus a
``tokenizer_config.json`` with one of the chat templates in :mod:`tests.support.templates`.
Nothing is downloaded.
"""

from __future__ import annotations

import base64
import fcntl
import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvgateway.tokens.bytelevel import byte_level_str, last_merge
from tests.support import templates
from tests.support.sentencepiece import sentencepiece_pieces

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _site(package: str) -> Path:
    """Where an installed package's files are, without importing it."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def _byte_str(raw: bytes) -> str:
    return byte_level_str(raw)


def _all_split_merges(ranks: dict[bytes, int]) -> list[list[str]]:
    found: list[tuple[int, int, int, bytes, bytes]] = []
    for raw, rank in ranks.items():
        for cut in range(1, len(raw)):
            left, right = raw[:cut], raw[cut:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                found.append((rank, lr, rr, left, right))
    found.sort()
    return [[_byte_str(a), _byte_str(b)] for _, _, _, a, b in found]


def _added(content: str, id_: int, *, special: bool = True) -> dict[str, Any]:
    return {
        "id": id_,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _last_merges(ranks: dict[bytes, int]) -> list[list[str]]:
    """One merge per token, GPT-2 style (as Qwen2's merges.txt): the pair tiktoken joins
    last when it builds the token."""
    vocab = {_byte_str(raw): rank for raw, rank in ranks.items()}
    out: list[tuple[int, str, str]] = []
    for token, rank in vocab.items():
        if len(token) > 1:
            pair = last_merge(token, vocab)
            assert pair is not None
            out.append((rank, *pair))
    out.sort()
    return [[a, b] for _, a, b in out]


def _byte_level_spec(
    ranks: dict[bytes, int],
    pattern: str,
    added: list[dict[str, Any]],
    *,
    nfc: bool,
    bos: str | None,
    one_merge_per_token: bool = False,
) -> dict[str, Any]:
    vocab = {a["content"]: a["id"] for a in added}
    vocab.update({_byte_str(raw): rank for raw, rank in ranks.items()})
    post: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    if bos is not None:
        bos_id = vocab[bos]
        post = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": post,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _last_merges(ranks) if one_merge_per_token else _all_split_merges(ranks),
        },
    }


def _write(directory: Path, spec: dict[str, Any], config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), "utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    return directory


def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def qwen_ranks() -> dict[bytes, int]:
    return tiktoken_ranks(_site("dashscope") / "resources" / "qwen.tiktoken")


def build_qwen(directory: Path, *, one_merge_per_token: bool = False) -> Path:
    """Qwen2.5-style: ChatML template with tools, no BOS, eos <|im_end|>."""
    ranks = qwen_ranks()
    base = len(ranks)
    added = [
        _added("<|endoftext|>", base),
        _added("<|im_start|>", base + 1),
        _added("<|im_end|>", base + 2),
        _added("<tool_call>", base + 3, special=False),
        _added("</tool_call>", base + 4, special=False),
    ]
    spec = _byte_level_spec(
        ranks, QWEN_PATTERN, added, nfc=True, bos=None, one_merge_per_token=one_merge_per_token
    )
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": templates.QWEN,
    }
    return _write(directory, spec, config)


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
]


def build_llama3(directory: Path) -> Path:
    """Llama 3.1: Meta's tokenizer.model (shipped by llama-models), 256 special ids after
    the 128k vocabulary, BOS <|begin_of_text|>, the Llama-3.1-style template."""
    ranks = tiktoken_ranks(_site("llama_models") / "llama3" / "tokenizer.model")
    base = len(ranks)
    names = LLAMA3_SPECIALS + [
        f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS))
    ]
    added = [_added(n, base + i) for i, n in enumerate(names)]
    spec = _byte_level_spec(ranks, LLAMA3_PATTERN, added, nfc=False, bos="<|begin_of_text|>")
    spec["model"]["ignore_merges"] = True  # as Llama 3's own tokenizer.json
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": templates.LLAMA31,
    }
    return _write(directory, spec, config)


TEKKEN_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]


def build_tekken(directory: Path) -> Path:
    """Mistral Tekken (Nemo-style): 1000 special ids first, BOS <s>, Mistral template."""
    data = json.loads((_site("mistral_common") / "data" / "tekken_240911.json").read_text())
    n_special = data["config"]["default_num_special_tokens"]
    size = data["config"]["default_vocab_size"] - n_special
    ranks = {
        base64.b64decode(v["token_bytes"]): v["rank"] + n_special for v in data["vocab"][:size]
    }
    names = TEKKEN_SPECIALS + [f"<SPECIAL_{i}>" for i in range(len(TEKKEN_SPECIALS), n_special)]
    added = [_added(n, i) for i, n in enumerate(names)]
    spec = _byte_level_spec(ranks, data["config"]["pattern"], added, nfc=False, bos="<s>")
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": templates.MISTRAL,
    }
    return _write(directory, spec, config)


def build_sentencepiece(directory: Path) -> Path:
    """Mistral v3 SentencePiece as transformers' Llama converter writes it (legacy)."""
    path = _site("mistral_common") / "data" / "mistral_instruct_tokenizer_240323.model.v3"
    pieces = sentencepiece_pieces(path)
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    merges: list[tuple[int, int, int, str, str]] = []
    for piece, kind in pieces:
        if kind != 1:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((vocab[piece], vocab[left], vocab[right], left, right))
    merges.sort()
    added = [_added(p, i) for i, (p, kind) in enumerate(pieces) if kind in (2, 3)]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for *_, a, b in merges],
        },
    }
    config = {
        # As mistralai/Mistral-7B-Instruct-v0.3's tokenizer_config.json: transformers 4.x
        # (what vLLM runs) needs it to load a directory without a config.json.
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": templates.MISTRAL,
    }
    return _write(directory, spec, config)


def build_qwen_gpt2_merges(directory: Path) -> Path:
    """Qwen with one merge per token, the shape of Qwen2's own merges.txt."""
    return build_qwen(directory, one_merge_per_token=True)


BUILDERS = {
    "qwen": build_qwen,
    "qwen-merges": build_qwen_gpt2_merges,
    "llama3": build_llama3,
    "tekken": build_tekken,
    "sentencepiece": build_sentencepiece,
}


def build(kind: str, root: Path) -> Path:
    """Build (once per ``root``, safe across processes) the directory for ``kind``."""
    directory = root / kind
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not directory.exists():
            partial = root / f".{kind}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            BUILDERS[kind](partial)
            partial.rename(directory)
    return directory


@pytest.fixture(scope="session")
def vocab_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``vocab_dirs(kind)``: the built directory, shared by all xdist workers of a run."""
    root = tmp_path_factory.getbasetemp().parent / "vocab-dirs"
    return lambda kind: build(kind, root)


# A Qwen2-VL image processor's preprocessor_config.json, at transformers' default limits.
QWEN2_VL_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
}


def variant(
    base: Path,
    directory: Path,
    *,
    chat_template: str | None = None,
    processor: dict[str, Any] | None = None,
) -> Path:
    """``base``'s vocabulary in ``directory``, with another chat template and/or an image
    processor's ``preprocessor_config.json``."""
    directory.mkdir(parents=True)
    (directory / "tokenizer.json").symlink_to(base / "tokenizer.json")
    config = json.loads((base / "tokenizer_config.json").read_text())
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if processor is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory
