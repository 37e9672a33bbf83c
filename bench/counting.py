"""Part 2, token counting: throughput, multi-turn cost, and event-loop lag under big prompts.

1. Throughput on 1k / 10k / 100k-token prompts (English prose, Python code): tiktoken
   alone, and the gateway's ``PromptCounter`` (built as the gateway builds it) seeing the
   prompt for the first time (cold cache: chunking, cache inserts, worker thread above
   ``inline_chars``) and again (counted before).
2. A 20-turn chat whose history grows each turn (1k-token system prompt, ~200-token user
   turns, ~400-token assistant answers): the counting cost per request with the
   gateway's cache (history counted before) and without (every prompt cold), on a body
   freshly parsed from JSON each time, as the gateway sees it. Then the same 20 turns
   through the live gateway (``gateway serve`` process, fake upstream), many
   conversations in parallel, turn by turn: the gateway's CPU per request at each turn.
3. Event-loop lag while 100k-token prompts arrive: the gateway (``create_app``, on
   uvloop) runs in this process with a sampler on its loop (a 2 ms sleep; the lag is how
   late it wakes); a separate load process sends small chats at 100/s, first alone (the
   machine's own noise), then while distinct 100k-token prompts arrive at 4/s (~1/4 of
   a core of counting), then while two connections send them back to back (counting
   saturates the machine).

    python -m bench.counting [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from bench import model_dirs, procs, texts
from bench.loadgen import SERVED
from bench.overhead import gateway_yaml
from bench.report import machine, save, table, verdict
from kvgateway.config.load import parse_config
from kvgateway.config.model import ModelConfig
from kvgateway.plan.openai_request import parse_body
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.plans import plan_chat

TARGET_LAG_P99_MS = 5.0
# "Near flat": the counted-before cost at the last turn stays within this factor of the
# second turn's, while the prompt grows ~5x over the same turns.
FLAT_FACTOR = 2.0


def _model() -> ModelConfig:
    cfg = parse_config(
        {
            "models": [{"name": "m", "served_name": SERVED}],
            "tiers": [
                {
                    "name": "t",
                    "backends": [{"name": "b", "url": "http://127.0.0.1:1", "model": "m"}],
                }
            ],
        }
    )
    return cfg.models[0]


def fresh_counter(pool: ThreadPoolExecutor, encodings: EncodingCache) -> Any:
    """A PromptCounter exactly as the gateway builds one, with an empty cache."""
    return TokenCounters(encodings, pool).for_tokenizer(_model().tokenizer)


def chat_body(content: str | list[dict[str, str]]) -> bytes:
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 16}).encode()


async def time_count(counter: Any, raw: bytes, cfg: Any) -> tuple[float, float, int]:
    """(parse seconds, plan+count seconds, tokens) for one request body."""
    t0 = time.perf_counter()
    body = parse_body(raw)
    t1 = time.perf_counter()
    n = await counter.count(plan_chat(body, cfg))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, n.total


# ---- 1. throughput ------------------------------------------------------------------


async def throughput(quick: bool) -> list[dict[str, Any]]:
    enc = texts.encoder()
    encodings = EncodingCache()
    cfg = _model().tokenizer
    rows = []
    with ThreadPoolExecutor(2, thread_name_prefix="count") as pool:
        for kind in ("english", "code"):
            for size in (1_000, 10_000, 100_000):
                reps = {1_000: 30, 10_000: 8, 100_000: 3}[size] // (3 if quick else 1) or 1
                raw_t, cold_t, warm_t, toks = [], [], [], 0
                for r in range(reps):
                    s = texts.text(kind, size, offset=r * 7_919)
                    t0 = time.perf_counter()
                    toks = len(enc.encode_ordinary(s))
                    raw_t.append(time.perf_counter() - t0)
                    counter = fresh_counter(pool, encodings)
                    raw = chat_body(s)
                    cold_t.append((await time_count(counter, raw, cfg))[1])
                    warm_t.append((await time_count(counter, raw, cfg))[1])
                rows.append(
                    {
                        "text": kind,
                        "tokens": toks,
                        "chars": len(s),
                        "tiktoken_ms": statistics.median(raw_t) * 1000,
                        "tiktoken_mtok_s": toks / statistics.median(raw_t) / 1e6,
                        "counter_cold_ms": statistics.median(cold_t) * 1000,
                        "counter_cold_mtok_s": toks / statistics.median(cold_t) / 1e6,
                        "counter_warm_ms": statistics.median(warm_t) * 1000,
                        "reps": reps,
                    }
                )
    return rows


# ---- 2. a 20-turn chat -------------------------------------------------------------


def conversation(turns: int, seed: int) -> list[list[dict[str, str]]]:
    """The message list sent at each turn of one conversation (distinct per seed)."""
    base = seed * 50_000
    system = f"[conversation {seed}] " + texts.text("english", 1_000, base)
    msgs = [{"role": "system", "content": system}]
    out = []
    for t in range(turns):
        user = f"[turn {t}] " + texts.text("english", 200, base + 1_000 + t * 700)
        msgs = [*msgs, {"role": "user", "content": user}]
        out.append(msgs)
        answer = texts.text("code" if t % 2 else "english", 400, base + t * 900)
        msgs = [*msgs, {"role": "assistant", "content": answer}]
    return out


async def multi_turn(quick: bool) -> list[dict[str, Any]]:
    turns = 20
    convs = 3 if quick else 10
    encodings = EncodingCache()
    cfg = _model().tokenizer
    per_turn: list[dict[str, list[float]]] = [
        {"cached": [], "cold": [], "parse": [], "tokens": []} for _ in range(turns)
    ]
    with ThreadPoolExecutor(2) as pool:
        for c in range(convs):
            counter = fresh_counter(pool, encodings)
            for t, msgs in enumerate(conversation(turns, 1 + c)):
                raw = chat_body(msgs)
                parse_s, cached_s, toks = await time_count(counter, raw, cfg)
                _, cold_s, _ = await time_count(fresh_counter(pool, encodings), raw, cfg)
                d = per_turn[t]
                d["cached"].append(cached_s)
                d["cold"].append(cold_s)
                d["parse"].append(parse_s)
                d["tokens"].append(toks)
    return [
        {
            "turn": t + 1,
            "prompt_tokens": int(statistics.median(d["tokens"])),
            "counted_before_ms": statistics.median(d["cached"]) * 1000,
            "cold_ms": statistics.median(d["cold"]) * 1000,
            "json_parse_ms": statistics.median(d["parse"]) * 1000,
        }
        for t, d in enumerate(per_turn)
    ]


async def multi_turn_live(
    quick: bool, workdir: Path, tokenizer: Path | None = None
) -> list[dict[str, Any]]:
    """The 20 turns through a live gateway process: its CPU per request at each turn."""
    convs_n = 40 if quick else 120
    turns = 20
    convs = [conversation(turns, 100 + c) for c in range(convs_n)]
    up_port, gw_port = procs.free_port(), procs.free_port()
    cfg = workdir / "gateway.yaml"
    cfg.write_text(gateway_yaml(gw_port, up_port, tokenizer=tokenizer))
    rows = []
    with (
        procs.running(
            "fake-upstream",
            procs.fake_upstream_cmd(up_port),
            up_port,
        ),
        procs.running(
            "gateway",
            procs.gateway_cmd(cfg),
            gw_port,
            log=workdir / "gateway-live.log",
        ) as gw,
    ):
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        conn = aiohttp.TCPConnector(limit=32)
        async with aiohttp.ClientSession(connector=conn) as s:
            await _ready(s, gw.url)
            for t in range(turns):
                bodies = [
                    json.dumps({"model": SERVED, "messages": c[t], "max_tokens": 16}).encode()
                    for c in convs
                ]
                cpu0 = gw.cpu()
                t0 = time.perf_counter()
                toks = await asyncio.gather(*(_post(s, url, b) for b in bodies))
                wall = time.perf_counter() - t0
                cpu = gw.cpu() - cpu0
                rows.append(
                    {
                        "turn": t + 1,
                        "prompt_tokens": int(statistics.median(toks)),
                        "requests": len(bodies),
                        "gateway_cpu_ms_per_req": cpu * 1000 / len(bodies),
                        "wall_s": wall,
                    }
                )
    return rows


async def _ready(s: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        try:
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("gateway not ready")


async def _post(s: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}")
        return int(r.headers["x-gateway-prompt-tokens"])


# ---- 3. event-loop lag ------------------------------------------------------------


class LagSampler:
    """How late a 2 ms sleep wakes up on the gateway's loop, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.samples: list[float] = []

    async def run(self) -> None:
        period = 0.002
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(period)
            late = time.perf_counter() - t0 - period
            if self.active:
                self.samples.append(late)


