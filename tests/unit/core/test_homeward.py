"""kv_aware in a tier of several contexts: a request the small context holds goes there,
waits there only while it would finish there sooner than on the large context, and
leaves the large context's room to what only the large context holds."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.backends import Backend
from kvgateway.core.demand import Demand
from kvgateway.core.routing import ModelIndex, Routed, RouteReason, Wait, homeward
from tests.support.backends import admission_over, backend, demand


def projected(prompt: int, output: int) -> Demand:
    return replace(demand(prompt, output), projected=True)


def _fleet(
    *, small_step: float = 0.01, large_step: float = 0.03, large_tier: int = 0, **kw: Any
) -> tuple[Backend, Backend, Admission]:
    """S: 1,024-token context, two sequences; L: 8,192, sixteen; steps learned."""
    s = backend("s", max_model_len=1024, kv=1024, seqs=2)
    big = backend("l", max_model_len=8192, kv=8192, seqs=16, tier_index=large_tier)
    s.step_s, big.step_s = small_step, large_step
    return s, big, admission_over([s, big], **kw)


async def _fill_small(adm: Admission, s: Backend, output: int, generated: int) -> list[Reservation]:
    """S's two slots taken by started requests ``output - generated`` steps from their ends."""
    held = [await adm.admit(projected(160, output), 0.0) for _ in range(2)]
    for r in held:
        assert r.backend is s
        r.progress(generated)
    return held


async def test_a_request_the_small_context_holds_goes_there_while_it_has_room() -> None:
    s, big, adm = _fleet()
    r = await adm.admit(projected(160, 40), 0.0)
    assert r.backend is s  # though L has eight times its free budget
    assert (await adm.admit(projected(2000, 40), 0.0)).backend is big  # only L holds it


async def test_with_the_small_context_full_it_waits_there_when_it_finishes_sooner() -> None:
    """(start + T) x 0.01 s < T x 0.03 s: it waits for S, claiming S alone, so a request
    only L holds still takes L's room at once."""
    s, big, adm = _fleet()
    held = await _fill_small(adm, s, output=40, generated=20)
    short = asyncio.create_task(adm.admit(projected(160, 40), 5.0))
    await asyncio.sleep(0)
    assert not short.done()
    assert adm.waiting_for("s") and not adm.waiting_for("l")
    assert (await adm.admit(projected(2000, 40), 0.0)).backend is big
    adm.rebalance()  # room on L is offered to every waiter: the home waiter takes none
    await asyncio.sleep(0)
    assert not short.done()
    adm.release(held[0])
    assert (await asyncio.wait_for(short, 1.0)).backend is s


async def test_a_small_context_with_slower_steps_is_no_home() -> None:
    s, big, adm = _fleet(small_step=0.04, large_step=0.03)
    assert (await adm.admit(projected(160, 40), 0.0)).backend is big
    s.step_s = 0.0  # unknown: not known to be slower
    assert (await adm.admit(projected(160, 40), 0.0)).backend is s


async def test_it_takes_the_large_context_when_waiting_would_finish_later() -> None:
    s, big, adm = _fleet(small_step=0.03, large_step=0.03)
    await _fill_small(adm, s, output=40, generated=20)
    r = await adm.admit(projected(160, 40), 5.0)
    assert r.backend is big and r.reason == RouteReason.FIT


async def test_without_learned_step_times_or_a_projection_it_takes_the_large_context() -> None:
    s, big, adm = _fleet(small_step=0.0)
    await _fill_small(adm, s, output=40, generated=20)
    assert (await adm.admit(projected(160, 40), 5.0)).backend is big
    s.step_s = 0.01
    assert (await adm.admit(demand(160, 40), 5.0)).backend is big  # whole-life reservation


async def test_a_home_wait_lasts_only_while_waiting_pays() -> None:
    """Patience T x (0.03 - 0.01) s = 0.2 s: past it the request finishes sooner on L
    even if S frees at once, so it takes L (S's requests here never end)."""
    s, big, adm = _fleet()
    await _fill_small(adm, s, output=20, generated=15)
    short = asyncio.create_task(adm.admit(projected(160, 10), 5.0))
    await asyncio.sleep(0.1)
    assert not short.done()
    r = await asyncio.wait_for(short, 1.0)
    assert r.backend is big
    assert not adm.waiting_for("s")


async def test_a_home_wait_that_cannot_queue_takes_the_room_it_passed_up() -> None:
    s, big, adm = _fleet(queue_size=0)
    await _fill_small(adm, s, output=40, generated=20)
    assert (await adm.admit(projected(160, 40), 5.0)).backend is big
    s2, big2, adm2 = _fleet()
    await _fill_small(adm2, s2, output=40, generated=20)
    assert (await adm2.admit(projected(160, 40), 0.0)).backend is big2  # no time to wait


async def test_a_later_tier_is_a_spill_as_it_always_was() -> None:
    """Contexts in tiers of their own: the configured order decides, not homeward."""
    s, big, adm = _fleet(large_tier=1)
    await _fill_small(adm, s, output=40, generated=20)
    r = await adm.admit(projected(160, 40), 5.0)
    assert r.backend is big and r.reason == RouteReason.SPILL


def test_a_tier_of_one_context_keeps_the_freest_backend() -> None:
    a = backend("a", kv=8192)
    b = backend("b", kv=16384)  # more KV, the same context (its max_model_len)
    index = ModelIndex([a, b])
    chosen = Routed(b, RouteReason.FIT)
    assert homeward(index, projected(160, 40), chosen, 0.0, lambda _: 0) is chosen


def test_waiters_already_waiting_for_home_count_against_waiting_there() -> None:
    s = backend("s", max_model_len=1024, kv=1024, seqs=2)
    big = backend("l", max_model_len=8192, kv=8192, seqs=16)
    s.step_s, big.step_s = 0.01, 0.03
    s.in_flight = 2
    s.reserved_seqs = 2  # full: no room now, and nothing projected on it (starts at once)
    index = ModelIndex([s, big])
    chosen = Routed(big, RouteReason.FIT)
    d = projected(160, 40)
    # (0 + 0 + 40) x 0.01 < 40 x 0.03: wait. (0 + 5 x 40 / 2 + 40) x 0.01 > 1.2: take L.
    wait = homeward(index, d, chosen, 0.0, lambda _: 0)
    assert isinstance(wait, Wait) and wait.home is not None
    assert wait.home.claims == {"s"} and wait.home.instead is chosen
    assert abs(wait.home.patience_s - 40 * 0.02) < 1e-9
    assert homeward(index, d, chosen, 0.0, lambda _: 5) is chosen
