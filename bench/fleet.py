"""Part 4, fleet outcome: what each routing policy does for a simulated mixed fleet.

The demo fleet (3 x 24 GB-class nodes: 8k context, ~30k KV tokens, 16 sequences;
2 x 80 GB: 32k context, ~400k KV tokens; 1 CPU-offload node: 128k context, slow) runs as
simulated vLLM processes (``bench.harness.fleet_and_gateway``), the gateway in this
process in front of them with one policy at a time: ``round_robin``, ``least_loaded``,
``length_aware`` and ``kv_aware``.

Workload (every request a streaming chat with a distinct prompt, the same seeded
sequence of requests and arrival times for every policy):
  80% short chats: 200-2,000 prompt tokens, max_tokens 256-1,024;
  18% long: 4k-16k prompt tokens, max_tokens 256-1,024;
   2% very long: 24k-100k prompt tokens, max_tokens 128-256.
The nodes draw each answer's length themselves (lognormal, mean 512 tokens, capped by
max_tokens), so reservations (prompt + max_tokens) exceed what is used.

Capacity: measured once per run of this module, as the successful requests completed
per second by the fleet under ``kv_aware`` with ``--clients`` (768) closed-loop clients
sending this mix, over the last 3/4 of ``--calibrate`` seconds: more clients than the
fleet has sequence slots (576), so every node is as full as the policy lets it be.
Arrivals are then Poisson at 50%, 90% and 120% of it for ``--window`` wall seconds.
Clients give up after ``--timeout`` simulated seconds; whatever is still running
``--drain`` seconds after the window is cancelled and counted as failed.

Times are simulated seconds (wall x time_scale). Goodput: output tokens received
during the arrival window by requests that succeeded (200, stream ended with [DONE],
no error event), per simulated second: the fleet's useful serving rate, neither
inflated by a backlog finishing after the window nor by failed work. ``offered``: the
expected output of every offered request (E[min(answer, max_tokens)] under the nodes'
lognormal) per simulated second, a ceiling no policy can pass. ``kv_aware`` (learned
output lengths, the default) is checked against >= 1.3x the best baseline's goodput and
<= 1 preemption per 1,000 requests when run beside the baselines;
``kv_aware+max_tokens`` bounds every answer by its max_tokens. Preemptions come
from the nodes' own /metrics. The gateway's queue timeout and load-feedback periods are
divided by time_scale so they keep their meaning in simulated time.

time_scale is 6: the gateway and the clients share this process and 2 cores with six
node processes, and every wall millisecond the gateway waits for a core becomes
time_scale simulated milliseconds of TTFT. At 10 kv_aware's short-request TTFT p50 came
out ~3x what it was at 4 (baselines moved less); at 6 it is within ~30% of the ts=4
figure and the run fits the 15-minute budget. ``sim_lag_trimmed_wall_s`` in the JSON says
how far the nodes themselves fell behind.

The reasoning mix (``--mix reasoning``) runs at time scale 2 with a 150 s calibration,
60 s windows and a 300 s client timeout unless told otherwise: its answers take ~1,500
engine steps, so a 60 s calibration counts the first wave of answers, the short ones
(5.1-5.4 req/s simulated against 3.55 over 150 s), and at time scale 6 the gateway's one
process, relaying every token of ~300 streams, is what runs out (TTFT p50 grew from 0.3
to 17 s within a window while the large nodes held 19% of their KV).

    python -m bench.fleet [--quick] [--time-scale 6] [--window 15] [--capacity R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import aiohttp

from bench.harness import Outcome, fleet_and_gateway, is_backend_400, node_metrics, words
from bench.report import RESULTS, machine, pyplot, save, table, verdict
from kvgateway.server.appkeys import STATE

POLICIES = ("round_robin", "least_loaded", "length_aware", "kv_aware")
LOADS = (0.5, 0.9, 1.2)
SHORT_MAX = 4_000  # prompts below this count as short
OUTPUT_MEAN = 512.0  # the nodes' mean answer length (lognormal), capped by max_tokens
OUTPUT_SIGMA = 1.0  # the simulator's default output_sigma


def expected_output(
    max_tokens: int, mean: float = OUTPUT_MEAN, sigma: float = OUTPUT_SIGMA
) -> float:
    """E[min(X, max_tokens)] for the nodes' lognormal answer length X: what a request
    generates on average. Summed over the offered requests it bounds any goodput."""
    s = sigma
    mu = math.log(mean) - s * s / 2
    z = NormalDist()
    cut = math.log(max_tokens)
    return mean * z.cdf((cut - mu - s * s) / s) + max_tokens * (1 - z.cdf((cut - mu) / s))


@dataclass(frozen=True)
class Request:
    at: float  # wall seconds after the window opens
    prompt: int
    max_tokens: int


def shape(rnd: random.Random) -> tuple[int, int]:
    x = rnd.random()
    if x < 0.80:
        return rnd.randint(200, 2_000), rnd.randint(256, 1_024)
    if x < 0.98:
        return rnd.randint(4_000, 16_000), rnd.randint(256, 1_024)
    return rnd.randint(24_000, 100_000), rnd.randint(128, 256)


def reasoning_shape(rnd: random.Random) -> tuple[int, int]:
    """A reasoning model's traffic: short prompts, max_tokens of 8k-32k."""
    return rnd.randint(200, 3_000), rnd.choice((8_192, 16_384, 24_576, 32_000))


