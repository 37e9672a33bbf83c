"""Admission by the projected KV peak against the node(s) alone and the baselines, on
real vLLM nodes (vLLM 0.32's CPU build, tiny random-weight Qwen2 models).

The same requests, in the same order, several ways. Every request is a streaming chat
sent with the official ``openai`` client; the gateway runs with its defaults and only
the model's tokenizer directory configured.

Workloads and what they compare:
  burst     48 chats at once on node B (64 blocks: 8,064 usable KV tokens, 16 sequences,
            4k context): prompts of 100-600 tokens, outputs of 128-512 tokens fixed with
            ``ignore_eos``. Modes: ``node`` (straight to the node), ``whole_life``
            (every request holds prompt + max_tokens for its life:
            ``admission.kv_projection: false``) and ``projected`` (the default).
  unknown   192 chats, 32 at a time, on B, ``max_tokens`` 2048; the node draws each answer's
            length (a ``logit_bias``ed token listed in ``stop_token_ids`` ends it, mean
            ~200 tokens), which the gateway cannot know. Same modes (``projected``
            bounds each answer by the lengths learned, the default), and ``max_tokens``
            (``admission.output_reservation: max_tokens``). ``+warm``: the gateway
            serves the workload once (marked apart) before the measured run, as one
            that has served before has learned its answers. In any workload,
            ``+usage`` has the clients ask for usage on every chunk
            (``continuous_usage_stats``, as the gateway asks the nodes): ``node+usage``
            is the node alone serving what the gateway makes it serve.
  fleet     60 chats, 30 at a time, on S (4k context, 6,016 KV tokens) and L (16k,
            24,448): 42 short (300-2,500 prompt tokens) and 18 too long for S (4,500-
            12,000); outputs of 128-512 fixed. Modes: ``projected`` (kv_aware),
            ``whole_life``, ``length_aware`` and ``round_robin``; ``+tiers`` puts each
            node in its own tier, in the order given (S first).
  multiturn 16 conversations of 5 turns on two equal nodes (S and S2), each turn the
            whole history plus a question, sharing two 1,500-token system prompts;
            8 conversations at a time. Modes: ``projected`` and ``round_robin``.

Printed per mode: wall time, output tokens/s, the nodes' preemptions, 429s, node 400s
and other errors, TTFT p50/p99, the nodes' mean KV use and running sequences (batch) and
the gateway's CPU seconds (the JSON adds each backend's requests and when its last
answer ended); then each mode's time against the node alone's, as wall time and per
output token (answers the node draws differ in length from run to run).

A workload of one node runs with the node on the machine's last CPU and this harness
(the clients) and the gateway on the others, in every mode (``--pin``): vLLM's CPU
engine polls with ``sched_yield`` and a process sharing its CPU waits for seconds.

    python -m bench.projection --real [--workload burst|unknown|fleet|multiturn|all]
        [--repeat N]

Nodes are started here, or reused from ``python -m tests.support.vllm_nodes B S L S2``
with ``KVGATEWAY_REAL_NODES``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from openai import APIConnectionError, APIStatusError, AsyncOpenAI

from bench.real_nodes import KvSampler, pin, real_nodes, wait_idle
from bench.report import machine, save
from tests.support.gateway_process import serve_process
from tests.support.real_fleet import BENCH, S2, L, S
from tests.support.vllm_nodes import NodeSpec, RealNode

# A token the random-weight model emits about as often as any other: biased up, it ends
# an answer after ~200 tokens on average (`--calibrate` prints what it draws).
STOP_TOKEN = 1000
STOP_BIAS = 6.5
WORDS = [
    "alpha",
    "river",
    "stone",
    "cloud",
    "garden",
    "silver",
    "window",
    "morning",
    "forest",
    "candle",
    "harbor",
    "meadow",
    "lantern",
    "orbit",
    "pepper",
    "quiet",
    "rocket",
    "saddle",
    "timber",
    "velvet",
    "walnut",
    "yellow",
    "zephyr",
    "anchor",
    "bishop",
    "castle",
    "dragon",
    "ember",
    "falcon",
    "glacier",
    "hollow",
    "island",
    "jasmine",
    "kettle",
    "lemon",
    "marble",
    "needle",
    "ocean",
    "pillow",
    "quartz",
    "raven",
    "summit",
    "tunnel",
    "umbrella",
    "valley",
    "willow",
]


@dataclass(frozen=True)
class Request:
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    fixed: bool  # ignore_eos: the output is exactly max_tokens
    # Multi-turn: (conversation, turn); a conversation's turns go one after another.
    turn: tuple[int, int] | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    nodes: tuple[NodeSpec, ...]
    modes: tuple[str, ...]
    requests: tuple[Request, ...]
    concurrency: int  # requests in flight at once (0: all at once)


@dataclass
class Result:
    mode: str
    workload: str
    requests: int
    ok: int
    refused_429: int
    node_400: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tps: float
    preemptions: int
    ttft_p50_s: float
    ttft_p99_s: float
    mean_kv_use: float
    mean_running: float = 0.0
    gateway_cpu_s: float = 0.0
    backends: dict[str, int] = field(default_factory=dict)
    # Seconds from the start until each backend's last answer ended.
    finished: dict[str, float] = field(default_factory=dict)


def _text(rng: random.Random, words: int, i: int) -> str:
    return f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _one_turn(text: str) -> tuple[tuple[str, str], ...]:
    return (("user", text),)


def workload(name: str, seed: int = 7) -> Workload:
    rng = random.Random(seed)
    if name == "burst":
        reqs = [
            Request(_one_turn(_text(rng, rng.randint(100, 600), i)), rng.randint(128, 512), True)
            for i in range(48)
        ]
        return Workload(name, (BENCH,), ("node", "whole_life", "projected"), tuple(reqs), 0)
    if name == "unknown":
        reqs = [
            Request(_one_turn(_text(rng, rng.randint(100, 600), i)), 2048, False)
            for i in range(192)
        ]
        modes = ("node", "whole_life", "max_tokens", "projected")
        return Workload(name, (BENCH,), modes, tuple(reqs), 32)
    if name == "fleet":
        short = [(rng.randint(300, 2500), rng.randint(128, 512)) for _ in range(42)]
        long = [(rng.randint(4500, 12000), rng.randint(128, 512)) for _ in range(18)]
        mix = short + long
        rng.shuffle(mix)
        reqs = [Request(_one_turn(_text(rng, p, i)), o, True) for i, (p, o) in enumerate(mix)]
        modes = ("projected", "whole_life", "length_aware", "round_robin")
        return Workload(name, (S, L), modes, tuple(reqs), 30)
    if name == "multiturn":
        systems = [_text(random.Random(100 + k), 1500, 10_000 + k) for k in range(2)]
        reqs = []
        for c in range(16):
            history: list[tuple[str, str]] = [("system", systems[c % 2])]
            for t in range(5):
                history.append(("user", _text(rng, rng.randint(40, 120), c * 10 + t)))
                reqs.append(Request(tuple(history), 64, True, (c, t)))
                history.append(("assistant", _text(rng, 48, c * 10 + t + 5)))
        return Workload(name, (S, S2), ("projected", "round_robin"), tuple(reqs), 8)
    raise SystemExit(f"unknown workload {name!r}")


def _extra(req: Request) -> dict[str, Any]:
    if req.fixed:
        return {"ignore_eos": True}
    return {"logit_bias": {str(STOP_TOKEN): STOP_BIAS}, "stop_token_ids": [STOP_TOKEN]}


@dataclass
class _Got:
    status: int
    ttft: float | None = None
    output: int = 0
    backend: str = "-"
    node_400: bool = False
    end: float = 0.0  # time.monotonic() when the answer ended


async def _one(client: AsyncOpenAI, model: str, req: Request, every: bool = False) -> _Got:
    """One request; a connection the server closed before answering (a keep-alive race
    with uvicorn's 5 s idle timeout, in every mode alike) is tried again, twice at most."""
    for attempt in range(3):
        try:
            return await _once(client, model, req, every)
        except APIConnectionError:
            if attempt == 2:
                return _Got(0)
    raise AssertionError("unreachable")


async def _once(client: AsyncOpenAI, model: str, req: Request, every: bool) -> _Got:
    start = time.monotonic()
    got = _Got(200)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": r, "content": c} for r, c in req.messages],  # type: ignore[misc]
            max_tokens=req.max_tokens,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": every},
            extra_body=_extra(req),
        )
        got.backend = raw.headers.get("x-gateway-backend", "-")
        async for chunk in raw.parse():
            if got.ttft is None and chunk.choices:
                got.ttft = time.monotonic() - start
            if chunk.usage is not None:
                got.output = chunk.usage.completion_tokens
    except APIStatusError as exc:
        # A 400 the node itself answered (relayed by the gateway, or straight).
        body = exc.response.headers.get("x-gateway-backend")
        return _Got(exc.status_code, node_400=exc.status_code == 400 and body is not None)
    got.end = time.monotonic()
    return got


