"""How a model's prompts are counted: the encoding and the template allowances."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvgateway.tokens.encoding import EncodingSpec
from kvgateway.tokens.modeldir import ModelTokenizer


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
        """The node's default chat-template arguments (empty without any)."""
        if not self.chat_template_kwargs:
            return {}
        value = json.loads(self.chat_template_kwargs)
        return value if isinstance(value, dict) else {}
