"""Prefix workloads on a simulated fleet: what prefix awareness and learned output do.

Fleet: 4 simulated 24 GB-class nodes in one tier (gpu24-8b: 8k context, ~30k KV tokens,
16 sequences each, prefix caching on as in vLLM V1), separate processes, the gateway in
this process. Closed loop: ``--sessions`` sessions run at once (56: ~90% of the fleet's 64
sequence slots); a session that ends is replaced by a new one, for ``--window`` wall
seconds. Every request is a streaming chat; each session's next turn sends the whole
history back, the node's own answers included.

Workloads (seeded, the same for every configuration):
  chat     multi-turn chats: one of 3 shared system prompts (~800 tokens), 3-6 turns of
           100-300-token user messages, max_tokens 128-384;
  agentic  one of 2 long shared tool prefixes (~3,000 tokens), 8-12 short turns (30-80
           tokens of tool output), max_tokens 32-96;
  rag      one turn: a distinct ~2,000-5,000-token document and a question, max_tokens 256.

Configurations: the baselines (``round_robin``, ``least_loaded``: prefix blind by
nature), ``kv_aware`` without and with ``routing.prefix_aware``, and the latter with
``admission.output_reservation: learned`` (preemption_risk 0.01).

Reported per run: the nodes' prefix-cache hit rate (sum of ``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries`` over the nodes, during the run), TTFT p50/p99 (simulated
seconds), goodput (output tokens of successful requests per simulated second), the
nodes' preemptions and the gateway's 429s.

    python -m bench.prefix_fleet [--window 20] [--time-scale 6] [--sessions 56]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.harness import demo_data, fleet_and_gateway, node_metrics
from bench.report import table

WORKLOADS = ("chat", "agentic", "rag")
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "round_robin": ("round_robin", {}),
    "least_loaded": ("least_loaded", {}),
    "kv_aware": ("kv_aware", {}),
    "kv_aware+prefix": ("kv_aware", {"routing": {"prefix_aware": True}}),
    "kv_aware+prefix+learned": (
        "kv_aware",
        {
            "routing": {"prefix_aware": True},
            "admission": {"output_reservation": "learned", "preemption_risk": 0.01},
        },
    ),
}
_VOCAB = [
    "shipment",
    "depot",
    "invoice",
    "carrier",
    "route",
    "pallet",
    "freight",
    "customs",
    "manifest",
    "warehouse",
    "delivery",
    "schedule",
    "driver",
    "truck",
    "container",
    "harbor",
    "rail",
    "forecast",
    "demand",
    "supply",
    "order",
    "ledger",
    "audit",
    "quote",
    "tariff",
    "zone",
    "region",
    "lane",
    "hub",
    "dock",
    "crane",
]
_HIT = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.M)
_QUERY = re.compile(r"^vllm:prefix_cache_queries_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def text(n_tokens: int, rnd: random.Random) -> str:
    """~n cl100k tokens of distinct words (one token each, with their space)."""
    return " ".join(rnd.choice(_VOCAB) for _ in range(n_tokens))


@dataclass
class Session:
    messages: list[dict[str, str]]
    turns: list[tuple[str, int]]  # (user text, max_tokens) per turn


def make_session(workload: str, rnd: random.Random, shared: list[str]) -> Session:
    if workload == "chat":
        system = rnd.choice(shared[:3])
        turns = [(text(rnd.randint(100, 300), rnd), rnd.randint(128, 384))]
        turns += [(text(rnd.randint(100, 300), rnd), rnd.randint(128, 384))]
        turns += [
            (text(rnd.randint(100, 300), rnd), rnd.randint(128, 384))
            for _ in range(rnd.randint(1, 4))
        ]
        return Session([{"role": "system", "content": system}], turns)
    if workload == "agentic":
        tools = rnd.choice(shared[3:5])
        turns = [(text(rnd.randint(30, 80), rnd), rnd.randint(32, 96)) for _ in range(8)]
        turns += [(text(rnd.randint(30, 80), rnd), rnd.randint(32, 96)) for _ in range(4)]
        return Session([{"role": "system", "content": tools}], turns[: rnd.randint(8, 12)])
    doc = text(rnd.randint(2_000, 5_000), rnd)
    return Session([], [(doc + " Question: " + text(30, rnd), 256)])


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    ok: int = 0
    output_tokens: int = 0
    status: dict[int, int] = field(default_factory=dict)


async def turn(
    s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int, st: Stats
) -> str | None:
    body = {
        "model": "llama-3.1-8b",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    answer: list[str] = []
    completion = 0
    try:
        async with asyncio.timeout(120), s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                st.status[r.status] = st.status.get(r.status, 0) + 1
                await r.read()
                return None
            first = None
            error = False
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = True
                    continue
                for c in chunk.get("choices") or ():
                    if first is None:
                        first = time.monotonic() - start
                    answer.append((c.get("delta") or {}).get("content") or "")
                if chunk.get("usage"):
                    completion = int(chunk["usage"].get("completion_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError):
        st.status[0] = st.status.get(0, 0) + 1
        return None
    if error or first is None:
        st.status[502] = st.status.get(502, 0) + 1
        return None
    st.status[200] = st.status.get(200, 0) + 1
    st.ok += 1
    st.ttft.append(first)
    st.output_tokens += completion
    return "".join(answer)


async def session_loop(
    url: str, workload: str, rnd: random.Random, shared: list[str], stop: float, st: Stats
) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        while time.monotonic() < stop:
            sess = make_session(workload, rnd, shared)
            for user, max_tokens in sess.turns:
                if time.monotonic() >= stop:
                    return
                sess.messages.append({"role": "user", "content": user})
                answer = await turn(s, url, sess.messages, max_tokens, st)
                if answer is None:
                    break  # a refused turn ends the session (its client gives up)
                sess.messages.append({"role": "assistant", "content": answer})


async def _prefix_counts(run: Any) -> tuple[float, float]:
    hits = queries = 0.0
    async with aiohttp.ClientSession() as s:
        for node in run.fleet:
            async with s.get(node.url + "/metrics") as r:
                body = await r.text()
            hits += sum(float(v) for v in _HIT.findall(body))
            queries += sum(float(v) for v in _QUERY.findall(body))
    return hits, queries


def fleet_data() -> dict[str, Any]:
    data = demo_data()
    data["tiers"] = [
        {
            "name": "small",
            "backends": [
                {
                    "name": f"small-{i}",
                    "url": "http://127.0.0.1:1",
                    "model": "llama-3.1-8b",
                    "max_num_seqs": 16,
                    "simulate": {"profile": "gpu24-8b"},
                }
                for i in range(1, 5)
            ],
        }
    ]
    return data


async def run_one(workload: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    policy, extra = CONFIGS[name]
    ts = args.time_scale
    gw: dict[str, Any] = {
        "admission": {"queue_timeout_s": 10.0 / ts, "default_output_tokens": 512},
        "load_feedback": {"interval_s": 2.0 / ts, "preemption_cooldown_s": 5.0 / ts},
    }
    for key, value in extra.items():
        gw.setdefault(key, {}).update(value)
    rnd = random.Random(args.seed)
    shared = [text(800, rnd) for _ in range(3)] + [text(3_000, rnd) for _ in range(2)]
    async with fleet_and_gateway(
        policy,
        time_scale=ts,
        seed=args.seed,
        data=fleet_data(),
        gateway_overrides=gw,
        sim_overrides={"output_mean": 160.0},
    ) as run:
        h0, q0 = await _prefix_counts(run)
        p0 = sum(m["preemptions"] for m in (await node_metrics(run.fleet)).values())
        st = Stats()
        stop = time.monotonic() + args.window
        await asyncio.gather(
            *(
                session_loop(
                    run.url, workload, random.Random(args.seed * 1000 + i), shared, stop, st
                )
                for i in range(args.sessions)
            )
        )
        h1, q1 = await _prefix_counts(run)
        p1 = sum(m["preemptions"] for m in (await node_metrics(run.fleet)).values())
    ttft = sorted(st.ttft)

    def pct(q: float) -> float | None:
        return ttft[min(len(ttft) - 1, round(q * (len(ttft) - 1)))] * ts if ttft else None

    return {
        "workload": workload,
        "config": name,
        "requests": sum(st.status.values()),
        "ok": st.ok,
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "ttft_p50_s": pct(0.5),
        "ttft_p99_s": pct(0.99),
        "goodput_tok_s": st.output_tokens / (args.window * ts),
        "preemptions": p1 - p0,
        "429s": st.status.get(429, 0),
        "other_errors": sum(v for k, v in st.status.items() if k not in (200, 429)),
    }


COLUMNS = [
    "workload", "config", "requests", "hit_rate", "ttft_p50_s", "ttft_p99_s",
    "goodput_tok_s", "preemptions", "429s", "other_errors",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--time-scale", type=float, default=6.0)
    parser.add_argument("--sessions", type=int, default=56)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        for name in args.configs.split(","):
            row = asyncio.run(run_one(workload, name, args))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
