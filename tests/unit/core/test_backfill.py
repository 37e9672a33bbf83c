"""The wait queue under the projection: a waiter that cannot fit yet does not idle room
that waiters behind it fit (backfill), and nothing admitted behind it delays the start
the projection gives it (no starvation)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.admission_core import REOFFER_S
from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand, earliest_fit, flight_for, projected_budget
from tests.support.backends import admission_over, backend, demand

BLOCK = 16


def projected(prompt: int, output: int) -> Demand:
    return replace(demand(prompt, output), projected=True)


def _node(kv: int, seqs: int = 64) -> tuple[Backend, Admission]:
    b = backend("a", kv=kv, seqs=seqs)
    return b, admission_over([b])


async def _started(adm: Admission, d: Demand, generated: int = 0) -> Reservation:
    r = await adm.admit(d, 0.0)
    r.progress(generated)
    return r


async def test_room_the_head_cannot_use_goes_to_a_waiter_that_ends_before_its_start() -> None:
    b, adm = _node(kv=64 * BLOCK)
    old = await _started(adm, projected(16 * 20, 40), generated=20)  # ends in 20 steps
    head = asyncio.create_task(adm.admit(projected(16 * 40, 16), 5.0))
    await asyncio.sleep(0)
    assert not head.done()  # 21 + 41 + 2 blocks > 64: it starts when `old` ends
    small = await asyncio.wait_for(adm.admit(projected(16, 8), 5.0), 1.0)
    assert small.backend is b  # fits now and ends long before the head's start
    adm.release(old)
    got = await asyncio.wait_for(head, 1.0)
    adm.release(got)
    adm.release(small)


async def test_a_waiter_that_would_delay_the_head_waits_behind_it() -> None:
    b, adm = _node(kv=64 * BLOCK)
    old = await _started(adm, projected(16 * 20, 40), generated=20)
    head = asyncio.create_task(adm.admit(projected(16 * 40, 16), 5.0))
    await asyncio.sleep(0)
    # Fits now (23 + 4 blocks), but grows to 25 blocks, which the head's 42 leave no
    # room for once it starts.
    long = asyncio.create_task(adm.admit(projected(16 * 2, 16 * 22), 5.0))
    await asyncio.sleep(0.01)
    assert not long.done() and not head.done()
    adm.release(old)
    first = await asyncio.wait_for(head, 1.0)
    assert not long.done() or long.result().backend is b
    adm.release(first)
    adm.release(await asyncio.wait_for(long, 1.0))


@dataclass
class _Run:
    r: Reservation
    length: int
    generated: int = 0


request = st.tuples(st.integers(1, 300), st.integers(1, 120), st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(request, min_size=2, max_size=30), budget=st.integers(24, 48))
def test_queued_requests_never_overfill_never_starve_and_never_idle(
    requests: list[tuple[int, int, int]], budget: int
) -> None:
    """An engine model (every running sequence grows a token a step, reports it, ends at
    its max_tokens) behind the real admission: no step holds more blocks than the budget;
    every request is served; each request that becomes the queue's head starts no later
    than the projection said when it did; and no step leaves the node with nothing
    admitted while a waiter fits an empty node."""
    asyncio.run(_engine(requests, budget))


async def _engine(requests: list[tuple[int, int, int]], budget: int) -> None:
    b, adm = _node(kv=budget * BLOCK)
    ids = itertools.count()
    waiting: dict[int, asyncio.Task[Reservation]] = {}
    planned: dict[int, int] = {}
    demands: dict[int, Demand] = {}
    running: list[_Run] = []
    step = 0
    todo = list(requests)
    while todo or waiting or running:
        while todo and (todo[0][2] == 0 or not running):
            prompt, output, _ = todo.pop(0)
            d = projected(prompt, output)
            if -(-(prompt + output + 2) // BLOCK) > budget:
                continue  # never fits: refused at once, not queued
            i = next(ids)
            demands[i] = d
            waiting[i] = asyncio.create_task(adm.admit(d, 1e9))
        if todo:
            prompt, output, gap = todo[0]
            todo[0] = (prompt, output, gap - 1)
        await asyncio.sleep(0)
        for i, task in list(waiting.items()):
            if task.done():
                r = task.result()
                running.append(_Run(r, r.flight.bound if r.flight else 0))
                del waiting[i]
                if i in planned:
                    assert step <= planned.pop(i) + 1, (step, i)
        if waiting:
            head = min(waiting)
            if head not in planned:
                plan = earliest_fit(
                    b.projection, BLOCK, flight_for(b, demands[head]), projected_budget(b), 0.0
                )
                if plan is not None:
                    planned[head] = step + plan
        used = sum(-(-(r.r.flight.prompt + r.generated) // BLOCK) for r in running if r.r.flight)
        assert used <= budget, (step, used, budget)
        if waiting and not running:
            raise AssertionError(f"step {step}: idle while {len(waiting)} wait")
        # One engine step: every sequence's token comes out together; those that went
        # on are reported, then those that ended are released.
        done = []
        for run in running:
            run.generated += 1
            if run.generated >= run.length:
                done.append(run)
            else:
                run.r.progress(run.generated)
        for run in done:
            running.remove(run)
            adm.release(run.r)
        step += 1
        assert step < 20_000
    assert b.reserved_tokens == 0 and len(b.projection) == 0


async def test_room_that_progress_makes_is_offered_at_most_once_per_reoffer_interval() -> None:
    """A running flight nearing its end makes room without ending; the queue is offered
    that room again at most once per REOFFER_S (each walk asks the projection about
    every waiter), and an end or a first report offers it at once."""
    now = [0.0]
    b = backend("a", kv=35 * BLOCK)
    adm = admission_over([b], clock=lambda: now[0])
    old = await adm.admit(projected(16 * 20, 40), 0.0)  # 20 prompt blocks, ends in 40
    old.progress(1)
    head = asyncio.create_task(adm.admit(projected(16 * 10, 64), 5.0))
    await asyncio.sleep(0)
    assert not head.done()  # 23 + 13 blocks just before `old` ends: over 35
    now[0] = 0.1
    old.progress(5)  # walked: still 23 + 13
    await asyncio.sleep(0)
    assert not head.done()
    now[0] = 0.1 + REOFFER_S / 2
    old.progress(30)  # it would fit now (23 + 11), but the last walk was too recent
    await asyncio.sleep(0)
    assert not head.done()
    now[0] = 0.1 + REOFFER_S * 1.01
    old.progress(31)
    got = await asyncio.wait_for(head, 1.0)
    assert got.backend is b
    adm.release(old)
    adm.release(got)
    assert b.reserved_tokens == 0
