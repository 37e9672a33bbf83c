"""The stand-in's upper bound stays at or above every real vocabulary's count, and the
node's count is read back out of its context-length 400."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgateway.tokens.counting import PromptCounter, TextCountCache
from kvgateway.tokens.encoding import load_encoding
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import ModelTokenizer
from kvgateway.tokens.node_count import (
    NodeCount,
    parse_context_length_error,
    readmission_prompt_tokens,
)
from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig, plan_chat
from kvgateway.tokens.standin import (
    ASCII_OVERCOUNT,
    MAX_OVERCOUNT,
    BoundFactors,
    completion_overcount,
    completion_upper_bound,
    overcount,
    text_extra,
    upper_bound,
)
from tests.support import corpus
from tests.unit.tokens.conftest import KINDS

CL100K = load_encoding(EncodingSpec())


async def _standin(body: dict[str, Any]) -> int:
    counter = PromptCounter(CL100K, TextCountCache(), None)
    return (await counter.count(plan_chat(body, TokenizerConfig()))).total


@pytest.mark.parametrize("kind", KINDS)
async def test_bound_holds_for_the_corpus(
    kind: str, gateway_tokenizer: Callable[[str], ModelTokenizer]
) -> None:
    exact = ExactCounter(gateway_tokenizer(kind))
    below = 0
    for body in corpus.corpus(seed=23, n=120):
        standin = await _standin(body)
        node = exact.count_chat_sync(body)
        below += node > standin
        assert upper_bound(standin, body) >= node, body
    assert below > 60  # the plain stand-in count does undercount most of these
    for prompt in corpus.completion_prompts(seed=23, n=80):
        node = len(exact.tokenizer.encode_prompt(prompt))
        assert completion_upper_bound(len(CL100K.encode_ordinary(prompt)), prompt) >= node


@pytest.mark.parametrize("content", ["numbers", "hex", "json", "emoji", "cjk", "code"])
async def test_bound_holds_for_long_undercounted_prompts(
    content: str, gateway_tokenizer: Callable[[str], ModelTokenizer]
) -> None:
    """Prompts built to be undercounted, at the size that meets a context limit."""
    body = {
        "messages": [
            {"role": "user", "content": corpus.GENERATORS[content](random.Random(content), 2500)}
        ]
    }
    bound = upper_bound(await _standin(body), body)
    counts = {k: ExactCounter(gateway_tokenizer(k)).count_chat_sync(body) for k in KINDS}
    assert all(n <= bound for n in counts.values()), (bound, counts)
    # ...and not absurdly above the worst vocabulary: long ASCII text stays within 40%
    # (Llama 3 groups digits by three as cl100k does, so the bound is looser for it).
    if content in ("numbers", "hex", "json", "code"):
        assert bound <= 1.4 * max(counts.values()), (bound, counts)


def test_digit_runs_count_one_token_per_digit() -> None:
    assert text_extra("abc") == 0
    assert text_extra("123456") == 6 - 2  # cl100k: 2 tokens, worst vocabulary: 6
    assert text_extra("7") == 0


@given(st.text(max_size=200))
def test_bound_never_below_the_standin(text: str) -> None:
    body = {"messages": [{"role": "user", "content": text}]}
    tokens = len(CL100K.encode_ordinary(text))
    assert upper_bound(tokens, body) >= tokens
    assert completion_upper_bound(tokens, text) >= tokens


VLLM_NEW = (
    "This model's maximum context length is 8192 tokens. However, you requested 512 output "
    "tokens and your prompt contains at least 7681 input tokens, for a total of at least "
    "8193 tokens. Please reduce the length of the input prompt or the number of requested "
    "output tokens. (parameter=input_tokens, value=7681)"
)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (VLLM_NEW, NodeCount(7681, True, 8192, 512)),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 0 "
            "output tokens and your prompt contains 4096 input tokens, for a total of 4096 tokens.",
            NodeCount(4096, False, 4096, 0),
        ),
        (
            "This model's maximum context length is 2048 tokens. However, you requested 2300 "
            "tokens (2100 in the messages, 200 in the completion). Please reduce the length "
            "of the messages or completion.",
            NodeCount(2100, False, 2048, 200),
        ),
        (
            "This model's maximum context length is 2048 tokens, however you requested 2300 "
            "tokens (2100 in your prompt; 200 for the completion). Please reduce your prompt; "
            "or completion length.",
            NodeCount(2100, False, 2048, 200),
        ),
        (
            "This model's maximum context length is 2048 tokens. However, you requested 3000 "
            "tokens in the messages, Please reduce the length of the messages.",
            NodeCount(3000, False, 2048, None),
        ),
        (
            "The decoder prompt (length 9000) is longer than the maximum model length of 8192. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens.",
            NodeCount(9000, False, 8192, None),
        ),
        # vLLM >= 0.32 (max_tokens is cut instead; only a prompt past the context is
        # refused), as its renderers/params.py and input_processor.py word it.
        (
            "This model's maximum context length is 256 tokens. However, your prompt "
            "contains at least 257 input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=257)",
            NodeCount(257, True, 256, 0),
        ),
        (
            "This model's maximum context length is 256 tokens. However, your prompt "
            "contains 300 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            NodeCount(300, False, 256, 0),
        ),
        (
            # vLLM >= 0.32's Responses API (responses/serving.py), a prompt of the context.
            "The engine prompt length 4096 exceeds the max_model_len 4096. Please reduce prompt.",
            NodeCount(4096, False, 4096, None),
        ),
        (
            "The decoder prompt (length 256) plus the number of requested output tokens (at "
            "least 1) is longer than the maximum model length of 256. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + "
            "requested output tokens).",
            NodeCount(256, False, 256, None),
        ),
        (
            "This model's maximum context length is 4096 tokens. However, your prompt "
            "contains 90000 characters (more than 61440 characters, which is the upper "
            "bound for 4096 input tokens). Please reduce the length of the input prompt.",
            NodeCount(4097, True, 4096, 0),
        ),
        ("max_tokens must be at least 1, got 0.", None),
    ],
)
def test_context_length_wordings(message: str, expected: NodeCount | None) -> None:
    assert parse_context_length_error(message) == expected


def test_a_prompt_of_exactly_the_context_is_read_with_the_nodes_context() -> None:
    """vLLM >= 0.32 cuts max_tokens to what the context leaves; a prompt filling the
    context leaves 0 and is refused without a count: the count is the node's context."""
    message = "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert parse_context_length_error(message) is None
    assert parse_context_length_error(message, 4096) == NodeCount(4096, False, 4096, 0)
    assert parse_context_length_error("max_tokens must be at least 1, got 0.5", 4096) is None


