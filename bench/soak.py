"""Soak: many requests with random client disconnects and node restarts, then a ledger.

Four simulated nodes (two per tier) and a gateway, all in this process. Clients send short
chat requests (half streaming) at a fixed concurrency; some give up at a random moment;
every RESTART_EVERY requests one node is stopped and started again on the same port.
At the end every backend must hold zero reserved tokens and zero in-flight requests,
every node zero KV blocks, and every request must be accounted for: the gateway's
per-status counters add up to the number of requests, and each failure has a known cause.

    python -m bench.soak [--requests 100000] [--concurrency 128]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvgateway.config.load import parse_config
from kvgateway.server.app import STATE, create_app
from kvgateway.simulator.fleet import RunningNode, start_node
from kvgateway.simulator.fleetconfig import NodeSpec
from kvgateway.simulator.profiles import get_profile
from kvgateway.tokens.encoding import EncodingCache

SERVED = "meta-llama/Llama-3.1-8B-Instruct"
RESULTS = Path(__file__).parent / "results"

# Client-visible outcomes a soak may produce, and why.
EXPECTED = {
    "200": "completed",
    "disconnected": "the client gave up (random disconnect)",
    "stream_error:upstream_reset": "node restarted mid-stream: error event + [DONE]",
    "stream_error:500": "node shut down mid-stream: vLLM's own error event, relayed",
    "502:upstream_connect": "node restarted before the first byte, no other attempt left",
    "502:upstream_reset": "node restarted while a non-streaming body was read",
    "503:no_healthy_backend": "every node able to serve it was restarting",
    "429:fleet_saturated": "no room within the queue timeout",
}


@dataclass
class SoakReport:
    requests: int
    seconds: float
    restarts: int
    outcomes: dict[str, int]
    gateway_statuses: dict[str, int]
    retries: int
    leaks: dict[str, tuple[int, int, int]]
    node_blocks: dict[str, int]
    unexpected: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"soak: {self.requests} requests in {self.seconds:.1f} s "
            f"({self.requests / self.seconds:.0f}/s), {self.restarts} node restarts, "
            f"{self.retries} retries on another node",
            "client outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items())),
            "gateway statuses: "
            + ", ".join(f"{k}={v}" for k, v in sorted(self.gateway_statuses.items())),
            f"leaks (reserved tokens, seqs, in-flight) = {self.leaks or 0}; "
            f"node KV blocks still used = {sum(self.node_blocks.values())}; "
            f"unexplained outcomes = {self.unexpected or 0}",
        ]
        return "\n".join(lines)


def _port_below_ephemeral(rnd: random.Random) -> int:
    """A free port under Linux's ephemeral range (32768+), so that a restarting node's
    port is not taken by one of the soak's own outgoing connections meanwhile."""
    for _ in range(1000):
        port = rnd.randint(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32000")


async def _one(
    session: aiohttp.ClientSession, url: str, rnd: random.Random, disconnect_p: float
) -> str:
    stream = rnd.random() < 0.5
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": f"{rnd.getrandbits(32):x} " + "hi " * rnd.randint(1, 300)}
        ],
        "max_tokens": rnd.randint(1, 48),
        "stream": stream,
    }
    give_up = rnd.random() * 0.03 if rnd.random() < disconnect_p else 30.0
    try:
        async with asyncio.timeout(give_up):
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                data = await r.read()
                if r.status != 200:
                    code = json.loads(data)["error"]["code"]
                    return f"{r.status}:{code}"
                if stream:
                    if not data.endswith(b"data: [DONE]\n\n"):
                        return "stream_truncated"
                    for line in data.split(b"\n\n"):
                        if line.startswith(b'data: {"error"'):
                            return f"stream_error:{json.loads(line[6:])['error']['code']}"
                return "200"
    except TimeoutError:
        return "disconnected"
    except aiohttp.ClientError as exc:
        return f"client_error:{exc.__class__.__name__}"