@dataclass(frozen=True)
class Mix:
    """A request mix and how the nodes draw its answers (lognormal, capped)."""

    shape: Callable[[random.Random], tuple[int, int]]
    output_mean: float
    output_sigma: float


MIXES = {
    "today": Mix(shape, OUTPUT_MEAN, OUTPUT_SIGMA),
    # Answers of 0.5k-4k tokens (mean 1,500) against max_tokens of 8k-32k.
    "reasoning": Mix(reasoning_shape, 1_500.0, 0.6),
}


def learned_ceiling(seed: int, mix: Mix = MIXES["today"], samples: int = 200_000) -> dict[str, Any]:
    """How much more an oracle could admit than ``max_tokens`` mode on this mix.

    An oracle knows each answer's length before it starts, so it reserves prompt +
    answer where ``max_tokens`` mode reserves prompt + max_tokens: no output-aware
    policy (``learned`` included) can book less without risking preemption. The ratio
    of the two is the most it could fit at once on a node bound by KV. By count it
    compares reservations; weighted by how long each is held (Little's law: KV held =
    arrival rate x reservation x duration, a decode-bound request lasting about as many
    steps as its answer's tokens) it is what raises goodput. ``by_kv_in_use`` compares
    with the KV a request actually holds over its life (its prompt, and its answer as it
    grows: half of it on average), which bounds even a policy that tracks every
    sequence's growth live and is never wrong. The answer lengths are
    drawn as the nodes draw them (lognormal at the mix's mean and sigma, capped by
    max_tokens). Slots bound it too: a 24 GB demo node fits ``max_num_seqs`` (16)
    short requests even at their max_tokens reservations (~30k KV tokens)."""
    rnd = random.Random(seed)
    mu = math.log(mix.output_mean) - mix.output_sigma**2 / 2
    sums: dict[str, list[float]] = {}
    for _ in range(samples):
        prompt, cap = mix.shape(rnd)
        answer = max(1, min(cap, round(rnd.lognormvariate(mu, mix.output_sigma))))
        kind = "short" if prompt < SHORT_MAX else "long"
        for key in ("all", kind):
            acc = sums.setdefault(key, [0.0] * 6)
            acc[0] += 1
            acc[1] += prompt + cap
            acc[2] += prompt + answer
            acc[3] += (prompt + cap) * answer
            acc[4] += (prompt + answer) * answer
            acc[5] += (prompt + answer / 2) * answer
    return {
        key: {
            "requests": int(n),
            "max_tokens_reservation_mean": booked / n,
            "oracle_reservation_mean": used / n,
            "by_count": booked / used,
            "by_time_held": booked_t / used_t,
            "by_kv_in_use": booked_t / live_t,
        }
        for key, (n, booked, used, booked_t, used_t, live_t) in sums.items()
    }


