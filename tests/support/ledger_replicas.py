"""Gateway replicas on one real Redis, in one test process: each its own Fleet, Admission
and RedisLedger over the same one-backend config (budget ``BUDGET``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from kvgateway.config.ledger import LedgerConfig
from kvgateway.config.load import parse_config
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand
from kvgateway.core.fleet import Fleet
from kvgateway.core.prefix_routing import PrefixRouter
from kvgateway.ledger.connect import redis_client
from kvgateway.ledger.redis_ledger import RedisLedger
from kvgateway.ledger.shared_book import LedgerStatus

BUDGET = 10_000  # kv_cache_tokens with budget_fraction 1.0


def config_doc(
    url: str,
    lease_s: float = 1.0,
    credit_hold_s: float = 0.05,
    name: str = "n1",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """The config every replica runs: one backend ``name`` of ``BUDGET`` KV tokens."""
    return {
        "models": [{"name": "m"}],
        "admission": {"budget_fraction": 1.0},
        # As long a Redis timeout as the lease allows: a machine busy with other
        # tests must not make these replicas flap into the fallback. Tests that stop
        # Redis wait such timeouts out, so a longer one is asked for by name.
        "ledger": {
            "url": url,
            "lease_s": lease_s,
            "timeout_s": timeout_s or min(0.5, lease_s / 3),
            "credit_hold_s": credit_hold_s,
        },
        "tiers": [
            {
                "name": "t",
                "backends": [
                    {
                        "name": name,
                        "url": "http://127.0.0.1:9",
                        "model": "m",
                        "max_model_len": 4096,
                        "kv_cache_tokens": BUDGET,
                        "max_num_seqs": 64,
                    }
                ],
            }
        ],
    }


def fleet_and_config(
    url: str, lease_s: float = 1.0, credit_hold_s: float = 0.05, timeout_s: float | None = None
) -> tuple[Fleet, LedgerConfig]:
    cfg = parse_config(config_doc(url, lease_s, credit_hold_s, timeout_s=timeout_s))
    fleet = Fleet(cfg)
    for b in fleet.active:
        b.healthy = b.ever_healthy = True
    return fleet, cfg.ledger


@dataclass
class Replica:
    fleet: Fleet
    ledger: RedisLedger
    admission: Admission
    statuses: list[LedgerStatus]

    @property
    def node(self) -> Backend:
        b = self.fleet.get("n1")
        assert b is not None
        return b


@contextlib.asynccontextmanager
async def replica(
    url: str,
    rid: str,
    lease_s: float = 1.0,
    credit_hold_s: float = 0.05,
    prefix: PrefixRouter | None = None,
    timeout_s: float | None = None,
) -> AsyncIterator[Replica]:
    fleet, cfg = fleet_and_config(url, lease_s, credit_hold_s, timeout_s)
    statuses: list[LedgerStatus] = []
    ledger = RedisLedger(cfg, rid, fleet, redis_client(cfg), on_status=statuses.append)
    admission = Admission.for_fleet(
        fleet, lambda: fleet.config, time.monotonic, ledger=ledger, prefix=prefix
    )
    async with ledger.running(admission):
        yield Replica(fleet, ledger, admission, statuses)


def demand(tokens: int) -> Demand:
    return Demand(
        model="m",
        prompt_tokens=tokens - 16,
        longest_prompt=1000,
        output_tokens=16,
        sequences=1,
        tokens=tokens,
    )


async def ledger_sum(url: str, name: str = "n1") -> int:
    client = Redis.from_url(url)
    try:
        held = await client.hgetall(f"{{kvgw}}:tok:{name}")
        return sum(int(v) for v in held.values())
    finally:
        await client.aclose()


async def settles_at(url: str, want: int, within: float = 3.0) -> int:
    """The ledger's sum once it reaches ``want`` (credit goes back after its hold and
    releases are pipelined), or what it is after ``within`` seconds."""
    deadline = time.monotonic() + within
    while (got := await ledger_sum(url)) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return got
