"""The mixed chat workload of the counting benchmark, and how its answers are judged.

Every request is a chat for one model, of one content class: English prose and Python
source (``bench.texts``), numbers, hex ids, JSON, CJK, emoji, other scripts (Cyrillic,
Arabic, Thai, Devanagari), text laid out with blank lines, indentation, tabs and CRLF,
multi-turn chats with tool definitions and tool calls (``tests.support.corpus``),
images, long prompts (2k-16k tokens), and prompts whose node count plus ``max_tokens``
lands within 5% of a node's context limit (under it, or just over a small node's).
Near-limit prompts are sized with the model's own tokenizer and template
(:class:`~kvgateway.tokens.exact.ExactCounter`), so they sit where a count that is
off by a few percent decides between serving and refusing.

:func:`judge` turns answers into the figures the issue asks for: how often the
gateway's ``x-gateway-prompt-tokens`` equals the node's ``usage.prompt_tokens``, how
often it is over or under, node 400s, and gateway refusals (400/429/503) of requests
the node would have served, decided by the node's own count (its ``/tokenize``)
against the largest context on offer.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench import texts
from kvgateway.tokens.exact import ExactCounter
from tests.support import corpus

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
SCRIPTS = (
    "Москва большой город, и русский язык красивый. ",
    "القاهرة مدينة كبيرة واللغة العربية جميلة. ",
    "กรุงเทพมหานครเป็นเมืองหลวง ภาษาไทยเป็นภาษาที่สวยงาม ",
    "दिल्ली भारत की राजधानी है। हिंदी एक सुंदर भाषा है। ",
)
# Shares of the mix (they need not add up to 1).
MIX: dict[str, float] = {
    "prose": 0.09,
    "code": 0.09,
    "numbers": 0.08,
    "hex": 0.05,
    "json": 0.08,
    "cjk": 0.07,
    "emoji": 0.04,
    "scripts": 0.05,
    "layout": 0.07,
    "tools": 0.12,
    "images": 0.06,
    "long": 0.08,
    "near_limit": 0.12,
}
NEAR = 0.05  # near a limit: node count + max_tokens within 5% of it


@dataclass
class Probe:
    """One request of the workload and what the client got back."""

    model: str
    kind: str
    body: dict[str, Any]
    max_tokens: int
    status: int = 0
    code: str | None = None
    gateway_count: int | None = None  # x-gateway-prompt-tokens
    node_count: int | None = None  # usage.prompt_tokens, or the node's /tokenize
    backend: str | None = None


def _scripts(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(SCRIPTS) for _ in range(max(1, n // 40)))


def _layout(rng: random.Random, n: int) -> str:
    """Blank lines, indentation, tabs, CRLF and pretty JSON: white space that a
    byte-fallback vocabulary counts one token per character where cl100k merges it."""
    parts = []
    while sum(map(len, parts)) < n * 4:
        pick = rng.randrange(5)
        if pick == 0:
            parts.append("\n\n\n" + corpus.GENERATORS["prose"](rng, 20) + "\n\n")
        elif pick == 1:
            depth = rng.randint(1, 6)
            parts.append("\n" + "    " * depth + "if x:\n" + "    " * (depth + 1) + "pass\n")
        elif pick == 2:
            parts.append("\t".join(corpus.WORDS[:6]) + "\r\n")
        elif pick == 3:
            parts.append(json.dumps({"a": [1, {"b": rng.random()}], "c": "d"}, indent=4) + "\n")
        else:
            parts.append(" " * rng.randint(2, 40) + rng.choice(corpus.WORDS) + "\n")
    return "".join(parts)


def content(kind: str, rng: random.Random, tokens: int) -> str:
    """About ``tokens`` cl100k tokens of one content class."""
    if kind == "prose":
        return texts.text("english", tokens, rng.randrange(100_000))
    if kind == "code":
        return texts.text("code", tokens, rng.randrange(100_000))
    if kind == "scripts":
        return _scripts(rng, tokens)
    if kind == "layout":
        return _layout(rng, tokens)
    # Generators of tests.support.corpus take a size in their own units (numbers, ids,
    # JSON rows / 8, words with an emoji), about this many cl100k tokens each.
    per_unit = {"numbers": 4, "hex": 15, "json": 5, "emoji": 3, "mixed": 2.5}.get(kind, 1)
    size = int(tokens / per_unit)
    return corpus.GENERATORS[kind](rng, max(2, size))


NEAR_KINDS = ("prose", "code", "numbers", "json", "cjk", "emoji", "scripts", "layout")


def _chat(text: str, rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You are terse."})
    messages.append({"role": "user", "content": text})
    return messages


def near_limit(
    rng: random.Random, counter: ExactCounter, limit: int, max_tokens: int, *, over: bool
) -> dict[str, Any]:
    """A chat whose node count + ``max_tokens`` lies in [limit * 0.95, limit] (or in
    (limit, limit * 1.05] with ``over``), trimmed with the model's own count."""
    lo, hi = (limit + 1, int(limit * (1 + NEAR))) if over else (int(limit * (1 - NEAR)), limit)
    goal = rng.randint(lo, hi) - max_tokens
    kind = rng.choice(NEAR_KINDS)
    text = content(kind, rng, goal * 2)
    messages = _chat("", rng)

    def count(chars: int) -> int:
        messages[-1]["content"] = text[:chars]
        return counter.count_chat_sync({"messages": messages})

    # Secant steps on the character count, then bisection: a few counts per prompt.
    chars = len(text)
    n = count(chars)
    while n < goal:  # too short even whole: repeat it
        text += text
        chars = len(text)
        n = count(chars)
    low, high = 0, chars
    for _ in range(40):
        if lo <= n + max_tokens <= hi:
            break
        if n + max_tokens > hi:
            high = chars
        else:
            low = chars
        guess = int(chars * goal / max(n, 1))
        chars = guess if low < guess < high else (low + high) // 2
        n = count(chars)
    else:
        raise RuntimeError(f"could not size a {kind} prompt to {lo}..{hi} tokens")
    body = {"messages": messages, "max_tokens": max_tokens}
    body["_kind"] = f"near_limit/{kind}"
    return body