def schedule(rate: float, window: float, seed: int, mix: Mix = MIXES["today"]) -> list[Request]:
    """Poisson arrivals at ``rate``/s (wall) for ``window`` seconds, seeded."""
    rnd = random.Random(seed)
    out, t = [], rnd.expovariate(rate)
    while t < window:
        p, o = mix.shape(rnd)
        out.append(Request(t, p, o))
        t += rnd.expovariate(rate)
    return out


def overrides(
    ts: float, mix: Mix = MIXES["today"], timeout: float = 120.0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gateway and simulator settings for a run at time scale ``ts``.

    The gateway's own clocks are wall time while the nodes run ``ts`` times faster, so
    the demo config's waits are divided by ``ts`` to keep their meaning in simulated
    time. A request waits in the gateway's queue at most as long as its client does
    (``timeout`` simulated seconds)."""
    gateway = {
        "admission": {"queue_timeout_s": timeout / ts},
        "load_feedback": {
            "interval_s": 2.0 / ts,
            "preemption_cooldown_s": 5.0 / ts,
            "stale_after_s": 15.0 / ts,
        },
    }
    sim = {"output_mean": mix.output_mean, "output_sigma": mix.output_sigma}
    return gateway, sim


def fleet(policy: str, args: argparse.Namespace) -> Any:
    """``kv_aware`` projects each answer's end from the lengths learned (the default);
    ``kv_aware+max_tokens`` bounds every answer by its max_tokens
    (``admission.output_reservation: max_tokens``); ``kv_aware+whole_life`` holds every
    request's prompt + max_tokens for its life (``admission.kv_projection: false``)."""
    gw, sim = overrides(args.time_scale, MIXES[args.mix], args.timeout)
    base, _, variant = policy.partition("+")
    if variant == "max_tokens":
        gw["admission"].update(output_reservation="max_tokens")
    elif variant == "whole_life":
        gw["admission"].update(kv_projection=False)
    return fleet_and_gateway(
        base, time_scale=args.time_scale, seed=args.seed, gateway_overrides=gw, sim_overrides=sim
    )


async def _preemptions(run: Any) -> float:
    return sum(m["preemptions"] for m in (await node_metrics(run.fleet)).values())


async def _sample_usage(run: Any, out: dict[str, list[float]], window: float) -> None:
    """The nodes' own KV usage (from /sim/state) once a second during the arrival window,
    by tier (small / large / offload): how much of the memory the policy put to work.
    Beside it (keys ``book:TIER`` and ``slots:TIER``) the gateway's own book: reserved
    KV tokens over budget and reserved sequences over slots, which says whether a tier
    was held back by its KV budget or by its sequence slots."""
    end = time.monotonic() + window
    state = run.app[STATE]
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            for node in run.fleet:
                async with s.get(node.url + "/sim/state") as r:
                    usage = float((await r.json()).get("kv_usage", 0.0))
                out.setdefault(node.name.rsplit("-", 1)[0], []).append(usage)
            for b in state.fleet.backends:
                tier = b.name.rsplit("-", 1)[0]
                if b.budget_tokens > 0:
                    out.setdefault("book:" + tier, []).append(b.reserved_tokens / b.budget_tokens)
                out.setdefault("slots:" + tier, []).append(b.reserved_seqs / b.max_num_seqs)
            await asyncio.sleep(1.0)


async def _lag_trimmed(run: Any) -> float:
    """Wall seconds the simulated nodes fell behind and skipped (the machine could not
    keep up with time_scale); near zero means the simulation ran as modelled."""
    total = 0.0
    async with aiohttp.ClientSession() as s:
        for node in run.fleet:
            async with s.get(node.url + "/sim/state") as r:
                total += float((await r.json()).get("lag_trimmed_s", 0.0))
    return total


async def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop under kv_aware: the fleet's throughput in requests per wall second."""
    async with fleet("kv_aware", args) as run:
        rnd = random.Random(args.seed)
        results: list[tuple[float, Outcome]] = []
        begin = time.monotonic()
        warm = begin + args.calibrate / 4
        stop = begin + args.calibrate
        timeout = args.timeout / args.time_scale
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def client() -> None:
                while True:
                    p, o = MIXES[args.mix].shape(rnd)
                    r = await stream_chat(s, run.url, p, o, rnd, timeout=timeout)
                    results.append((time.monotonic(), r.outcome))

            # Only completions inside [warm, stop] count: cancel the rest at `stop`.
            tasks = [
                asyncio.create_task(client(), name=f"calibrate-{i}") for i in range(args.clients)
            ]
            await asyncio.sleep(stop - time.monotonic())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    counted = [o for t, o in results if warm <= t <= stop and o.status == 200]
    rate = len(counted) / (stop - warm)
    return {
        "clients": args.clients,
        "seconds": args.calibrate,
        "measured_from_s": args.calibrate / 4,
        "requests": len(results),
        "ok": sum(1 for _, o in results if o.status == 200),
        "capacity_rps_wall": rate,
        "capacity_rps_simulated": rate / args.time_scale,
    }


async def run_load(run: Any, reqs: list[Request], args: argparse.Namespace) -> list[Result]:
    rnd = random.Random(args.seed)
    timeout = args.timeout / args.time_scale
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        start = time.monotonic()
        window_end = start + args.window
        tasks = []
        for i, r in enumerate(reqs):
            delay = start + r.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(
                    stream_chat(
                        s,
                        run.url,
                        r.prompt,
                        r.max_tokens,
                        rnd,
                        timeout=timeout,
                        window_end=window_end,
                    ),
                    name=f"req-{i}",
                )
            )
        left = max(1.0, window_end + args.drain - time.monotonic())
        done, pending = await asyncio.wait(tasks, timeout=left)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [
        t.result() if t in done else Result(Outcome(0, "unfinished", None, 0, 0, None, 0.0, False))
        for t in tasks
    ]


