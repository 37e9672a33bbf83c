"""The gateway's prompt ids equal what a vLLM <= 0.18 node computes (transformers 4.x),
with transformers as the oracle: the gateway's ``tokenizer.transformers: 4`` mode.
(vLLM >= 0.19 runs transformers 5: test_vs_transformers5.py checks the default mode.)

The gateway renders chat templates with its own sandboxed jinja2 (``chat_template.py``),
and so does the simulator, so their agreement says nothing about the rendering. Here
the reference is what vLLM runs: Hugging Face ``AutoTokenizer.from_pretrained(dir)``,
``apply_chat_template(..., tokenize=False)`` and then the tokenizer itself with
``add_special_tokens=False``, with the transformers vLLM <= 0.18 installs: its
``requirements/common.txt`` pins ``transformers >= 4.56.0, < 5`` (vllm-project/vllm
b61ce3b08a2e), so the oracle is a 4.x release (the dev extra pins it; checked with
4.57.5). Messages keep None-valued keys and reasoning only under vLLM's names
(``test_transformers_4_message_keys``; transformers 5.19 renders them alike).

vLLM prepares the request before transformers sees it; that step is written out below
from vLLM's source, independently of the gateway's ``conversation()``. The search index
holds vLLM's requirements/common.txt at b61ce3b08a2e but these files only at other
commits, named here: ``vllm/entrypoints/chat_utils.py`` @001eadcf295d
(``_parse_chat_message_content``, ``_postprocess_messages``);
``vllm/entrypoints/openai/chat_completion/protocol.py`` @002032ee18b2
(``ChatCompletionRequest.build_chat_params``, ``_normalize_messages_before``);
``vllm/renderers/params.py`` @017638d70159 lines 24-36 (``merge_kwargs``);
``vllm/renderers/hf.py`` @02e64f581de4 (``resolve_chat_template_kwargs``,
``safe_apply_chat_template``); the ``FunctionDefinition`` serializer:

- content parts: text-like parts (text, input_text, output_text, refusal, thinking)
  become strings joined with "\\n" when the template's content format is "string", or
  ``{"type": "text", "text": ...}`` dicts when it is "openai" (tool messages whose parts
  are all text are joined back into one string);
- assistant ``tool_calls``: an empty list is dropped, string ``arguments`` are parsed
  as JSON (``{}`` when that fails);
- ``reasoning`` is passed as ``reasoning`` and ``reasoning_content``; a message's
  ``reasoning_content`` is read as its ``reasoning`` when that is None
  (``ChatCompletionRequest._normalize_messages_before``);
- the request's ``add_generation_prompt``, ``continue_final_message``, ``documents``
  and ``reasoning_effort`` override ``chat_template_kwargs`` unless None; a
  ``reasoning_effort`` sets ``enable_thinking`` unless the kwargs do;
- kwargs are kept only when the template reads them or apply_chat_template takes them;
- tools are dumped as ``{"type", "function": {"name", "description", "parameters"}}``
  (``strict`` only when set, unknown keys dropped).

The content format of each template is stated here by hand (which templates loop over
``message.content``), and checked against the gateway's detection.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jinja2.meta
import jinja2.sandbox
import pytest
import transformers

from kvgateway.tokens.chat_template import ChatTemplate, TemplateError
from kvgateway.tokens.counting import PromptCounter, TextCountCache
from kvgateway.tokens.encoding import EncodingCache, load_encoding
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import ModelTokenizer, _templates
from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig, plan_chat
from kvgateway.tokens.standin import upper_bound
from tests.support import corpus, templates

# Loads real vocabularies (and transformers): the slow tier.
pytestmark = pytest.mark.slow

# -- vLLM's request preparation, re-stated -----------------------------------------

_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def vllm_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool["function"]
        dumped = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        for optional in ("strict", "defer_loading"):
            if fn.get(optional) is not None:
                dumped[optional] = fn[optional]
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def vllm_conversation(messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    conv: list[dict[str, Any]] = []
    for msg in copy.deepcopy(messages):
        role = msg["role"]
        content = msg.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = content
        pieces: list[Any] = []
        for part in parts:
            if isinstance(part, str):
                text = part
            else:
                field = _TEXT_FIELDS[part["type"]]  # the corpus carries no media
                text = part.get(field)
                if text is None and part["type"] in ("text", "refusal"):
                    continue
            if fmt != "openai" and not text:
                continue  # vLLM keeps a parsed part only if it is truthy
            pieces.append({"type": "text", "text": text} if fmt == "openai" else text)
        new: dict[str, Any] = {
            "role": role,
            "content": pieces if fmt == "openai" else "\n".join(pieces),
        }
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                new["tool_calls"] = list(msg["tool_calls"])
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                new["reasoning"] = reasoning
                new["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                new["tool_call_id"] = msg["tool_call_id"]
            if isinstance(new["content"], list) and not any(
                isinstance(p, dict) and p.get("type") != "text" for p in new["content"]
            ):
                new["content"] = "\n".join(p.get("text", "") for p in new["content"])
        if isinstance(msg.get("name"), str):
            new["name"] = msg["name"]
        conv.append(new)
    for new in conv:
        calls = new.get("tool_calls")
        if new["role"] != "assistant" or not isinstance(calls, list):
            continue
        if not calls:
            del new["tool_calls"]
            continue
        for call in calls:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args)
                except json.JSONDecodeError:
                    call["function"]["arguments"] = {}
            elif not isinstance(args, dict | list):
                call["function"]["arguments"] = {}
    return conv


_HF_PARAMS = frozenset(
    name
    for name, p in inspect.signature(
        transformers.PreTrainedTokenizerBase.apply_chat_template
    ).parameters.items()
    if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
)


@functools.lru_cache(maxsize=16)
def _template_vars(source: str) -> frozenset[str]:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def vllm_template_kwargs(body: dict[str, Any], source: str) -> dict[str, Any]:
    user = dict(body.get("chat_template_kwargs") or {})
    extra: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    if body.get("reasoning_effort") is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = body["reasoning_effort"] != "none"
    merged = user | {k: v for k, v in extra.items() if v not in (None, "auto")}
    accepted = (_template_vars(source) | _HF_PARAMS) - {"chat_template", "tokenize"}
    return {k: v for k, v in merged.items() if k in accepted}


def node_ids(tok: Any, body: dict[str, Any], fmt: str, source: str | None = None) -> list[int]:
    """The node's prompt ids: vLLM's preparation, transformers' rendering and encoding.

    vLLM resolves the template itself (``tokenizer.get_chat_template(None, tools)`` for
    a text model) and passes it as ``chat_template``; ``source`` stands for a directory
    whose tokenizer_config.json carries that template."""
    source = source or tok.get_chat_template(None, tools=vllm_tools(body.get("tools")))
    text = tok.apply_chat_template(
        vllm_conversation(body["messages"], fmt),
        tools=vllm_tools(body.get("tools")),
        chat_template=source,
        tokenize=False,
        **vllm_template_kwargs(body, source),
    )
    assert isinstance(text, str)
    ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    return ids


# -- request variants ----------------------------------------------------------


def as_parts(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The same request with each string content cut into 1-3 text parts."""
    body = copy.deepcopy(body)
    for msg in body["messages"]:
        content = msg.get("content")
        if not isinstance(content, str) or not content:
            continue
        cuts = sorted(rng.sample(range(1, len(content)), min(rng.randint(0, 2), len(content) - 1)))
        bounds = [0, *cuts, len(content)]
        kind = "text" if msg["role"] != "assistant" else rng.choice(["text", "output_text"])
        msg["content"] = [
            {"type": kind, "text": content[a:b]} for a, b in itertools.pairwise(bounds)
        ]
    return body