def request(
    kind: str,
    rng: random.Random,
    counter: ExactCounter,
    contexts: Sequence[int],
) -> dict[str, Any]:
    """One chat body of ``kind`` (without ``model``)."""
    max_tokens = rng.randint(8, 128)
    if kind == "near_limit":
        limit = rng.choice(contexts)
        # Just over a node's limit only where a larger node can take it.
        over = limit < max(contexts) and rng.random() < 0.3
        return near_limit(rng, counter, limit, rng.randint(16, 256), over=over)
    if kind == "tools":
        body = corpus.chat_request(rng)
        body.pop("model")
        body["max_tokens"] = max_tokens
        return body
    if kind == "images":
        parts: list[dict[str, Any]] = [{"type": "text", "text": content("prose", rng, 200)}]
        parts += [IMAGE] * rng.randint(1, 3)
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens}
    if kind == "long":
        text = content(rng.choice(NEAR_KINDS), rng, rng.randint(2_000, 16_000))
        return {"messages": _chat(text, rng), "max_tokens": max_tokens}
    text = content(kind, rng, rng.randint(50, 1_500))
    return {"messages": _chat(text, rng), "max_tokens": max_tokens}


def workload(
    model: str,
    counter: ExactCounter,
    n: int,
    seed: int,
    contexts: Sequence[int],
    mix: dict[str, float] | None = None,
) -> list[Probe]:
    """``n`` probes for ``model``, the kinds drawn by ``mix`` (seeded)."""
    rng = random.Random(seed)
    mix = mix or MIX
    kinds = list(mix)
    weights = [mix[k] for k in kinds]
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        body = request(kind, rng, counter, contexts)
        kind = body.pop("_kind", kind)
        out.append(Probe(model, kind, {"model": model, **body}, body["max_tokens"]))
    return out


# ---- sending and judging ----------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, probe: Probe, timeout: float) -> None:
    """One non-streaming chat through the gateway; fills in the probe's answer."""
    try:
        async with (
            asyncio.timeout(timeout),
            session.post(url + "/v1/chat/completions", json=probe.body) as r,
        ):
            data = await r.json(content_type=None)
            probe.status = r.status
            probe.backend = r.headers.get("x-gateway-backend")
            header = r.headers.get("x-gateway-prompt-tokens")
            probe.gateway_count = int(header) if header is not None else None
            if r.status == 200:
                probe.node_count = int(data["usage"]["prompt_tokens"])
            else:
                probe.code = str((data.get("error") or {}).get("code"))
    except (TimeoutError, aiohttp.ClientError) as exc:
        probe.status, probe.code = 0, type(exc).__name__


async def node_counts(
    session: aiohttp.ClientSession,
    probes: Sequence[Probe],
    node_of: Callable[[str], tuple[str, str]],
) -> None:
    """The node's own count of every probe the node did not count itself (refused
    before or by a node): ``/tokenize`` of ``node_of(model)``, a (URL, served name)."""
    for p in probes:
        if p.node_count is not None:
            continue
        url, served = node_of(p.model)
        body = {k: v for k, v in p.body.items() if k in ("messages", "tools")}
        async with session.post(url + "/tokenize", json={**body, "model": served}) as r:
            data = await r.json()
            if r.status == 200:
                p.node_count = int(data["count"])


@dataclass
class Verdict:
    """The figures of one mode (or one model within it)."""

    requests: int = 0
    served: int = 0
    exact: int = 0
    over: int = 0
    under: int = 0
    worst_under: int = 0
    over_ratio_max: float = 0.0
    node_400: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # gateway refusals by status
    servable: int = 0
    wrongly_refused: int = 0
    wrongly_refused_kinds: dict[str, int] = field(default_factory=dict)
    other_failures: int = 0

    @property
    def exact_share(self) -> float:
        return self.exact / self.served if self.served else 0.0

    @property
    def wrongly_refused_share(self) -> float:
        return self.wrongly_refused / self.servable if self.servable else 0.0


GATEWAY_CODES = {"context_length_exceeded", "saturated", "queue_timeout", "no_backend"}


def is_gateway_refusal(p: Probe) -> bool:
    """Refused by the gateway itself (not relayed from a node)."""
    return p.status in (429, 503) or (p.status == 400 and p.code == "context_length_exceeded")


def judge(probes: Sequence[Probe], largest_context: int) -> Verdict:
    v = Verdict(requests=len(probes))
    for p in probes:
        fits = p.node_count is not None and p.node_count + p.max_tokens <= largest_context
        v.servable += fits
        if p.status == 200:
            v.served += 1
            assert p.node_count is not None and p.gateway_count is not None
            if p.gateway_count == p.node_count:
                v.exact += 1
            elif p.gateway_count > p.node_count:
                v.over += 1
                v.over_ratio_max = max(v.over_ratio_max, p.gateway_count / p.node_count)
            else:
                v.under += 1
                v.worst_under = max(v.worst_under, p.node_count - p.gateway_count)
        elif is_gateway_refusal(p):
            key = str(p.status)
            v.refused[key] = v.refused.get(key, 0) + 1
            if fits:
                v.wrongly_refused += 1
                v.wrongly_refused_kinds[p.kind] = v.wrongly_refused_kinds.get(p.kind, 0) + 1
        elif p.status == 400:
            v.node_400 += 1
        else:
            v.other_failures += 1
    return v
