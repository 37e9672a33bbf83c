"""Prefix workloads on a simulated fleet: what prefix awareness and learned output do.

Fleet: 4 simulated 24 GB-class nodes in one tier (gpu24-8b: 8k context, ~30k KV tokens,
16 sequences each, prefix caching on as in vLLM V1), separate processes, the gateway in
this process. Closed loop: ``--sessions`` sessions run at once, by default 90% load:
90% of the fleet's 64 sequence slots or of the requests its KV budget holds at the
workload's mean footprint (prompt + max_tokens), whichever binds first
(``default_sessions``); a session that ends is replaced by a new one, for ``--window``
wall seconds. Every request is a streaming chat; a session (one client) sends one
request at a time; each conversation's next turn sends the whole history back, the node's
own answers included. The gateway counts with cl100k and
``tokenizer.upper_bound: false``, as the nodes count (so routing is compared, not the
stand-in's worst-case bound).

Workloads (seeded, the same for every configuration):
  chat       short multi-turn chats: one of 3 shared system prompts (~800 tokens), 3-6
             turns of 100-300-token user messages, max_tokens 128-384;
  multiturn  multi-turn chats as vLLM's own multi-turn benchmark generates them
             (benchmarks/multi_turn/generate_multi_turn.json: 12-18 messages, a 500-token
             common prefix, a per-conversation prefix of lognormal size with mean 1,000
             tokens (median 850, at most 5,000), 120-160-token user turns, 80-120-token
             answers): one of 3 shared 500-token system prompts, a first user message
             holding the conversation's own context (the document or code being
             discussed) and its question, 6-9 user turns of 120-160 tokens, max_tokens
             80-120; histories grow to ~2-4k tokens, so the history, not the shared
             system prompt, is most of every later prompt; each client sends its
             conversation's turns back to back, as vLLM's benchmark does by default
             (``--request-rate 0``: "no delay between requests");
  multiturn_think
             the same conversations, each client thinking between its requests: an
             exponential delay with mean ``THINK_S`` (15 simulated s) after every request,
             as vLLM's benchmark sleeps when given ``--request-rate`` (``poisson_sleep`` in
             ``benchmarks/multi_turn/benchmark_serving_multi_turn.py``: after each request,
             ``np.random.exponential(1.0 / request_rate)``; here 1 / 15 s per client); a
             client starts in its think phase (the exponential is memoryless, so that is
             where a client in steady state is), not all at once; ``default_sessions``
             scales the sessions by (request + think) / request so that as many requests
             are in flight as in ``multiturn`` (``in_flight`` reports what was);
  multiturn3 the same conversations, each client keeping 3 going and taking turns among
             them (vLLM's benchmark runs 6 active conversations over 2 clients): a
             conversation's history must stay cached while 2 other turns of its client
             run, and 3x as many conversations are alive;
  agentic    one of 2 long shared tool prefixes (~3,000 tokens), 8-12 short turns (30-80
             tokens of tool output), max_tokens 32-96;
  rag        one turn: a distinct ~2,000-5,000-token document and a question, max_tokens 256.

Configurations: the baselines (``round_robin``, ``least_loaded``: prefix blind by
nature), ``kv_aware`` without and with ``routing.prefix_aware``, and the latter with
``admission.output_reservation: learned`` (preemption_risk 0.01).

Reported per run: the nodes' prefix-cache hit rate as vLLM's counters define it (the
increase of ``vllm:prefix_cache_hits`` over that of ``vllm:prefix_cache_queries``, both
in tokens, summed over the nodes, from just before the first session starts to after the
last turn ends), TTFT p50/p99 (simulated seconds), goodput (output tokens of successful
requests per simulated second), the nodes' preemptions, the gateway's 429s and 400s (a
node's refusal reaches the client as the gateway's 400), the mean request duration and
the mean number of requests in flight (Little's law: the requests' summed durations over
the run's wall time), and the share of follow-up turns served by another node than the
session's previous turn.

    python -m bench.prefix_fleet [--window 20] [--time-scale 6] [--sessions N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvloop

from bench import model_dirs
from bench.harness import demo_data, fleet_and_gateway, node_metrics
from bench.report import table

WORKLOADS = ("chat", "multiturn", "multiturn3", "multiturn_think", "agentic", "rag")
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
# The per-conversation context of "multiturn": lognormal with mean 1,000 tokens and
# median 850 (vLLM's "average": 1000 with its default median_ratio 0.85), capped at 5,000.
_MT_SIGMA = math.sqrt(2 * math.log(1 / 0.85))
_MT_MU = math.log(850)
_CONTENT = re.compile(rb'"delta":\s*\{[^{}]*?"content":\s*"((?:[^"\\]|\\.)*)"')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_ERROR_EVENT = re.compile(rb'^data: \{"error"', re.M)
_TTFT_SUM = re.compile(r"^vllm:time_to_first_token_seconds_sum\{[^}]*\} ([0-9.e+]+)$", re.M)
_TTFT_COUNT = re.compile(r"^vllm:time_to_first_token_seconds_count\{[^}]*\} ([0-9.e+]+)$", re.M)
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
    if workload.startswith("multiturn"):
        # vLLM's benchmarks/multi_turn/generate_multi_turn.json, see the module docstring.
        system = rnd.choice(shared[5:8])
        context = min(5_000, round(rnd.lognormvariate(_MT_MU, _MT_SIGMA)))
        first = text(context, rnd) + " " + text(rnd.randint(120, 160), rnd)
        turns = [(first, rnd.randint(80, 120))]
        turns += [
            (text(rnd.randint(120, 160), rnd), rnd.randint(80, 120))
            for _ in range(rnd.randint(6, 9) - 1)
        ]
        return Session([{"role": "system", "content": system}], turns)
    doc = text(rnd.randint(2_000, 5_000), rnd)
    return Session([], [(doc + " Question: " + text(30, rnd), 256)])


@functools.cache
def mean_footprint(workload: str, seed: int = 7, sessions: int = 2_000) -> float:
    """Mean KV tokens one request of ``workload`` reserves (prompt + max_tokens, the
    template's ~5 tokens a message, answers at their max_tokens), over its turns."""
    rnd = random.Random(seed)
    shared = [text(800, rnd) for _ in range(3)] + [text(3_000, rnd) for _ in range(2)]
    shared += [text(500, rnd) for _ in range(3)]
    total = count = 0
    for _ in range(sessions):
        sess = make_session(workload, rnd, shared)
        history = sum(len(m["content"].split()) + 5 for m in sess.messages)
        for user, max_tokens in sess.turns:
            history += len(user.split()) + 5
            total += history + max_tokens
            count += 1
            history += max_tokens + 5
    return total / count


# Mean think time of a client between two of its requests, in simulated seconds (0: back
# to back). 15 s is the user-centric example of NVIDIA's AIPerf ("reads the response,
# takes ~15 seconds"; 15 users at 1 req/s) and below the 20 s per-user gap of LMCache's
# multi-round QA example (10 users at 0.5 QPS): the short end of human pacing (reading a
# 100-token answer alone takes ~20 s; typing a 120-160-token question, longer), so the
# most a history can hope to stay cached between turns.
THINK_S: dict[str, float] = {"multiturn_think": 15.0}
# Mean duration of a request of a thinking client at 90% load, in simulated seconds: what
# ``default_sessions`` needs to keep as many requests in flight as the back-to-back
# clients do. Measured with kv_aware (time scale 1, 120 s): 150 sessions gave 4.26 s and
# 32 requests in flight, 193 sessions (REQUEST_S 4) 7.18 s and 60 in flight (the fleet
# queueing: between think times the nodes have lost most histories, every turn prefills
# ~3/4 of its prompt, against ~1/3 back to back); 5 s puts the ~40 of 90% in flight.
REQUEST_S = 5.0


def default_sessions(workload: str, load: float = 0.9) -> int:
    """Sessions for ``load``: of the fleet's 64 sequence slots, or of the requests its KV
    budget holds at the workload's mean footprint, whichever binds first. A client that
    thinks between requests is in a request only REQUEST_S / (REQUEST_S + think) of the
    time (Little's law), so it takes that many more clients to keep as many in flight."""
    # 95% of 4 gpu24-8b nodes' KV: the sizing every recorded run of this benchmark used.
    kv_budget = 4 * 0.95 * (1_920 - 1) * 16
    in_flight = load * min(64, kv_budget / mean_footprint(workload))
    return int(in_flight * (REQUEST_S + THINK_S.get(workload, 0.0)) / REQUEST_S)


def think_s(workload: str, rnd: random.Random) -> float:
    """One think time (simulated seconds): exponential with mean ``THINK_S[workload]``, as
    vLLM's ``poisson_sleep`` draws it; 0 for a workload whose clients do not think."""
    mean = THINK_S.get(workload, 0.0)
    return rnd.expovariate(1 / mean) if mean > 0 else 0.0


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    ok: int = 0
    output_tokens: int = 0
    status: dict[int, int] = field(default_factory=dict)
    follow_ups: int = 0  # turns after a session's first that succeeded
    moved: int = 0  # ... of which went to another node than the session's last turn
    busy_s: float = 0.0  # wall seconds spent in requests, summed over the requests


async def turn(
    s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int, st: Stats
) -> tuple[str, str] | None:
    """One streamed turn: the answer and the node that served it (None: it failed)."""
    body = {
        "model": "llama-3.1-8b",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    # The client shares this process (and 2 cores) with the gateway: the stream is only
    # scanned for its first token while it flows, and parsed once it has ended.
    data = bytearray()
    first = None
    try:
        async with asyncio.timeout(120), s.post(url + "/v1/chat/completions", json=body) as r:
            backend = r.headers.get("x-gateway-backend", "")
            if r.status != 200:
                st.status[r.status] = st.status.get(r.status, 0) + 1
                await r.read()
                return None
            async for chunk in r.content.iter_any():
                if first is None and b'"choices":[{' in chunk:
                    first = time.monotonic() - start
                data += chunk
    except (TimeoutError, aiohttp.ClientError):
        st.status[0] = st.status.get(0, 0) + 1
        return None
    finally:
        st.busy_s += time.monotonic() - start
    raw = bytes(data)
    if first is None or _ERROR_EVENT.search(raw) or not raw.endswith(b"data: [DONE]\n\n"):
        st.status[502] = st.status.get(502, 0) + 1
        return None
    answer = "".join(json.loads(b'"' + m + b'"') for m in _CONTENT.findall(raw))
    usage = _COMPLETION.findall(raw)
    completion = int(usage[-1]) if usage else 0
    st.status[200] = st.status.get(200, 0) + 1
    st.ok += 1
    st.ttft.append(first)
    st.output_tokens += completion
    return answer, backend


# Conversations each client keeps going at once, taking turns among them (vLLM's
# multi-turn benchmark: 6 active conversations over 2 clients); 1 = back to back.
ACTIVE: dict[str, int] = {
    "chat": 1, "multiturn": 1, "multiturn3": 3, "multiturn_think": 1, "agentic": 1, "rag": 1,
}  # fmt: skip


@dataclass
class Conversation:
    session: Session
    next_turn: int = 0
    last_backend: str | None = None


async def think(workload: str, pace: random.Random, time_scale: float, stop: float) -> None:
    """The client's think time, cut short at ``stop`` (the client then sends nothing)."""
    delay = think_s(workload, pace) / time_scale
    if delay > 0:
        await asyncio.sleep(max(0.0, min(delay, stop - time.monotonic())))


async def session_loop(
    url: str,
    workload: str,
    rnd: random.Random,
    shared: list[str],
    stop: float,
    st: Stats,
    pace: random.Random | None = None,
    time_scale: float = 1.0,
) -> None:
    """One client: sends one request at a time, each the next turn of one of its
    ``ACTIVE[workload]`` conversations in turn (round robin, as vLLM's benchmark does), so
    a conversation's turns are as far apart as the client's other conversations' turns
    take, plus the client's think times (``THINK_S``) if it has any; a conversation that
    ends (or whose turn failed) is replaced by a new one. Think times come from their own
    generator (``pace``), so a workload that thinks has the same conversations as one that
    does not."""
    pace = pace or random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        convs = [Conversation(make_session(workload, rnd, shared)) for _ in range(ACTIVE[workload])]
        i = 0
        await think(workload, pace, time_scale, stop)
        while time.monotonic() < stop:
            c = convs[i]
            sess = c.session
            user, max_tokens = sess.turns[c.next_turn]
            sess.messages.append({"role": "user", "content": user})
            got = await turn(s, url, sess.messages, max_tokens, st)
            c.next_turn += 1
            if got is None or c.next_turn >= len(sess.turns):
                # Finished, or refused (its client gives up): a new conversation.
                convs[i] = Conversation(make_session(workload, rnd, shared))
            if got is not None:
                answer, backend = got
                if c.last_backend is not None:
                    st.follow_ups += 1
                    st.moved += backend != c.last_backend
                c.last_backend = backend
                sess.messages.append({"role": "assistant", "content": answer})
            i = (i + 1) % len(convs)
            await think(workload, pace, time_scale, stop)


async def _node_counters(run: Any) -> tuple[float, float, float, float]:
    """Summed over the nodes: prefix-cache hits and queries (tokens), and the sum and
    count of their own time-to-first-token histogram (simulated seconds)."""
    hits = queries = ttft_sum = ttft_count = 0.0
    async with aiohttp.ClientSession() as s:
        for node in run.fleet:
            async with s.get(node.url + "/metrics") as r:
                body = await r.text()
            hits += sum(float(v) for v in _HIT.findall(body))
            queries += sum(float(v) for v in _QUERY.findall(body))
            ttft_sum += sum(float(v) for v in _TTFT_SUM.findall(body))
            ttft_count += sum(float(v) for v in _TTFT_COUNT.findall(body))
    return hits, queries, ttft_sum, ttft_count


def fleet_data(tokenizer: str | None = None) -> dict[str, Any]:
    """The 4-node fleet. ``tokenizer``: a model tokenizer directory the nodes count with
    and the gateway reads (exact counting, and prefix keys that are the nodes' own ids,
    so shared blocks are credited); else cl100k on both sides."""
    data = demo_data()
    for model in data["models"]:
        tok = model.setdefault("tokenizer", {})
        if tokenizer is not None:
            tok["path"] = tokenizer
        else:
            # The simulated nodes count with cl100k, the gateway's own encoding: reserve
            # its count as it is (docs/counting.md), so
            # that what is compared is routing, not the stand-in's worst-case bound.
            tok["upper_bound"] = False
    simulate: dict[str, Any] = {"profile": "gpu24-8b"}
    if tokenizer is not None:
        simulate["tokenizer"] = tokenizer
    data["tiers"] = [
        {
            "name": "small",
            "backends": [
                {
                    "name": f"small-{i}",
                    "url": "http://127.0.0.1:1",
                    "model": "llama-3.1-8b",
                    "max_num_seqs": 16,
                    "simulate": dict(simulate),
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
    sessions = args.sessions or default_sessions(workload)
    rnd = random.Random(args.seed)
    shared = [text(800, rnd) for _ in range(3)] + [text(3_000, rnd) for _ in range(2)]
    shared += [text(500, rnd) for _ in range(3)]
    async with fleet_and_gateway(
        policy,
        time_scale=ts,
        seed=args.seed,
        data=fleet_data(str(model_dirs.tokenizer_dir(args.tokenizer)) if args.tokenizer else None),
        gateway_overrides=gw,
        sim_overrides={"output_mean": 160.0},
    ) as run:
        h0, q0, ts0, tc0 = await _node_counters(run)
        p0 = sum(m["preemptions"] for m in (await node_metrics(run.fleet)).values())
        st = Stats()
        started = time.monotonic()
        stop = started + args.window
        await asyncio.gather(
            *(
                session_loop(
                    run.url,
                    workload,
                    random.Random(args.seed * 1000 + i),
                    shared,
                    stop,
                    st,
                    pace=random.Random(f"think {args.seed} {i}"),
                    time_scale=ts,
                )
                for i in range(sessions)
            )
        )
        elapsed = time.monotonic() - started
        h1, q1, ts1, tc1 = await _node_counters(run)
        p1 = sum(m["preemptions"] for m in (await node_metrics(run.fleet)).values())
    ttft = sorted(st.ttft)

    def pct(q: float) -> float | None:
        return ttft[min(len(ttft) - 1, round(q * (len(ttft) - 1)))] * ts if ttft else None

    return {
        "workload": workload,
        "sessions": sessions,
        "config": name,
        "requests": sum(st.status.values()),
        "ok": st.ok,
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "ttft_p50_s": pct(0.5),
        "ttft_p99_s": pct(0.99),
        "node_ttft_mean_s": (ts1 - ts0) / (tc1 - tc0) if tc1 > tc0 else None,
        "goodput_tok_s": st.output_tokens / (args.window * ts),
        "preemptions": p1 - p0,
        "429s": st.status.get(429, 0),
        "400s": st.status.get(400, 0),
        "other_errors": sum(v for k, v in st.status.items() if k not in (200, 400, 429)),
        "request_mean_s": st.busy_s * ts / n if (n := sum(st.status.values())) else None,
        "in_flight": st.busy_s / elapsed,
        "follow_ups_moved": st.moved / st.follow_ups if st.follow_ups else 0.0,
    }


COLUMNS = [
    "workload", "config", "sessions", "requests", "hit_rate", "ttft_p50_s", "ttft_p99_s",
    "node_ttft_mean_s", "goodput_tok_s", "preemptions", "429s", "400s", "other_errors",
    "request_mean_s", "in_flight", "follow_ups_moved",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--time-scale", type=float, default=6.0)
    parser.add_argument(
        "--sessions", type=int, default=0, help="default: 90%% load (default_sessions)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--tokenizer",
        help="nodes and gateway count with this model's tokenizer and template (qwen, "
        "llama3, tekken, sentencepiece or a directory; bench.model_dirs): exact counts "
        "and shared-block credit. Default: cl100k on both sides",
    )
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        for name in args.configs.split(","):
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                row = runner.run(run_one(workload, name, args))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
