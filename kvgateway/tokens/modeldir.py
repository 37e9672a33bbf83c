"""Loading a model's own tokenizer from a directory, offline.

A directory is a Hugging Face model directory or just its tokenizer files:

- ``tokenizer.json`` (the vocabulary, added tokens and post-processor), run by tiktoken
  when :mod:`.bytelevel` proves that exact, else by the ``tokenizers`` library; or a
  tiktoken-format BPE file (``*.tiktoken``) with its split pattern given by the caller;
- ``tokenizer_config.json``: ``chat_template`` (one string, or named templates),
  ``bos_token``/``eos_token`` and the other special tokens a template may print,
  ``add_bos_token``/``add_eos_token``, ``added_tokens_decoder``, ``tokenizer_class``
  (else ``config.json``'s ``model_type``): as transformers 4.x, the class gives
  special-token defaults, and only Llama-, Gemma- and Cohere-style classes add BOS/EOS
  by those two keys (others keep tokenizer.json's post-processor);
- ``special_tokens_map.json``, read as transformers reads it: only beside a config saved
  without ``added_tokens_decoder``;
- ``chat_template.jinja`` (wins over the config's template, as in transformers) and a
  processor's ``chat_template.json`` (vLLM prefers it when the request has no tools).

:func:`load_model_tokenizer` raises :class:`TokenizerDirError` saying what is missing
or inconsistent; the config loader prefixes the YAML path.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiktoken.load import load_tiktoken_bpe

from kvgateway.tokens.bytelevel import NotExact, to_tiktoken_ranks
from kvgateway.tokens.chat_template import ChatTemplate, TemplateError
from kvgateway.tokens.encoding import PATTERNS
from kvgateway.tokens.engines import HfEngine, TextEngine, TiktokenEngine
from kvgateway.tokens.images import ImageGrid, load_grid

# Special-token attributes transformers passes to every chat template.
_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


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


class TokenizerDirError(ValueError):
    """The tokenizer directory is missing, unreadable or inconsistent."""


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """A model's tokenizer and chat templates, as a vLLM node serving it has them."""

    path: str
    engine: TextEngine
    # Ids the model adds around a prompt tokenized with add_special_tokens=True.
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    # bos_token, eos_token, ... as strings, plus additional_special_tokens: template globals.
    special_tokens: Mapping[str, Any] = field(default_factory=dict)
    # "default" and other named templates (e.g. "tool_use"); "processor" if one ships.
    templates: Mapping[str, str] = field(default_factory=dict)
    # Why the engine was chosen (tiktoken proven exact, or the reason it was not).
    engine_note: str = ""
    # The image processor's grid (preprocessor_config.json) when it sizes images by the
    # picture (Qwen2-VL's): images then cost what the node's processor makes of them.
    image_grid: ImageGrid | None = None

    @property
    def name(self) -> str:
        return self.engine.name

    def template_for(self, *, tools: bool) -> str | None:
        """The template vLLM resolves when a request gives none of its own."""
        if not tools and "processor" in self.templates:
            return self.templates["processor"]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default")

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.engine.encode(text)
        if add_special_tokens:
            return [*self.prefix, *ids, *self.suffix]
        return ids


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise TokenizerDirError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerDirError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    return None


