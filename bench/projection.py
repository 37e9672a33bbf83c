"""Admission by the projected KV peak against the node alone, on a real vLLM node.

The same requests, in the same order, three ways: straight to the node (``node``), and
through the gateway with its default settings and only the model's tokenizer directory
configured, once holding every request's prompt + max_tokens for its whole life
(``whole_life``: ``admission.kv_projection: false``) and once admitting by the
projected peak (``projected``, the default). Every request is a streaming chat (the
official ``openai`` client), all sent at once (a burst).

Workloads:
  burst     48 chats, prompts of 100-600 tokens, outputs of 128-512 tokens fixed with
            ``ignore_eos`` (max_tokens = the output), as a client that knows its lengths.
  unknown   64 chats, prompts of 100-600 tokens, ``max_tokens`` 2048; the node draws
            each answer's length: a ``logit_bias``ed token listed in ``stop_token_ids``
            ends it (mean ~200 tokens here), which the gateway cannot know.

Printed per mode: wall time, output tokens/s, the node's preemptions, 429s and other
errors, TTFT p50/p99 and the node's mean KV use (``vllm:kv_cache_usage_perc``).

    python -m bench.projection --real [--workload burst|unknown|all] [--repeat N]

The node is ``B`` of tests/support/real_fleet.py: 64 blocks of 128 tokens (8,064 usable
KV tokens), 16 sequences, 4k context (started here, or reused from
``python -m tests.support.vllm_nodes B`` with ``KVGATEWAY_REAL_NODES``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from openai import APIStatusError, AsyncOpenAI

from bench.procs import free_port
from bench.real_nodes import KvSampler, real_nodes, wait_idle
from bench.report import machine, save
from tests.support.real_fleet import BENCH
from tests.support.vllm_nodes import RealNode

MODES = ("node", "whole_life", "projected")
# A token the random-weight model emits about as often as any other: biased up, it ends
# an answer after ~STOP_MEAN tokens on average (measured: see --calibrate).
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
    prompt: str
    max_tokens: int
    fixed: bool  # ignore_eos: the output is exactly max_tokens


@dataclass
class Result:
    mode: str
    workload: str
    requests: int
    ok: int
    refused_429: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tps: float
    preemptions: int
    ttft_p50_s: float
    ttft_p99_s: float
    mean_kv_use: float
    gateway_cpu_s: float = 0.0


def _prompt(rng: random.Random, words: int, i: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Request {i}: {body}"


def workload(name: str, seed: int = 7) -> list[Request]:
    rng = random.Random(seed)
    if name == "burst":
        return [
            Request(_prompt(rng, rng.randint(100, 600), i), rng.randint(128, 512), True)
            for i in range(48)
        ]
    if name == "unknown":
        return [Request(_prompt(rng, rng.randint(100, 600), i), 2048, False) for i in range(64)]
    raise SystemExit(f"unknown workload {name!r}")


def _extra(req: Request) -> dict[str, Any]:
    if req.fixed:
        return {"ignore_eos": True}
    return {"logit_bias": {str(STOP_TOKEN): STOP_BIAS}, "stop_token_ids": [STOP_TOKEN]}


async def _one(client: AsyncOpenAI, model: str, req: Request) -> tuple[int, float | None, int]:
    """(status, TTFT, output tokens) of one streamed chat."""
    start = time.monotonic()
    ttft: float | None = None
    out = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": req.prompt}],
            max_tokens=req.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=_extra(req),
        )
        async for chunk in stream:
            if ttft is None and chunk.choices:
                ttft = time.monotonic() - start
            if chunk.usage is not None:
                out = chunk.usage.completion_tokens
    except APIStatusError as exc:
        return exc.status_code, None, 0
    return 200, ttft, out


async def _run(
    url: str, model: str, requests: list[Request]
) -> list[tuple[int, float | None, int]]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", timeout=1800, max_retries=0)
    try:
        return await asyncio.gather(*(_one(client, model, r) for r in requests))
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


@contextmanager
def _gateway(node: RealNode, projected: bool) -> Iterator[tuple[str, int]]:
    """`gateway serve` in front of ``node``: defaults, the tokenizer directory only."""
    port = free_port()
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "models": [{"name": node.spec.served_name, "tokenizer": {"path": str(node.model_dir)}}],
        "tiers": [
            {
                "name": "cpu",
                "backends": [
                    {"name": node.spec.name, "url": node.url, "model": node.spec.served_name}
                ],
            }
        ],
    }
    if not projected:
        config["admission"] = {"kv_projection": False}
    work = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    (work / "gateway.yaml").write_text(yaml.safe_dump(config))
    log = (work / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgateway", "serve", "--config", str(work / "gateway.yaml")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    f"gateway did not start: {(work / 'gateway.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def measure(node: RealNode, mode: str, name: str, requests: list[Request]) -> Result:
    wait_idle(node)
    pre = node.metric("vllm:num_preemptions_total")
    model = node.spec.served_name
    cpu = 0.0
    with contextlib.ExitStack() as stack:
        url, pid = node.url, 0
        if mode != "node":
            url, pid = stack.enter_context(_gateway(node, projected=mode == "projected"))
            cpu = _cpu_seconds(pid)
        with KvSampler(node) as kv:
            t0 = time.monotonic()
            got = asyncio.run(_run(url, model, requests))
            wall = time.monotonic() - t0
        if pid:
            cpu = _cpu_seconds(pid) - cpu
    ok = [g for g in got if g[0] == 200]
    out = sum(g[2] for g in ok)
    ttfts = [g[1] for g in ok if g[1] is not None]
    return Result(
        mode=mode,
        workload=name,
        requests=len(requests),
        ok=len(ok),
        refused_429=sum(1 for g in got if g[0] == 429),
        errors=sum(1 for g in got if g[0] not in (200, 429)),
        wall_s=round(wall, 2),
        output_tokens=out,
        output_tps=round(out / wall, 1) if wall else 0.0,
        preemptions=int(node.metric("vllm:num_preemptions_total") - pre),
        ttft_p50_s=round(statistics.median(ttfts), 3) if ttfts else 0.0,
        ttft_p99_s=round(_quantile(ttfts, 0.99), 3),
        mean_kv_use=round(kv.mean, 3),
        gateway_cpu_s=round(cpu, 2),
    )


def _print(results: list[Result]) -> None:
    head = f"{'workload':9} {'mode':11} {'ok':>6} {'429':>4} {'err':>4} {'wall s':>7} {'tok/s':>6} {'preempt':>7} {'ttft p50':>8} {'ttft p99':>8} {'kv use':>6} {'gw cpu s':>8}"
    print(head)
    for r in results:
        print(
            f"{r.workload:9} {r.mode:11} {r.ok:>3}/{r.requests:<2} {r.refused_429:>4} {r.errors:>4} "
            f"{r.wall_s:>7.1f} {r.output_tps:>6.0f} {r.preemptions:>7} {r.ttft_p50_s:>8.2f} "
            f"{r.ttft_p99_s:>8.2f} {r.mean_kv_use:>6.2f} {r.gateway_cpu_s:>8.1f}"
        )
    node = {(r.workload): r.wall_s for r in results if r.mode == "node"}
    for r in results:
        if r.mode != "node" and r.workload in node and node[r.workload]:
            print(
                f"{r.workload} {r.mode}: {r.wall_s / node[r.workload]:.2f}x the node alone's time"
            )


def calibrate(node: RealNode, n: int = 32) -> None:
    """The answer lengths the stop-token bias draws on this node (for ``unknown``)."""
    reqs = [Request(_prompt(random.Random(i), 50, i), 2048, False) for i in range(n)]
    got = asyncio.run(_run(node.url, node.spec.served_name, reqs))
    lengths = sorted(g[2] for g in got if g[0] == 200)
    print(
        f"bias {STOP_BIAS} on token {STOP_TOKEN}: mean {statistics.mean(lengths):.0f}, "
        f"median {statistics.median(lengths)}, max {lengths[-1]} over {len(lengths)} answers"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--real", action="store_true", required=True, help="run against a real vLLM node"
    )
    p.add_argument("--workload", choices=("burst", "unknown", "all"), default="all")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--calibrate", action="store_true", help="print the stop-token lengths and exit")
    p.add_argument("--out", default="projection_real", help="results name under bench/results")
    args = p.parse_args(argv)
    names = ("burst", "unknown") if args.workload == "all" else (args.workload,)
    modes = args.modes.split(",")
    results: list[Result] = []
    with real_nodes([BENCH]) as nodes:
        node = nodes[BENCH.name]
        if args.calibrate:
            calibrate(node)
            return 0
        for _ in range(args.repeat):
            for name in names:
                reqs = workload(name)
                for mode in modes:
                    r = measure(node, mode, name, reqs)
                    results.append(r)
                    print(json.dumps(asdict(r)), flush=True)
    _print(results)
    save(args.out, {"machine": machine(), "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
