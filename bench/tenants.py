"""Part 5: a flooding batch tenant beside a light interactive one, with and without classes.

The same fleet and load twice: the tenants in one class (``classes: off``: the queue is
fair between them but nobody is ahead), then with ``interactive`` above ``batch`` and a
floor share of the KV budget kept for ``interactive``. Per tenant: TTFT percentiles, the
HTTP statuses, and goodput (completion tokens per second of requests that succeeded).
The interactive tenant is also measured alone first, as the reference.

The load functions are shared with ``tests/integration/test_tenants.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

INTERACTIVE_KEY = "k-app"
BATCH_KEY = "k-etl"


MODES = ("shared", "tenants", "classes")


def gateway_config(mode: str, floor_share: float = 0.25) -> dict[str, Any]:
    """The gateway's ``server`` and ``auth`` sections for one mode:

    - ``shared``: both keys are ``server.api_keys``, one (default) tenant: one FIFO queue,
      as before tenants existed;
    - ``tenants``: two tenants of one class: fair queuing on KV tokens between them;
    - ``classes``: ``interactive`` above ``batch``, with ``floor_share`` of the fleet's KV
      budget kept for ``interactive``.
    """
    if mode == "shared":
        return {"server": {"api_keys": [INTERACTIVE_KEY, BATCH_KEY]}}
    if mode == "tenants":
        keys = [{"name": "app", "key": INTERACTIVE_KEY}, {"name": "etl", "key": BATCH_KEY}]
        return {"auth": {"keys": keys}}
    return {
        "auth": {
            "classes": [{"name": "interactive", "floor_share": floor_share}, {"name": "batch"}],
            "keys": [
                {"name": "app", "key": INTERACTIVE_KEY, "class": "interactive"},
                {"name": "etl", "key": BATCH_KEY, "class": "batch"},
            ],
        }
    }


@dataclass
class TenantRun:
    ttfts: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0

    def percentile(self, q: float) -> float:
        xs = sorted(self.ttfts)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]

    @property
    def goodput(self) -> float:
        """Completion tokens per second of the requests that succeeded."""
        return self.completion_tokens / max(1e-9, (self.ended or time.monotonic()) - self.started)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": sum(self.statuses.values()),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "ttft_p50_ms": round(self.percentile(50) * 1000, 1),
            "ttft_p90_ms": round(self.percentile(90) * 1000, 1),
            "ttft_p99_ms": round(self.percentile(99) * 1000, 1),
            "goodput_tok_s": round(self.goodput, 1),
        }


def prompt(n_tokens: int, rnd: random.Random) -> str:
    # A distinct prompt of ~n cl100k tokens (no prefix shared between requests).
    return f"{rnd.getrandbits(64):x}" + " hello" * max(1, n_tokens - 4)


async def one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    key: str,
    prompt_tokens: int,
    max_tokens: int,
    rnd: random.Random,
    run: TenantRun,
    *,
    stream: bool,
) -> None:
    """One chat request; TTFT is the first content chunk (streams) or the answer."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt(prompt_tokens, rnd)}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        run.statuses[r.status] += 1
        if r.status != 200:
            await r.read()
            return
        if not stream:
            data = await r.json()
            run.ttfts.append(time.monotonic() - start)
            run.completion_tokens += int(data["usage"]["completion_tokens"])
            return
        first = True
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if first and chunk.get("choices"):
                run.ttfts.append(time.monotonic() - start)
                first = False
            if chunk.get("usage"):
                run.completion_tokens += int(chunk["usage"]["completion_tokens"])


async def interactive(
    url: str,
    model: str,
    *,
    clients: int,
    requests: int,
    prompt_tokens: int = 100,
    max_tokens: int = 8,
    pause_s: float = 0.02,
    seed: int = 1,
) -> TenantRun:
    """``clients`` users, each sending ``requests`` short streamed chats one after another."""
    run = TenantRun()
    async with aiohttp.ClientSession() as session:

        async def user(i: int) -> None:
            rnd = random.Random(seed * 1000 + i)
            for _ in range(requests):
                await one(
                    session,
                    url,
                    model,
                    INTERACTIVE_KEY,
                    prompt_tokens,
                    max_tokens,
                    rnd,
                    run,
                    stream=True,
                )
                await asyncio.sleep(pause_s * rnd.uniform(0.5, 1.5))

        await asyncio.gather(*(user(i) for i in range(clients)))
    run.ended = time.monotonic()
    return run


async def flood(
    url: str,
    model: str,
    stop: asyncio.Event,
    *,
    clients: int,
    prompt_tokens: int = 64,
    max_tokens: int = 1000,
    seed: int = 2,
) -> TenantRun:
    """``clients`` loops sending long batch requests back to back until ``stop``; a
    refused request is retried after a short pause. Unfinished requests are cancelled."""
    run = TenantRun()
    async with aiohttp.ClientSession() as session:

        async def loop(i: int) -> None:
            rnd = random.Random(seed * 1000 + i)
            while not stop.is_set():
                before = run.statuses[429]
                await one(
                    session,
                    url,
                    model,
                    BATCH_KEY,
                    prompt_tokens,
                    max_tokens,
                    rnd,
                    run,
                    stream=False,
                )
                if run.statuses[429] > before:
                    await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(loop(i), name=f"flood-{i}") for i in range(clients)]
        await stop.wait()
        run.ended = time.monotonic()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return run