PREFILLS = ["The answer is ", "Sure", "", "  leading and trailing  ", "line one\nline two\n", "{"]


def continued(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The request with an assistant message the model must continue."""
    body = copy.deepcopy(body)
    body["messages"].append({"role": "assistant", "content": rng.choice(PREFILLS)})
    body["add_generation_prompt"] = False
    body["continue_final_message"] = True
    return body


def without_generation_prompt(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "add_generation_prompt": False}


def with_string_arguments_oddities(body: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as vLLM may get them: bad JSON, empty, a dict, a list, None."""
    body = copy.deepcopy(body)
    oddities: list[Any] = ["not json", "", '{"city": "Z\\u00fcrich", "n": [1, 2.5, null]}', None]
    i = 0
    for msg in body["messages"]:
        for call in msg.get("tool_calls") or []:
            call["function"]["arguments"] = oddities[i % len(oddities)]
            i += 1
    return body


def variants(kind: str, n: int, seed: int) -> Iterator[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    for i, body in enumerate(corpus.corpus(seed, n)):
        yield "plain", body
        yield "parts", as_parts(body, rng)
        if i % 2 == 0:
            yield "continue", continued(body, rng)
        if i % 3 == 0:
            yield "no-generation-prompt", without_generation_prompt(body)
        if i % 4 == 0 and "tools" in body:
            yield "odd-arguments", with_string_arguments_oddities(body)
        if i % 5 == 0:
            # vLLM: the request's own add_generation_prompt wins over the kwargs'.
            yield "kwargs", {**body, "chat_template_kwargs": {"add_generation_prompt": False}}


# -- model directories ---------------------------------------------------------

# "qwen-merges" is the Qwen directory with Qwen2's merges.txt layout: the same template
# and ids, and test_exact.py already holds the gateway to the node's tokenizer on it;
# loading it here would cost a fifth of this file's time for no new rendering.
KINDS = ("qwen", "llama3", "tekken", "sentencepiece")
# None of the family templates loops over message.content.
FORMATS = {templates.QWEN: "string", templates.LLAMA31: "string", templates.MISTRAL: "string"}


# The tokenizer_class the real repositories' tokenizer_config.json names
# (meta-llama/Llama-3.1-8B-Instruct, mistralai/Mistral-Nemo-Instruct-2407), for the test
# directories whose builders leave it out. transformers 4.x cannot load a directory
# without it and without a config.json (a real model directory has both); the
# sentencepiece builder writes Mistral-7B-Instruct-v0.3's "LlamaTokenizer" itself.
REAL_TOKENIZER_CLASS = {"llama3": "PreTrainedTokenizerFast", "tekken": "PreTrainedTokenizerFast"}


def hf_directory(kind: str, directory: Path, root: Path) -> Path:
    """The directory transformers loads: the built one, or a view of it whose
    tokenizer_config.json names the real repository's tokenizer class."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if "tokenizer_class" in config:
        return directory
    view = root / kind
    view.mkdir()
    (view / "tokenizer.json").symlink_to(directory / "tokenizer.json")
    config["tokenizer_class"] = REAL_TOKENIZER_CLASS[kind]
    (view / "tokenizer_config.json").write_text(json.dumps(config))
    return view


_HF: dict[Path, Any] = {}


def hf_tokenizer(directory: Path) -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, as vLLM loads it, once per run."""
    if directory not in _HF:
        _HF[directory] = transformers.AutoTokenizer.from_pretrained(str(directory))
    return _HF[directory]


class Pair:
    """One model directory as the gateway and as transformers load it."""

    def __init__(
        self, directory: Path, gateway: ModelTokenizer, hf: Any, template: str | None = None
    ) -> None:
        self.directory = directory
        self.gateway = ExactCounter(gateway)
        self.hf = hf
        self.template = template

    def source(self, body: dict[str, Any]) -> str:
        return self.template or self.hf.get_chat_template(None, tools=body.get("tools"))

    def check(self, body: dict[str, Any], fmt: str | None = None) -> None:
        source = self.source(body)
        want = node_ids(self.hf, body, fmt or FORMATS[source], source)
        got = self.gateway.prompt_ids(body)
        if got != want:
            text = self.gateway.render_chat(body).text
            ref = self.hf.decode(want)
            raise AssertionError(
                f"{self.directory.name}: ids differ\n"
                f"body: {json.dumps(body, ensure_ascii=False)[:1500]}\n"
                f"gateway text: {text!r}\ntransformers text: {ref!r}"
            )


@pytest.fixture(scope="module")
def gateway_tokenizer(
    vocab_dirs: Callable[[str], Path], encodings: EncodingCache
) -> Callable[[str], ModelTokenizer]:
    """The gateway as it counts for nodes on transformers 4.x (``tokenizer.transformers:
    4``, vLLM <= 0.18): what this oracle checks (test_vs_transformers5.py checks 5)."""
    return lambda kind: encodings.model(str(vocab_dirs(kind)), transformers=4)


@pytest.fixture(scope="module")
def pairs(
    vocab_dirs: Callable[[str], Path],
    gateway_tokenizer: Callable[[str], ModelTokenizer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], Pair]]:
    root = tmp_path_factory.mktemp("hf-views")
    loaded: dict[str, Pair] = {}

    def get(kind: str) -> Pair:
        if kind not in loaded:
            directory = vocab_dirs(kind)
            hf = hf_tokenizer(hf_directory(kind, directory, root))
            loaded[kind] = Pair(directory, gateway_tokenizer(kind), hf)
        return loaded[kind]

    yield get
    shutil.rmtree(root, ignore_errors=True)


def test_directories_load_as_the_real_repositories(pairs: Callable[[str], Pair]) -> None:
    classes = {kind: type(pairs(kind).hf).__name__ for kind in KINDS}
    assert classes == {
        "qwen": "Qwen2TokenizerFast",
        "llama3": "PreTrainedTokenizerFast",
        "tekken": "PreTrainedTokenizerFast",
        "sentencepiece": "LlamaTokenizerFast",
    }


@pytest.mark.parametrize("kind", KINDS)
def test_corpus_prompt_ids_equal_transformers(kind: str, pairs: Callable[[str], Pair]) -> None:
    pair = pairs(kind)
    seen: dict[str, int] = {}
    for name, body in variants(kind, n=20, seed=101):
        pair.check(body)
        seen[name] = seen.get(name, 0) + 1
    assert set(seen) == {
        "plain",
        "parts",
        "continue",
        "no-generation-prompt",
        "odd-arguments",
        "kwargs",
    }, seen


def test_llama_date_string_kwarg(pairs: Callable[[str], Pair]) -> None:
    pair = pairs("llama3")
    for body in corpus.corpus(7, 5):
        pair.check({**body, "chat_template_kwargs": {"date_string": "01 Jan 2027"}})
        # A kwarg the template does not read is dropped by vLLM and unseen either way.
        pair.check({**body, "chat_template_kwargs": {"unused_flag": True}})


# -- a template that uses what the family templates do not ---------------------

# ChatML with the Qwen3/gpt-oss extras: documents, enable_thinking, reasoning_effort, a
# custom kwarg, reasoning under both names, tool-call ids, message names.
THINKING = """\
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- else %}{%- set sys = '' %}{%- endif %}
{{- '<|im_start|>system\\n' + sys }}
{%- if reasoning_effort is defined and reasoning_effort %}{{- '\\nReasoning: ' + reasoning_effort }}{%- endif %}
{%- if house_style is defined %}{{- '\\nStyle: ' + house_style | string }}{%- endif %}
{%- if documents %}
{{- '\\n# Documents' }}
{%- for doc in documents %}{{- '\\n[' ~ loop.index ~ '] ' + doc.title + ': ' + doc.text }}{%- endfor %}
{%- endif %}
{%- if tools %}
{{- '\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{{- '<|im_start|>' + message.role }}
{%- if message.name is defined %}{{- ' name=' + message.name }}{%- endif %}
{{- '\\n' }}
{%- if message.role == 'assistant' %}
{%- if message.reasoning_content is defined and message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{%- if message.thinking is defined %}{{- '<analysis>' + message.thinking + '</analysis>' }}{%- endif %}
{{- message.content }}
{%- for call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson + '\\n</tool_call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<tool_response id=' ~ (message.tool_call_id | default('?')) ~ '>\\n' + message.content + '\\n</tool_response>' }}
{%- else %}
{{- message.content }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# vLLM's "openai" content format: the template walks the content parts itself.
PARTS = """\
{{- bos_token | default('') }}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string %}
{{- message['content'] }}
{%- else %}
{%- for part in message['content'] %}
{%- if part['type'] == 'text' %}{{- '[' + part['text'] + ']' }}{%- else %}{{- '<' + part['type'] + '>' }}{%- endif %}
{%- endfor %}
{%- endif %}
{%- if message.tool_calls is defined %}
{%- for call in message.tool_calls %}{{- '\\n<tool_call>' + call.function.name + ' ' + call.function.arguments | tojson + '</tool_call>' }}{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
FORMATS[THINKING] = "string"
FORMATS[PARTS] = "openai"


@pytest.fixture(scope="module")
def custom(
    vocab_dirs: Callable[[str], Path],
    gateway_tokenizer: Callable[[str], ModelTokenizer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, str], Pair]]:
    """The Qwen vocabulary with another chat template in its tokenizer_config.json (the
    gateway loads that directory's templates; its vocabulary is the Qwen one, already
    converted, and transformers' Qwen tokenizer is handed the template as vLLM hands it)."""
    root = tmp_path_factory.mktemp("custom-templates")
    loaded: dict[str, Pair] = {}

    def get(name: str, source: str) -> Pair:
        if name not in loaded:
            base = vocab_dirs("qwen")
            directory = root / name
            directory.mkdir()
            (directory / "tokenizer.json").symlink_to(base / "tokenizer.json")
            config = json.loads((base / "tokenizer_config.json").read_text())
            config["chat_template"] = source
            (directory / "tokenizer_config.json").write_text(json.dumps(config))
            qwen = gateway_tokenizer("qwen")
            gateway = dataclasses.replace(
                qwen, path=str(directory), templates=_templates(str(directory), config)
            )
            loaded[name] = Pair(directory, gateway, hf_tokenizer(base), source)
        return loaded[name]

    yield get
    shutil.rmtree(root, ignore_errors=True)


