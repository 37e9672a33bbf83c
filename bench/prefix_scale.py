"""Prefix-aware routing decision time vs fleet size (beside bench/scale.py's plain one).

The same synthetic fleets as ``bench.scale`` (10, 100, 1,000 backends, each already 0-80%
full), with ``routing.prefix_aware`` placement: the prefix index is first fed 5,000
routed prompts from 200 conversations (2-64 blocks each), then ``Admission.decide`` is
timed for hinted demands that share one of those histories (follow-up turns) or nothing
(fresh prompts), alternating. Block keys are computed before timing (planning does that,
off the decision path).

    python -m bench.prefix_scale [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from typing import Any

from bench.report import table
from bench.scale import TARGET_ROUTE_US_AT_1000, _stats, demand, synthetic_gateway
from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.demand import Demand, PrefixHint
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import block_keys
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.core.shared_blocks import SharedBlocks


def _hinted(rnd: random.Random, history: list[int], extra: int) -> Demand:
    ids = history + [rnd.randrange(1, 100_000) for _ in range(extra)]
    d = demand(len(ids))
    return replace(d, prefix=PrefixHint(tuple(block_keys(ids, 16)), 16))


def prefix_times(sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        rnd = random.Random(n)
        state = synthetic_gateway(n, "kv_aware", rnd)
        router = PrefixRouter(PrefixIndex(), shared=SharedBlocks())
        adm = Admission.for_fleet(
            state.fleet, lambda s=state: s.config, time.monotonic, prefix=router
        )
        histories = [
            [rnd.randrange(1, 100_000) for _ in range(16 * rnd.randrange(2, 65))]
            for _ in range(200)
        ]
        for _ in range(5_000 if not quick else 1_000):
            r = adm.try_admit(_hinted(rnd, rnd.choice(histories), rnd.randrange(0, 200)))
            if isinstance(r, Reservation):
                adm.release(r)
        iters = max(300, (20_000 if not quick else 4_000) // max(1, n // 10))
        demands = [
            _hinted(rnd, rnd.choice(histories), 64) if i % 2 else _hinted(rnd, [], 1_000)
            for i in range(64)
        ]
        ns = []
        for i in range(iters):
            d = demands[i % len(demands)]
            t0 = time.perf_counter_ns()
            adm.decide(d)
            ns.append(time.perf_counter_ns() - t0)
        rows.append({"backends": n, "call": "decide kv_aware+prefix", **_stats(ns), "iters": iters})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = prefix_times([10, 100, 1000], args.quick)
    cols = ["backends", "call", "p50_us", "p99_us", "mean_us", "iters"]
    print(table(cols, [[r[c] for c in cols] for r in rows]))
    at_1000 = next(r for r in rows if r["backends"] == 1000)
    print(
        f"p99 at 1,000 backends < {TARGET_ROUTE_US_AT_1000:g} us: {at_1000['p99_us'] < TARGET_ROUTE_US_AT_1000}"
    )


if __name__ == "__main__":
    main()
