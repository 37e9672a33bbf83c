"""Hostile and careless clients against the demo: does everyone else still get served?

A demo fleet (config/demo.yaml's simulated nodes, ``gateway simulate``) and ``gateway
serve`` run as processes. First, alone: /health probes (every 20 ms) and ordinary ~1k-token
chats (one at a time). Then the same while three hostile loads run for ``--seconds``, each
in a process of its own (as the three hostile-client scripts would run: building and
sending 16-30 MB bodies must not slow the process that measures):

- loop_dos: three connections resending a ~30 MB chat of 800k messages;
- pool_starve: two 16 MB single-word prompts, over and over;
- slow_hold: 60 connections that send half a request (headers, or headers and part of
  the body) and stall.

It prints /health p50/p99, the chats' latency p50/p99 (alone and under attack) and the
gateway's peak RSS, with the issue's targets: /health p99 < 50 ms, chats within 2x,
peak RSS < 500 MB.

    python -m bench.hostile [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.report import save

MODEL = "llama-3.1-8b"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _config(port: int, offset: int) -> str:
    """config/demo.yaml with the gateway on ``port`` and the nodes' ports moved by
    ``offset`` (so a running `make demo` is not in the way)."""
    text = (procs.ROOT / "config" / "demo.yaml").read_text()
    text = text.replace("  port: 8080", f"  port: {port}\n  access_log: false")
    for p in range(9100, 9400):
        text = text.replace(f"127.0.0.1:{p}\n", f"127.0.0.1:{p + offset}\n")
    return text


def chat_body(tag: str) -> dict[str, Any]:
    words = " ".join(f"word{i % 50}" for i in range(900))
    return {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": f"{tag} {words}"}],
    }


async def probe_health(s: aiohttp.ClientSession, url: str, until: float, out: list[float]) -> None:
    while time.monotonic() < until:
        t = time.perf_counter()
        async with s.get(url + "/health") as r:
            await r.read()
        out.append((time.perf_counter() - t) * 1000)
        await asyncio.sleep(0.02)


async def chats(s: aiohttp.ClientSession, url: str, until: float, out: list[float]) -> None:
    i = 0
    while time.monotonic() < until:
        i += 1
        t = time.perf_counter()
        async with s.post(url + "/v1/chat/completions", json=chat_body(f"c{i}")) as r:
            await r.read()
            if r.status == 200:
                out.append((time.perf_counter() - t) * 1000)


async def loop_dos(url: str, until: float, statuses: list[int]) -> None:
    """Three connections resending a body of 800k messages (just under 32 MiB)."""
    msg = b'{"role":"user","content":"x"},'
    body = (
        b'{"model":"%s","messages":[' % MODEL.encode()
        + msg * 800_000
        + b'{"role":"user","content":"x"}]}'
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one() -> None:
            while time.monotonic() < until:
                async with s.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as r:
                    await r.read()
                    statuses.append(r.status)

        await asyncio.gather(*(one() for _ in range(3)))


async def pool_starve(url: str, until: float, statuses: list[int]) -> None:
    """Two connections resending a 16 MB single-word prompt."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(k: int) -> None:
            # Serialised once: on this shared machine the attacker's own CPU is the
            # gateway's loss; the bytes sent are the same.
            body = json.dumps(
                {"model": MODEL, "max_tokens": 1, "prompt": f"{k}" + "a" * (16 * 2**20)}
            ).encode()
            headers = {"Content-Type": "application/json"}
            while time.monotonic() < until:
                async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    statuses.append(r.status)

        await asyncio.gather(*(one(k) for k in range(2)))


def slow_hold(port: int, n: int) -> list[socket.socket]:
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: 1")
        else:
            s.sendall(
                b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"mo'
            )
        socks.append(s)
    return socks