def test_readmission_count_is_never_a_lower_bound() -> None:
    """vLLM >= 0.32 refuses a 9,028-token prompt on a 4k node as "at least 4097" (it
    stops counting past the context). Re-admitted to the 16k node, it reserves that
    node's own count, or else the most that node can hold beside the output, never the
    4,097: reserving that, the prompt would take twice its reservation there."""
    exact = NodeCount(5000, False, 4096, 100)
    assert readmission_prompt_tokens(exact, asked=None, largest_context=16_384, output=16) == 5000
    refused = parse_context_length_error(
        "This model's maximum context length is 4096 tokens. However, your prompt contains "
        "at least 4097 input tokens, which exceeds this limit even without any output tokens."
    )
    assert refused == NodeCount(4097, True, 4096, 0)
    asked = readmission_prompt_tokens(refused, asked=9_028, largest_context=16_384, output=16)
    assert asked == 9_028
    unknown = readmission_prompt_tokens(refused, asked=None, largest_context=16_384, output=16)
    assert unknown == 16_368
    lower = parse_context_length_error(VLLM_NEW)
    assert lower is not None and lower.at_least
    got = readmission_prompt_tokens(lower, asked=None, largest_context=32_768, output=512)
    assert got == 32_256
    # Nothing larger is on offer: at least what the node counted.
    assert readmission_prompt_tokens(lower, asked=None, largest_context=8_192, output=512) == 7_681


LAYOUT = {
    # White space a byte-fallback vocabulary spends a token per character on.
    "blank lines": "A paragraph.\n\n\n\nAnother one.\n\n" * 60,
    "indented code": "def f(x):\n    if x:\n        return [\n            x,\n        ]\n\n" * 40,
    "tabs": "name\tvalue\tunit\n" * 120,
    "crlf": "line one\r\nline two\r\n\r\n" * 100,
    "pretty json": "\n".join(
        json.dumps({"a": [1, {"b": i}], "c": "d"}, indent=4) for i in range(60)
    ),
    "line breaks": "\n" * 3000,
    "spaces": "a" + " " * 2000 + "b",
    "long space runs": ("x" + " " * 40) * 80,
    # Non-ASCII between spaces: no merges across characters in any vocabulary.
    "spaced rare CJK": " ".join(chr(0x4E00 + i * 37 % 20000) for i in range(800)),
    "spaced Hangul": " ".join(chr(0xAC00 + i * 13 % 11000) for i in range(800)),
    "spaced symbols": " ".join(chr(0x2000 + i * 3 % 3000) for i in range(800)),
    "emoji run": "🙂🚀🔥" * 300,
    "line separators": "\u2028" * 600,
    "ideographic spaces": "\u3000" * 600,
}


@pytest.mark.parametrize("name", LAYOUT)
async def test_bound_holds_for_white_space_and_unmerged_characters(
    name: str, gateway_tokenizer: Callable[[str], ModelTokenizer]
) -> None:
    """Every layout of white space and unmerged characters stays within the bound in
    every vocabulary: there a byte-fallback vocabulary spends a token per character, and
    a long prompt of indented, blank-line-rich text costs Mistral's SentencePiece 30
    tokens past a bound that ignores it."""
    body = {"messages": [{"role": "user", "content": LAYOUT[name]}]}
    bound = upper_bound(await _standin(body), body)
    counts = {k: ExactCounter(gateway_tokenizer(k)).count_chat_sync(body) for k in KINDS}
    assert all(n <= bound for n in counts.values()), (bound, counts)


