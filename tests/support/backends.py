"""Builders for unit tests of the pure core (no sockets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from kvgateway.config.model import BackendConfig, Policy
from kvgateway.core.admission import Admission
from kvgateway.core.backends import Backend, Limit, Limits, LimitSource
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.core.routing import ModelIndex


# Read through a call, for mypy: it keeps an attribute narrowed by a check or an
# assignment (``assert not b.paused``) across the calls that change it, and would call a
# later check of the other value unreachable.
def paused(b: Backend) -> bool:
    return b.paused


def healthy(b: Backend) -> bool:
    return b.healthy


def backend(
    name: str,
    *,
    tier: str = "small",
    tier_index: int = 0,
    offload: bool = False,
    max_model_len: int = 8192,
    kv: int = 32768,
    seqs: int = 16,
    fraction: float = 1.0,
    healthy: bool = True,
    model: str = "m",
) -> Backend:
    cfg = BackendConfig(
        name=name,
        url=f"http://127.0.0.1:1/{name}",
        model=model,
        tier=tier,
        offload=offload,
        served_model=model,
    )
    limits = Limits(
        Limit(max_model_len, LimitSource.CONFIG),
        Limit(kv, LimitSource.CONFIG),
        Limit(seqs, LimitSource.CONFIG),
    )
    b = Backend(config=cfg, tier_index=tier_index, limits=limits, budget_fraction=fraction)
    b.healthy = healthy
    b.ever_healthy = healthy
    return b


def demand(prompt: int, output: int = 100, *, n: int = 1, model: str = "m") -> Demand:
    return Demand(
        model=model,
        prompt_tokens=prompt,
        longest_prompt=prompt,
        output_tokens=output,
        sequences=n,
        tokens=demand_tokens([prompt], output, n, 16),
    )


def admission_over(
    backends: list[Backend],
    *,
    clock: Callable[[], float] = lambda: 0.0,
    queue_size: int = 10_000,
    policy: str = "kv_aware",
    **kw: Any,
) -> Admission:
    """``policy`` (kv_aware) admission over ``backends`` (one model's index); ``kw``:
    Admission's optional parts (ledger, prefix, tenancy...)."""
    idx = ModelIndex(backends)
    return Admission(
        index_for=lambda m: idx,
        adjust=idx.adjust,
        # The core compares the policy with ==, so a plain string stands in for the enum.
        policy=lambda: cast("Policy", policy),
        offload_overflow=lambda: False,
        queue_size=lambda: queue_size,
        clock=clock,
        **kw,
    )
