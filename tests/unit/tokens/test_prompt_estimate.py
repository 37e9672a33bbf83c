"""What the proxy reserves: the exact count with the model's tokenizer, else a bound."""

from __future__ import annotations

from collections.abc import Callable

from kvgateway.tokens.counting import PromptCounter, TextCountCache
from kvgateway.tokens.encoding import EncodingSpec, load_encoding
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import ModelTokenizer
from kvgateway.tokens.prompt_estimate import PromptEstimator
from kvgateway.tokens.spec import TokenizerConfig
from tests.support import corpus

Loader = Callable[[str], ModelTokenizer]
CONFIG = TokenizerConfig()


def _standin() -> PromptCounter:
    return PromptCounter(load_encoding(EncodingSpec()), TextCountCache(), None)


async def test_exact_when_the_model_has_its_tokenizer(
    gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    exact = ExactCounter(gateway_tokenizer("tekken"))
    estimator = PromptEstimator(CONFIG, _standin(), exact)
    node = ExactCounter(node_tokenizer("tekken"))
    assert estimator.exact and estimator.description == "exact (tiktoken:tekken)"
    for body in corpus.corpus(seed=51, n=20):
        got = await estimator.chat(body)
        assert got.exact and got.total == len(node.encode_chat(body)) == got.standin
    batch = await estimator.completion({"prompt": ["12 34", "hello there friend"]})
    lengths = [len(node.tokenizer.encode_prompt(p)) for p in ("12 34", "hello there friend")]
    assert (batch.total, batch.longest, batch.prompts) == (sum(lengths), max(lengths), 2)


async def test_a_refused_template_falls_back_to_the_bound(gateway_tokenizer: Loader) -> None:
    estimator = PromptEstimator(CONFIG, _standin(), ExactCounter(gateway_tokenizer("tekken")))
    body = {"messages": [{"role": "robot", "content": "beep 123456"}]}
    got = await estimator.chat(body)
    assert not got.exact and got.total > got.standin > 0


async def test_stand_in_bound_covers_every_vocabulary(
    gateway_tokenizer: Loader, node_tokenizer: Loader
) -> None:
    estimator = PromptEstimator(CONFIG, _standin())
    assert not estimator.exact and "cl100k_base" in estimator.description
    nodes = {k: ExactCounter(node_tokenizer(k)) for k in ("qwen", "llama3", "sentencepiece")}
    for body in corpus.corpus(seed=52, n=40):
        got = await estimator.chat(body)
        assert not got.exact and got.total >= got.standin
        for node in nodes.values():
            assert got.total >= len(node.encode_chat(body))
    prompts: list[str | list[int]] = [*corpus.completion_prompts(seed=52, n=6), [1, 2, 3]]
    got = await estimator.completion({"prompt": prompts})
    for node in nodes.values():
        counts = [len(node.tokenizer.encode_prompt(p)) for p in prompts if isinstance(p, str)]
        assert got.total >= sum(counts) + 3 and got.longest >= max(counts)