def test_content_formats_match_vllm_detection() -> None:
    for source, fmt in FORMATS.items():
        assert ChatTemplate(source).content_format == fmt


def test_thinking_template_kwargs_documents_and_reasoning(
    custom: Callable[[str, str], Pair],
) -> None:
    pair = custom("thinking", THINKING)
    rng = random.Random(3)
    docs = [
        {"title": "Cache", "text": "KV blocks are 16 tokens. 東京"},
        {"title": "Routing", "text": corpus.text(rng, 30)},
    ]
    for body in corpus.corpus(21, 12):
        pair.check(body)
        pair.check(as_parts(body, rng))
        pair.check({**body, "documents": docs})
        pair.check({**body, "chat_template_kwargs": {"enable_thinking": False}})
        pair.check({**body, "chat_template_kwargs": {"house_style": "terse", "documents": docs}})
        pair.check({**body, "reasoning_effort": rng.choice(["none", "low", "high"])})
        pair.check(
            {
                **body,
                "reasoning_effort": "low",
                "chat_template_kwargs": {"enable_thinking": True},
            }
        )
        pair.check(continued(body, rng))
    history = [
        {"role": "user", "content": "Weather?", "name": "ana"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "The user wants weather; call the tool.",
            "tool_calls": [
                {
                    "id": "call1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call1", "content": [{"type": "text", "text": "3°C"}]},
        {"role": "assistant", "content": "It is 3°C.", "tool_calls": []},
        {"role": "user", "content": "Thanks"},
    ]
    pair.check({"messages": history, "tools": corpus.TOOLS})
    pair.check({"messages": history[:1], "tools": [{"function": {"name": "f", "strict": True}}]})


def test_transformers_4_message_keys(custom: Callable[[str, str], Pair]) -> None:
    """transformers keeps None-valued keys (a tool message's null tool_call_id is
    defined, and renders as "None"), and the template sees
    reasoning only under vLLM's names (``reasoning``, ``reasoning_content``), never as
    ``thinking``."""
    pair = custom("thinking", THINKING)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "old", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": None, "content": "r"},
            {"role": "assistant", "content": "a", "reasoning": "why", "name": None},
            {"role": "user", "content": "q2"},
        ]
    }
    pair.check(body)
    text = pair.gateway.render_chat(body).text
    assert "<tool_response id=None>" in text
    assert "<think>\nold\n</think>" in text and "<think>\nwhy\n</think>" in text
    assert "<analysis>" not in text