async def flooded(
    url: str,
    model: str,
    *,
    batch_clients: int,
    settle_s: float,
    min_flood_s: float = 0.0,
    **interactive_args: Any,
) -> tuple[TenantRun, TenantRun]:
    """The interactive load while the batch tenant floods (started ``settle_s`` before);
    the flood lasts at least ``min_flood_s`` (goodput compares equal windows)."""
    stop = asyncio.Event()
    started = time.monotonic()
    batch = asyncio.create_task(flood(url, model, stop, clients=batch_clients), name="flood")
    await asyncio.sleep(settle_s)
    try:
        # Other prompts than the run alone used: the nodes' prefix caches must not help.
        inter = await interactive(url, model, **{"seed": 3, **interactive_args})
        await asyncio.sleep(max(0.0, started + min_flood_s - time.monotonic()))
    finally:
        stop.set()
    return inter, await batch


# --- the benchmark -------------------------------------------------------------------------

MODEL = "llama-3.1-8b"
NODES = 2
MAX_NUM_SEQS = 64


def fleet_data() -> dict[str, Any]:
    """Two 24 GB nodes (gpu24-8b: 30k KV tokens each) whose KV budget, not their sequence
    slots, is what the flood exhausts."""
    backends = [
        {
            "name": f"small-{i + 1}",
            "url": "http://127.0.0.1:1",
            "model": MODEL,
            "max_num_seqs": MAX_NUM_SEQS,
            "simulate": {"profile": "gpu24-8b", "max_num_seqs": MAX_NUM_SEQS},
        }
        for i in range(NODES)
    ]
    return {
        "models": [
            {"name": MODEL, "served_name": "meta-llama/Llama-3.1-8B-Instruct", "aliases": []}
        ],
        "admission": {"queue_timeout_s": 5, "queue_size": 128, "default_output_tokens": 256},
        "tiers": [{"name": "small", "backends": backends}],
    }


async def run_mode(
    mode: str, *, time_scale: float, requests: int, batch_clients: int, flood_s: float
) -> dict[str, Any]:
    from bench.harness import fleet_and_gateway

    overrides = gateway_config(mode)
    async with fleet_and_gateway(
        "kv_aware", time_scale=time_scale, data=fleet_data(), gateway_overrides=overrides
    ) as running:
        args = {"clients": 4, "requests": requests, "prompt_tokens": 1000, "max_tokens": 32}
        alone = await interactive(running.url, MODEL, **args)
        inter, batch = await flooded(
            running.url,
            MODEL,
            batch_clients=batch_clients,
            settle_s=2.0,
            min_flood_s=flood_s,
            **args,
        )
    return {
        "mode": mode,
        "interactive_alone": alone.summary(),
        "interactive_flooded": inter.summary(),
        "batch": batch.summary(),
    }


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        f"{'mode':<8} {'tenant':<22} {'TTFT p50':>9} {'p90':>8} {'p99':>8}  "
        f"{'statuses':<22} {'goodput tok/s':>13}"
    ]
    for r in results:
        for label, key in (
            ("interactive alone", "interactive_alone"),
            ("interactive (flood)", "interactive_flooded"),
            ("batch (flooding)", "batch"),
        ):
            s = r[key]
            statuses = " ".join(f"{k}:{v}" for k, v in s["statuses"].items())
            rows.append(
                f"{r['mode']:<8} {label:<22} {s['ttft_p50_ms']:>7.0f}ms {s['ttft_p90_ms']:>6.0f}ms "
                f"{s['ttft_p99_ms']:>6.0f}ms  {statuses:<22} {s['goodput_tok_s']:>13.0f}"
            )
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> None:
    results = []
    for mode in MODES:
        results.append(
            await run_mode(
                mode,
                time_scale=args.time_scale,
                requests=args.requests,
                batch_clients=args.batch_clients,
                flood_s=args.flood_s,
            )
        )
    text = table(results)
    print(text)
    out = Path(__file__).parent / "results" / "tenants.json"
    out.write_text(
        json.dumps(
            {
                "settings": {
                    "time_scale": args.time_scale,
                    "nodes": f"{NODES} x gpu24-8b, max_num_seqs {MAX_NUM_SEQS}",
                    "interactive": f"4 users x {args.requests} streamed chats, 1000-token "
                    "prompts, max_tokens 32",
                    "batch": f"{args.batch_clients} loops, 64-token prompts, max_tokens 1000, "
                    f"flooding for {args.flood_s:g} s (goodput over that window)",
                    "gateway": {m: gateway_config(m) for m in MODES},
                    "admission": fleet_data()["admission"],
                },
                "results": results,
                "table": text,
            },
            indent=2,
        )
        + "\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--requests", type=int, default=15, help="per interactive user")
    p.add_argument("--batch-clients", type=int, default=80)
    p.add_argument("--flood-s", type=float, default=30.0, help="length of the flood phase")
    p.add_argument("--quick", action="store_true", help="fewer requests")
    args = p.parse_args()
    if args.quick:
        args.requests, args.flood_s = 5, 8.0
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
