"""Rendering a chat request with the model's template, as vLLM renders it.

vLLM turns the request's messages into a "conversation" (content parts joined or kept
as a list depending on the template, tool-call arguments parsed from JSON, unknown
message keys dropped), then calls transformers' ``apply_chat_template``: a sandboxed
jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension and a ``{% generation %}`` tag, the globals ``raise_exception`` and
``strftime_now``, and a ``tojson`` filter that keeps non-ASCII text
(``ensure_ascii=False``) and accepts ``indent``, ``separators`` and ``sort_keys``. The
template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
tokenizer's special tokens (``bos_token`` ...) and the request's
``chat_template_kwargs`` (which override the special tokens; the request's own fields
override them, see :func:`kvgateway.tokens.exact.template_arguments`).
``continue_final_message`` appends a tag to the final text and cuts the rendering where
the tag lands.

The reference is what a vLLM node runs: transformers 4.57's ``apply_chat_template``
(``tokenization_utils_base.py``) and ``render_jinja_template``, which transformers 5.19
(vLLM 0.32's) renders alike (its templates see the named special tokens only, see
:mod:`.transformers5`). Messages reach the template as vLLM builds them
(:func:`.conversation.conversation`), None-valued keys kept, no ``thinking`` alias added (both
versions); vLLM >= 0.19 then rewrites developer messages (:mod:`.roles`).

Images and other media are not rendered here: the counter adds a configured cost per
item (see :func:`.conversation.conversation`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvgateway.tokens.conversation import ContentFormat

# Keys vLLM passes to apply_chat_template itself: a request may not set these through
# chat_template_kwargs (vLLM answers 400), so they are ignored here.
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize"})
# Keys vLLM passes on (vllm/renderers/hf.py @02e64f581de4, resolve_chat_template_kwargs:
# apply_chat_template's own parameters and the template's variables are kept) that
# collide with arguments set by vLLM's safe_apply_chat_template ("conversation", "tools")
# or by transformers 4.57's render_jinja_template ("messages", "conversations"): Python
# raises TypeError ("got multiple values"), which safe_apply_chat_template turns into a
# ValueError, a 400. The last two only reach transformers when the template reads them.
_PARAMETER_KWARGS = frozenset({"conversation", "tools"})
_VARIABLE_KWARGS = frozenset({"messages", "conversations"})


class TemplateError(ValueError):
    """The template failed to compile or raised while rendering (vLLM answers 400)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (assistant masks unused)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's declared attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        text: str = caller()
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# What ``message.role`` may find on a dict before its keys: dict's own attributes.
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with ``obj.key`` on a plain dict read at once.

    The sandbox's ``getattr`` first looks for an attribute (none of a dict's is a key
    that is not one of dict's own names), then falls back to ``obj[key]``: the same
    value, found without the failed lookup and its exception. Templates read every
    message's fields this way (``message.role``, ``message.content``)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (KeyError, TypeError):
                pass
        return super().getattr(obj, attribute)


def new_environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (vLLM's "openai" format)."""
    message_vars = {"messages"}
    for assign in ast.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _reads(assign.node, message_vars):
            message_vars.add(assign.target.name)
    item_vars: set[str] = set()
    for loop in ast.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, message_vars):
            item_vars.add(loop.target.name)
    for loop in ast.find_all(jinja2.nodes.For):
        if _reads(loop.iter, item_vars, key="content"):
            return True
    return False


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        return _reads(node.node, names, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, names, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _reads(node.node, names)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _reads(node.node, names) and node.attr == key
    return False


class ChatTemplate:
    """One compiled template (compile once per template text: it takes milliseconds)."""

    def __init__(self, source: str, env: ImmutableSandboxedEnvironment | None = None) -> None:
        env = env or new_environment()
        try:
            self._template = env.from_string(source)
            ast = env.parse(source)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.content_format: ContentFormat = "openai" if _loops_over_content(ast) else "string"
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        special_tokens: Mapping[str, Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if not messages:
            # transformers 4.57 apply_chat_template reads conversation[0]
            # (tokenization_utils_base.py:1650): an IndexError, which vLLM's
            # safe_apply_chat_template turns into a ValueError, a 400.
            raise TemplateError("cannot apply a chat template to an empty conversation")
        context: dict[str, Any] = dict(special_tokens or {})
        for key, value in (kwargs or {}).items():
            if key in _PARAMETER_KWARGS or (key in _VARIABLE_KWARGS and key in self.variables):
                raise TemplateError(f"chat_template_kwargs may not set {key!r}")
            if key not in _RESERVED_KWARGS:
                context[key] = value
        context.update(
            tools=tools, documents=documents, add_generation_prompt=add_generation_prompt
        )
        context.pop("continue_final_message", None)
        if continue_final_message and add_generation_prompt:
            raise TemplateError(
                "continue_final_message and add_generation_prompt are not compatible"
            )
        final: str | None = None
        if continue_final_message:
            messages, final = self._tag_final(messages)
        context["messages"] = messages
        try:
            rendered: str = self._template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateError(f"chat template failed: {exc!r}") from exc
        except RecursionError as exc:
            raise TemplateError("chat template: a value is nested too deeply") from exc
        if final is not None:
            rendered = _cut_at_tag(rendered, final)
        return rendered

    def _tag_final(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """transformers' continue_final_message (4.57 render_jinja_template): the last text
        of the final message gets a tag appended, and the rendering is cut where the tag
        lands."""
        last = dict(messages[-1])
        content = last.get("content")
        if isinstance(content, list):
            parts = list(content)
            for i in range(len(parts) - 1, -1, -1):
                part = parts[i]
                if isinstance(part, dict) and "text" in part:
                    final = part["text"]
                    parts[i] = {**part, "text": f"{final}{_CONTINUE_TAG}"}
                    break
            else:
                raise TemplateError("continue_final_message: the final message has no text")
            last["content"] = parts
        elif isinstance(content, str):
            final = content
            last["content"] = content + _CONTINUE_TAG
        else:
            raise TemplateError("continue_final_message: the final message has no text")
        if not isinstance(final, str):
            raise TemplateError("continue_final_message: the final message has no text")
        return [*messages[:-1], last], final


# transformers (4.57 as 5.x) appends this to the text to continue and cuts the rendering
# where it lands.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise TemplateError("continue_final_message: the final message is not in the rendering")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the text (and the tag's trailing space): so must the cut.
    return rendered[:at].rstrip()
