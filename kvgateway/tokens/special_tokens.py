"""Special tokens and BOS/EOS as transformers 4.x sets them (what vLLM <= 0.18 runs;
:mod:`.transformers5` has 5.x's), by tokenizer class: pure rules over a directory's
configs, which :mod:`.modeldir` reads.

- The class AutoTokenizer loads: ``tokenizer_config.json``'s ``tokenizer_class``, else
  ``config.json``'s, else its ``model_type`` (for the classes below; any other is the
  generic ``PreTrainedTokenizerFast``).
- A class's default special tokens, then the config's, then ``special_tokens_map.json``'s
  beside a config saved without ``added_tokens_decoder``.
- Llama-, CodeLlama-, Gemma-, Cohere- and GPT-NeoX-style classes rebuild the
  post-processor from ``add_bos_token``/``add_eos_token``; every other class keeps
  ``tokenizer.json``'s and ignores those keys.
- A special token that is no token of the vocabulary is added, with the next free id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class SpecialTokenError(ValueError):
    """The directory asks for a BOS/EOS it has no token for."""


# Special-token attributes transformers passes to every chat template.
SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def token_text(value: Any) -> str | None:
    """A special token as a config gives it: a string or an AddedToken mapping."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    return None


# transformers 4.x tokenizer classes (as AutoTokenizer loads them: the fast ones) that
# give special tokens defaults, and whether they rebuild the post-processor from
# add_bos_token / add_eos_token (with these defaults); every other class keeps
# tokenizer.json's post-processor and ignores those two keys.


@dataclass(frozen=True, slots=True)
class _ClassRules:
    defaults: Mapping[str, str]
    rebuilds_post_processor: bool = False
    add_bos: bool = False
    add_eos: bool = False