async def _loadgen_phase(spec: dict[str, Any], sampler: LagSampler) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        procs.PYTHON,
        "-m",
        "bench.loadgen",
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        cwd=procs.ROOT,
    )
    assert proc.stdout is not None
    result: dict[str, Any] | None = None
    async for line in proc.stdout:
        ev = json.loads(line)
        if ev["event"] == "window_start":
            sampler.active = True
        elif ev["event"] == "window_end":
            sampler.active = False
        elif ev["event"] == "result":
            result = ev
    await proc.wait()
    if result is None:
        raise RuntimeError("loadgen gave no result")
    return result


BIG_PHASE = "small + 100k-token prompts at 4/s"
FLOOD_PHASE = "small + 100k-token prompts back to back (2 conns)"


async def loop_lag(
    quick: bool, workdir: Path, big_rate: float = 4.0, tokenizer: Path | None = None
) -> dict[str, Any]:
    from aiohttp import web

    from kvgateway.core.derived_limits import derive_all
    from kvgateway.server.app import create_app

    up_port = procs.free_port()
    with procs.running(
        "fake-upstream",
        procs.fake_upstream_cmd(up_port),
        up_port,
    ):
        yaml_text = gateway_yaml(0, up_port, tokenizer=tokenizer)
        config = parse_config(json.loads(json.dumps(_yaml_dict(yaml_text))))
        app = create_app(config, derived=derive_all(config))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        port = runner.addresses[0][1]
        sampler = LagSampler()
        task = asyncio.create_task(sampler.run(), name="lag-sampler")
        small = {"name": "small", "mode": "rate", "rate": 100, "concurrency": 8, "body": "small"}
        big = {
            "name": "big",
            "mode": "rate",
            "rate": big_rate,
            "concurrency": 4,
            "prompt_tokens": 100_000,
        }
        flood = {"name": "big", "mode": "closed", "concurrency": 2, "prompt_tokens": 100_000}
        phases: dict[str, Any] = {}
        try:
            for phase, workloads, duration in (
                ("small only", [small], 2.0 if quick else 3.0),
                (BIG_PHASE, [small, big], 4.0 if quick else 8.0),
                (FLOOD_PHASE, [small, flood], 3.0 if quick else 5.0),
            ):
                sampler.samples = []
                res = await _loadgen_phase(
                    {"port": port, "warmup_s": 0.5, "duration_s": duration, "workloads": workloads},
                    sampler,
                )
                lags = sorted(sampler.samples)
                phases[phase] = {
                    "loop_lag_p50_ms": _q(lags, 0.5),
                    "loop_lag_p99_ms": _q(lags, 0.99),
                    "loop_lag_max_ms": lags[-1] * 1000 if lags else None,
                    "lag_samples": len(lags),
                    "small": res["workloads"]["small"],
                    "big": res["workloads"].get("big"),
                }
        finally:
            task.cancel()
            await runner.cleanup()
    return phases


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] * 1000