_TOKEN = re.compile(rb'"delta":\s*\{"content"')
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_ERROR = re.compile(rb'data: (\{"error".*)')


@dataclass
class Result:
    outcome: Outcome
    tokens_in_window: int = 0  # output tokens received before the arrival window closed


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    prompt_tokens: int,
    max_tokens: int,
    rnd: random.Random,
    *,
    timeout: float,
    window_end: float = math.inf,
) -> Result:
    """``bench.harness.send_chat`` without parsing every event: the client shares this
    process with the gateway, so it only looks for the first token, token events, an
    error event and the final usage."""
    body = (
        b'{"model":"llama-3.1-8b","messages":[{"role":"user","content":"'
        + words(prompt_tokens, rnd).encode()
        + b'"}],"max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}' % max_tokens
    )
    short = prompt_tokens < SHORT_MAX
    start = time.monotonic()
    ttft = None
    tail = b""
    in_window = 0
    tier: str | None = None

    def out(status: int, code: str | None, tier: str | None, completion: int = 0) -> Result:
        o = Outcome(
            status, code, tier, prompt_tokens, completion, ttft, time.monotonic() - start, short
        )
        return Result(o, in_window)

    try:
        async with asyncio.timeout(timeout):
            async with session.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r:
                tier = r.headers.get("x-gateway-tier")
                if r.status != 200:
                    data = await r.json(content_type=None)
                    return out(r.status, str(data.get("error", {}).get("code")), tier)
                async for chunk in r.content.iter_any():
                    now = time.monotonic()
                    if ttft is None and b'"choices":[{' in chunk:
                        ttft = now - start
                    if now <= window_end:
                        in_window += len(_TOKEN.findall(chunk))
                    tail = (tail + chunk)[-8192:]
        m = _ERROR.search(tail)
        if m is not None:
            code = json.loads(m.group(1).split(b"\n")[0])["error"].get("code") or "stream_error"
            return out(502, str(code), tier)
        if not tail.endswith(b"data: [DONE]\n\n"):
            return out(502, "truncated", tier)
        u = _USAGE.findall(tail)
        return out(200, None, tier, int(u[-1]) if u else 0)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return out(0, exc.__class__.__name__, tier)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def summarize_run(
    policy: str,
    load: float,
    rate: float,
    reqs: list[Request],
    res: list[Result],
    preempt: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    ts = args.time_scale
    pairs = list(zip(reqs, res, strict=True))
    ok = [r for _, r in pairs if r.outcome.status == 200]

    def ttfts(short: bool) -> list[float]:
        return [
            r.outcome.ttft_s * ts
            for q, r in pairs
            if r.outcome.status == 200
            and r.outcome.ttft_s is not None
            and (q.prompt < SHORT_MAX) == short
        ]

    short, long_ = ttfts(True), ttfts(False)
    failures: dict[str, int] = {}
    for _, r in pairs:
        o = r.outcome
        if o.status != 200:
            k = f"{o.status}:{o.code}"
            failures[k] = failures.get(k, 0) + 1
    return {
        "policy": policy,
        "load": load,
        "rate_rps_wall": rate,
        "requests": len(res),
        "ok": len(ok),
        "success_rate": len(ok) / max(1, len(res)),
        "backend_400": sum(1 for r in res if is_backend_400(r.outcome)),
        "gateway_400": sum(1 for r in res if r.outcome.code == "context_length_exceeded"),
        "gateway_429": sum(1 for r in res if r.outcome.status == 429),
        "other_failures": sum(1 for r in res if r.outcome.status not in (200, 400, 429)),
        "failures": failures,
        "preemptions": int(preempt),
        "goodput_tok_s": sum(r.tokens_in_window for r in ok) / (args.window * ts),
        # Every offered request served, its expected output counted whole: a ceiling.
        "offered_tok_s": sum(
            expected_output(q.max_tokens, MIXES[args.mix].output_mean, MIXES[args.mix].output_sigma)
            for q in reqs
        )
        / (args.window * ts),
        "output_tokens_ok": sum(r.outcome.completion_tokens for r in ok),
        "ttft_short_p50_s": _pct(short, 0.5),
        "ttft_short_p99_s": _pct(short, 0.99),
        "ttft_long_p50_s": _pct(long_, 0.5),
        "ttft_long_p99_s": _pct(long_, 0.99),
        "short_ok": len(short),
        "long_ok": len(long_),
        # Short chats fit every GPU tier; the slow offload node is the wrong place.
        "short_sent_to_offload": sum(
            1 for q, r in pairs if q.prompt < SHORT_MAX and r.outcome.tier == "offload"
        ),
    }


async def run_policy(
    policy: str, capacity: float, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    async with fleet(policy, args) as run:
        for i, load in enumerate(args.loads):
            rate = capacity * load
            reqs = schedule(rate, args.window, args.seed * 100 + i, MIXES[args.mix])
            before, lag0 = await _preemptions(run), await _lag_trimmed(run)
            usage: dict[str, list[float]] = {}
            sampler = asyncio.create_task(_sample_usage(run, usage, args.window), name="kv-usage")
            res = await run_load(run, reqs, args)
            await sampler
            after, lag1 = await _preemptions(run), await _lag_trimmed(run)
            rows.append(summarize_run(policy, load, rate, reqs, res, after - before, args))
            rows[-1]["sim_lag_trimmed_wall_s"] = round(lag1 - lag0, 3)
            means = {k: round(sum(v) / len(v), 3) for k, v in usage.items() if v}
            rows[-1]["kv_usage_mean_by_tier"] = {k: v for k, v in means.items() if ":" not in k}
            # The gateway's book: reserved KV over budget, reserved sequences over slots.
            rows[-1]["gateway_book_mean_by_tier"] = {
                k: v for k, v in means.items() if k.startswith(("book:", "slots:"))
            }
            if args.raw:
                rows[-1]["raw"] = [
                    (
                        round(q.at, 3),
                        q.prompt,
                        q.max_tokens,
                        r.outcome.status,
                        r.outcome.code,
                        r.outcome.tier,
                        None
                        if r.outcome.ttft_s is None
                        else round(r.outcome.ttft_s * args.time_scale, 3),
                        round(r.outcome.latency_s * args.time_scale, 3),
                        r.outcome.completion_tokens,
                    )
                    for q, r in zip(reqs, res, strict=True)
                ]
            book = " ".join(
                f"{k} {v:.0%}" for k, v in rows[-1]["gateway_book_mean_by_tier"].items()
            )
            print(
                f"  {policy} at {load:.0%}: {rows[-1]['ok']}/{rows[-1]['requests']} ok; {book}",
                flush=True,
            )
            await _idle(run)
    return rows


async def _idle(run: Any, timeout: float = 30.0) -> None:
    """Wait until no request is in flight at the gateway (the fleet drains with it)."""
    from kvgateway.server.app import STATE

    state = run.app[STATE]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(b.in_flight for b in state.fleet.backends):
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)


def targets(rows: list[dict[str, Any]], loads: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv = {r["load"]: r for r in rows if r["policy"] == "kv_aware"}
    base = [r for r in rows if not r["policy"].startswith("kv_aware")]
    learned = kv
    if learned and base:
        # kv_aware (learned output lengths) per load: goodput against the best baseline,
        # and preemptions per 1,000 requests.
        ldetails = {}
        for load, r in learned.items():
            best = max((b["goodput_tok_s"] for b in base if b["load"] == load), default=0.0)
            ldetails[f"{load:.0%}"] = {
                "best_baseline_goodput": best,
                "ratio": r["goodput_tok_s"] / best if best else None,
                "preemptions_per_1000": 1000 * r["preemptions"] / max(1, r["requests"]),
            }
        out["learned_vs_best_baseline"] = ldetails
    whole = {r["load"]: r for r in rows if r["policy"] == "kv_aware+whole_life"}
    if whole:
        # Against admission as it was (whole-life reservations): no worse at any load.
        out["vs_whole_life"] = {
            f"{r['policy']} {r['load']:.0%}": r["goodput_tok_s"] / whole[r["load"]]["goodput_tok_s"]
            for r in rows
            if r["policy"] in ("kv_aware", "kv_aware+max_tokens")
            and r["load"] in whole
            and whole[r["load"]]["goodput_tok_s"]
        }
    if not base or not kv:
        out.update(
            {
                "kv_aware_zero_backend_400": all(r["backend_400"] == 0 for r in kv.values()),
                "kv_aware_zero_preemptions": all(r["preemptions"] == 0 for r in kv.values()),
                "goodput_vs_best_baseline": {},
                "kv_aware_goodput_target": None,
                "short_ttft_p99_vs_best_baseline": {},
                "kv_aware_short_ttft_target": None,
            }
        )
        return out
    out["kv_aware_zero_backend_400"] = all(r["backend_400"] == 0 for r in kv.values())
    out["kv_aware_zero_preemptions"] = all(r["preemptions"] == 0 for r in kv.values())
    goodput_ok, details = True, {}
    for load in loads:
        best = max((r["goodput_tok_s"] for r in base if r["load"] == load), default=0.0)
        ratio = kv[load]["goodput_tok_s"] / best if best else math.inf
        need = 1.2 if load >= 1.2 else 1.0
        details[f"{load:.0%}"] = {
            "best_baseline_goodput": best,
            "kv_aware_ratio": ratio,
            "need": need,
        }
        goodput_ok &= ratio >= need
    out["goodput_vs_best_baseline"] = details
    out["kv_aware_goodput_target"] = goodput_ok
    ttft_ok, tdetails = True, {}
    for load in [x for x in loads if x >= 0.9]:
        vals = [
            r["ttft_short_p99_s"]
            for r in base
            if r["load"] == load and r["ttft_short_p99_s"] is not None
        ]
        best = min(vals, default=None)
        mine = kv[load]["ttft_short_p99_s"]
        ratio = mine / best if mine is not None and best else None
        tdetails[f"{load:.0%}"] = {
            "best_baseline_p99_s": best,
            "kv_aware_p99_s": mine,
            "ratio": ratio,
        }
        ttft_ok &= ratio is not None and ratio <= 0.5
    out["short_ttft_p99_vs_best_baseline"] = tdetails
    out["kv_aware_short_ttft_target"] = ttft_ok
    return out


def plot(rows: list[dict[str, Any]], capacity_sim: float) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in POLICIES:
        rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["load"])
        if not rs:
            continue
        xs = [100 * r["load"] for r in rs]
        style = {"linewidth": 2.5} if policy == "kv_aware" else {"linestyle": "--"}
        ax1.plot(xs, [r["goodput_tok_s"] for r in rs], marker="o", label=policy, **style)
        ax2.plot(xs, [r["ttft_short_p99_s"] for r in rs], marker="o", label=f"{policy}", **style)
    ax1.set_xlabel("offered load, % of measured capacity")
    ax1.set_ylabel("goodput, output tokens / s (simulated)")
    ax1.set_title("Goodput (successful requests)")
    ax2.set_xlabel("offered load, % of measured capacity")
    ax2.set_ylabel("p99 time to first token, s (simulated)")
    ax2.set_title("p99 TTFT of short requests (< 4k tokens)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Demo fleet (6 simulated vLLM nodes), capacity {capacity_sim:.2f} req/s simulated",
        fontsize=10,
    )
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / "fleet.png", dpi=110)
    plt.close(fig)