async def _run(url: str, model: str, w: Workload, every: bool = False) -> list[_Got]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", timeout=1800, max_retries=0)
    limit = asyncio.Semaphore(w.concurrency or len(w.requests))
    done: dict[tuple[int, int], asyncio.Event] = {
        r.turn: asyncio.Event() for r in w.requests if r.turn is not None
    }

    async def one(req: Request) -> _Got:
        if req.turn is not None and req.turn[1] > 0:
            await done[(req.turn[0], req.turn[1] - 1)].wait()
        async with limit:
            got = await _one(client, model, req, every)
        if req.turn is not None:
            done[req.turn].set()
        return got

    try:
        return await asyncio.gather(*(one(r) for r in w.requests))
    finally:
        await client.close()


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


TRACE_COLUMNS = (
    "s",
    "kv_use",
    "running",
    "waiting",
    "gateway_queue",
    "preemptions",
    "gateway_blocks",
)


def _gateway_config(nodes: list[RealNode], mode: str) -> dict[str, Any]:
    """The gateway's defaults in front of ``nodes`` (one tier, in the order given; a
    larger context later), only the model's tokenizer directory and the mode set."""
    served = nodes[0].spec.served_name
    config: dict[str, Any] = {
        "models": [{"name": served, "tokenizer": {"path": str(nodes[0].model_dir)}}],
        "tiers": [
            {
                "name": "cpu",
                "backends": [{"name": n.spec.name, "url": n.url, "model": served} for n in nodes],
            }
        ],
    }
    adm: dict[str, Any] = {}
    for part in mode.split("+"):
        if part == "whole_life":
            adm["kv_projection"] = False
        elif part == "max_tokens":
            adm["output_reservation"] = "max_tokens"
        elif part.startswith("fraction="):
            adm["budget_fraction"] = float(part.partition("=")[2])
        elif part.startswith("risk="):
            adm["preemption_risk"] = float(part.partition("=")[2])
        elif part in ("warm", "usage"):
            pass  # measure(): served once before the run; the client asks usage per chunk
        elif part in ("length_aware", "round_robin"):
            config["routing"] = {"policy": part}
        elif part == "tiers":  # each node its own tier, in the order given
            config["tiers"] = [
                {"name": f"t{i}", "backends": [b]}
                for i, b in enumerate(config["tiers"][0]["backends"])
            ]
    if adm:
        config["admission"] = adm
    return config


