"""Counting a request exactly as the node will: its template, its tokenizer, its BOS.

:class:`ExactCounter` renders a chat request with the model's chat template
(:mod:`.chat_template`) and tokenizes the text as vLLM does (``add_special_tokens``
false for chat, true for completions, both overridable per request). Media parts
cost ``image_tokens`` each, or an image what the model's processor makes of its size
(:mod:`.images`).

Cost: the rendering of a multi-turn chat repeats its whole history every turn. With a
tiktoken engine the text between two added tokens (``<|im_start|>``, ``<|eot_id|>``...)
encodes the same wherever it stands, so those pieces' ids are kept in a
:class:`~kvgateway.tokens.counting.TextCache` and only the new turn is encoded, whether
the prompt is counted or its ids are taken (prefix-aware routing keys its blocks).
Uncached text above ``inline_chars`` is encoded in the executor, off the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from kvgateway.tokens.chat_template import ChatTemplate, TemplateError, new_environment
from kvgateway.tokens.conversation import conversation, tool_schemas
from kvgateway.tokens.counting import PromptTokens, TextCache
from kvgateway.tokens.images import ImagePricing
from kvgateway.tokens.modeldir import ModelTokenizer
from kvgateway.tokens.plans import TokenizerConfig, flag
from kvgateway.tokens.roles import as_system

# Per-request templates compiled and kept (only when the config trusts them).
_REQUEST_TEMPLATES = 8


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A chat request as the node's tokenizer will see it."""

    text: str
    media: int
    add_special_tokens: bool
    # What the media items cost the node (ImagePricing: flat, or an image by its size),
    # and at least (less when an image's size is unknown: a remote URL).
    media_tokens: int = 0
    media_floor: int = 0


