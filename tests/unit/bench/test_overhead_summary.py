"""bench.overhead's summary: its figures come from the rows of one run."""

from __future__ import annotations

from typing import Any

from bench.overhead import summarize


def _row(scenario: str, target: str, rps: float, p99: float) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "target": target,
        "rps": rps,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "proxy_cpu_ms_per_req": None if target == "direct" else 1.0,
    }


def test_two_workers_against_one_and_their_paced_tail() -> None:
    rows = [
        _row("c32", "gateway-redis", 400, 90),
        _row("c32", "gateway-redis-2w", 660, 60),
        _row("c128", "gateway-redis", 500, 300),
        _row("c128", "gateway-redis-2w", 600, 250),
        _row("paced", "direct", 200, 1.5),
        _row("paced", "gateway-redis-2w", 200, 4.0),
    ]
    s = summarize(rows)
    assert s["workers_speedup_c32"] == 1.65
    assert s["workers_speedup_c128"] == 1.2
    assert s["added_p99_ms_paced_redis_2w"] == 2.5
    assert s["targets"]["workers_speedup_c32>=1.6"] is True
    assert s["targets"]["added_p99_ms_paced_redis_2w<2"] is False
    # Without the ledger rows the figures are absent, not zero.
    s = summarize([_row("paced", "direct", 200, 1.5)])
    assert "workers_speedup_c32" not in s
    assert s["targets"]["workers_speedup_c32>=1.6"] is None


def test_the_gateways_own_work_is_its_cpu_above_the_floor() -> None:
    rows = [
        {**_row("c32", "gateway", 500, 60), "proxy_cpu_ms_per_req": 1.5},
        {**_row("c32", "floor", 900, 40), "proxy_cpu_ms_per_req": 0.75},
        {**_row("c128", "gateway", 450, 250), "proxy_cpu_ms_per_req": 1.75},
        {**_row("c128", "floor", 800, 150), "proxy_cpu_ms_per_req": 0.5},
        _row("paced", "direct", 200, 1.5),
        _row("paced", "floor", 200, 2.25),
    ]
    s = summarize(rows)
    # Taken from the scenario where the gateway costs most, floor from the same run.
    assert s["gateway_cpu_ms_per_req"] == 1.75
    assert s["floor_cpu_ms_per_req"] == 0.5
    assert s["gateway_own_cpu_ms_per_req"] == 1.25
    assert s["added_p99_ms_paced_floor"] == 0.75
    assert "floor_cpu_ms_per_req" not in summarize([_row("c32", "gateway", 500, 60)])


def test_the_cpu_target_is_the_one_for_how_the_gateway_counted() -> None:
    """0.76 ms with the stand-in, 1.2 ms with the model's own tokenizer."""
    rows = [{**_row("c32", "gateway", 500, 60), "proxy_cpu_ms_per_req": 1.0}]
    assert summarize(rows)["targets"]["cpu_ms_per_req<=target"] is False
    assert summarize(rows, exact=True)["targets"]["cpu_ms_per_req<=target"] is True
