"""Overload one simulated 24 GB-class node directly (no gateway): the failure the gateway
exists to prevent. Waves of N concurrent streaming requests (2,000-token prompts asking
for 2,000 tokens, generated to the end) hit a fresh `gpu24-8b` node; for each wave the
node's own /metrics give preemptions and latency (simulated seconds).

    python -m bench.node_overload [--waves 4,16,40] [--time-scale 10]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgateway.simulator.fleet import start_node
from kvgateway.simulator.fleetconfig import NodeSpec
from kvgateway.simulator.profiles import get_profile

RESULTS = Path(__file__).parent / "results"


def _hist_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return float("inf")


async def wave(n: int, time_scale: float) -> dict[str, float]:
    settings = dataclasses.replace(
        get_profile("gpu24-8b"), name="small", time_scale=time_scale, seed=1
    )
    node = await start_node(NodeSpec(settings, "127.0.0.1", 0))
    body = {"model": settings.model, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def one(i: int) -> None:
                # 1,999 token ids ("hello" in cl100k), distinct from the first block on:
                # identical prompts would share their blocks in the node's prefix cache.
                prompt = [100 + i] + [15339] * 1998
                async with s.post(
                    node.url + "/v1/completions", json={**body, "prompt": prompt}
                ) as r:
                    async for _ in r.content.iter_any():
                        pass

            t0 = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(n)))
            wall = time.monotonic() - t0
            async with s.get(node.url + "/metrics") as r:
                text = await r.text()
    finally:
        await node.stop()
    out: dict[str, float] = {"concurrent": n, "wall_s": round(wall, 2)}
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:num_preemptions":
            out["preemptions"] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        if fam.name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
            b = [
                (float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")
            ]
            key = "ttft" if "first_token" in fam.name else "e2e"
            out[f"{key}_p50_s"] = _hist_quantile(b, 0.5)
            out[f"{key}_p99_s"] = _hist_quantile(b, 0.99)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", default="4,16,40")
    parser.add_argument("--time-scale", type=float, default=10.0)
    args = parser.parse_args()
    rows = [asyncio.run(wave(int(n), args.time_scale)) for n in args.waves.split(",")]
    print(
        "one gpu24-8b node (30,704 KV tokens, max_num_seqs 16), 2k-token prompts x 2k output tokens"
    )
    print("(latency: histogram bucket bounds from the node's /metrics, simulated seconds)")
    header = ("concurrent", "preemptions", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")
    print(" ".join(f"{h:>12}" for h in header))
    for r in rows:
        print(" ".join(f"{r.get(h, 0):>12g}" for h in header))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "node_overload.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