class ExactCounter:
    """Counts one model's requests with its own tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        cache: TextCache[array[int]] | None = None,
        executor: Executor | None = None,
        *,
        image_tokens: int = 765,
        trust_request_chat_template: bool = False,
        inline_chars: int = 24_000,
        template_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # The node's default template arguments (--default-chat-template-kwargs).
        self._defaults = dict(template_defaults or {})
        self._cache: TextCache[array[int]] = cache if cache is not None else TextCache()
        self._executor = executor
        self._pricing = ImagePricing(image_tokens, tokenizer.image_grid)
        self._trust_request_template = trust_request_chat_template
        self._inline_chars = inline_chars
        self._env = new_environment()
        self._templates: dict[str, ChatTemplate] = {}
        for source in tokenizer.templates.values():
            self._templates.setdefault(source, ChatTemplate(source, self._env))
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._request_lock = threading.Lock()

    @classmethod
    def for_model(
        cls,
        config: TokenizerConfig,
        cache: TextCache[array[int]] | None = None,
        executor: Executor | None = None,
        *,
        trust_request_chat_template: bool = False,
    ) -> ExactCounter | None:
        """The exact counter for a model whose config has ``tokenizer.path``, else None."""
        if config.model is None:
            return None
        return cls(
            config.model,
            cache,
            executor,
            image_tokens=config.image_tokens,
            trust_request_chat_template=trust_request_chat_template,
            template_defaults=config.template_defaults(),
        )

    @property
    def name(self) -> str:
        return self.tokenizer.name

    # -- rendering (pure) ----------------------------------------------------------

    def _template(self, body: dict[str, Any], has_tools: bool) -> ChatTemplate:
        given = body.get("chat_template")
        if isinstance(given, str) and given and self._trust_request_template:
            with self._request_lock:  # big prompts are rendered in worker threads
                tpl = self._request_templates.get(given)
                if tpl is None:
                    tpl = ChatTemplate(given, self._env)
                    self._request_templates[given] = tpl
                    if len(self._request_templates) > _REQUEST_TEMPLATES:
                        self._request_templates.popitem(last=False)
                else:
                    self._request_templates.move_to_end(given)
                return tpl
        source = self.tokenizer.template_for(tools=has_tools)
        if source is None:
            raise TemplateError(f"the tokenizer in {self.tokenizer.path} has no chat template")
        return self._templates[source]

    def render_chat(self, body: dict[str, Any]) -> RenderedChat:
        """The prompt text vLLM builds for a chat request; raises TemplateError."""
        tools = tool_schemas(body.get("tools"))
        template = self._template(body, tools is not None)
        conv = conversation(body.get("messages") or [], template.content_format)
        messages = conv.messages
        if self.tokenizer.transformers >= 5:
            # vLLM >= 0.19's renderer: developer messages as system ones where the
            # template does not know the role.
            messages = as_system(messages, template.source)
        args = template_arguments(body, self._defaults)
        text = template.render(
            messages,
            tools=tools,
            documents=args.pop("documents", None),
            add_generation_prompt=bool(args.pop("add_generation_prompt", False)),
            continue_final_message=bool(args.pop("continue_final_message", False)),
            special_tokens=self.tokenizer.template_tokens,
            kwargs=args,
        )
        pricing = self._pricing.for_request(body)
        bounds = [pricing.bounds(p) for p in conv.media_parts]
        return RenderedChat(
            text,
            conv.media,
            flag(body, "add_special_tokens", False),
            sum(hi for hi, _ in bounds),
            sum(lo for _, lo in bounds),
        )

    def encode_chat(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a chat prompt (media items are not expanded)."""
        chat = self.render_chat(body)
        return self.tokenizer.encode_prompt(chat.text, add_special_tokens=chat.add_special_tokens)

    # -- counting ------------------------------------------------------------------

    def _added_count(self, add_special_tokens: bool) -> int:
        tok = self.tokenizer
        return len(tok.prefix) + len(tok.suffix) if add_special_tokens else 0

    def prompt_ids(self, body: dict[str, Any], media_id: int = 0) -> list[int]:
        """The node's prompt ids, each media item expanded to as many placeholder ids as
        it costs. Any thread may call it."""
        return self.counted_ids(body, media_id)[0]

    def counted_ids(
        self, body: dict[str, Any], media_id: int = 0
    ) -> tuple[list[int], PromptTokens]:
        """:meth:`prompt_ids` and the count they make, from one rendering."""
        chat = self.render_chat(body)
        engine = self.tokenizer.engine
        ids: list[int] = []
        chars = 0
        if engine.segment_additive:
            for piece in engine.split_added(chat.text):
                if engine.is_added(piece):
                    ids.extend(engine.encode(piece))
                    continue
                part = self._cache.get(piece)
                if part is None:
                    part = self._encode(piece)
                    chars += len(piece)
                ids.extend(part)
        else:
            ids = engine.encode(chat.text)
            chars = len(chat.text)
        if chat.add_special_tokens:
            ids = [*self.tokenizer.prefix, *ids, *self.tokenizer.suffix]
        ids += [media_id] * chat.media_tokens
        return ids, self._tokens(len(ids), chars, chat)

    def _tokens(self, n: int, chars: int, chat: RenderedChat) -> PromptTokens:
        floor = n - chat.media_tokens + chat.media_floor
        return PromptTokens(
            total=n,
            longest=n,
            prompts=1,
            encoded_chars=chars,
            each=(n,),
            floor=floor if floor < n else None,
        )

    def _ids(self, piece: str) -> Sequence[int]:
        """Ids of a text holding no added token, kept when the engine allows."""
        if not self.tokenizer.engine.segment_additive:
            return self.tokenizer.engine.encode(piece)
        ids = self._cache.get(piece)
        return self._encode(piece) if ids is None else ids

    def _encode(self, piece: str) -> array[int]:
        ids = array("i", self.tokenizer.engine.encode(piece))
        self._cache.put(piece, ids)
        return ids

    def completion_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The node's ids of a completions request's single prompt (a text encoded as
        the node encodes it, BOS/EOS as ``add_special_tokens`` says; ids as given);
        None for a batch."""
        prompts = _prompts(body.get("prompt"))
        if len(prompts) != 1:
            return None
        prompt = prompts[0]
        if isinstance(prompt, str):
            add = flag(body, "add_special_tokens", True)
            return self.tokenizer.encode_prompt(prompt, add_special_tokens=add)
        return list(prompt)

    def count_chat_sync(self, body: dict[str, Any]) -> int:
        """Like :meth:`count_chat`, on the calling thread (the event loop's: it uses the
        cache)."""
        chat = self.render_chat(body)
        return (
            self._count_text_sync(chat.text)
            + self._added_count(chat.add_special_tokens)
            + chat.media_tokens
        )

    def _pieces(self, text: str) -> tuple[int, list[str]]:
        """Added tokens counted, and the text pieces between them still to count."""
        engine = self.tokenizer.engine
        if not engine.segment_additive:
            return 0, [text] if text else []
        fixed = 0
        pieces: list[str] = []
        for piece in engine.split_added(text):
            if engine.is_added(piece):
                fixed += 1
            else:
                pieces.append(piece)
        return fixed, pieces

    def _count_text_sync(self, text: str) -> int:
        fixed, pieces = self._pieces(text)
        return fixed + sum(len(self._ids(piece)) for piece in pieces)

    async def count_text(self, text: str) -> tuple[int, int]:
        """Tokens of ``text`` (added tokens recognised, nothing added), and chars encoded."""
        if len(text) > 4 * self._inline_chars and self._executor is not None:
            # Cutting at added tokens is a regex over every character (~2 ms per 400k).
            loop = asyncio.get_running_loop()
            fixed, pieces = await loop.run_in_executor(self._executor, self._pieces, text)
        else:
            fixed, pieces = self._pieces(text)
        known = [self._cache.get(p) for p in pieces]
        todo = [p for p, ids in zip(pieces, known, strict=True) if ids is None]
        chars = sum(map(len, todo))
        if chars > self._inline_chars and self._executor is not None:
            loop = asyncio.get_running_loop()
            fresh = await loop.run_in_executor(self._executor, self._encode_many, todo)
        else:
            fresh = self._encode_many(todo)
        more = iter(fresh)
        return fixed + sum(len(ids if ids is not None else next(more)) for ids in known), chars

    def _encode_many(self, texts: Sequence[str]) -> list[Sequence[int]]:
        return [self._ids(text) for text in texts]

    async def count_chat(self, body: dict[str, Any]) -> PromptTokens:
        """Count a chat request; raises TemplateError when the node would refuse it."""
        chat = await self._render_off_loop(body)
        n, chars = await self.count_text(chat.text)
        n += self._added_count(chat.add_special_tokens) + chat.media_tokens
        return self._tokens(n, chars, chat)

    async def _render_off_loop(self, body: dict[str, Any]) -> RenderedChat:
        size = sum(len(str(m.get("content") or "")) for m in body.get("messages") or [])
        if size > 4 * self._inline_chars and self._executor is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self.render_chat, body)
        return self.render_chat(body)

    async def count_completion(self, body: dict[str, Any]) -> PromptTokens:
        """Count a completions request's ``prompt`` (a string, ids, or a batch of them)."""
        add = flag(body, "add_special_tokens", True)
        extra = self._added_count(add)
        per_prompt: list[int] = []
        chars = 0
        for prompt in _prompts(body.get("prompt")):
            if isinstance(prompt, str):
                n, c = await self.count_text(prompt)
                per_prompt.append(n + extra)
                chars += c
            else:
                per_prompt.append(len(prompt))
        return PromptTokens(
            total=sum(per_prompt),
            longest=max(per_prompt, default=0),
            prompts=len(per_prompt),
            encoded_chars=chars,
            each=tuple(per_prompt),
        )