def test_openai_content_format(custom: Callable[[str, str], Pair]) -> None:
    pair = custom("parts", PARTS)
    rng = random.Random(4)
    for body in corpus.corpus(31, 12):
        pair.check(body)
        pair.check(as_parts(body, rng))
        pair.check(continued(as_parts(body, rng), rng))
    mixed = [
        {
            "role": "user",
            "content": [
                "a bare string part",
                {"type": "input_text", "text": "input text"},
                {"type": "refusal", "refusal": "no"},
                {"type": "text", "text": None},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
        },
    ]
    pair.check({"messages": mixed})


HI = [{"role": "user", "content": "hi"}]
REFUSED: dict[str, dict[str, Any]] = {
    "generation-prompt-and-continue": {
        "messages": HI,
        "add_generation_prompt": True,
        "continue_final_message": True,
    },
    # transformers 4.57 reads conversation[0] (tokenization_utils_base.py:1650).
    "empty": {"messages": []},
    # Kept by vLLM's resolve_chat_template_kwargs (apply_chat_template's parameters, the
    # template's variables), then given twice: "tools" and "conversation" to
    # apply_chat_template by vLLM's safe_apply_chat_template (vllm/renderers/hf.py),
    # "messages" to template.render by transformers (chat_template_utils.py:539-540).
    "kwargs-tools": {"messages": HI, "chat_template_kwargs": {"tools": []}},
    "kwargs-conversation": {"messages": HI, "chat_template_kwargs": {"conversation": HI}},
    "kwargs-messages": {"messages": HI, "chat_template_kwargs": {"messages": HI}},
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_stay_refusals(case: str, custom: Callable[[str, str], Pair]) -> None:
    """Both sides refuse what the node refuses: vLLM's safe_apply_chat_template turns any
    exception from apply_chat_template into a ValueError, a 400, never a count."""
    pair = custom("thinking", THINKING)
    body = REFUSED[case]
    with pytest.raises((ValueError, TypeError, IndexError)):
        node_ids(pair.hf, body, "string", THINKING)
    with pytest.raises(TemplateError):
        pair.gateway.prompt_ids(body)


async def test_the_standin_bound_holds_for_what_only_the_template_renders(
    custom: Callable[[str, str], Pair],
) -> None:
    """Reasoning, documents, template kwargs, refusal and thinking parts and tool-call ids
    are rendered by the template: the stand-in's bound must cover them too (reading
    message content and tool calls only, it would bound a 12k-token prompt at 99)."""
    pair = custom("thinking", THINKING)
    exact = pair.gateway
    standin = PromptCounter(load_encoding(EncodingSpec()), TextCountCache(), None)
    digits = "".join(random.Random(5).choice("0123456789") for _ in range(3000))
    ask = [{"role": "user", "content": "Check these."}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bodies: list[dict[str, Any]] = [
        {"messages": [*ask, {"role": "assistant", "content": "ok", "reasoning_content": digits}]},
        {"messages": [*ask, {"role": "assistant", "content": "ok", "reasoning": digits}]},
        {"messages": ask, "documents": [{"title": "t", "text": digits}]},
        {"messages": ask, "chat_template_kwargs": {"house_style": digits}},
        {
            "messages": [
                *ask,
                {"role": "assistant", "content": [{"type": "refusal", "refusal": digits}]},
            ]
        },
        {
            "messages": [
                *ask,
                {"role": "assistant", "content": [{"type": "thinking", "thinking": digits}]},
            ]
        },
        {
            "messages": [
                *ask,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": digits, "content": "done"},
            ]
        },
    ]
    for body in bodies:
        pair.check(body)  # the gateway's exact count is the node's
        node = exact.count_chat_sync(body)
        bound = upper_bound((await standin.count(plan_chat(body, TokenizerConfig()))).total, body)
        assert node > 3000 and bound >= node, (body["messages"][-1], bound, node)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_text_parts_add_nothing(kind: str, pairs: Callable[[str], Pair]) -> None:
    """vLLM keeps a parsed content part only if it is truthy: in the string format an
    empty text part is dropped before the parts are joined with "\\n" (counted as one
    more token, or two with a leading one, on Tekken and SentencePiece vocabularies)."""
    pair = pairs(kind)
    for parts in (["hello", ""], ["", "hello"], ["", ""], ["a", "", "b"]):
        content = [{"type": "text", "text": t} for t in parts]
        system = {"role": "system", "content": content[::-1]}
        pair.check({"messages": [system, {"role": "user", "content": content}]})
        pair.check({"messages": [{"role": "user", "content": ["x", "", *parts]}]})


# -- special tokens and BOS/EOS as the tokenizer class sets them --------------------

# name: (kind, config changes (None removes a key), tokenizer.json post-processor
# removed, special_tokens_map.json written from the removed tokens)
DIR_VARIANTS: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    # A Llama 3 fine-tune saying add_bos_token false: the generic class ignores it.
    "generic-add-bos-false": ("llama3", {"add_bos_token": False}, False, False),
    # The generic class ignores add_eos_token too.
    "generic-add-eos-true": ("tekken", {"add_eos_token": True}, False, False),
    # A Llama-class directory whose config is silent: BOS by the class's default, even
    # with no post-processor in tokenizer.json.
    "llama-class-defaults": (
        "sentencepiece",
        {"add_bos_token": None, "add_eos_token": None},
        True,
        False,
    ),
    # add_eos_token on a Llama-class directory: it adds EOS.
    "llama-class-add-eos": ("sentencepiece", {"add_eos_token": True}, False, False),
    # Special tokens only in special_tokens_map.json (a config saved before 4.34).
    "special-tokens-map": (
        "llama3",
        {"bos_token": None, "eos_token": None, "add_bos_token": None},
        False,
        True,
    ),
    "special-tokens-map-llama-class": (
        "sentencepiece",
        {"bos_token": None, "eos_token": None, "unk_token": None, "add_bos_token": None},
        False,
        True,
    ),
    # No special tokens anywhere: the Llama class's defaults (<s>, </s>) fill in.
    "llama-class-token-defaults": (
        "sentencepiece",
        {"bos_token": None, "eos_token": None, "unk_token": None, "add_bos_token": None},
        False,
        False,
    ),
    # GPT-NeoX's class rebuilds the post-processor with no BOS by
    # default, and its <|endoftext|> defaults are no tokens of Llama 3's vocabulary:
    # transformers adds them, one new id each.
    "gpt-neox-class": (
        "llama3",
        {"tokenizer_class": "GPTNeoXTokenizer", "bos_token": None, "eos_token": None},
        False,
        False,
    ),
    "gpt2-class-defaults": (
        "qwen",
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": None, "eos_token": None},
        False,
        False,
    ),
    "gemma-class-pad-added": ("sentencepiece", {"tokenizer_class": "GemmaTokenizer"}, False, False),
    "cohere-class-no-pad": ("sentencepiece", {"tokenizer_class": "CohereTokenizer"}, False, False),
    # The class from config.json: its model_type (phi3: Llama's class), or its own
    # tokenizer_class.
    "model-type-phi3": (
        "sentencepiece",
        {"tokenizer_class": None, "add_bos_token": None, "add_eos_token": None},
        True,
        False,
    ),
}
# Variants with a config.json beside the tokenizer files.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {"model-type-phi3": {"model_type": "phi3"}}


@pytest.mark.parametrize("variant", sorted(DIR_VARIANTS))
def test_special_tokens_and_bos_eos_as_the_tokenizer_class_sets_them(
    variant: str,
    vocab_dirs: Callable[[str], Path],
    tmp_path: Path,
    encodings: EncodingCache,
) -> None:
    """Against transformers 4.57: add_bos_token / add_eos_token apply only to the classes
    that read them (applied to every class, a Llama 3 directory saying add_bos_token false
    would count one under), special_tokens_map.json is read (unread, a template's
    bos_token would render as "", one under), and each class's defaults hold (without
    them a Mistral template's eos_token would be undefined)."""

    kind, changes, drop_post, stmap = DIR_VARIANTS[variant]
    source = vocab_dirs(kind)
    spec = json.loads((source / "tokenizer.json").read_text())
    if drop_post:
        spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.setdefault("tokenizer_class", REAL_TOKENIZER_CLASS.get(kind, "PreTrainedTokenizerFast"))
    moved = {}
    for key, value in changes.items():
        if value is None:
            if key in config:
                moved[key] = config.pop(key)
        else:
            config[key] = value
    if stmap:
        moved = {k: v for k, v in moved.items() if k.endswith("_token")}
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(moved))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if variant in MODEL_CONFIGS:
        (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIGS[variant]))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    gateway = ExactCounter(encodings.model(str(tmp_path), transformers=4))
    for prompt in ("Hello world", "12345 <s> x", "a <|endoftext|> b <pad> c"):
        assert gateway.completion_ids({"prompt": prompt}) == hf(prompt)["input_ids"], prompt
    pair = Pair(tmp_path, gateway.tokenizer, hf)
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    pair.check({"messages": chat})
    # A chat with add_special_tokens: vLLM encodes the rendered text with the class's
    # BOS/EOS around it (a template's own BOS then comes twice).
    body = {"messages": chat, "add_special_tokens": True}
    text = gateway.render_chat(body).text
    assert gateway.prompt_ids(body) == hf(text, add_special_tokens=True)["input_ids"]
    assert gateway.count_chat_sync(body) == len(hf(text, add_special_tokens=True)["input_ids"])


def test_model_types_map_to_the_classes_transformers_maps_them_to() -> None:
    """The gateway's table of model types (for directories that name no class) against
    transformers' own, for the classes whose defaults the gateway knows."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from kvgateway.tokens.special_tokens import _CLASS_OF_MODEL_TYPE, _CLASS_RULES

    theirs = {}
    for model_type, classes in TOKENIZER_MAPPING_NAMES.items():
        fast = classes[1] if isinstance(classes, tuple) else classes
        name = (fast or (classes[0] if isinstance(classes, tuple) else None) or "").removesuffix(
            "Fast"
        )
        if name in _CLASS_RULES:
            theirs[model_type] = name
    ours = {t: c for t, c in _CLASS_OF_MODEL_TYPE.items() if t in TOKENIZER_MAPPING_NAMES}
    assert ours == theirs