def _usage(r: dict[str, Any]) -> str:
    u = r.get("kv_usage_mean_by_tier", {})
    return f"{u.get('small', 0):.0%}/{u.get('large', 0):.0%}"


def _order(policy: str) -> tuple[int, str]:
    return POLICIES.index(policy.partition("+")[0]), policy


def print_report(out: dict[str, Any]) -> None:
    c = out["calibration"]
    print(
        f"Fleet outcome: demo fleet, time_scale {out['settings']['time_scale']:g}; capacity "
        f"{c['capacity_rps_simulated']:.2f} req/s simulated ({c['capacity_rps_wall']:.1f}/s wall, kv_aware, "
        f"{c['clients']} closed-loop clients); Poisson arrivals for {out['settings']['window_s']:g} s wall; "
        "TTFT in simulated s"
    )
    print(
        table(
            (
                "policy",
                "load",
                "reqs",
                "success",
                "backend 400",
                "429",
                "other fail",
                "preempt",
                "goodput tok/s",
                "offered",
                "short TTFT p50",
                "p99",
                "long TTFT p50",
                "p99",
                "KV used S/L",
            ),
            [
                (
                    r["policy"],
                    f"{r['load']:.0%}",
                    r["requests"],
                    f"{100 * r['success_rate']:.1f}%",
                    r["backend_400"],
                    r["gateway_429"],
                    r["other_failures"],
                    r["preemptions"],
                    r["goodput_tok_s"],
                    r.get("offered_tok_s"),
                    r["ttft_short_p50_s"],
                    r["ttft_short_p99_s"],
                    r["ttft_long_p50_s"],
                    r["ttft_long_p99_s"],
                    _usage(r),
                )
                for r in sorted(out["rows"], key=lambda r: (r["load"], _order(r["policy"])))
            ],
            digits=2,
        )
    )
    t = out["targets"]
    for k, v in t.get("learned_vs_best_baseline", {}).items():
        ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}x"
        print(
            f"kv_aware at {k}: goodput {ratio} the best baseline (need 1.3x), "
            f"{v['preemptions_per_1000']:.2f} preemptions per 1,000 requests (need <= 1)"
        )
    for k, v in t.get("vs_whole_life", {}).items():
        print(f"{k}: goodput {v:.2f}x kv_aware with whole-life reservations")
    if ceiling := out.get("learned_ceiling"):
        print(ceiling_line(ceiling))
    if "kv_aware_zero_backend_400" not in t or "goodput_vs_best_baseline" not in t:
        return
    print(
        f"kv_aware: zero backend 400s {verdict(t['kv_aware_zero_backend_400'])}; zero preemptions "
        f"{verdict(t['kv_aware_zero_preemptions'])}; goodput vs best baseline "
        + ", ".join(
            f"{k} {v['kv_aware_ratio']:.2f}x (need {v['need']:g}x)"
            for k, v in t["goodput_vs_best_baseline"].items()
        )
        + f": {verdict(t['kv_aware_goodput_target'])}; short p99 TTFT vs best baseline "
        + ", ".join(
            f"{k} {v['ratio']:.2f}x" if v["ratio"] is not None else f"{k} n/a"
            for k, v in t["short_ttft_p99_vs_best_baseline"].items()
        )
        + f" (need <= 0.5x): {verdict(t['kv_aware_short_ttft_target'])}"
    )