def template_arguments(
    body: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What vLLM hands apply_chat_template besides the messages and tools.

    The node's ``defaults`` (``--default-chat-template-kwargs``), under the request's
    ``chat_template_kwargs``, both overridden by the request's own fields unless those
    are null or "auto" (``add_generation_prompt``, ``continue_final_message``,
    ``documents``, ``reasoning_effort``). A ``reasoning_effort`` also sets
    ``enable_thinking`` (false for "none") unless the kwargs set it.

    From vLLM's source (vllm-project/vllm; the search index holds these files at the
    commits named, not at b61ce3b08a2e, whose requirements/common.txt pins
    ``transformers >= 4.56.0, < 5``):
    ``vllm/entrypoints/openai/chat_completion/protocol.py`` @002032ee18,
    ``ChatCompletionRequest.build_chat_params`` (the four fields as ``extra_kwargs``, the
    ``enable_thinking`` rule, ``merge_kwargs(self.chat_template_kwargs, extra_kwargs)``);
    ``vllm/renderers/params.py`` @017638d701 lines 24-36, ``merge_kwargs`` (overrides
    whose value is None or "auto" are dropped)."""
    given = body.get("chat_template_kwargs")
    user: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
    # The node's defaults under the request's kwargs, whose null or "auto" values leave
    # a default be (vLLM's ChatParams.with_defaults, merge_kwargs over the defaults).
    merged = (
        {**defaults, **{k: v for k, v in user.items() if v is not None and v != "auto"}}
        if defaults
        else user
    )
    fields: dict[str, Any] = {
        "add_generation_prompt": flag(body, "add_generation_prompt", True),
        "continue_final_message": flag(body, "continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    effort = fields["reasoning_effort"]
    if effort is not None and "enable_thinking" not in user:
        fields["enable_thinking"] = effort != "none"
    merged.update((k, v) for k, v in fields.items() if v is not None and v != "auto")
    return merged


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list):
        return [p for p in prompt if isinstance(p, str | list)]
    return []
