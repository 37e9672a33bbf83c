"""Tokenizer classes as transformers 5 builds them (what vLLM >= 0.19 runs): pure rules
over a directory's configs and ``tokenizer.json``, which :mod:`.modeldir` reads.

What changed from transformers 4.x (:mod:`.special_tokens` has the 4.x rules), read in
transformers 5.19's ``tokenization_utils_tokenizers.py`` (``TokenizersBackend``),
``tokenization_utils_base.py`` (``_from_pretrained``, ``special_tokens_map``),
``models/auto/tokenization_auto.py`` and each class's ``tokenization_*.py``:

- The class: ``tokenizer_class`` of ``tokenizer_config.json`` or ``config.json``, but a
  ``model_type`` whose registered class differs overrules it (the generic class for most,
  the registered one where transformers says the hub's is wrong: ``qwen2``...);
  ``"PreTrainedTokenizerFast"`` is the generic class. vLLM forces the generic class for a
  few model types of its own (``vllm/tokenizers/registry.py``).
- A class with its own constructor (all below) rebuilds the vocabulary's pipeline:
  ``tokenizer.json`` gives only the vocabulary, the merges and the post-processor; the
  normalizer, pre-tokenizer and BPE options are the class's (Qwen2's NFC and split
  regex whatever the file says). The generic class keeps the file as it is.
- ``add_bos_token`` / ``add_eos_token`` are dropped when a ``tokenizer.json`` is there: the
  file's post-processor decides BOS/EOS for every class, except GPT-NeoX's, which builds
  one that adds neither.
- Special tokens: the class's defaults (Gemma's ``<mask>``, Cohere's ``<PAD>``/``<CLS>``...),
  then the configs' (as transformers 4 reads them); other ``*_token`` keys of the config
  are named special tokens too. A template sees the named ones only (``additional_special_tokens`` is no
  longer a template variable).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgateway.tokens.special_tokens import SPECIAL_NAMES, token_text

_ENDOFTEXT = "<|endoftext|>"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# BPE options of the byte-level classes (the file's dropout, prefixes and fallback go).
_BYTE_LEVEL_BPE: Mapping[str, Any] = {
    "dropout": None,
    "unk_token": None,
    "continuing_subword_prefix": "",
    "end_of_word_suffix": "",
    "fuse_unk": False,
    "byte_fallback": False,
    "ignore_merges": False,
}


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    return default if value is None else bool(value)


def _byte_level(cfg: Mapping[str, Any], *, use_regex: bool = True) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": _flag(cfg, "add_prefix_space", False),
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _qwen(pattern: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    def pipeline(cfg: Mapping[str, Any]) -> dict[str, Any]:
        split = {
            "type": "Split",
            "pattern": {"Regex": pattern},
            "behavior": "Isolated",
            "invert": False,
        }
        pre = {"type": "Sequence", "pretokenizers": [split, _byte_level(cfg, use_regex=False)]}
        return {"normalizer": {"type": "NFC"}, "pre_tokenizer": pre, "model": _BYTE_LEVEL_BPE}

    return pipeline


def _gpt2(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"normalizer": None, "pre_tokenizer": _byte_level(cfg), "model": _BYTE_LEVEL_BPE}


def _gpt_neox(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": _byte_level(cfg),
        "model": _BYTE_LEVEL_BPE,
    }


def _cohere(cfg: Mapping[str, Any]) -> dict[str, Any]:
    pre = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(cfg)],
    }
    return {"normalizer": {"type": "NFC"}, "pre_tokenizer": pre, "model": _BYTE_LEVEL_BPE}


def _metaspace(prepend_scheme: str) -> dict[str, Any]:
    return {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": prepend_scheme,
        "split": False,
    }


def _llama(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' _get_prepend_scheme: "first" unless the config says legacy.
    if not _flag(cfg, "add_prefix_space", True):
        scheme = "never"
    else:
        scheme = "always" if cfg.get("legacy") else "first"
    model = {"fuse_unk": True, "byte_fallback": True, "dropout": None, "unk_token": None}
    return {"normalizer": None, "pre_tokenizer": _metaspace(scheme), "model": model}


def _code_llama(cfg: Mapping[str, Any]) -> dict[str, Any]:
    scheme = "first" if _flag(cfg, "add_prefix_space", True) else "never"
    unk = token_text(cfg.get("unk_token")) or "<unk>"
    model = {"fuse_unk": True, "byte_fallback": True, "dropout": None, "unk_token": unk}
    return {"normalizer": None, "pre_tokenizer": _metaspace(scheme), "model": model}


def _gemma(cfg: Mapping[str, Any]) -> dict[str, Any]:
    unk = token_text(cfg.get("unk_token")) or "<unk>"
    return {
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        },
        "model": {"fuse_unk": True, "byte_fallback": True, "dropout": None, "unk_token": unk},
    }


@dataclass(frozen=True, slots=True)
class _Class5:
    defaults: Mapping[str, str]
    pipeline: Callable[[Mapping[str, Any]], dict[str, Any]]
    # Builds a post-processor from add_bos_token/add_eos_token (which are dropped: none).
    own_post_processor: bool = False
    named_extras: Mapping[str, str] = field(default_factory=dict)


_LLAMA_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_QWEN_TOKENS = {"unk_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT}
_CLASSES: Mapping[str, _Class5] = {
    "LlamaTokenizer": _Class5(_LLAMA_TOKENS, _llama),
    "CodeLlamaTokenizer": _Class5(
        _LLAMA_TOKENS,
        _code_llama,
        named_extras={
            "prefix_token": "\u2581<PRE>",
            "middle_token": "\u2581<MID>",
            "suffix_token": "\u2581<SUF>",
            "eot_token": "\u2581<EOT>",
            "fill_token": "<FILL_ME>",
        },
    ),
    "GemmaTokenizer": _Class5(
        {
            "unk_token": "<unk>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
        _gemma,
    ),
    "CohereTokenizer": _Class5(
        {
            "unk_token": "<UNK>",
            "bos_token": "<BOS_TOKEN>",
            "eos_token": "<|END_OF_TURN_TOKEN|>",
            "pad_token": "<PAD>",
            "cls_token": "<CLS>",
            "sep_token": "<SEP>",
            "mask_token": "<MASK_TOKEN>",
        },
        _cohere,
    ),
    "GPTNeoXTokenizer": _Class5(
        {
            "unk_token": _ENDOFTEXT,
            "bos_token": _ENDOFTEXT,
            "eos_token": _ENDOFTEXT,
            "pad_token": "<|padding|>",
        },
        _gpt_neox,
        own_post_processor=True,
    ),
    "Qwen2Tokenizer": _Class5(_QWEN_TOKENS, _qwen(_QWEN2_SPLIT)),
    "Qwen3_5Tokenizer": _Class5(_QWEN_TOKENS, _qwen(_QWEN35_SPLIT)),
    "GPT2Tokenizer": _Class5(
        {"unk_token": _ENDOFTEXT, "bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT}, _gpt2
    ),
}

# transformers 5.19's registered class per config.json model_type, for the classes above
# (tests/unit/tokens/test_vs_transformers5.py checks both tables against its mapping).
_MODEL_TYPES_OF_CLASS: Mapping[str, tuple[str, ...]] = {
    "LlamaTokenizer": ("idefics", "idefics2"),
    "CodeLlamaTokenizer": ("code_llama",),
    "GemmaTokenizer": (
        "diffusion_gemma", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n",
        "gemma3n_text", "recurrent_gemma", "shieldgemma2", "t5gemma", "zaya",
    ),
    "CohereTokenizer": ("aya_vision", "cohere", "cohere2"),
    "GPTNeoXTokenizer": (
        "falcon_mamba", "gpt_neox", "mamba", "mamba2", "mpt", "olmo", "olmoe", "rwkv", "xlstm",
    ),
    "Qwen2Tokenizer": (
        "audioflamingo3", "colqwen2", "cosmos3_omni", "fun_asr_nano", "hunyuan_vl",
        "internvl", "ovis2", "qianfan_ocr", "qwen2", "qwen2_5_omni", "qwen2_5_vl",
        "qwen2_audio", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_asr", "qwen3_moe",
        "qwen3_next", "qwen3_omni_moe", "qwen3_vl", "qwen3_vl_moe",
    ),
    "Qwen3_5Tokenizer": (
        "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen4_exp",
    ),
    "GPT2Tokenizer": (
        "blip-2", "codegen", "dbrx", "emu3", "gpt2", "gpt_neo", "gptj",
        "hyperclovax_vision_v2", "instructblip", "instructblipvideo", "jais2", "opt", "phi",
        "starcoder2",
    ),
}  # fmt: skip
_CLASS_OF_MODEL_TYPE = {t: cls for cls, types in _MODEL_TYPES_OF_CLASS.items() for t in types}
# Model types registered with the generic class (TokenizersBackend, or Mistral's backend,
# which is the generic class without Mistral's own files): a differing hub class loses.
GENERIC_MODEL_TYPES = frozenset({
    "EvollaModel", "arctic", "aria", "bigbird_pegasus", "camembertv2-base", "canary",
    "chameleon", "chatlm", "cohere_asr", "deepseek_ocr", "deepseek_ocr2", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_vl", "deepseek_vl_hybrid",
    "deepseek_vl_v2", "ernie4_5", "ernie4_5_moe", "flex_olmo", "fuyu", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_moe", "glm_image", "glmasr", "got_ocr2",
    "gpt_bigcode", "granite", "granitemoe", "granitemoehybrid", "granitemoeshared",
    "h2ovl_chat", "hyperclovax", "hyperclovax_vlm", "internlm2", "jamba", "janus",
    "kimi_k25", "kimi_linear", "kosmos-2", "llava", "llava_next", "mimo_v2_flash",
    "minicpm3", "minicpmv", "minicpmv4_6", "minicpmv4_7", "minimax_m2", "ministral",
    "ministral3", "mistral", "mistral3", "mixtral", "modernbert", "modernbert-decoder",
    "molmo", "molmo2", "nemotron", "nvfp4", "nystromformer", "olmo2", "olmo3",
    "olmo_hybrid", "opencua", "openvla", "paddleocr_vl", "pegasus_x", "persimmon", "phi3",
    "phi3_v", "phimoe", "pix2struct", "pixtral", "smolvlm", "stablelm", "step3_vl",
    "step3p5", "umt5", "vipllava", "voxtral", "voxtral_realtime", "xlm-roberta-xl",
})  # fmt: skip
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (whose registered class wins
# over the hub's), and vLLM's own list that loads the generic class whatever the configs say.
REGISTERED_WINS = frozenset({
    "arctic", "camembertv2-base", "chameleon", "chatlm", "cohere_asr", "deepseek_ocr",
    "deepseek_ocr2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4",
    "deepseek_vl", "deepseek_vl_hybrid", "deepseek_vl_v2", "ernie4_5", "ernie4_5_moe", "fuyu",
    "h2ovl_chat", "hyperclovax", "hyperclovax_vision_v2", "hyperclovax_vlm", "internlm2",
    "jamba", "janus", "llava", "llava_next", "minicpm3", "minicpmv", "minimax_m2",
    "modernbert", "modernbert-decoder", "molmo", "molmo2", "nemotron", "nvfp4", "opencua",
    "openvla", "paddleocr_vl", "phi3", "phi3_v", "phimoe", "qwen2", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen4_exp", "smolvlm", "step3_vl", "step3p5", "vipllava",
})  # fmt: skip
_VLLM_GENERIC = frozenset({"internlm2", "step3_vl", "step3p7", "unlimited-ocr", "unlimited_ocr"})


def _named(value: Any) -> str:
    """A class name as AutoTokenizer looks it up ("" for the generic class)."""
    if not isinstance(value, str) or not value:
        return ""
    name = value.removesuffix("Fast")
    return name if name in _CLASSES else ""


def tokenizer_class(cfg: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """The class transformers 5's AutoTokenizer loads, as vLLM calls it ("" for the generic
    TokenizersBackend, and for any class these rules do not know)."""
    model_type = model.get("model_type")
    model_type = model_type if isinstance(model_type, str) else ""
    if model_type in _VLLM_GENERIC:
        return ""
    hub_value = cfg.get("tokenizer_class") or model.get("tokenizer_class")
    hub = hub_value.removesuffix("Fast") if isinstance(hub_value, str) and hub_value else ""
    registered = _CLASS_OF_MODEL_TYPE.get(model_type)
    generic = model_type in GENERIC_MODEL_TYPES
    if hub and (registered is not None or generic) and (registered or "") != hub:
        if registered is None:
            return ""  # registered generic: the hub's class is not used
        return registered if model_type in REGISTERED_WINS else _named(hub)
    if hub:
        return _named(hub)
    return registered or ""


def pipeline(spec: Mapping[str, Any], cls: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``tokenizer.json`` as ``cls`` rebuilds it: its vocabulary, merges, added tokens and
    post-processor kept, the class's normalizer, pre-tokenizer and BPE options instead of
    the file's. The generic class, and a file whose model is not BPE, stay as they are."""
    rules = _CLASSES.get(cls)
    model = spec.get("model")
    if rules is None or not isinstance(model, dict) or model.get("type") != "BPE":
        return dict(spec)
    parts = rules.pipeline(cfg)
    out = dict(spec)
    out["normalizer"] = parts["normalizer"]
    out["pre_tokenizer"] = parts["pre_tokenizer"]
    rebuilt = {
        "type": "BPE",
        "vocab": model.get("vocab"),
        "merges": model.get("merges"),
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
    }
    rebuilt.update(parts["model"])
    out["model"] = rebuilt
    if rules.own_post_processor:
        out["post_processor"] = None
    return out


