"""What the fleet-wide tenant holdings cost a request: the latency of one hold (the
script a grant that a tenant limit or class floor concerns runs after its KV confirm)
against a real redis-server on loopback, each request released before the next, so the
release refreshes run beside the holds as they do under load.

    python -m bench.tenant_holds [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from kvgateway.config.model import AuthConfig, ClassConfig, TenantConfig
from kvgateway.core.reservation import Reservation
from kvgateway.core.routing import RouteReason
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.tenant_holds import TenantHolds
from tests.support.backends import admission_over, backend
from tests.support.redis_server import run_redis

NS = "bench-holds"
AUTH = AuthConfig(
    keys=(
        TenantConfig("i", ("k-i",), class_name="interactive"),
        TenantConfig("b", ("k-b",), class_name="batch"),
    ),
    classes=(ClassConfig("interactive", floor_share=0.2), ClassConfig("batch")),
)


async def measure(url: str, requests: int) -> list[float]:
    client = Redis.from_url(url)
    try:
        await client.zadd(f"{{{NS}}}:live", {"a": 2**40, "b": 2**40})
        node = backend("n1", seqs=256)
        holds = TenantHolds(
            client,
            NS,
            "a",
            1.0,
            shared=lambda: True,
            live=lambda: 2,
            budget=lambda: node.budget_tokens,
            slots=lambda: node.max_num_seqs,
        )
        tenancy = Tenancy(lambda: AUTH)
        owner = admission_over([node])
        took = []
        async with holds.running(tenancy, lambda tenant: None):
            for i in range(requests):
                tenant = "i" if i % 2 else "b"
                r = Reservation(
                    node, 1000, 1, RouteReason.FIT, owner, ticket=tenancy.ticket(tenant, 1000)
                )
                start = time.perf_counter()
                await holds.hold(r)
                took.append(time.perf_counter() - start)
                holds.released(r)
        return sorted(took)
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    args = p.parse_args(argv)
    with run_redis(Path(tempfile.mkdtemp(prefix="bench-holds-"))) as server:
        took = asyncio.run(measure(server.url, args.requests))
    n = len(took)
    print(
        f"tenant hold, {n} requests (two classes, a floor): "
        f"p50 {took[n // 2] * 1e3:.3f} ms, p99 {took[int(n * 0.99)] * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
