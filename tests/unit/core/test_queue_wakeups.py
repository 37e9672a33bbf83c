"""A queued request is offered every room it could take: whoever leaves the queue (by a
grant elsewhere, by giving up, by displacement) hands on what it held back, claims follow
the backends as they are now, and nobody is displaced for a newcomer refused anyway."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.model import AuthConfig, ClassConfig, TenantConfig, TenantLimits
from kvgateway.core.admission import Admission
from kvgateway.core.admission_queue import AdmissionQueue, Waiter
from kvgateway.core.backends import Observed
from kvgateway.core.demand import Demand
from kvgateway.core.fleet import Fleet
from kvgateway.core.tenancy import Tenancy
from kvgateway.errors import Saturated
from tests.support.backends import admission_over, backend, demand

CLASSES = (ClassConfig("interactive"), ClassConfig("standard"), ClassConfig("batch"))


def _tenant(name: str, klass: str = "standard", **limits: int) -> TenantConfig:
    return TenantConfig(name, (f"k-{name}",), klass, 1.0, TenantLimits(**limits))


def _of(name: str, prompt: int, output: int = 100, *, projected: bool = False) -> Demand:
    return dataclasses.replace(demand(prompt, output), tenant=name, projected=projected)


async def test_a_waiter_granted_elsewhere_hands_on_the_room_it_held_back() -> None:
    """W1 (fits nowhere yet) claims both nodes; W2 fits the emptier one but queues behind
    W1's claim. When W1 is granted the other node, W2 is offered the room W1 held."""
    a, b = backend("a", kv=1024), backend("b", kv=1024)
    adm = admission_over([a, b])
    hold_small = await adm.admit(demand(600, 100), 1.0)  # 704 tokens: 320 left there
    hold_big = await adm.admit(demand(900, 100), 1.0)  # 1,008 on the other node
    big = asyncio.create_task(adm.admit(demand(900, 100), 5.0))
    await asyncio.sleep(0)
    little = asyncio.create_task(adm.admit(demand(150, 100), 5.0))  # 256 tokens
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    adm.release(hold_big)
    assert (await asyncio.wait_for(big, 1.0)).backend is hold_big.backend
    got = await asyncio.wait_for(little, 1.0)
    assert got.backend is hold_small.backend