async def soak(
    *,
    requests: int = 20_000,
    concurrency: int = 96,
    disconnect_p: float = 0.1,
    restart_every: int = 2_000,
    seed: int = 11,
    time_scale: float = 1000.0,
) -> SoakReport:
    rnd = random.Random(seed)
    encodings = EncodingCache()
    base = dataclasses.replace(get_profile("gpu24-8b"), model=SERVED, time_scale=time_scale)
    nodes: dict[str, RunningNode] = {}
    for i, tier in enumerate(["small", "small", "large", "large"]):
        name = f"{tier}-{i}"
        settings = dataclasses.replace(base, name=name, seed=seed + i)
        spec = NodeSpec(settings, "127.0.0.1", _port_below_ephemeral(rnd))
        nodes[name] = await start_node(spec, encodings=encodings)
    config = parse_config(
        {
            "server": {"access_log": False},
            "models": [{"name": "m", "served_name": SERVED}],
            "admission": {"queue_timeout_s": 10, "default_output_tokens": 64},
            "health": {"interval_s": 0.2, "timeout_s": 1, "eject_after_failures": 2},
            "load_feedback": {"interval_s": 0.5},
            "tiers": [
                {
                    "name": t,
                    "backends": [
                        {"name": n, "url": nodes[n].url, "model": "m", "max_num_seqs": 16}
                        for n in nodes
                        if n.startswith(t)
                    ],
                }
                for t in ("small", "large")
            ],
        }
    )
    app = create_app(config, encodings=encodings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    state = app[STATE]
    while not all(b.usable for b in state.fleet.active):
        await asyncio.sleep(0.05)

    outcomes: Counter[str] = Counter()
    sent = 0
    restarts = 0
    start = time.monotonic()

    async def restart(name: str) -> None:
        old = nodes[name]
        await old.stop()
        await asyncio.sleep(rnd.random() * 0.2)
        spec = NodeSpec(old.settings, "127.0.0.1", old.port)
        for attempt in range(100):
            try:
                nodes[name] = await start_node(spec, encodings=encodings)
                return
            except OSError:
                # The port can be briefly taken by an outgoing connection; try again.
                if attempt == 99:
                    raise
                await asyncio.sleep(0.05)

    restart_tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal sent, restarts
            while sent < requests:
                sent += 1
                if sent % restart_every == 0:
                    restarts += 1
                    name = rnd.choice(list(nodes))
                    restart_tasks.append(asyncio.create_task(restart(name), name=f"restart:{name}"))
                outcomes[await _one(session, url, rnd, disconnect_p)] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await asyncio.gather(*restart_tasks)
    seconds = time.monotonic() - start
    for _ in range(200):
        if all(b.in_flight == 0 for b in state.fleet.backends):
            break
        await asyncio.sleep(0.05)
    leaks = {
        b.name: (b.reserved_tokens, b.reserved_seqs, b.in_flight)
        for b in state.fleet.backends
        if (b.reserved_tokens, b.reserved_seqs, b.in_flight) != (0, 0, 0)
    }
    node_blocks: dict[str, int] = {}
    for _ in range(200):
        node_blocks = {n: r.node.driver.core.used_blocks for n, r in nodes.items()}
        if not any(node_blocks.values()):
            break
        await asyncio.sleep(0.05)
    statuses: Counter[str] = Counter()
    retries = 0
    for metric in state.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "gateway_requests_total":
                statuses[s.labels["status"]] += int(s.value)
            elif s.name == "gateway_upstream_retries_total":
                retries += int(s.value)
    await runner.cleanup()
    for r in nodes.values():
        await r.stop()
    unexpected = {k: v for k, v in outcomes.items() if k not in EXPECTED}
    return SoakReport(
        requests=sum(outcomes.values()),
        seconds=seconds,
        restarts=restarts,
        outcomes=dict(outcomes),
        gateway_statuses=dict(statuses),
        retries=retries,
        leaks=leaks,
        node_blocks={k: v for k, v in node_blocks.items() if v},
        unexpected=unexpected,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--disconnect-p", type=float, default=0.1)
    parser.add_argument("--restart-every", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    report = asyncio.run(
        soak(
            requests=args.requests,
            concurrency=args.concurrency,
            disconnect_p=args.disconnect_p,
            restart_every=args.restart_every,
            seed=args.seed,
        )
    )
    print(report.summary())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")


def as_dict(report: SoakReport) -> dict[str, Any]:
    return dataclasses.asdict(report)


if __name__ == "__main__":
    main()
