"""One KV-overflow workload against the demo fleet, under kv_aware and round_robin.

Closed loop: CONCURRENCY clients send streaming chats back to back for DURATION seconds
of wall time. The mix overflows the 24 GB-class nodes: most prompts are 1.5k-6k tokens
with up to 2k output tokens, and 15% are 9k-30k tokens (longer than a small node's 8k
context). Generations are long (the nodes draw output lengths with mean 1,500 tokens, as
reasoning models produce), so KV grows while requests run. Counts come from the clients
and from each node's own /metrics.

    python -m bench.kv_overflow [--duration 20] [--concurrency 64] [--time-scale 10]

``--tokenizer qwen`` (or a directory, see ``bench.model_dirs``): every node counts with
that model's vocabulary and chat template, and ``--counting exact`` gives the gateway the
same directory (``standin``, the default: cl100k and its upper bound). Results then go
to ``kv_overflow-<tokenizer>-<counting>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp

from bench import model_dirs
from bench.harness import (
    Outcome,
    demo_data,
    fleet_and_gateway,
    is_backend_400,
    node_metrics,
    send_chat,
)

RESULTS = Path(__file__).parent / "results"


def request_shape(rnd: random.Random) -> tuple[int, int]:
    if rnd.random() < 0.15:
        return rnd.randint(9_000, 30_000), rnd.randint(256, 1024)
    return rnd.randint(1_500, 6_000), rnd.randint(512, 2_000)


async def run_policy(policy: str, args: argparse.Namespace) -> dict[str, object]:
    sim: dict[str, object] = {"output_mean": 1500.0, "output_sigma": 0.5}
    data = None
    if args.tokenizer:
        directory = str(model_dirs.tokenizer_dir(args.tokenizer))
        sim["tokenizer"] = directory
        data = demo_data()
        if args.counting == "exact":
            for model in data["models"]:
                model["tokenizer"] = {"path": directory}
    async with fleet_and_gateway(
        policy,
        time_scale=args.time_scale,
        seed=args.seed,
        data=data,
        sim_overrides=sim,
    ) as run:
        rnd = random.Random(args.seed)
        results: list[Outcome] = []
        deadline = time.monotonic() + args.duration
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client() -> None:
                while time.monotonic() < deadline:
                    p, o = request_shape(rnd)
                    results.append(await send_chat(session, run.url, p, o, rnd, short=p < 8000))

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        nodes = await node_metrics(run.fleet)
    ok = [r for r in results if r.status == 200]
    return {
        "policy": policy,
        "requests": len(results),
        "ok": len(ok),
        "backend_400": sum(1 for r in results if is_backend_400(r)),
        "gateway_400": sum(1 for r in results if r.code == "context_length_exceeded"),
        "gateway_429": sum(1 for r in results if r.status == 429),
        "other_errors": sum(1 for r in results if r.status not in (200, 400, 429)),
        "preemptions": int(sum(n["preemptions"] for n in nodes.values())),
        "preemptions_by_node": {k: int(v["preemptions"]) for k, v in nodes.items()},
        "output_tokens": sum(r.completion_tokens for r in ok),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="wall seconds per policy")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policies", default="kv_aware,round_robin")
    parser.add_argument("--tokenizer", help="nodes count with this model's tokenizer")
    parser.add_argument("--counting", choices=("exact", "standin"), default="standin")
    args = parser.parse_args()
    rows = [asyncio.run(run_policy(p, args)) for p in args.policies.split(",")]
    counting = (
        f", nodes count with {args.tokenizer}, gateway {args.counting}" if args.tokenizer else ""
    )
    print(
        f"KV-overflow workload: {args.concurrency} concurrent streaming clients, "
        f"{args.duration:g} s wall x time_scale {args.time_scale:g}, demo fleet{counting}"
    )
    header = (
        "policy",
        "requests",
        "ok",
        "backend_400",
        "gateway_400",
        "gateway_429",
        "other_errors",
        "preemptions",
        "output_tokens",
    )
    print(" ".join(f"{h:>12}" for h in header))
    for r in rows:
        print(" ".join(f"{r[h]!s:>12}" for h in header))
    RESULTS.mkdir(exist_ok=True)
    name = (
        f"kv_overflow-{model_dirs.label(args.tokenizer)}-{args.counting}"
        if args.tokenizer
        else "kv_overflow"
    )
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
