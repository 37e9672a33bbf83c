"""Part 3, scale: routing decision time vs fleet size, memory per open stream, overload.

1. Routing decision time with 10, 100 and 1,000 synthetic backends (60% in a small-GPU
   tier, 35% large, 5% offload; each already holding a random 0-80% of its KV budget and
   sequence slots), built as the server builds them (``create_app``, no sockets):
   ``Admission.decide`` (``kvgateway.core.routing.route`` over the model's backends) for each
   policy, and ``Admission.try_admit`` and ``release`` (kv_aware: the whole synchronous
   admission step; a release offers the freed room to the queue), with an empty queue
   and with 64 waiters queued (every waiter claims backends, and an arrival must avoid
   them). Short (1k) and long (20k-token) demands
   alternate. Times are per call, from ``perf_counter_ns``.
2. Memory per open stream: a ``gateway serve`` process in front of a fake upstream that
   streams slowly (one event every 5 s); a load process opens 10,000 streaming chats
   (1,000 a second) and holds them. Gateway RSS (from /proc) before and at the peak.
3. The admission queue at 2x overload: a fake upstream that answers after 200 ms, one
   backend declared with 32 sequence slots (capacity 160 req/s), a queue of 64 with a
   2 s timeout, and 320 req/s offered open loop for 8 s: what is served, how fast the
   429s come back, queue depth and gateway RSS over time.

    python -m bench.scale [--quick] [--streams 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import procs
from bench.loadgen import SERVED
from bench.report import machine, save, table, verdict
from kvgateway.config.load import parse_config
from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.core.fleet import Fleet

TARGET_ROUTE_US_AT_1000 = 50.0
TARGET_RSS_BYTES = 1 << 30
POLICIES = ("kv_aware", "round_robin", "least_loaded", "length_aware")

_TIERS = (
    # name, offload, max_model_len, kv tokens, seqs, share of the fleet
    ("small", False, 8_192, 30_704, 16, 0.60),
    ("large", False, 32_768, 409_584, 256, 0.35),
    ("offload", True, 131_072, 155_632, 16, 0.05),
)


def synthetic_gateway(n: int, policy: str, rnd: random.Random) -> Any:
    """The gateway's own state (``create_app``, no sockets) over ``n`` healthy backends in
    three tiers, each already holding a random 0-80% of its KV budget and slots. Built
    through the public config so routing runs exactly as in the server, whatever its
    internal indexes are."""
    tiers = []
    counts = [max(1, round(n * share)) for *_, share in _TIERS]
    counts[0] = n - sum(counts[1:])
    for (tier, offload, mml, kv, seqs, _), count in zip(_TIERS, counts, strict=True):
        tiers.append(
            {
                "name": tier,
                "offload": offload,
                "backends": [
                    {
                        "name": f"{tier}-{i}",
                        "url": "http://127.0.0.1:9",
                        "model": "m",
                        "max_model_len": mml,
                        "kv_cache_tokens": kv,
                        "max_num_seqs": seqs,
                        "discover": False,
                    }
                    for i in range(count)
                ],
            }
        )
    config = parse_config(
        {
            "server": {"access_log": False},
            "models": [{"name": "m", "served_name": "m"}],
            "routing": {"policy": policy},
            "admission": {"queue_size": 10_000},
            "tiers": tiers,
        }
    )
    fleet = Fleet(config)
    for b in fleet.backends:
        b.healthy = b.ever_healthy = True
    fleet.apply(config, {})  # health changed: rebuild the index, as discovery does
    for b in fleet.backends:
        fill = rnd.uniform(0.0, 0.8)
        tokens, seqs = int(b.budget_tokens * fill), int(b.max_num_seqs * fill)
        fleet.adjust(b, tokens, seqs, seqs)
    # The same Admission the server builds (GatewayState), without sockets.
    return SimpleNamespace(
        fleet=fleet,
        config=config,
        admission=Admission.for_fleet(fleet, lambda: config, time.monotonic),
    )


def demand(prompt: int, output: int = 512) -> Demand:
    return Demand(
        model="m",
        prompt_tokens=prompt,
        longest_prompt=prompt,
        output_tokens=output,
        sequences=1,
        tokens=demand_tokens([prompt], output, 1, 16),
    )


def _stats(ns: list[int]) -> dict[str, float]:
    v = sorted(ns)
    return {
        "p50_us": v[len(v) // 2] / 1000,
        "p99_us": v[min(len(v) - 1, int(0.99 * len(v)))] / 1000,
        "mean_us": statistics.fmean(v) / 1000,
    }


def routing_times(sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    rows = []
    demands = [demand(1_000), demand(20_000)]
    for n in sizes:
        iters = max(300, (20_000 if not quick else 4_000) // max(1, n // 10))
        for policy in POLICIES:
            state = synthetic_gateway(n, policy, random.Random(n))
            ns = []
            for i in range(iters):
                d = demands[i & 1]
                t0 = time.perf_counter_ns()
                state.admission.decide(d)
                ns.append(time.perf_counter_ns() - t0)
            rows.append({"backends": n, "call": f"decide {policy}", **_stats(ns), "iters": iters})
        for waiters in (0, 64):
            state = synthetic_gateway(n, "kv_aware", random.Random(n))
            admit_ns, release_ns = asyncio.run(_admit_times(state, demands, iters, waiters))
            for call, ns in (("try_admit", admit_ns), ("release", release_ns)):
                rows.append(
                    {
                        "backends": n,
                        "call": f"{call} kv_aware, {waiters} queued",
                        **_stats(ns),
                        "iters": iters,
                    }
                )
    return rows


async def _admit_times(
    state: Any, demands: list[Demand], iters: int, waiters: int
) -> tuple[list[int], list[int]]:
    adm = state.admission
    # Waiters that cannot be served now: 120k-token prompts fit only the offload tier,
    # which is filled up first.
    parked: list[asyncio.Task[Reservation]] = []
    held: list[Reservation] = []
    if waiters:
        while isinstance(r := adm.try_admit(demand(120_000, 64)), Reservation):
            held.append(r)
        for i in range(waiters):
            parked.append(
                asyncio.create_task(adm.admit(demand(120_000, 64), 60.0), name=f"waiter-{i}")
            )
        await asyncio.sleep(0)
        assert adm.queue_depth == waiters, adm.queue_depth
    admit_ns, release_ns = [], []
    for i in range(iters):
        d = demands[i & 1]
        t0 = time.perf_counter_ns()
        r = adm.try_admit(d)
        t1 = time.perf_counter_ns()
        admit_ns.append(t1 - t0)
        if isinstance(r, Reservation):
            adm.release(r)
            release_ns.append(time.perf_counter_ns() - t1)
    for t in parked:
        t.cancel()
    await asyncio.gather(*parked, return_exceptions=True)
    for r in held:
        adm.release(r)
    return admit_ns, release_ns or [0]


# ---- live gateway runs ---------------------------------------------------------------


def gateway_yaml(port: int, upstream_port: int, *, seqs: int, admission: str = "") -> str:
    return f"""# generated by bench/scale.py
