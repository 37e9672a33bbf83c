"""What one release costs the event loop while many requests wait, with tenants on.

An overloaded gateway holds up to ``admission.queue_size`` waiters (1,024 by default);
every response that ends offers its room to them in serving order (classes, fair-queuing
tags, aging), and every waiter that times out or is cancelled offers the room it
claimed. This drives the admission core directly (no sockets): one node kept full, N
waiters of 50 tenants in three classes, then releases one by one, then every waiter
cancelled in one instant. Prints CPU ms per release and for the whole cancellation.

    python -m bench.queue_release [--sizes 250,1000,2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import replace

from kvgateway.config.model import AuthConfig, BackendConfig, ClassConfig, Policy, TenantConfig
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Backend, Limit, Limits, LimitSource
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.core.reservation import Reservation
from kvgateway.core.routing import ModelIndex
from kvgateway.core.tenancy import Tenancy

CLASSES = ("interactive", "standard", "batch")


def _admission(clock: list[float], queue_size: int) -> tuple[Admission, Backend]:
    cfg = BackendConfig(
        name="a", url="http://127.0.0.1:1/a", model="m", tier="gpu", offload=False, served_model="m"
    )
    limits = Limits(
        Limit(8192, LimitSource.CONFIG),
        Limit(200_000, LimitSource.CONFIG),
        Limit(16, LimitSource.CONFIG),
    )
    b = Backend(config=cfg, tier_index=0, limits=limits, budget_fraction=1.0)
    b.healthy = b.ever_healthy = True
    tenants = tuple(TenantConfig(f"t{i}", (f"k{i}",), CLASSES[i % 3]) for i in range(50))
    auth = AuthConfig(keys=tenants, classes=tuple(ClassConfig(c) for c in CLASSES))
    idx = ModelIndex([b])
    adm = Admission(
        index_for=lambda m: idx,
        adjust=idx.adjust,
        policy=lambda: Policy.KV_AWARE,
        offload_overflow=lambda: False,
        queue_size=lambda: queue_size,
        clock=lambda: clock[0],
        tenancy=Tenancy(lambda: auth),
        budget=lambda: b.budget_tokens,
    )
    return adm, b


def _demand(tenant: str) -> Demand:
    d = Demand(
        model="m",
        prompt_tokens=900,
        longest_prompt=900,
        output_tokens=100,
        sequences=1,
        tokens=demand_tokens([900], 100, 1, 16),
    )
    return replace(d, tenant=tenant)


async def measure(n: int) -> tuple[float, float, int]:
    clock = [0.0]
    adm, _ = _admission(clock, n + 10)
    rng = random.Random(1)
    held: list[Reservation] = []
    while True:  # fill the node (16 sequences)
        try:
            held.append(await adm.admit(_demand(f"t{len(held) % 50}"), 0.0))
        except Exception:
            break
    waiting = []
    for _ in range(n):
        clock[0] += 0.001
        waiting.append(asyncio.create_task(adm.admit(_demand(f"t{rng.randrange(50)}"), 1e6)))
        await asyncio.sleep(0)
    cpu = 0.0
    for r in held:
        clock[0] += 0.003
        t0 = time.process_time()
        adm.release(r)
        cpu += time.process_time() - t0
        await asyncio.sleep(0)
    per_release = cpu / len(held) * 1e3
    t0 = time.process_time()
    for t in waiting:
        t.cancel()
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    storm = (time.process_time() - t0) * 1e3
    for got in outcomes:
        if not isinstance(got, BaseException):
            adm.release(got)
    return per_release, storm, len(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="250,1000,2000")
    args = ap.parse_args()
    print("queued   CPU ms per release   CPU ms to cancel every waiter at once")
    for n in (int(s) for s in args.sizes.split(",")):
        per, storm, _ = asyncio.run(measure(n))
        print(f"{n:>6}   {per:>18.3f}   {storm:>37.1f}")


if __name__ == "__main__":
    main()
