"""What the proxy reserves: the exact count with the model's tokenizer, else a bound."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from kvgateway.tokens.counting import PromptCounter, TextCountCache
from kvgateway.tokens.encoding import load_encoding
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import ModelTokenizer
from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig
from kvgateway.tokens.prompt_estimate import PromptEstimator
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
    assert len(got.each) == len(prompts) and got.each[-1] == 3  # token ids: known exactly
    assert got.total == sum(got.each) and got.longest == max(got.each)
    for node in nodes.values():
        counts = [len(node.tokenizer.encode_prompt(p)) for p in prompts if isinstance(p, str)]
        assert all(b >= n for b, n in zip(got.each, counts, strict=False))


async def test_counters_build_one_estimator_per_model(vocab_dirs) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvgateway.config.load import parse_config
    from kvgateway.tokens.counters import TokenCounters
    from kvgateway.tokens.encoding import EncodingCache

    backend = {"name": "b", "url": "http://h:1", "model": "plain"}
    data = {
        "models": [
            {"name": "exact", "tokenizer": {"path": str(vocab_dirs("qwen"))}},
            {"name": "plain"},
        ],
        "tiers": [{"name": "t", "backends": [backend]}],
    }
    encodings = EncodingCache()
    config = parse_config(data, encodings=encodings)
    with ThreadPoolExecutor(1) as pool:
        counters = TokenCounters(encodings, pool)
        exact = counters.estimator_for(config.models[0].tokenizer)
        plain = counters.estimator_for(config.models[1].tokenizer)
        assert exact.exact and not plain.exact
        assert counters.estimator_for(config.models[0].tokenizer) is exact
        body = {"messages": [{"role": "user", "content": "Order 1234567"}]}
        assert (await exact.chat(body)).exact and not (await plain.chat(body)).exact


async def test_a_prompt_the_standin_overcounts_is_not_cut_off_at_the_context() -> None:
    """cl100k counts Chinese ~2x what Qwen does: a prompt it counts past the largest
    context may still fit the node, so it is counted on (to MAX_OVERCOUNT times the
    context) and given a floor the node's count cannot be below; ASCII text is not."""
    from kvgateway.plan.budget import worth_asking
    from kvgateway.tokens.standin import ASCII_OVERCOUNT, MAX_OVERCOUNT

    estimator = PromptEstimator(CONFIG, _standin())
    english = await estimator.chat(
        {"messages": [{"role": "user", "content": "word " * 3000}]}, 2000
    )
    assert english.total == english.standin  # certainly past: the bound is not computed
    assert english.floor == int(english.standin / ASCII_OVERCOUNT) > 2000
    assert english.standin <= 2000 * ASCII_OVERCOUNT + 1000  # stopped early
    cjk_body = {"messages": [{"role": "user", "content": "我们今天讨论缓存容量模型" * 300}]}
    cjk = await estimator.chat(cjk_body, 2000)
    assert cjk.standin > 2000 and cjk.total > cjk.standin  # counted on, and bounded
    assert cjk.floor == cjk.standin // MAX_OVERCOUNT
    assert worth_asking(cjk.total, cjk.floor, 16, 2000)
    assert not worth_asking(english.total, english.floor, 16, 2000)
    assert not worth_asking(500, 400, 16, 2000)  # nowhere near: no need


async def test_floor_is_the_count_when_exact(gateway_tokenizer: Loader) -> None:
    estimator = PromptEstimator(CONFIG, _standin(), ExactCounter(gateway_tokenizer("qwen")))
    got = await estimator.chat({"messages": [{"role": "user", "content": "东京 123"}]})
    assert got.exact and got.floor == got.total


async def test_a_big_prompts_bound_is_scanned_off_the_loop() -> None:
    """The bound scans every character (~5 ms per 100k): for a big prompt, in the
    executor, with the same result as on the loop."""
    from concurrent.futures import ThreadPoolExecutor

    class Recording(ThreadPoolExecutor):
        calls = 0

        def submit(self, fn, /, *args, **kwargs):
            Recording.calls += 1
            return super().submit(fn, *args, **kwargs)

    body = {
        "messages": [{"role": "user", "content": corpus.GENERATORS["json"](random.Random(1), 400)}]
    }
    prompts = {"prompt": ["12 34 " * 2000, "tiny"]}
    inline = PromptEstimator(CONFIG, _standin())
    with Recording(1) as pool:
        off = PromptEstimator(CONFIG, _standin(), executor=pool, inline_tokens=100)
        assert (await off.chat(body)).total == (await inline.chat(body)).total
        assert (await off.completion(prompts)).each == (await inline.completion(prompts)).each
    assert Recording.calls == 2


async def test_a_batch_whose_prompts_each_fit_is_counted_prompt_by_prompt() -> None:
    # Eight prompts of ~630 tokens against a 1,000-token context: their total passes
    # the limit, yet each fits. Counting does not stop on the total (read as one prompt
    # past the limit, the batch would be refused); it stops only past eight prompts' worth.
    estimator = PromptEstimator(CONFIG, _standin())
    text = "the quick brown fox jumps over the lazy dog " * 70
    got = await estimator.completion({"prompt": [text] * 8}, limit=1000)
    assert got.prompts == 8 and len(got.each) == 8
    assert max(got.each) < 1000 < got.total
    # Past eight prompts' worth, one of them is past the limit: still stopped early.
    huge = await estimator.completion({"prompt": [text * 20] * 8}, limit=1000)
    assert huge.longest > 1000


async def test_without_the_bound_the_floor_allows_for_the_overcount() -> None:
    """upper_bound false reserves the stand-in's count as the nodes' reports scale it;
    the least the node may count is still that count less what cl100k may overcount
    (Chinese ~2x Qwen's count): a CJK prompt counted past the context may fit the node,
    which is asked."""
    from kvgateway.plan.budget import worth_asking
    from kvgateway.tokens.standin import MAX_OVERCOUNT

    estimator = PromptEstimator(replace(CONFIG, upper_bound=False), _standin())
    cjk = await estimator.chat(
        {"messages": [{"role": "user", "content": "我们今天讨论缓存容量模型" * 300}]}, 2000
    )
    assert cjk.total == cjk.standin > 2000 and not cjk.exact
    assert cjk.floor == int(cjk.standin / MAX_OVERCOUNT)
    assert worth_asking(cjk.total, cjk.floor, 16, 2000)


async def test_a_prompt_keyed_for_routing_is_counted_from_its_ids_without_encoding() -> None:
    """Prefix-aware routing encodes a prompt's texts to key its blocks; counting the
    same prompt then reads their ids' lengths: the same count, nothing encoded again."""
    from concurrent.futures import ThreadPoolExecutor

    from kvgateway.tokens.counters import TokenCounters
    from kvgateway.tokens.encoding import EncodingCache

    body = {"messages": [{"role": "user", "content": corpus.text(random.Random(7), 2000)}]}
    with ThreadPoolExecutor(1) as pool:
        fresh = await TokenCounters(EncodingCache(), pool).estimator_for(CONFIG).chat(body)
        counters = TokenCounters(EncodingCache(), pool)
        counters.ids_for(CONFIG).chat(body, CONFIG)
        keyed = await counters.estimator_for(CONFIG).chat(body)
    assert fresh.encoded_chars > 1000
    assert keyed.standin == fresh.standin and keyed.total == fresh.total
    assert keyed.encoded_chars < 50  # at most the template's short texts