def _yaml_dict(text: str) -> dict[str, Any]:
    import yaml

    data: dict[str, Any] = yaml.safe_load(text)
    return data


# ---- report -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--tokenizer",
        help="the gateway of parts 2 (live) and 3 counts exactly with this model's tokenizer "
        "and chat template: a directory, or qwen / llama3 / tekken / sentencepiece "
        "(bench.model_dirs); implies --parts lag unless --parts is given",
    )
    p.add_argument("--parts", help="comma-separated: throughput, turns, live, lag (default: all)")
    p.add_argument("--save", help="bench/results/<name>.json (default: counting[-<tokenizer>])")
    args = p.parse_args(argv)
    tokenizer = model_dirs.tokenizer_dir(args.tokenizer) if args.tokenizer else None
    parts = set((args.parts or ("lag" if tokenizer else "throughput,turns,live,lag")).split(","))
    name = args.save or (
        f"counting-{model_dirs.label(args.tokenizer)}" if tokenizer else "counting"
    )
    procs.raise_nofile()
    import uvloop

    info = machine()
    out: dict[str, Any] = {
        "machine": info,
        "tokenizer": str(tokenizer) if tokenizer else "cl100k stand-in (upper bound)",
    }
    with (
        tempfile.TemporaryDirectory(prefix="bench-counting-") as tmp,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as r,
    ):
        if "throughput" in parts:
            out["throughput"] = r.run(throughput(args.quick))
        if "turns" in parts:
            out["multi_turn"] = r.run(multi_turn(args.quick))
        if "live" in parts:
            out["multi_turn_live"] = r.run(multi_turn_live(args.quick, Path(tmp), tokenizer))
        if "lag" in parts:
            out["loop_lag"] = r.run(loop_lag(args.quick, Path(tmp), tokenizer=tokenizer))
    out["summary"] = summarize(out)
    print_report(out)
    save(name, out)
    return out


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    if not {"multi_turn", "multi_turn_live", "loop_lag"} <= out.keys():
        return _lag_summary(out["loop_lag"]) if "loop_lag" in out else {}
    turns = out["multi_turn"]
    live = out["multi_turn_live"]
    flat = turns[-1]["counted_before_ms"] / turns[1]["counted_before_ms"]
    live_flat = live[-1]["gateway_cpu_ms_per_req"] / live[1]["gateway_cpu_ms_per_req"]
    busy = out["loop_lag"][BIG_PHASE]
    calm = out["loop_lag"]["small only"]
    added = (
        busy["small"]["p99_ms"] - calm["small"]["p99_ms"]
        if busy["small"]["p99_ms"] is not None and calm["small"]["p99_ms"] is not None
        else None
    )
    return {
        "turn20_over_turn2_counted_before": flat,
        "turn20_over_turn2_live_gateway_cpu": live_flat,
        "prompt_growth_turn2_to_20": turns[-1]["prompt_tokens"] / turns[1]["prompt_tokens"],
        "loop_lag_p99_ms_with_100k_prompts": busy["loop_lag_p99_ms"],
        "loop_lag_p99_ms_calm": calm["loop_lag_p99_ms"],
        "small_request_p99_added_ms": added,
        "targets": {
            "counting_cost_near_flat": flat <= FLAT_FACTOR,
            "loop_lag_p99<5ms": busy["loop_lag_p99_ms"] is not None
            and busy["loop_lag_p99_ms"] < TARGET_LAG_P99_MS,
        },
    }