@contextlib.contextmanager
def _gateway(nodes: list[RealNode], mode: str) -> Iterator[tuple[str, int]]:
    """`gateway serve` as its own process; yields its URL and pid."""
    work = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    with serve_process(_gateway_config(nodes, mode), work) as (url, proc):
        yield url, proc.pid


def salted(w: Workload, run: int) -> Workload:
    """``w`` with every conversation's first message marked with ``run``: the nodes'
    prefix caches outlive a run, and a run must not find the blocks of an earlier run's
    identical prompts there. Shared prefixes within a run stay shared."""
    mark = f"Run {run:05d}. "
    return replace(
        w,
        requests=tuple(
            replace(r, messages=((r.messages[0][0], mark + r.messages[0][1]), *r.messages[1:]))
            for r in w.requests
        ),
    )


# Added to a run's mark for the unmeasured pass of a ``+warm`` mode.
WARM_MARK = 50_000


def measure(
    nodes: list[RealNode],
    mode: str,
    w: Workload,
    trace: dict[str, Any] | None = None,
    run: int = 0,
) -> Result:
    """One run of ``w`` in ``mode`` (its prompts marked with ``run``, unique per run);
    with ``trace`` each node's readings over time go into it under ``mode/node``."""
    parts = mode.split("+")
    alone, warm, every = parts[0] == "node", "warm" in parts, "usage" in parts
    model = nodes[0].spec.served_name
    cpu = 0.0
    with contextlib.ExitStack() as stack:
        url, pid = nodes[0].url, 0
        if not alone:
            url, pid = stack.enter_context(_gateway(nodes, mode))
            if warm:  # the gateway serves the workload once, marked apart, unmeasured
                asyncio.run(_run(url, model, salted(w, run + WARM_MARK)))
        for n in nodes:
            wait_idle(n)
        w = salted(w, run)
        pre = sum(n.metric("vllm:num_preemptions_total") for n in nodes)
        if pid:
            cpu = _cpu_seconds(pid)
        gw = None if alone else url
        samplers = [stack.enter_context(KvSampler(n, gateway=gw)) for n in nodes]
        t0 = time.monotonic()
        got = asyncio.run(_run(url, model, w, every))
        wall = time.monotonic() - t0
        if pid:
            cpu = _cpu_seconds(pid) - cpu
    if trace is not None:
        for n, s in zip(nodes, samplers, strict=True):
            trace.setdefault(f"{mode}/{n.spec.name}", []).append(s.series)
    ok = [g for g in got if g.status == 200]
    out = sum(g.output for g in ok)
    ttfts = [g.ttft for g in ok if g.ttft is not None]
    backends: dict[str, int] = {}
    finished: dict[str, float] = {}
    for g in ok:
        backends[g.backend] = backends.get(g.backend, 0) + 1
        finished[g.backend] = max(finished.get(g.backend, 0.0), round(g.end - t0, 1))
    return Result(
        mode=mode,
        workload=w.name,
        requests=len(got),
        ok=len(ok),
        refused_429=sum(1 for g in got if g.status == 429),
        node_400=sum(1 for g in got if g.node_400 or (alone and g.status == 400)),
        errors=sum(1 for g in got if g.status not in (200, 429) and not g.node_400),
        wall_s=round(wall, 2),
        output_tokens=out,
        output_tps=round(out / wall, 1) if wall else 0.0,
        preemptions=int(sum(n.metric("vllm:num_preemptions_total") for n in nodes) - pre),
        ttft_p50_s=round(statistics.median(ttfts), 3) if ttfts else 0.0,
        ttft_p99_s=round(_quantile(ttfts, 0.99), 3),
        mean_kv_use=round(statistics.mean(s.mean for s in samplers), 3),
        mean_running=round(statistics.mean(s.mean_running for s in samplers), 2),
        gateway_cpu_s=round(cpu, 2),
        backends=backends,
        finished=finished,
    )


