"""A simulated node given a model tokenizer counts as a vLLM serving that model would:
usage, /tokenize, /detokenize, context-length 400s and KV accounting."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgateway.simulator import cli
from kvgateway.simulator.cli import build_specs
from kvgateway.simulator.fleetconfig import node_spec, parse_fleet_config
from kvgateway.simulator.profiles import TINY
from kvgateway.simulator.settings import SettingsError, apply_overrides
from kvgateway.tokens.encoding import EncodingCache, load_encoding
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.node_count import (
    parse_context_length_error,
    tokenize_body,
    tokenize_count,
)
from kvgateway.tokens.plans import EncodingSpec
from tests.support import corpus, vocab
from tests.support.sim import SimFactory
from tests.unit.tokens.test_vs_transformers import THINKING

# Loads real vocabularies: the slow tier.
pytestmark = pytest.mark.slow

MODEL = TINY.model
CL100K = load_encoding(EncodingSpec())
Dirs = Callable[[str], Path]


@pytest.mark.parametrize("kind", ["qwen", "tekken", "sentencepiece"])
async def test_usage_and_tokenize_equal_the_gateways_exact_count(
    kind: str, sim: SimFactory, vocab_dirs: Dirs, encodings: EncodingCache
) -> None:
    directory = str(vocab_dirs(kind))
    node = await sim(tokenizer=directory, max_model_len=8192, num_gpu_blocks=2048)
    gateway = ExactCounter(encodings.model(directory))
    for request in corpus.corpus(seed=31, n=25):
        body = {**request, "model": MODEL, "max_tokens": 4}
        expected = gateway.count_chat_sync(body)
        status, reply = await node.post("/v1/chat/completions", body)
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == expected
        status, tokenized = await node.post("/tokenize", body)
        assert status == 200
        assert tokenized["count"] == expected == len(tokenized["tokens"])
        assert tokenized["max_model_len"] == 8192
    prompt = "Order 12345678 shipped to 東京 🙂"
    status, reply = await node.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200
    counted = await gateway.count_completion({"prompt": prompt})
    assert reply["usage"]["prompt_tokens"] == counted.total


async def test_tokenize_forms_and_detokenize(sim: SimFactory, vocab_dirs: Dirs) -> None:
    node = await sim(tokenizer=str(vocab_dirs("tekken")))
    status, body = await node.post("/tokenize", {"prompt": "hello world"})
    assert status == 200 and body["tokens"][0] == 1  # BOS, as add_special_tokens defaults
    _, plain = await node.post("/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert plain["tokens"] == body["tokens"][1:]
    status, text = await node.post("/detokenize", {"tokens": plain["tokens"]})
    assert status == 200 and text == {"prompt": "hello world"}
    _, strs = await node.post("/tokenize", {"prompt": "hi there", "return_token_strs": True})
    assert strs["token_strs"] == ["<s>", "hi", "Ġthere"]  # the vocabulary's own spelling
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    _, rendered = await node.post("/tokenize", chat)
    _, decoded = await node.post("/detokenize", {"tokens": rendered["tokens"]})
    assert decoded["prompt"] == "<s>[INST] hi[/INST]"
    status, err = await node.post("/detokenize", {"tokens": ["x"]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = await node.post("/tokenize", {"messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and "Only user, assistant and tool roles" in err["error"]["message"]


async def test_context_length_400_reports_the_nodes_count(
    sim: SimFactory, vocab_dirs: Dirs, encodings: EncodingCache
) -> None:
    directory = str(vocab_dirs("qwen"))
    # vLLM <= 0.31 refuses prompt + max_tokens past the context; >= 0.32 cuts max_tokens.
    node = await sim(
        tokenizer=directory, max_model_len=1024, num_gpu_blocks=512, context_overflow="reject"
    )
    counter = ExactCounter(encodings.model(directory))
    rng = random.Random(4)
    digits = ""
    while True:  # a number-heavy prompt just past the limit for 100 output tokens
        digits += f" {rng.randint(10**8, 10**9)}"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": digits}],
            "max_tokens": 100,
        }
        exact = counter.count_chat_sync(body)
        if exact > 1024 - 100:
            break
    assert exact < 1024
    # cl100k alone counts this well under the limit: 3 digits per token, not 1.
    assert len(CL100K.encode_ordinary(digits)) < 0.6 * (1024 - 100)
    status, err = await node.post("/v1/chat/completions", body)
    assert status == 400
    count = parse_context_length_error(err["error"]["message"])
    assert count is not None and count.max_model_len == 1024
    assert count.at_least and count.prompt_tokens == 1024 - 100 + 1 <= exact
    fits = {**body, "max_tokens": 1024 - exact}
    status, reply = await node.post("/v1/chat/completions", fits)
    assert status == 200 and reply["usage"]["prompt_tokens"] == exact
    state = await node.wait_idle()
    assert state["preemptions"] == 0
    clamps = await sim(tokenizer=directory, max_model_len=1024, num_gpu_blocks=512)
    status, reply = await clamps.post("/v1/chat/completions", body)
    assert status == 200 and reply["usage"]["prompt_tokens"] == exact
    assert reply["usage"]["completion_tokens"] <= 1024 - exact


async def test_checks_against_the_vocabulary(sim: SimFactory, vocab_dirs: Dirs) -> None:
    """vLLM >= 0.32 refuses text past what max_model_len tokens of the longest spelling
    hold before it tokenizes (chat: the rendered text), and ids outside the vocabulary."""
    directory = str(vocab_dirs("qwen"))
    node = await sim(tokenizer=directory, max_model_len=64, num_gpu_blocks=64)
    vocabulary = node.node.tokenizer.vocabulary
    assert vocabulary is not None
    limit = 64 * vocabulary.max_chars_per_token
    status, err = await node.post("/v1/completions", {"prompt": "a" * (limit + 1)})
    assert status == 400 and err["error"]["param"] == "input_text"
    count = parse_context_length_error(err["error"]["message"])
    assert count is not None and count.at_least and count.prompt_tokens == 65
    body = {"messages": [{"role": "user", "content": "a" * (limit - 5)}]}
    status, err = await node.post("/v1/chat/completions", body)
    assert status == 400 and f"contains {limit - 5 + 1}" not in err["error"]["message"]
    assert err["error"]["param"] == "input_text"  # the template's characters count too
    too_big = vocabulary.max_token_id + 1
    status, err = await node.post("/v1/completions", {"prompt": [5, too_big]})
    assert (status, err["error"]["message"]) == (400, f"Token id {too_big} is out of vocabulary")
    status, _ = await node.post("/v1/completions", {"prompt": [vocabulary.max_token_id]})
    assert status == 200


def test_settings_and_cli(tmp_path: Path, vocab_dirs: Dirs) -> None:
    directory = str(vocab_dirs("sentencepiece"))
    settings = apply_overrides(TINY, {"tokenizer": directory}, "tiers[0].backends[0].simulate")
    assert settings.tokenizer == directory
    with pytest.raises(SettingsError, match=r"simulate\.tokenizer: .* is not a directory"):
        apply_overrides(TINY, {"tokenizer": str(tmp_path / "x")}, "simulate")
    spec = node_spec("tiny", overrides={"tokenizer": directory})
    assert spec.settings.tokenizer == directory
    fleet = {
        "models": [{"name": "m", "tokenizer": {"path": directory}}],
        "tiers": [
            {
                "name": "t",
                "backends": [
                    {
                        "name": "b",
                        "url": "http://127.0.0.1:9101",
                        "model": "m",
                        "simulate": {"profile": "tiny", "tokenizer": directory},
                    },
                    {
                        "name": "c",
                        "url": "http://127.0.0.1:9102",
                        "model": "m",
                        "simulate": {"profile": "tiny", "tokenizer": 3},
                    },
                ],
            }
        ],
    }
    with pytest.raises(
        SettingsError, match=r"backends\[1\]\.simulate\.tokenizer: expected a string"
    ):
        parse_fleet_config(fleet)
    del fleet["tiers"][0]["backends"][1]  # type: ignore[index]
    (node,) = parse_fleet_config(fleet)
    assert node.settings.tokenizer == directory
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--profile", "tiny", "--tokenizer", directory])
    (built,) = build_specs(args)
    assert built.settings.tokenizer == directory


async def test_tokenize_body_asks_the_node_for_the_forwarded_count(
    sim: SimFactory, vocab_dirs: Dirs, encodings: EncodingCache
) -> None:
    directory = str(vocab_dirs("qwen"))
    node = await sim(tokenizer=directory)
    gateway = ExactCounter(encodings.model(directory))
    for request in corpus.corpus(seed=41, n=10):
        body = {**request, "stream": True, "temperature": 0.3, "max_tokens": 9}
        status, reply = await node.post("/tokenize", tokenize_body(body, MODEL, chat=True))
        assert status == 200 and tokenize_count(reply) == gateway.count_chat_sync(body)
    completion = {"prompt": "12345 67890", "max_tokens": 3, "echo": False}
    status, reply = await node.post("/tokenize", tokenize_body(completion, MODEL, chat=False))
    assert status == 200 and tokenize_count(reply) == len(
        gateway.tokenizer.encode_prompt("12345 67890")
    )
    assert tokenize_count({"error": {}}) is None


async def test_tokenize_body_carries_documents_and_reasoning_effort_as_template_kwargs(
    sim: SimFactory, vocab_dirs: Dirs, encodings: EncodingCache, tmp_path: Path
) -> None:
    # vLLM's TokenizeChatRequest has no documents or reasoning_effort fields: asked as
    # fields, the node's count leaves out what the chat request renders (6 tokens short
    # with Qwen3's template and reasoning_effort "none": a node 400 near the limit).
    directory = vocab.variant(vocab_dirs("qwen"), tmp_path / "thinking", chat_template=THINKING)
    node = await sim(tokenizer=str(directory))
    gateway = ExactCounter(encodings.model(str(directory)))
    docs = [{"title": "Cache", "text": "KV blocks are 16 tokens."}]
    ask = {"messages": [{"role": "user", "content": "Which block size?"}], "max_tokens": 9}
    for extra in (
        {"reasoning_effort": "none"},
        {"reasoning_effort": "high"},
        {"documents": docs},
        {"documents": docs, "chat_template_kwargs": {"house_style": "terse"}},
        {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": True}},
    ):
        body = {**ask, **extra}
        status, reply = await node.post("/tokenize", tokenize_body(body, MODEL, chat=True))
        assert status == 200, reply
        assert tokenize_count(reply) == gateway.count_chat_sync(body), extra
        assert gateway.count_chat_sync(body) != gateway.count_chat_sync(ask), extra


async def test_a_requests_own_template_is_refused_as_vllm_does(
    sim: SimFactory, vocab_dirs: Dirs
) -> None:
    node = await sim(tokenizer=str(vocab_dirs("qwen")))
    for extra in ({"chat_template": "{{ 1 }}"}, {"chat_template_kwargs": {"chat_template": "x"}}):
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        for path in ("/tokenize", "/v1/chat/completions"):
            status, err = await node.post(path, body)
            assert status == 400 and "--trust-request-chat-template" in err["error"]["message"]
    kwargs = {"chat_template_kwargs": {"unused_flag": True}}
    status, _ = await node.post(
        "/tokenize", {"messages": [{"role": "user", "content": "hi"}], **kwargs}
    )
    assert status == 200