def _lag_summary(lag: dict[str, Any]) -> dict[str, Any]:
    busy, calm = lag[BIG_PHASE], lag["small only"]
    return {
        "loop_lag_p99_ms_with_100k_prompts": busy["loop_lag_p99_ms"],
        "loop_lag_p99_ms_calm": calm["loop_lag_p99_ms"],
        "targets": {
            "loop_lag_p99<5ms": busy["loop_lag_p99_ms"] is not None
            and busy["loop_lag_p99_ms"] < TARGET_LAG_P99_MS,
        },
    }


def print_report(out: dict[str, Any]) -> None:
    print(f"gateway counting: {out.get('tokenizer', 'cl100k stand-in')}")
    if "throughput" not in out or "multi_turn" not in out:
        if "loop_lag" in out:
            _print_lag(out)
        return
    print(
        "Token counting throughput (cl100k_base; median of reps; counter = the gateway's PromptCounter)"
    )
    print(
        table(
            (
                "text",
                "tokens",
                "tiktoken ms",
                "Mtok/s",
                "counter cold ms",
                "Mtok/s",
                "counted before ms",
            ),
            [
                (
                    r["text"],
                    r["tokens"],
                    r["tiktoken_ms"],
                    r["tiktoken_mtok_s"],
                    r["counter_cold_ms"],
                    r["counter_cold_mtok_s"],
                    r["counter_warm_ms"],
                )
                for r in out["throughput"]
            ],
            digits=3,
        )
    )
    print("\n20-turn chat, history growing each turn: counting cost per request (plan + count)")
    live = {r["turn"]: r for r in out.get("multi_turn_live", [])}
    print(
        table(
            (
                "turn",
                "prompt tokens",
                "counted before ms",
                "cold ms",
                "JSON parse ms",
                "live gateway CPU ms/req",
            ),
            [
                (
                    r["turn"],
                    r["prompt_tokens"],
                    r["counted_before_ms"],
                    r["cold_ms"],
                    r["json_parse_ms"],
                    live.get(r["turn"], {}).get("gateway_cpu_ms_per_req"),
                )
                for r in out["multi_turn"]
                if r["turn"] in (1, 2, 3, 5, 10, 15, 20)
            ],
            digits=3,
        )
    )
    if "loop_lag" in out:
        _print_lag(out)
    s = out["summary"]
    if "turn20_over_turn2_counted_before" not in s:
        return
    t = s["targets"]
    print(
        f"counting cost near flat: turn 20 / turn 2 = {s['turn20_over_turn2_counted_before']:.2f}x "
        f"(prompt grew {s['prompt_growth_turn2_to_20']:.1f}x; live gateway CPU "
        f"{s['turn20_over_turn2_live_gateway_cpu']:.2f}x; target <= {FLAT_FACTOR:g}x): "
        f"{verdict(t['counting_cost_near_flat'])}"
    )