def _print(results: list[Result]) -> None:
    print(
        f"{'workload':9} {'mode':12} {'ok':>6} {'429':>4} {'n400':>4} {'err':>4} {'wall s':>7} "
        f"{'tok/s':>6} {'preempt':>7} {'ttft p50':>8} {'ttft p99':>8} {'kv use':>6} {'batch':>5} {'gw cpu':>6}"
    )
    for r in results:
        print(
            f"{r.workload:9} {r.mode:12} {r.ok:>3}/{r.requests:<2} {r.refused_429:>4} "
            f"{r.node_400:>4} {r.errors:>4} {r.wall_s:>7.1f} {r.output_tps:>6.0f} "
            f"{r.preemptions:>7} {r.ttft_p50_s:>8.2f} {r.ttft_p99_s:>8.2f} "
            f"{r.mean_kv_use:>6.2f} {r.mean_running:>5.1f} {r.gateway_cpu_s:>6.1f}"
        )
    for name in dict.fromkeys(r.workload for r in results):
        mine = [r for r in results if r.workload == name]
        base = [r for r in mine if r.mode == "node"]
        if base:
            ref = statistics.mean(r.wall_s for r in base)
            per = statistics.mean(r.wall_s / max(1, r.output_tokens) for r in base)
            for mode in dict.fromkeys(r.mode for r in mine if r.mode != "node"):
                runs = [r for r in mine if r.mode == mode]
                wall = statistics.mean(r.wall_s for r in runs) / ref
                token = statistics.mean(r.wall_s / max(1, r.output_tokens) for r in runs) / per
                print(
                    f"{name} {mode}: {wall:.2f}x the node alone's time, "
                    f"{token:.2f}x its time per output token"
                )


