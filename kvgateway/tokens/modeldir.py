"""Loading a model's own tokenizer from a directory, offline.

A directory is a Hugging Face model directory or just its tokenizer files:

- ``tokenizer.json`` (the vocabulary, added tokens and post-processor), run by tiktoken
  when :mod:`.bytelevel` proves that exact, else by the ``tokenizers`` library; or a
  tiktoken-format BPE file (``*.tiktoken``) with its split pattern given by the caller;
- ``tokenizer_config.json``: ``chat_template`` (one string, or named templates),
  ``bos_token``/``eos_token`` and the other special tokens a template may print,
  ``add_bos_token``/``add_eos_token``, ``added_tokens_decoder``, ``tokenizer_class``;
- ``config.json`` (its ``tokenizer_class`` or ``model_type``) and
  ``special_tokens_map.json``: the tokenizer class, its special tokens, BOS/EOS and (in
  transformers 5) its own normalizer and pre-tokenizer, as the nodes' transformers sets
  them: 5.x (vLLM >= 0.19, :mod:`.transformers5`) or 4.x (:mod:`.special_tokens`);
- ``chat_template.jinja`` (wins over the config's template, as in transformers) and a
  processor's ``chat_template.json`` (vLLM prefers it when the request has no tools).

:func:`load_model_tokenizer` raises :class:`TokenizerDirError` saying what is missing
or inconsistent; the config loader prefixes the YAML path.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiktoken.load import load_tiktoken_bpe

from kvgateway.tokens import transformers5
from kvgateway.tokens.bytelevel import MergeProofs, NotExact, to_tiktoken_ranks
from kvgateway.tokens.chat_template import ChatTemplate, TemplateError
from kvgateway.tokens.engines import HfEngine, TextEngine, TiktokenEngine
from kvgateway.tokens.images import ImageGrid, load_grid
from kvgateway.tokens.lookahead_free import PATTERNS
from kvgateway.tokens.special_tokens import (
    SpecialTokenError,
    bos_eos,
    special_tokens,
    token_text,
    tokenizer_class,
    vocabulary,
    with_special_tokens,
)

# The transformers major versions whose tokenizer loading is modelled: 5 is what vLLM
# >= 0.19 runs, 4 what earlier releases ran.
TRANSFORMERS_VERSIONS = (4, 5)


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
    # The transformers major version the nodes run (what the rules above followed).
    transformers: int = 5

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def template_tokens(self) -> Mapping[str, Any]:
        """The special tokens a chat template sees (transformers 5: the named ones only)."""
        if self.transformers >= 5:
            return transformers5.template_tokens(self.special_tokens)
        return self.special_tokens

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


def _optional_json(path: str) -> dict[str, Any]:
    """A JSON file the directory may have ({} without it, or if it is unreadable: as
    transformers, which then goes on without it)."""
    if not os.path.isfile(path):
        return {}
    try:
        return _read_json(path)
    except TokenizerDirError:
        return {}


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
            text = token_text(tok)
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


def load_model_tokenizer(
    directory: str,
    *,
    pattern: str | None = None,
    engine: str = "auto",
    transformers: int = 5,
    proofs: MergeProofs | None = None,
) -> ModelTokenizer:
    """The tokenizer in ``directory``; ``pattern`` is the split regex (or a family name
    from :data:`~kvgateway.tokens.lookahead_free.PATTERNS`) of a ``*.tiktoken`` file.

    ``engine``: "auto" (tiktoken when proven exact), or "tokenizers" to force the
    ``tokenizers`` library (what the simulator's reference node does). ``transformers``:
    the major version whose loading rules apply (see :data:`TRANSFORMERS_VERSIONS`).
    ``proofs``: merge checks already made (see :class:`~.bytelevel.MergeProofs`).
    """
    if transformers not in TRANSFORMERS_VERSIONS:
        raise TokenizerDirError(
            f"transformers {transformers} is not one of {TRANSFORMERS_VERSIONS}"
        )
    v5 = transformers >= 5
    directory = os.path.expanduser(directory)
    if not os.path.isdir(directory):
        raise TokenizerDirError(f"tokenizer directory {directory!r} does not exist")
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    spec_path = os.path.join(directory, "tokenizer.json")
    bpe_files = sorted(glob.glob(os.path.join(directory, "*.tiktoken")))
    model_cfg = _optional_json(os.path.join(directory, "config.json"))
    legacy = _optional_json(os.path.join(directory, "special_tokens_map.json"))
    if v5:
        cls = transformers5.tokenizer_class(cfg, model_cfg)
        special = transformers5.special_tokens(cfg, legacy, cls)
    else:
        cls = tokenizer_class(cfg, model_cfg)
        special = special_tokens(cfg, legacy, cls)
    note = ""
    if os.path.isfile(spec_path):
        with open(spec_path, encoding="utf-8") as fh:
            spec_text = fh.read()
        try:
            spec = json.loads(spec_text)
        except ValueError as exc:
            raise TokenizerDirError(f"cannot read {spec_path}: {exc}") from exc
        if v5 and cls:
            # The class's own normalizer, pre-tokenizer and BPE options replace the file's.
            spec = transformers5.pipeline(spec, cls, cfg)
            spec_text = json.dumps(spec, ensure_ascii=False)
        added = with_special_tokens(_added_tokens(spec, cfg), special, vocabulary(spec))
        processor = _post_processor_ids(spec.get("post_processor"), added)
        label = os.path.basename(os.path.normpath(directory))
        text_engine: TextEngine
        try:
            if engine == "tokenizers":
                raise NotExact("the tokenizers engine was asked for")
            parts = to_tiktoken_ranks(spec, proofs=proofs)
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
        # what the config lists (as transformers 4 reads them).
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
    try:
        # transformers 5 drops add_bos_token/add_eos_token beside a tokenizer.json: the
        # post-processor (the file's, or the class's own) decides.
        prefix, suffix = (
            (tuple(processor[0]), tuple(processor[1]))
            if v5 and os.path.isfile(spec_path)
            else bos_eos(cfg, cls, special, added, processor)
        )
    except SpecialTokenError as exc:
        raise TokenizerDirError(str(exc)) from exc
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
        transformers=transformers,
    )