async def test_claims_follow_limits_learned_while_requests_waited() -> None:
    """Requests queued while the node's limits were unknown claim it once they are
    known, so its releases offer it to them."""
    cfg = parse_config(
        {
            "models": [{"name": "m"}],
            "tiers": [
                {
                    "name": "t",
                    "backends": [{"name": "a", "url": "http://a.invalid:9", "model": "m"}],
                }
            ],
        }
    )
    fleet = Fleet(cfg)
    adm = Admission.for_fleet(fleet, lambda: cfg, lambda: 0.0)
    node = fleet.get("a")
    assert node is not None and node.starting
    first = asyncio.create_task(adm.admit(demand(600, 100), 5.0))
    second = asyncio.create_task(adm.admit(demand(600, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 2 and adm.waiting_backends() == set()
    node.healthy = node.ever_healthy = True
    assert fleet.set_discovered(node, Observed(2048, 1024, 8))
    adm.rebalance()  # as the monitor does when limits change
    r1 = await asyncio.wait_for(first, 1.0)
    assert adm.waiting_backends() == {"a"}
    adm.release(r1)
    adm.release(await asyncio.wait_for(second, 1.0))


async def test_a_retry_never_claims_the_backend_it_excludes() -> None:
    a, b = backend("a", kv=1024), backend("b", kv=1024)
    adm = admission_over([a, b])
    away_from_b = frozenset({"b"})
    hold = await adm.admit(dataclasses.replace(demand(900, 100), exclude=away_from_b), 1.0)
    assert hold.backend is a
    retry = asyncio.create_task(
        adm.admit(dataclasses.replace(demand(600, 100), exclude=away_from_b), 5.0)
    )
    await asyncio.sleep(0)
    assert adm.waiting_backends() == {"a"}
    assert (await adm.admit(demand(100, 100), 0.5)).backend is b  # b stays free to take
    adm.release(hold)
    adm.release(await asyncio.wait_for(retry, 1.0))


async def test_a_parked_waiter_is_asked_again_when_a_sibling_counted_ahead_leaves() -> None:
    """Tenant c (max_concurrent 2) has one running and one let through; its third is
    parked. When the second gives up, the third's limit opens and it is asked again."""
    cfg = AuthConfig(
        keys=(_tenant("c", max_concurrent=2), _tenant("o")), classes=CLASSES, aging_s=5.0
    )
    node = backend("a", kv=2048)
    adm = admission_over([node], tenancy=Tenancy(lambda: cfg), budget=lambda: node.budget_tokens)
    await adm.admit(_of("c", 600), 1.0)
    other = await adm.admit(_of("o", 900), 1.0)  # 336 tokens left
    second = asyncio.create_task(adm.admit(_of("c", 600), 5.0))  # let through, no room
    await asyncio.sleep(0)
    third = asyncio.create_task(adm.admit(_of("c", 100), 5.0))  # parked: max_concurrent
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    adm.release(other)
    assert (await asyncio.wait_for(third, 1.0)).backend is node


async def test_nobody_is_displaced_for_a_newcomer_refused_on_its_projected_wait() -> None:
    cfg = AuthConfig(
        keys=(_tenant("i", "interactive"), _tenant("b", "batch")), classes=CLASSES, aging_s=1e9
    )
    node = backend("a", kv=1024)
    clock = [0.0]
    adm = admission_over(
        [node],
        queue_size=1,
        clock=lambda: clock[0],
        tenancy=Tenancy(lambda: cfg),
        budget=lambda: node.budget_tokens,
    )
    running = await adm.admit(_of("b", 100, 800, projected=True), 1.0)
    running.progress(5)
    clock[0] = 10.0
    running.progress(10)  # 2 s a step: busy for ~1,600 s
    queued = asyncio.create_task(adm.admit(_of("b", 100, 100, projected=True), 10_000.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1  # the queue is full
    with pytest.raises(Saturated):
        await adm.admit(_of("i", 100, 100, projected=True), 5.0)
    assert adm.queue_depth == 1 and not queued.done()  # the batch request keeps its place
    queued.cancel()


async def test_a_node_left_with_nothing_keeps_no_report_bookkeeping() -> None:
    """Progress reports of a node's flights are tallied while a waiter claims it (to offer
    the node again once they all reported); a node whose last request ended keeps no
    tally (nodes come and go under new names)."""
    node = backend("a", kv=1024)
    adm = admission_over([node], clock=lambda: 0.0)
    running = await adm.admit(_of("t", 100, 800, projected=True), 1.0)
    running.progress(5)
    queued = asyncio.create_task(adm.admit(_of("t", 600, 400, projected=True), 10_000.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1
    running.progress(6)
    assert adm._reported.get("a") or adm._reoffered.get("a") is not None
    adm.release(running)
    adm.release(await asyncio.wait_for(queued, 1.0))  # the room freed goes to the waiter
    assert node.in_flight == 0
    assert "a" not in adm._reported and "a" not in adm._reoffered


async def test_a_release_walks_the_queue_for_held_waiters_only_while_a_limit_holds_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ending request asks its tenant's held waiters again; while no limit holds any
    waiter (all wait for room), that asks nobody and reads no queue. A waiter the limit
    holds is asked again at the release that opens its limit."""
    cfg = AuthConfig(keys=(_tenant("c", max_concurrent=3),), classes=CLASSES, aging_s=5.0)
    small, big = backend("a", kv=1024, max_model_len=1024), backend("b", kv=4096)
    nodes = [small, big]
    adm = admission_over(nodes, tenancy=Tenancy(lambda: cfg), budget=lambda: 5120)
    walks = 0
    ordered = AdmissionQueue.ordered

    def counted(self: AdmissionQueue) -> Iterator[Waiter]:
        nonlocal walks
        walks += 1
        return ordered(self)

    monkeypatch.setattr(AdmissionQueue, "ordered", counted)
    held_big = await adm.admit(_of("c", 3000, 900), 1.0)  # too long for a; b full
    on_small = await adm.admit(_of("c", 100), 1.0)
    assert (held_big.backend, on_small.backend) == (big, small)
    waiting = asyncio.create_task(adm.admit(_of("c", 2000, 900), 5.0))  # room on b only
    await asyncio.sleep(0)
    assert adm.queue_depth == 1 and walks == 0
    adm.release(on_small)  # a's room: nobody claims it, no limit held anyone
    assert walks == 0
    await adm.admit(_of("c", 100), 1.0)  # on a: c's third
    parked = asyncio.create_task(adm.admit(_of("c", 100), 5.0))  # max_concurrent: held
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    adm.release(held_big)
    assert (await asyncio.wait_for(waiting, 1.0)).backend is big
    await asyncio.wait_for(parked, 1.0)
    assert walks > 0