_ENDOFTEXT = "<|endoftext|>"
_LLAMA = _ClassRules({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, True, True)
_CLASS_RULES: Mapping[str, _ClassRules] = {
    "LlamaTokenizer": _LLAMA,
    "CodeLlamaTokenizer": _LLAMA,
    "GemmaTokenizer": _ClassRules(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
        True,
        True,
    ),
    "CohereTokenizer": _ClassRules(
        {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "unk_token": "<UNK>"},
        True,
        True,
    ),
    "GPTNeoXTokenizer": _ClassRules(
        {"bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "unk_token": _ENDOFTEXT}, True
    ),
    "Qwen2Tokenizer": _ClassRules(
        {"eos_token": _ENDOFTEXT, "unk_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT}
    ),
    "GPT2Tokenizer": _ClassRules(
        {"bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "unk_token": _ENDOFTEXT}
    ),
}
# AutoTokenizer's class for a config.json model_type where neither tokenizer_config.json
# nor config.json names one: the model types transformers 4.57 maps to the classes above
# (tests/unit/tokens/test_vs_transformers.py checks this table against its mapping); any
# other falls to the generic class, as with no config.
_MODEL_TYPES_OF_CLASS: Mapping[str, tuple[str, ...]] = {
    "LlamaTokenizer": (
        "arcee", "aria", "chameleon", "colpali", "deepseek_v2", "deepseek_v3", "deepseek_vl",
        "deepseek_vl_hybrid", "diffllama", "ernie4_5", "ernie4_5_moe", "idefics", "idefics2",
        "idefics3", "jamba", "janus", "jetmoe", "llama", "llama4", "llama4_text", "llava",
        "llava_next", "llava_next_video", "llava_onevision", "mllama", "paligemma",
        "persimmon", "phi3", "phimoe", "video_llava", "vipllava", "zamba", "zamba2",
    ),
    "CodeLlamaTokenizer": ("code_llama",),
    "GemmaTokenizer": (
        "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text",
        "recurrent_gemma", "shieldgemma2", "siglip2", "t5gemma",
    ),
    "CohereTokenizer": ("aya_vision", "cohere", "cohere2"),
    "GPTNeoXTokenizer": (
        "falcon_mamba", "gpt_neox", "mamba", "mamba2", "mpt", "olmo", "olmo2", "olmoe", "rwkv",
        "stablelm", "xlstm",
    ),
    "Qwen2Tokenizer": (
        "colqwen2", "internvl", "qwen2", "qwen2_5_omni", "qwen2_5_vl", "qwen2_audio",
        "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_omni_moe",
        "qwen3_vl", "qwen3_vl_moe",
    ),
    "GPT2Tokenizer": (
        "blip-2", "dbrx", "emu3", "exaone4", "flex_olmo", "gpt2", "gpt_bigcode", "gpt_neo",
        "gptj", "granite", "granitemoe", "granitemoehybrid", "granitemoeshared",
        "instructblip", "instructblipvideo", "minimax", "olmo3", "opt", "starcoder2",
    ),
}  # fmt: skip
_CLASS_OF_MODEL_TYPE = {t: cls for cls, types in _MODEL_TYPES_OF_CLASS.items() for t in types}


def tokenizer_class(cfg: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """The transformers tokenizer class AutoTokenizer loads (without "Fast"):
    tokenizer_config.json's (``cfg``) ``tokenizer_class``, else config.json's
    (``model``), else its ``model_type`` where known, else "" (the generic
    PreTrainedTokenizerFast)."""
    for source in (cfg, model):
        named = source.get("tokenizer_class")
        if isinstance(named, str) and named:
            return named.removesuffix("Fast")
    model_type = model.get("model_type")
    if isinstance(model_type, str):
        return _CLASS_OF_MODEL_TYPE.get(model_type, "")
    return ""


def special_tokens(cfg: Mapping[str, Any], legacy: Mapping[str, Any], cls: str) -> dict[str, Any]:
    """The special tokens a template sees, as transformers 4.x sets them: the class's
    defaults, then tokenizer_config.json's values (``cfg``; null removes one), then, for
    a config without ``added_tokens_decoder`` (saved before transformers 4.34),
    special_tokens_map.json's (``legacy``)."""
    rules = _CLASS_RULES.get(cls)
    values: dict[str, Any] = dict(rules.defaults) if rules is not None else {}
    sources: list[Mapping[str, Any]] = [cfg]
    if "added_tokens_decoder" not in cfg:
        sources.append(legacy)
    for source in sources:
        for name in (*SPECIAL_NAMES, "additional_special_tokens"):
            if name in source:
                values[name] = source[name]
    out: dict[str, Any] = {}
    for name in SPECIAL_NAMES:
        text = token_text(values.get(name))
        if text is not None:
            out[name] = text
    extra = values.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(token_text, extra) if t is not None]
    return out


def vocabulary(spec: Mapping[str, Any]) -> tuple[Callable[[str], int | None], int]:
    """A token's id in tokenizer.json's model vocabulary (BPE/WordPiece map, Unigram
    list) or None; and the size of that vocabulary (its largest id + 1)."""
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        size = max((int(v) for v in vocab.values()), default=-1) + 1
        return (lambda token: int(vocab[token]) if token in vocab else None), size
    if isinstance(vocab, list):

        def in_list(token: str) -> int | None:
            for i, entry in enumerate(vocab):
                if isinstance(entry, list) and entry and entry[0] == token:
                    return i
            return None

        return in_list, len(vocab)
    return (lambda token: None), 0


def with_special_tokens(
    added: Mapping[str, int],
    special: Mapping[str, Any],
    vocab: tuple[Callable[[str], int | None], int],
) -> dict[str, int]:
    """``added`` with every special token the tokenizer does not already split out, as
    transformers adds them when it builds the tokenizer: the token's vocabulary id if it
    has one, else the next free id (so a "<pad>" that is no token of the vocabulary is
    one token, not five)."""
    vocab_id, size = vocab
    out = dict(added)
    tokens = [v for k, v in special.items() if k != "additional_special_tokens"]
    tokens += list(special.get("additional_special_tokens") or ())
    next_id = max(size, max(out.values(), default=-1) + 1)
    for token in tokens:
        if not isinstance(token, str) or not token or token in out:
            continue
        found = vocab_id(token)
        if found is None:
            found, next_id = next_id, next_id + 1
        out[token] = found
    return out


def bos_eos(
    cfg: Mapping[str, Any],
    cls: str,
    special: Mapping[str, Any],
    added: Mapping[str, int],
    from_processor: tuple[list[int], list[int]],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ids added around a prompt with add_special_tokens: the post-processor the class
    rebuilds from add_bos_token / add_eos_token (Llama-, Gemma-, Cohere-style: BOS by
    default, no EOS; GPT-NeoX-style: neither by default), or else tokenizer.json's own,
    whatever the config's keys say (transformers 4.x ignores them there)."""
    rules = _CLASS_RULES.get(cls)
    if rules is None or not rules.rebuilds_post_processor:
        prefix, suffix = from_processor
        return tuple(prefix), tuple(suffix)
    sides: list[list[int]] = []
    for key, token_key, default in (
        ("add_bos_token", "bos_token", rules.add_bos),
        ("add_eos_token", "eos_token", rules.add_eos),
    ):
        on = bool(cfg.get(key, default))
        token = special.get(token_key)
        ids = [added[token]] if on and isinstance(token, str) and token in added else []
        if on and not ids:
            raise SpecialTokenError(f"{key} is true but {token_key} {token!r} is no added token")
        sides.append(ids)
    return tuple(sides[0]), tuple(sides[1])