async def phase(
    url: str, seconds: float, gw: procs.Proc, attacks: tuple[str, ...]
) -> dict[str, Any]:
    health: list[float] = []
    chat: list[float] = []
    statuses: list[int] = []
    peak = [gw.rss()]
    until = time.monotonic() + seconds

    async def sample() -> None:
        while time.monotonic() < until:
            peak[0] = max(peak[0], gw.rss())
            await asyncio.sleep(0.2)

    attackers: list[asyncio.subprocess.Process] = []
    if attacks:
        for name in attacks:
            attackers.append(
                await asyncio.create_subprocess_exec(
                    procs.PYTHON, "-m", "bench.hostile", "--attack", name, "--url", url,
                    "--port", str(gw.port), "--seconds", f"{seconds:.1f}",
                    stdout=asyncio.subprocess.PIPE, cwd=procs.ROOT,
                )
            )  # fmt: skip
        await asyncio.sleep(1.0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            await asyncio.gather(
                probe_health(s, url, until, health), chats(s, url, until, chat), sample()
            )
        for a in attackers:
            out, _ = await asyncio.wait_for(a.communicate(), timeout=180)
            statuses.extend(json.loads(out or b"[]"))
    finally:
        for a in attackers:
            if a.returncode is None:
                a.kill()
                await a.wait()
    return {
        "health_p50_ms": _pct(health, 0.5),
        "health_p99_ms": _pct(health, 0.99),
        "health_probes": len(health),
        "chat_p50_ms": statistics.median(chat) if chat else float("nan"),
        "chat_p99_ms": _pct(chat, 0.99),
        "chats": len(chat),
        "hostile_statuses": {str(k): statuses.count(k) for k in sorted(set(statuses))},
        "rss_peak_mb": peak[0] / 2**20,
    }


ATTACKS = ("loop_dos", "pool_starve", "slow_hold")


async def attack(name: str, url: str, port: int, seconds: float) -> list[int]:
    """One hostile load, run in its own process; the statuses it got back."""
    until = time.monotonic() + seconds
    statuses: list[int] = []
    if name == "loop_dos":
        await loop_dos(url, until, statuses)
    elif name == "pool_starve":
        await pool_starve(url, until, statuses)
    else:
        held = slow_hold(port, 60)
        try:
            await asyncio.sleep(max(0.0, until - time.monotonic()))
        finally:
            for sock in held:
                sock.close()
    return statuses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="8 s under attack")
    p.add_argument(
        "--attacks", default=",".join(ATTACKS), help="which hostile loads (comma-separated)"
    )
    p.add_argument("--attack", choices=ATTACKS, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.attack:
        print(json.dumps(asyncio.run(attack(args.attack, args.url, args.port, args.seconds))))
        return {}
    if args.quick:
        args.seconds = 8.0
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        work = Path(tmp)
        gw_port = procs.free_port()
        cfg = work / "demo.yaml"
        cfg.write_text(_config(gw_port, 500))
        fleet_cmd = [procs.PYTHON, "-m", "kvgateway", "simulate", "--config", str(cfg)]
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                procs.running("fleet", fleet_cmd, _first_port(cfg), log=work / "fleet.log")
            )
            gw = stack.enter_context(
                procs.running("gateway", procs.gateway_cmd(cfg), gw_port, log=work / "gw.log")
            )
            url = gw.url
            time.sleep(2.0)  # first health checks and discovery
            alone = asyncio.run(phase(url, args.seconds / 2, gw, ()))
            attacks = tuple(a for a in args.attacks.split(",") if a)
            attacked = asyncio.run(phase(url, args.seconds, gw, attacks))
    out = {"alone": alone, "under_attack": attacked}
    out["targets"] = {
        "health_p99<50ms": attacked["health_p99_ms"] < 50,
        "chat_p50_within_2x": attacked["chat_p50_ms"] <= 2 * alone["chat_p50_ms"],
        "rss_peak<500MB": attacked["rss_peak_mb"] < 500,
    }
    print(
        f"{'':14}{'health p50':>11}{'health p99':>11}{'chat p50':>10}{'chat p99':>10}{'chats':>7}{'RSS MB':>8}"
    )
    for name, r in (("alone", alone), ("under attack", attacked)):
        print(
            f"{name:14}{r['health_p50_ms']:>10.1f} {r['health_p99_ms']:>10.1f} {r['chat_p50_ms']:>9.1f} "
            f"{r['chat_p99_ms']:>9.1f} {r['chats']:>6} {r['rss_peak_mb']:>7.0f}"
        )
    print("hostile answers:", json.dumps(attacked["hostile_statuses"]))
    print("targets:", json.dumps(out["targets"]))
    save("hostile", out)
    return out


def _first_port(cfg: Path) -> int:
    import yaml

    data = yaml.safe_load(cfg.read_text())
    url = data["tiers"][0]["backends"][0]["url"]
    return int(url.rsplit(":", 1)[1])


if __name__ == "__main__":
    main()
