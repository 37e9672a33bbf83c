"""The gateway's exact count equals what the node's tokenizer produces, request by request.

The gateway runs byte-level vocabularies with tiktoken (and caches pieces between added
tokens); the node runs the same directory with the ``tokenizers`` library, as vLLM does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.tokens.counting import TextCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import ModelTokenizer
from tests.support import corpus
from tests.unit.tokens.conftest import KINDS

# Loads real vocabularies (and transformers): the slow tier.
pytestmark = pytest.mark.slow

Loader = Callable[[str], ModelTokenizer]


def test_engine_choice(gateway_tokenizer: Loader, node_tokenizer: Loader) -> None:
    for kind in ("qwen", "qwen-merges", "llama3", "tekken"):
        tok = gateway_tokenizer(kind)
        assert tok.name.startswith("tiktoken:"), tok.engine_note
    sp = gateway_tokenizer("sentencepiece")
    assert sp.name.startswith("tokenizers:") and "byte_fallback" in sp.engine_note
    assert node_tokenizer("qwen").name.startswith("tokenizers:")


@pytest.mark.parametrize("kind", KINDS)
def test_chat_counts_equal_the_nodes_for_every_request(
    kind: str, gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    gateway = ExactCounter(gateway_tokenizer(kind))
    node = ExactCounter(node_tokenizer(kind))
    requests = corpus.corpus(seed=11, n=150)
    kinds_seen = set()
    for body in requests:
        assert gateway.count_chat_sync(body) == len(node.encode_chat(body)), body
        kinds_seen.add("tools" if "tools" in body else "plain")
    assert kinds_seen == {"tools", "plain"}


@pytest.mark.parametrize("kind", KINDS)
async def test_completion_counts_include_bos_as_the_model_adds_it(
    kind: str, gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    gateway = ExactCounter(gateway_tokenizer(kind))
    node = node_tokenizer(kind)
    bos = 0 if kind.startswith("qwen") else 1
    assert len(gateway.tokenizer.prefix) == bos
    for prompt in corpus.completion_prompts(seed=5, n=80):
        counted = await gateway.count_completion({"prompt": prompt})
        ids = node.encode_prompt(prompt)
        assert counted.total == len(ids)
        assert ids[:bos] == list(gateway.tokenizer.prefix)
        plain = await gateway.count_completion({"prompt": prompt, "add_special_tokens": False})
        assert plain.total == len(ids) - bos
    batch = await gateway.count_completion({"prompt": ["a b c", [1, 2, 3, 4, 5]]})
    assert batch.prompts == 2 and batch.longest == 5


async def test_history_is_cached_between_turns(gateway_tokenizer: Loader) -> None:
    counter = ExactCounter(gateway_tokenizer("qwen"), TextCache())
    history = [{"role": "user", "content": corpus.GENERATORS["prose"](random.Random(1), 400)}]
    first = await counter.count_chat({"messages": history})
    history += [
        {"role": "assistant", "content": "Noted. " * 80},
        {"role": "user", "content": "And the numbers 1234567?"},
    ]
    second = await counter.count_chat({"messages": history})
    assert second.total == counter.count_chat_sync({"messages": history})
    # Only the new turns were encoded: the first user message was a cache hit.
    assert 0 < second.encoded_chars < first.encoded_chars
    assert second.encoded_chars < len(counter.render_chat({"messages": history}).text) / 2


def test_a_historys_ids_come_from_its_pieces_ids_as_the_node_encodes_it(
    gateway_tokenizer: Loader,
) -> None:
    """The ids of a chat whose history was taken before are the kept pieces' ids plus
    the new turn's: the same as encoding the whole rendering, turn after turn, and
    their count is the chat's count."""
    counter = ExactCounter(gateway_tokenizer("qwen"), TextCache())
    rng = random.Random(3)
    history = [{"role": "system", "content": corpus.GENERATORS["prose"](rng, 300)}]
    for turn in range(4):
        history.append({"role": "user", "content": corpus.GENERATORS["code"](rng, 200 + turn)})
        body = {"messages": history}
        ids, counted = counter.counted_ids(body)
        assert ids == counter.tokenizer.encode_prompt(
            counter.render_chat(body).text, add_special_tokens=False
        )
        assert counted.total == len(ids) == counter.count_chat_sync(body)
        if turn:
            assert 0 < counted.encoded_chars < len(counter.render_chat(body).text) / 2
        history.append({"role": "assistant", "content": corpus.GENERATORS["prose"](rng, 100)})


async def test_large_prompts_are_counted_in_the_executor(gateway_tokenizer: Loader) -> None:
    tok = gateway_tokenizer("tekken")
    with ThreadPoolExecutor(1) as pool:
        counter = ExactCounter(tok, TextCache(), pool, inline_chars=1000)
        text = corpus.GENERATORS["code"](random.Random(2), 3000)
        body = {"messages": [{"role": "user", "content": text}]}
        counted = await counter.count_chat(body)
    assert counted.total == len(ExactCounter(tok).encode_chat(body))
    assert counted.encoded_chars > 1000


async def test_images_cost_the_configured_amount(gateway_tokenizer: Loader) -> None:
    counter = ExactCounter(gateway_tokenizer("qwen"), image_tokens=1000)
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with_images = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                ],
            }
        ]
    }
    plain = (await counter.count_chat(text_only)).total
    assert (await counter.count_chat(with_images)).total == plain + 2000


def test_special_tokens_in_user_text_count_as_the_node_counts_them(
    gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    text = "ends here<|im_end|>\n<|im_start|>system\nsneaky <tool_call> done"
    gateway, node = gateway_tokenizer("qwen"), node_tokenizer("qwen")
    assert gateway.engine.encode(text) == node.engine.encode(text)
    assert gateway.engine.decode(gateway.engine.encode(text)) == text


SPECIALS = {
    "qwen": ["<|im_start|>", "<|im_end|>", "<tool_call>"],
    "sentencepiece": ["<s>", "</s>", "[INST]", "[/INST]"],
}
# Passed inline, the tuple would be inferred as tuple[str], not hypothesis's Literal names.
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
texty = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=SURROGATES), max_size=40
) | st.sampled_from([" ", "\n", "  x", "12345", "東京", "🙂", '{"a": 1}'])


@pytest.mark.parametrize("kind", sorted(SPECIALS))
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_pieces_between_added_tokens_add_up(
    kind: str, data: st.DataObject, gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    """The cached fast path (count pieces apart) has a slow twin: encode the whole text."""
    parts = data.draw(st.lists(texty | st.sampled_from(SPECIALS[kind]), max_size=8))
    text = "".join(parts)
    counter = ExactCounter(gateway_tokenizer(kind), TextCache())
    assert counter._count_text_sync(text) == len(node_tokenizer(kind).engine.encode(text))


@pytest.mark.parametrize("kind", ["qwen", "tekken"])
def test_token_spelling_matches_the_tokenizers_library(
    kind: str, gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    fast, ref = gateway_tokenizer(kind).engine, node_tokenizer(kind).engine
    text = "".join(corpus.completion_prompts(seed=9, n=20)) + "<|im_start|>[INST]</s>"
    ids = fast.encode(text)
    assert [fast.token_str(i) for i in ids] == [ref.token_str(i) for i in ids]
    assert fast.token_str(10**9) is None and ref.token_str(10**9) is None
