"""A generated corpus of chat and completion requests that stress token counting.

Kinds: English prose, code, number-heavy text, hex ids and UUIDs, JSON, CJK, emoji,
mixed scripts, tool definitions and tool calls with results, and multi-turn histories.
Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

WORDS = [
    "the",
    "gateway",
    "counts",
    "tokens",
    "before",
    "it",
    "forwards",
    "a",
    "request",
    "to",
    "the",
    "node",
    "so",
    "that",
    "no",
    "node",
    "receives",
    "work",
    "it",
    "must",
    "refuse",
    "and",
    "none",
    "is",
    "pushed",
    "into",
    "preemption",
    "while",
    "others",
    "idle",
    "capacity",
    "memory",
    "cache",
    "block",
    "sequence",
    "prefill",
    "decode",
    "schedule",
    "latency",
    "throughput",
]
CJK = "你好世界我们今天讨论缓存容量模型推理请求令牌调度延迟吞吐量東京大阪日本語の文章をテスト한국어문장시험"
EMOJI = "🙂🚀🔥✨🎉👍🏽🧪📦🌍💡"
CODE = [
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for (let i = 0; i < items.length; i++) {\n  total += items[i].price * 1.08;\n}\n",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC;\n",
    '    if err != nil {\n        return fmt.Errorf("read %s: %w", path, err)\n    }\n',
]


def _prose(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def _numbers(rng: random.Random, n: int) -> str:
    parts = [str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(n)]
    return "Values: " + ", ".join(parts) + f". Total {rng.random() * 1e6:.4f}."


def _hex(rng: random.Random, n: int) -> str:
    ids = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(n // 2)]
    ids += [f"{rng.getrandbits(64):016x}" for _ in range(n - n // 2)]
    return " ".join(ids)


def _json(rng: random.Random, n: int) -> str:
    rows = [
        {
            "id": rng.randint(1, 99999),
            "name": rng.choice(WORDS),
            "ok": rng.random() < 0.5,
            "score": round(rng.random() * 100, 3),
            "tags": [rng.choice(WORDS) for _ in range(3)],
        }
        for _ in range(max(1, n // 8))
    ]
    return json.dumps(rows, indent=rng.choice([None, 2]))


def _cjk(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CJK) for _ in range(n))


def _emoji(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + rng.choice(EMOJI) for _ in range(n))


def _code(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CODE) for _ in range(max(1, n // 12)))


def _mixed(rng: random.Random, n: int) -> str:
    return " ".join(
        GENERATORS[k](rng, max(2, n // 4)) for k in ("prose", "cjk", "numbers", "emoji")
    )


GENERATORS = {
    "prose": _prose,
    "code": _code,
    "numbers": _numbers,
    "hex": _hex,
    "json": _json,
    "cjk": _cjk,
    "emoji": _emoji,
    "mixed": _mixed,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city, in °C.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    },
]


def text(rng: random.Random, size: int = 40) -> str:
    kind = rng.choice(list(GENERATORS))
    return GENERATORS[kind](rng, size)


def chat_request(rng: random.Random, *, tools_allowed: bool = True) -> dict[str, Any]:
    """One chat request: optional system prompt, 1-4 turns, maybe tools and tool calls."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You are terse. " + text(rng, 10)})
    use_tools = tools_allowed and rng.random() < 0.35
    turns = rng.randint(1, 4)
    for turn in range(turns):
        messages.append({"role": "user", "content": text(rng, rng.randint(5, 80))})
        if turn == turns - 1:
            break
        if use_tools and rng.random() < 0.6:
            call_id = f"call{rng.randint(100000000, 999999999)}"
            args = {"city": rng.choice(["Zürich", "東京", "Paris"]), "unit": "celsius"}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(args)},
                        }
                    ],
                }
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": json.dumps({"temp": rng.randint(-20, 40)}),
                }
            )
            messages.append({"role": "user", "content": text(rng, 10)})
        messages.append({"role": "assistant", "content": text(rng, rng.randint(5, 60))})
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 16}
    if use_tools:
        body["tools"] = TOOLS
    return body


def corpus(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [chat_request(rng) for _ in range(n)]


def completion_prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [text(rng, rng.randint(1, 120)) for _ in range(n)]