def _templates(directory: str, cfg: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    raw = cfg.get("chat_template")
    if isinstance(raw, str):
        out["default"] = raw
    elif isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                out[str(item.get("name", "default"))] = item["template"]
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            out["default"] = fh.read()
    for extra in sorted(glob.glob(os.path.join(directory, "additional_chat_templates", "*.jinja"))):
        with open(extra, encoding="utf-8") as fh:
            out[os.path.basename(extra).removesuffix(".jinja")] = fh.read()
    processor = os.path.join(directory, "chat_template.json")
    if os.path.isfile(processor):
        tpl = _read_json(processor).get("chat_template")
        if isinstance(tpl, str):
            out["processor"] = tpl
    return out


def _added_tokens(spec: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, int]:
    added: dict[str, int] = {}
    for tok in spec.get("added_tokens") or []:
        if isinstance(tok, dict) and isinstance(tok.get("content"), str):
            added[tok["content"]] = int(tok["id"])
    decoder = cfg.get("added_tokens_decoder") or {}
    if isinstance(decoder, dict):
        for key, tok in decoder.items():
            text = _token_text(tok)
            if text is not None and text not in added:
                added[text] = int(key)
    return added


def _post_processor_ids(proc: Any, added: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """Ids a tokenizer.json post-processor puts before and after a single sequence."""
    if not isinstance(proc, dict):
        return [], []
    kind = proc.get("type")
    if kind == "Sequence":
        prefix: list[int] = []
        suffix: list[int] = []
        for step in proc.get("processors") or []:
            p, s = _post_processor_ids(step, added)
            prefix += p
            suffix = s + suffix
        return prefix, suffix
    if kind == "TemplateProcessing":
        specials = proc.get("special_tokens") or {}
        before: list[int] = []
        after: list[int] = []
        seen_seq = False
        for item in proc.get("single") or []:
            if "Sequence" in item:
                seen_seq = True
                continue
            name = item.get("SpecialToken", {}).get("id")
            ids = specials.get(name, {}).get("ids") or [added.get(name, -1)]
            (after if seen_seq else before).extend(int(i) for i in ids)
        return before, after
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls, sep = proc.get("cls") or [None, -1], proc.get("sep") or [None, -1]
        return [int(cls[1])], [int(sep[1])]
    return [], []


def tokenizer_class(directory: str, cfg: Mapping[str, Any]) -> str:
    """The transformers tokenizer class AutoTokenizer loads for ``directory`` (without
    "Fast"): tokenizer_config.json's ``tokenizer_class``, else config.json's
    ``tokenizer_class``, else its ``model_type`` where known, else "" (the generic
    PreTrainedTokenizerFast)."""
    named = cfg.get("tokenizer_class")
    if isinstance(named, str) and named:
        return named.removesuffix("Fast")
    model_cfg = os.path.join(directory, "config.json")
    if os.path.isfile(model_cfg):
        try:
            model = _read_json(model_cfg)
        except TokenizerDirError:
            return ""
        named = model.get("tokenizer_class")
        if isinstance(named, str) and named:
            return named.removesuffix("Fast")
        model_type = model.get("model_type")
        if isinstance(model_type, str):
            return _CLASS_OF_MODEL_TYPE.get(model_type, "")
    return ""


def _special_tokens(directory: str, cfg: Mapping[str, Any], cls: str) -> dict[str, Any]:
    """The special tokens a template sees, as transformers 4.x sets them: the class's
    defaults, then tokenizer_config.json's values (null removes one), then, for a
    config without ``added_tokens_decoder`` (saved before transformers 4.34),
    special_tokens_map.json's."""
    rules = _CLASS_RULES.get(cls)
    values: dict[str, Any] = dict(rules.defaults) if rules is not None else {}
    sources: list[Mapping[str, Any]] = [cfg]
    legacy = os.path.join(directory, "special_tokens_map.json")
    if "added_tokens_decoder" not in cfg and os.path.isfile(legacy):
        sources.append(_read_json(legacy))
    for source in sources:
        for name in (*_SPECIAL_NAMES, "additional_special_tokens"):
            if name in source:
                values[name] = source[name]
    out: dict[str, Any] = {}
    for name in _SPECIAL_NAMES:
        text = _token_text(values.get(name))
        if text is not None:
            out[name] = text
    extra = values.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return out


def _vocab(spec: Mapping[str, Any]) -> tuple[Callable[[str], int | None], int]:
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


def _with_special_tokens(
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
    tokens = [special.get(n) for n in _SPECIAL_NAMES]
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


def _bos_eos(
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
            raise TokenizerDirError(f"{key} is true but {token_key} {token!r} is no added token")
        sides.append(ids)
    return tuple(sides[0]), tuple(sides[1])


def load_model_tokenizer(
    directory: str, *, pattern: str | None = None, engine: str = "auto"
) -> ModelTokenizer:
    """The tokenizer in ``directory``; ``pattern`` is the split regex (or a family name
    from :data:`~kvgateway.tokens.encoding.PATTERNS`) of a ``*.tiktoken`` file.

    ``engine``: "auto" (tiktoken when proven exact), or "tokenizers" to force the
    ``tokenizers`` library (what the simulator's reference node does).
    """
    directory = os.path.expanduser(directory)
    if not os.path.isdir(directory):
        raise TokenizerDirError(f"tokenizer directory {directory!r} does not exist")
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    spec_path = os.path.join(directory, "tokenizer.json")
    bpe_files = sorted(glob.glob(os.path.join(directory, "*.tiktoken")))
    cls = tokenizer_class(directory, cfg)
    special = _special_tokens(directory, cfg, cls)
    note = ""
    if os.path.isfile(spec_path):
        with open(spec_path, encoding="utf-8") as fh:
            spec_text = fh.read()
        try:
            spec = json.loads(spec_text)
        except ValueError as exc:
            raise TokenizerDirError(f"cannot read {spec_path}: {exc}") from exc
        added = _with_special_tokens(_added_tokens(spec, cfg), special, _vocab(spec))
        processor = _post_processor_ids(spec.get("post_processor"), added)
        label = os.path.basename(os.path.normpath(directory))
        text_engine: TextEngine
        try:
            if engine == "tokenizers":
                raise NotExact("the tokenizers engine was asked for")
            parts = to_tiktoken_ranks(spec)
            text_engine = TiktokenEngine(label, parts.pattern, parts.ranks, added, nfc=parts.nfc)
            note = "byte-level BPE that tiktoken reproduces exactly"
        except NotExact as exc:
            text_engine = HfEngine(label, spec_text, added)
            note = f"tokenizers library: {exc}"
    elif bpe_files:
        if len(bpe_files) > 1:
            raise TokenizerDirError(f"{directory}: more than one *.tiktoken file: {bpe_files}")
        if pattern is None:
            raise TokenizerDirError(
                f"{bpe_files[0]} needs its split pattern (tokenizer.pattern: a family "
                f"name {', '.join(PATTERNS)} or the regex)"
            )
        try:
            ranks = load_tiktoken_bpe(bpe_files[0])
        except Exception as exc:
            raise TokenizerDirError(f"cannot read {bpe_files[0]}: {exc}") from exc
        # No tokenizer.json: transformers cannot build this one; its added tokens are
        # what the config lists, as before.
        added = _added_tokens({}, cfg)
        clash = [t for t, i in added.items() if i < len(ranks)]
        if clash:
            raise TokenizerDirError(f"added tokens {clash[:3]} reuse ids of the BPE file")
        label = os.path.basename(bpe_files[0])
        text_engine = TiktokenEngine(label, PATTERNS.get(pattern, pattern), ranks, added)
        processor = ([], [])
        note = "tiktoken BPE file"
    else:
        raise TokenizerDirError(f"{directory} has neither tokenizer.json nor a *.tiktoken BPE file")
    prefix, suffix = _bos_eos(cfg, cls, special, added, processor)
    templates = _templates(directory, cfg)
    for name, source in templates.items():
        try:
            ChatTemplate(source)
        except TemplateError as exc:
            raise TokenizerDirError(f"{directory}: chat template {name!r}: {exc}") from exc
    return ModelTokenizer(
        path=directory,
        engine=text_engine,
        prefix=prefix,
        suffix=suffix,
        special_tokens=special,
        templates=templates,
        engine_note=note,
        image_grid=load_grid(directory),
    )