def special_tokens(cfg: Mapping[str, Any], legacy: Mapping[str, Any], cls: str) -> dict[str, Any]:
    """Named special tokens (``bos_token``..., and a config's other ``*_token`` keys) and
    ``additional_special_tokens`` (transformers 5's extra special tokens), as transformers
    5 sets them: the class's defaults, then tokenizer_config.json's values (null removes
    one), then special_tokens_map.json's beside a config without ``added_tokens_decoder``."""
    rules = _CLASSES.get(cls)
    values: dict[str, Any] = {}
    if rules is not None:
        values.update(rules.defaults)
        values.update(rules.named_extras)
    sources: list[Mapping[str, Any]] = [cfg]
    if "added_tokens_decoder" not in cfg:
        sources.append(legacy)
    extras: list[str] = []
    for source in sources:
        for name, value in source.items():
            if name in ("additional_special_tokens", "extra_special_tokens"):
                if isinstance(value, list):
                    extras = [t for t in map(token_text, value) if t is not None]
                elif isinstance(value, dict):
                    values.update(value)
            elif name in SPECIAL_NAMES or (name.endswith("_token") and token_text(value)):
                values[name] = value
    out: dict[str, Any] = {}
    # transformers' order (the standard names, then the config's others): a token that
    # is no token of the vocabulary is added with the next free id in this order.
    for name in sorted(values, key=lambda n: SPECIAL_NAMES.index(n) if n in SPECIAL_NAMES else 99):
        text = token_text(values[name])
        if text is not None:
            out[name] = text
    if extras:
        out["additional_special_tokens"] = extras
    return out


def template_tokens(special: Mapping[str, Any]) -> dict[str, Any]:
    """What a chat template sees of the special tokens: the named ones only."""
    return {k: v for k, v in special.items() if k != "additional_special_tokens"}