def calibrate(node: RealNode, n: int = 32) -> None:
    """The answer lengths the stop-token bias draws on this node (``unknown``)."""
    rng = random.Random(1)
    reqs = tuple(Request(_one_turn(_text(rng, 50, i)), 2048, False) for i in range(n))
    got = asyncio.run(_run(node.url, node.spec.served_name, Workload("c", (), (), reqs, 0)))
    lengths = sorted(g.output for g in got if g.status == 200)
    print(
        f"bias {STOP_BIAS} on token {STOP_TOKEN}: mean {statistics.mean(lengths):.0f}, "
        f"median {statistics.median(lengths)}, max {lengths[-1]} over {len(lengths)} answers"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--real", action="store_true", required=True, help="real vLLM nodes")
    p.add_argument(
        "--workload", choices=("burst", "unknown", "fleet", "multiturn", "all"), default="all"
    )
    p.add_argument("--modes", default="", help="comma-separated; default: the workload's")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--calibrate", action="store_true", help="print the stop-token lengths")
    p.add_argument("--out", default="projection_real", help="results name under bench/results")
    p.add_argument(
        "--trace",
        action="store_true",
        help="also write each node's readings over time (KV use, running, waiting, the "
        "gateway's queue) to bench/results/OUT_trace.json",
    )
    p.add_argument(
        "--pin",
        choices=("auto", "on", "off"),
        default="auto",
        help="the node(s) on the last CPU, this harness and the gateway on the others "
        "(auto: when the workload runs one node on a machine of 2 or more CPUs)",
    )
    args = p.parse_args(argv)
    names = (
        ("burst", "unknown", "fleet", "multiturn") if args.workload == "all" else (args.workload,)
    )
    results: list[Result] = []
    trace: dict[str, Any] | None = {} if args.trace else None
    cpus = sorted(os.sched_getaffinity(0))
    # Runs are numbered from the clock, so that runs of separate invocations against
    # the same kept nodes differ too.
    run = int(time.time()) % 1000 * 10
    for name in names:
        w = workload(name)
        modes = args.modes.split(",") if args.modes else w.modes
        with real_nodes(list(w.nodes)) as found:
            nodes = [found[s.name] for s in w.nodes]
            pinned = len(cpus) > 1 and (
                args.pin == "on" or (args.pin == "auto" and len(nodes) == 1)
            )
            if pinned:
                pin(nodes, {cpus[-1]}, set(cpus[:-1]))
                print(f"pinned: node(s) on CPU {cpus[-1]}, harness and gateway on {cpus[:-1]}")
            try:
                if args.calibrate:
                    calibrate(nodes[0])
                    return 0
                for _ in range(args.repeat):
                    for mode in modes:
                        run += 1
                        r = measure(nodes, mode, w, trace, run)
                        results.append(r)
                        print(json.dumps(asdict(r)), flush=True)
            finally:
                pin(nodes, set(cpus), set(cpus))
    _print(results)
    save(args.out, {"machine": machine(), "results": [asdict(r) for r in results]})
    if trace is not None:
        save(f"{args.out}_trace", {"columns": TRACE_COLUMNS, "runs": trace})
    return 0


if __name__ == "__main__":
    sys.exit(main())