def _print_lag(out: dict[str, Any]) -> None:
    print("\nEvent-loop lag in the gateway (2 ms sleep sampler) and small-request latency")
    rows = []
    for phase, d in out["loop_lag"].items():
        big = d["big"]
        rows.append(
            (
                phase,
                d["loop_lag_p50_ms"],
                d["loop_lag_p99_ms"],
                d["loop_lag_max_ms"],
                d["small"]["p50_ms"],
                d["small"]["p99_ms"],
                d["small"]["max_ms"],
                big["rps"] if big else None,
                big["p50_ms"] if big else None,
            )
        )
    print(
        table(
            (
                "phase",
                "lag p50 ms",
                "lag p99 ms",
                "lag max ms",
                "small p50 ms",
                "small p99 ms",
                "small max ms",
                "100k prompts/s",
                "100k p50 ms",
            ),
            rows,
            digits=2,
        )
    )
    s = out["summary"]
    t = s["targets"]
    added = s.get("small_request_p99_added_ms")
    print(
        f"loop lag p99 with 100k-token prompts arriving: {s['loop_lag_p99_ms_with_100k_prompts']:.2f} ms "
        f"(target < {TARGET_LAG_P99_MS:g} ms): {verdict(t['loop_lag_p99<5ms'])} (calm phase: "
        f"{s['loop_lag_p99_ms_calm']:.2f} ms, the machine's own noise)"
        + (
            f"; small requests' p99 +{added:.2f} ms over the calm phase"
            if added is not None
            else ""
        )
    )


if __name__ == "__main__":
    sys.exit(main() and 0)