def test_white_space_extra() -> None:
    assert text_extra("a b c") == 0
    assert text_extra("a\tb") == 1
    assert text_extra("a\r\nb") == 1
    assert text_extra("a\nb") == 0  # one token in every vocabulary
    assert text_extra("a\n\n\nb") >= 2  # a byte-fallback vocabulary: 3 tokens, cl100k 1
    assert text_extra("a\n    b") == 1
    assert text_extra("a" + " " * 15 + "b") == 0
    assert text_extra("a" + " " * 33 + "b") == 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "content", ["prose", "code", "numbers", "hex", "json", "cjk", "emoji", "mixed", "scripts"]
)
async def test_the_standin_overcounts_no_more_than_it_allows(
    kind: str, content: str, gateway_tokenizer: Callable[[str], ModelTokenizer]
) -> None:
    """overcount() is how far below the stand-in's count the node's may be: a prompt the
    stand-in counts past a context by less than that is worth asking the node about."""
    rng = random.Random(content)
    if content == "scripts":
        text = " ".join(SCRIPTS) * 40
    else:
        text = corpus.GENERATORS[content](rng, 2000)
    body = {"messages": [{"role": "user", "content": text}]}
    node = ExactCounter(gateway_tokenizer(kind)).count_chat_sync(body)
    assert await _standin(body) <= node * overcount(body), (node, await _standin(body))


SCRIPTS = (
    "Москва большой город, и русский язык красивый.",
    "القاهرة مدينة كبيرة واللغة العربية جميلة.",
    "กรุงเทพมหานครเป็นเมืองหลวง ภาษาไทยเป็นภาษาที่สวยงาม",
    "दिल्ली भारत की राजधानी है। हिंदी एक सुंदर भाषा है।",
)


def test_overcount_by_content() -> None:
    ascii_body = {"messages": [{"role": "user", "content": "plain text 123"}]}
    assert overcount(ascii_body) == ASCII_OVERCOUNT
    assert overcount({"messages": [{"role": "user", "content": "東京"}]}) == MAX_OVERCOUNT
    tools = [{"type": "function", "function": {"name": "f", "description": "°C"}}]
    assert overcount({**ascii_body, "tools": tools}) == MAX_OVERCOUNT
    assert completion_overcount(["abc", [1, 2]]) == ASCII_OVERCOUNT
    assert completion_overcount(["abc", "é"]) == MAX_OVERCOUNT


async def test_images_are_charged_once(gateway_tokenizer: Callable[[str], ModelTokenizer]) -> None:
    """The stand-in charges each image image_tokens itself; the bound scales only the
    text, within 10% of the node's count (scaling the images too would charge an
    image-only chat 2.2x what the node counts)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}]}]
    }
    body["messages"][0]["content"] += [image, image, image]
    bound = upper_bound(await _standin(body), body)
    counts = {k: ExactCounter(gateway_tokenizer(k)).count_chat_sync(body) for k in KINDS}
    assert all(n <= bound <= 1.1 * n for n in counts.values()), (bound, counts)


def _reference_extra(text: str) -> float:
    """text_extra's slow twin: regexes and a loop per character."""
    import math
    import re

    f = BoundFactors()
    digits = sum(len(m) - math.ceil(len(m) / 3) for m in re.findall(r"[0-9]+", text))
    punct = len(re.findall(r"""[!-/:-@\[-`{-~]""", text))
    by_len = {2: f.non_ascii_extra[0], 3: f.non_ascii_extra[1], 4: f.non_ascii_extra[2]}
    non_ascii = sum(by_len.get(len(c.encode("utf-8", "surrogatepass")), 0) for c in text)
    breaks = sum(1 for i, c in enumerate(text[:-1]) if c == "\n" and text[i + 1] in "\t\n\r ")
    spaces = sum((len(r) - 1) // 16 for r in re.findall(" {17,}", text))
    ws = text.count("\t") + text.count("\r") + breaks + spaces
    return digits + f.punct_extra * punct + non_ascii + f.space_extra * ws


@given(st.lists(st.sampled_from([*'ab 019,.{}"\\~\n\t\ré你🙂٣', " " * 8]), max_size=40))
def test_text_extra_matches_its_slow_twin(parts: list[str]) -> None:
    text = "".join(parts)
    # Counted in C: line breaks by pairs, space runs by 16s: at least the true count.
    fast, slow = text_extra(text), _reference_extra(text)
    slack = text.count("\n") + text.count(" " * 16)
    assert slow - 1e-9 <= fast <= slow + slack + 1e-9, (fast, slow)