def ceiling_line(ceiling: dict[str, Any]) -> str:
    a, sh = ceiling["all"], ceiling["short"]
    return (
        "ceiling for any output-aware policy on this mix (an oracle reserving each "
        f"answer's true length, {a['requests']:,} drawn requests): max_tokens books "
        f"{a['by_count']:.2f}x what it needs by count, {a['by_time_held']:.2f}x by time "
        f"held ({sh['by_count']:.2f}x / {sh['by_time_held']:.2f}x for short requests), "
        f"{a['by_kv_in_use']:.2f}x ({sh['by_kv_in_use']:.2f}x short) against the KV "
        "sequences hold as they grow: goodput on KV-bound nodes can rise at most that much"
    )


def _log_to_file() -> None:
    """The in-process gateway's log (node pauses, limit warnings, and aiohttp's traceback
    for every client that disconnects mid-stream when a run is cut off) goes to
    bench/results/fleet-gateway.log instead of the console."""
    import logging

    RESULTS.mkdir(exist_ok=True)
    handler = logging.FileHandler(RESULTS / "fleet-gateway.log", mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows (about 3 minutes)")
    p.add_argument("--time-scale", type=float, default=None, help="6 (reasoning: 2)")
    p.add_argument("--window", type=float, default=None, help="wall seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=None, help="wall seconds for stragglers")
    p.add_argument("--timeout", type=float, default=None, help="client timeout, simulated s (120)")
    p.add_argument("--calibrate", type=float, default=None, help="wall seconds of calibration")
    p.add_argument("--capacity", type=float, default=None, help="skip calibration: req/s wall")
    p.add_argument("--clients", type=int, default=768)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--raw", action="store_true", help="keep every request's outcome in the JSON")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--loads", default=",".join(str(x) for x in LOADS))
    p.add_argument("--name", default="fleet", help="results file: bench/results/NAME.json")
    p.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="today",
        help="today's mix, or a reasoning model's (max_tokens 8k-32k, answers 0.5k-4k)",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="only print the most an output-aware policy could gain on this mix (no fleet)",
    )
    args = p.parse_args(argv)
    if args.ceiling:
        ceiling = learned_ceiling(args.seed, MIXES[args.mix])
        print(ceiling_line(ceiling))
        return {"learned_ceiling": ceiling}
    reasoning = args.mix == "reasoning"  # long answers: see the module's docstring
    args.time_scale = args.time_scale or (2.0 if reasoning else 6.0)
    args.window = args.window or (4.0 if args.quick else 60.0 if reasoning else 15.0)
    args.timeout = args.timeout or (60.0 if args.quick else 300.0 if reasoning else 120.0)
    args.drain = args.drain or args.timeout / args.time_scale
    args.calibrate = args.calibrate or (6.0 if args.quick else 150.0 if reasoning else 10.0)
    args.loads = [float(x) for x in args.loads.split(",")]
    import uvloop

    from bench.procs import raise_nofile

    raise_nofile()
    _log_to_file()
    info = machine()
    t0 = time.monotonic()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        if args.capacity:
            cal = {
                "clients": 0,
                "seconds": 0,
                "requests": 0,
                "ok": 0,
                "capacity_rps_wall": args.capacity,
                "capacity_rps_simulated": args.capacity / args.time_scale,
                "given": True,
            }
        else:
            cal = r.run(calibrate(args))
        print(f"capacity: {cal['capacity_rps_wall']:.2f} req/s wall", flush=True)
        rows: list[dict[str, Any]] = []
        for policy in args.policies.split(","):
            rows += r.run(run_policy(policy, cal["capacity_rps_wall"], args))
    out = {
        "machine": info,
        "settings": {
            "time_scale": args.time_scale,
            "window_s": args.window,
            "drain_s": args.drain,
            "timeout_sim_s": args.timeout,
            "seed": args.seed,
            "short_below_tokens": SHORT_MAX,
            "mix": args.mix,
        },
        "calibration": cal,
        "rows": rows,
        "seconds": time.monotonic() - t0,
    }
    out["targets"] = targets(rows, args.loads) if "kv_aware" in args.policies else {}
    if "kv_aware" in args.policies.split(","):
        out["learned_ceiling"] = learned_ceiling(args.seed, MIXES[args.mix])
    print_report(out)
    save(args.name, out)
    if args.name == "fleet":
        plot(rows, cal["capacity_rps_simulated"])
    return out


__all__ = ["Request", "asdict", "main"]

if __name__ == "__main__":
    main()