server: {{host: 127.0.0.1, port: {port}, access_log: false}}
models:
  - {{name: {SERVED}, served_name: {SERVED}}}
admission: {{queue_size: 4096{admission}}}
tiers:
  - name: main
    backends:
      - name: fake
        url: "http://127.0.0.1:{upstream_port}"
        model: {SERVED}
        max_num_seqs: {seqs}
"""


class Sampler:
    """Samples a process's RSS (and optionally the gateway's queue depth) in a thread."""

    def __init__(
        self, proc: procs.Proc, admin_url: str | None = None, period: float = 0.25
    ) -> None:
        self.proc = proc
        self.admin_url = admin_url
        self.period = period
        self.samples: list[tuple[float, int, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import urllib.request

        t0 = time.monotonic()
        while not self._stop.is_set():
            depth = None
            if self.admin_url:
                try:
                    with urllib.request.urlopen(self.admin_url, timeout=1) as r:
                        depth = int(json.loads(r.read())["queue_depth"])
                except (OSError, ValueError, KeyError):
                    depth = None
            self.samples.append((time.monotonic() - t0, self.proc.rss(), depth))
            self._stop.wait(self.period)

    @property
    def peak_rss(self) -> int:
        return max((s[1] for s in self.samples), default=0)


def run_loadgen_events(
    spec: dict[str, Any], on_event: Any = None, timeout: float = 300.0
) -> dict[str, Any]:
    proc = subprocess.Popen(
        [procs.PYTHON, "-m", "bench.loadgen", json.dumps(spec)],
        stdout=subprocess.PIPE,
        cwd=procs.ROOT,
    )
    assert proc.stdout is not None
    result = None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        ev = json.loads(line)
        if on_event is not None:
            on_event(ev)
        if ev["event"] == "result":
            result = ev
        if time.monotonic() > deadline:
            proc.kill()
            break
    proc.wait()
    if result is None:
        raise RuntimeError("loadgen gave no result")
    return result


def warm_up(port: int) -> None:
    run_loadgen_events(
        {
            "port": port,
            "warmup_s": 0.2,
            "duration_s": 1.0,
            "workloads": [{"concurrency": 16, "body": "small", "stream": True}],
        }
    )


def stream_memory(requested: int, workdir: Path) -> dict[str, Any]:
    # Each stream holds two sockets in the gateway (client and upstream). Without
    # CAP_SYS_RESOURCE the hard open-file limit cannot be raised (this sandbox: 20,000),
    # so hold as many as fit and extrapolate the total to the requested count.
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    streams = min(requested, (hard - 64) // 2) if hard != resource.RLIM_INFINITY else requested
    up_port, gw_port = procs.free_port(), procs.free_port()
    cfg = workdir / "gateway-streams.yaml"
    cfg.write_text(gateway_yaml(gw_port, up_port, seqs=1_000_000))
    with (
        procs.running(
            "fake-upstream",
            procs.fake_upstream_cmd(up_port, "--stream-interval", "5", "--stream-events", "40"),
            up_port,
        ) as up,
        procs.running(
            "gateway",
            procs.gateway_cmd(cfg),
            gw_port,
            log=workdir / "gateway-streams.log",
        ) as gw,
    ):
        time.sleep(1.0)
        idle = gw.rss()
        fds_limit = _nofile(gw.pid)
        marks: dict[str, float] = {}
        with Sampler(gw) as sampler:
            res = run_loadgen_events(
                {
                    "port": gw_port,
                    "hold_s": 3.0,
                    "hold_timeout_s": 120.0,
                    "workloads": [
                        {
                            "name": "streams",
                            "mode": "hold",
                            "concurrency": streams,
                            "ramp": 1000,
                            "body": "small",
                            "stream": True,
                        }
                    ],
                },
                on_event=lambda ev: marks.setdefault(ev["event"], time.monotonic()),
            )
            time.sleep(1.0)
        after = gw.rss()
        upstream_rss = up.rss()
    w = res["workloads"]["streams"]
    peak = sampler.peak_rss
    per_stream = (peak - idle) / max(1, w["max_open_streams"])
    return {
        "streams_requested": requested,
        "streams_held": streams,
        "nofile_hard_limit": hard,
        "streams_open_at_peak": w["max_open_streams"],
        "gateway_rss_at_requested_mb": (idle + per_stream * requested) / 2**20,
        "connect_errors": w["errors"],
        "gateway_rss_idle_mb": idle / 2**20,
        "gateway_rss_peak_mb": peak / 2**20,
        "gateway_rss_after_mb": after / 2**20,
        "kib_per_stream": per_stream / 1024,
        "upstream_rss_mb": upstream_rss / 2**20,
        "first_event_p50_ms": w["ttfc_p50_ms"],
        "first_event_p99_ms": w["ttfc_p99_ms"],
        "gateway_nofile_limit": fds_limit,
        "timeline": [(round(t, 2), round(r / 2**20, 1)) for t, r, _ in sampler.samples],
    }


def _nofile(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    except (OSError, ValueError):
        return None
    return None


def overload(workdir: Path, quick: bool) -> dict[str, Any]:
    up_port, gw_port = procs.free_port(), procs.free_port()
    cfg = workdir / "gateway-overload.yaml"
    seqs, delay_s, offered = 32, 0.2, 320.0
    capacity = seqs / delay_s
    cfg.write_text(
        gateway_yaml(gw_port, up_port, seqs=seqs, admission=", queue_timeout_s: 2").replace(
            "queue_size: 4096", "queue_size: 64"
        )
    )
    duration = 4.0 if quick else 8.0
    with (
        procs.running(
            "fake-upstream",
            procs.fake_upstream_cmd(up_port, "--delay-ms", str(delay_s * 1000)),
            up_port,
        ),
        procs.running(
            "gateway",
            procs.gateway_cmd(cfg),
            gw_port,
            log=workdir / "gateway-overload.log",
        ) as gw,
    ):
        time.sleep(1.0)
        idle = gw.rss()
        with Sampler(gw, admin_url=f"{gw.url}/admin/backends") as sampler:
            res = run_loadgen_events(
                {
                    "port": gw_port,
                    "warmup_s": 1.0,
                    "duration_s": duration,
                    "cpu_pids": {"gateway": [gw.pid]},
                    "workloads": [
                        {
                            "name": "load",
                            "mode": "rate",
                            "rate": offered,
                            "concurrency": 1200,
                            "body": "small",
                        }
                    ],
                }
            )
    w = res["workloads"]["load"]
    depths = [d for _, _, d in sampler.samples if d is not None]
    ok = w["statuses"].get("200", 0)
    s429 = w["non_200"].get("429", {})
    return {
        "capacity_rps": capacity,
        "offered_rps": offered,
        "queue_size": 64,
        "queue_timeout_s": 2.0,
        "window_s": res["wall_s"],
        "completed_in_window": w["requests"],
        "served_rps": len_ok(w) / res["wall_s"],
        "ok_p50_ms": w["p50_ms"],
        "ok_p99_ms": w["p99_ms"],
        "rejected_429": s429.get("count", 0),
        "reject_p50_ms": s429.get("p50_ms"),
        "reject_p99_ms": s429.get("p99_ms"),
        "other_statuses": {k: v for k, v in w["statuses"].items() if k not in ("200", "429")},
        "statuses_all": w["statuses"],
        "ok_all": ok,
        "queue_depth_max": max(depths, default=None),
        "queue_depth_mean": statistics.fmean(depths) if depths else None,
        "gateway_rss_idle_mb": idle / 2**20,
        "gateway_rss_peak_mb": sampler.peak_rss / 2**20,
        "gateway_cpu_s": res["cpu_s"]["gateway"],
        "timeline": [(round(t, 2), round(r / 2**20, 1), d) for t, r, d in sampler.samples],
    }


def len_ok(w: dict[str, Any]) -> int:
    # Requests that started and ended in the window with a 200.
    return int(w["ok"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--streams", type=int, default=None, help="concurrent slow streams (10,000)")
    args = p.parse_args(argv)
    streams = args.streams or (2_000 if args.quick else 10_000)
    limit = procs.raise_nofile(4 * streams + 4096)
    info = machine()
    routing = routing_times([10, 100, 1000], args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        mem = stream_memory(streams, Path(tmp))
        over = overload(Path(tmp), args.quick)
    out = {
        "machine": info,
        "nofile_limit": limit,
        "routing": routing,
        "streams": mem,
        "overload": over,
    }
    out["summary"] = summarize(out)
    print_report(out)
    save("scale", out)
    return out


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    at1000 = [r for r in out["routing"] if r["backends"] == 1000]
    kv = next(r for r in at1000 if r["call"] == "decide kv_aware")
    admit = max(r["p99_us"] for r in at1000 if r["call"].startswith(("try_admit", "release")))
    mem = out["streams"]
    over = out["overload"]
    return {
        "route_kv_aware_p99_us_at_1000": kv["p99_us"],
        "try_admit_worst_p99_us_at_1000": admit,
        "gateway_rss_peak_mb_streams": mem["gateway_rss_peak_mb"],
        "targets": {
            "route_at_1000<50us": kv["p99_us"] < TARGET_ROUTE_US_AT_1000,
            "try_admit_at_1000<50us": admit < TARGET_ROUTE_US_AT_1000,
            "rss_10k_streams<1GB": mem["gateway_rss_at_requested_mb"] * 2**20 < TARGET_RSS_BYTES
            and mem["streams_open_at_peak"] >= 0.999 * mem["streams_held"],
            "overload_429_p99<100ms": over["reject_p99_ms"] is not None
            and over["reject_p99_ms"] < 100,
        },
    }


def print_report(out: dict[str, Any]) -> None:
    print("Routing decision time per call (us), synthetic fleets, 0-80% already reserved")
    calls = list(dict.fromkeys(r["call"] for r in out["routing"]))
    sizes = sorted({r["backends"] for r in out["routing"]})
    rows = []
    for c in calls:
        row: list[Any] = [c]
        for n in sizes:
            r = next(x for x in out["routing"] if x["call"] == c and x["backends"] == n)
            row += [r["p50_us"], r["p99_us"]]
        rows.append(row)
    headers = ["call"] + [f"{n} {q}" for n in sizes for q in ("p50", "p99")]
    print(table(headers, rows, digits=1))
    m = out["streams"]
    if m["streams_held"] < m["streams_requested"]:
        print(
            f"\n(open-file hard limit {m['nofile_hard_limit']:,} and no CAP_SYS_RESOURCE: "
            f"{m['streams_held']:,} streams held, the total extrapolated to "
            f"{m['streams_requested']:,}: {m['gateway_rss_at_requested_mb']:.0f} MB)"
        )
    print(
        f"\n{m['streams_open_at_peak']:,} of {m['streams_held']:,} slow streams open at once: "
        f"gateway RSS {m['gateway_rss_idle_mb']:.0f} MB idle -> {m['gateway_rss_peak_mb']:.0f} MB peak "
        f"({m['kib_per_stream']:.1f} KiB per open stream), {m['gateway_rss_after_mb']:.0f} MB after they closed; "
        f"first event p50 {m['first_event_p50_ms']} ms, p99 {m['first_event_p99_ms']} ms while opening "
        f"1,000/s; connect errors {m['connect_errors'] or 0}"
    )
    o = out["overload"]
    print(
        f"\n2x overload: {o['offered_rps']:g} req/s offered to capacity {o['capacity_rps']:g} req/s "
        f"(32 slots x 200 ms), queue {o['queue_size']} / {o['queue_timeout_s']:g} s, {o['window_s']:.1f} s window:"
    )
    print(
        table(
            (
                "served req/s",
                "200 p50 ms",
                "200 p99 ms",
                "429s",
                "429 p50 ms",
                "429 p99 ms",
                "other",
                "queue depth max",
                "mean",
                "RSS idle MB",
                "RSS peak MB",
            ),
            [
                (
                    o["served_rps"],
                    o["ok_p50_ms"],
                    o["ok_p99_ms"],
                    o["rejected_429"],
                    o["reject_p50_ms"],
                    o["reject_p99_ms"],
                    o["other_statuses"] or 0,
                    o["queue_depth_max"],
                    o["queue_depth_mean"],
                    o["gateway_rss_idle_mb"],
                    o["gateway_rss_peak_mb"],
                )
            ],
            digits=1,
        )
    )
    s = out["summary"]
    t = s["targets"]
    print(
        f"route kv_aware p99 at 1,000 backends {s['route_kv_aware_p99_us_at_1000']:.1f} us, "
        f"try_admit/release worst p99 {s['try_admit_worst_p99_us_at_1000']:.1f} us (target < 50 us): "
        f"{verdict(t['route_at_1000<50us'])} / {verdict(t['try_admit_at_1000<50us'])}; "
        f"RSS with {m['streams_requested']:,} streams {m['gateway_rss_at_requested_mb']:.0f} MB (target < 1024 MB): "
        f"{verdict(t['rss_10k_streams<1GB'])}; 429 p99 {o['reject_p99_ms']} ms: {verdict(t['overload_429_p99<100ms'])}"
    )


if __name__ == "__main__":
    main()
