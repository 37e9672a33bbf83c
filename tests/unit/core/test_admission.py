import asyncio
import random

import pytest

from kvgateway.core.demand import Demand
from kvgateway.core.reservation import Reservation
from kvgateway.errors import ContextLengthExceeded, NoHealthyBackend, Saturated
from tests.support.backends import admission_over, backend, demand, paused


def make(backends, queue_size=100, clock=None, abort_delay=0.0):
    clock = clock or [0.0]
    adm = admission_over(
        backends, queue_size=queue_size, clock=lambda: clock[0], abort_delay=lambda: abort_delay
    )
    return adm


async def test_reserve_and_release_exactly_once():
    b = backend("a", kv=1000)
    adm = make([b])
    r = await adm.admit(demand(100, 100), 1.0)
    assert b.reserved_tokens == r.tokens == 208 and b.in_flight == 1 and b.reserved_seqs == 1
    assert adm.release(r) is True
    assert adm.release(r) is False
    assert b.reserved_tokens == 0 and b.in_flight == 0 and b.reserved_seqs == 0


async def test_too_long_and_no_backend_raise_without_waiting():
    b = backend("a", kv=1000)
    adm = make([b])
    with pytest.raises(ContextLengthExceeded) as err:
        await adm.admit(demand(5000), 5.0)
    assert "largest context" in err.value.message and "1000" in err.value.message
    assert err.value.message.startswith("This model's maximum context length is 1000 tokens.")
    b.healthy = False
    with pytest.raises(NoHealthyBackend):
        await adm.admit(demand(100), 5.0)


async def test_waiter_gets_capacity_released_by_another():
    b = backend("a", kv=512)
    adm = make([b])
    first = await adm.admit(demand(300, 100), 1.0)
    task = asyncio.create_task(adm.admit(demand(300, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1 and not task.done()
    adm.release(first)
    second = await task
    assert second.backend is b and b.reserved_tokens == second.tokens
    adm.release(second)
    assert b.reserved_tokens == 0


async def test_queue_timeout_gives_429_with_retry_after():
    b = backend("a", kv=512)
    adm = make([b])
    await adm.admit(demand(300, 100), 1.0)
    with pytest.raises(Saturated) as err:
        await adm.admit(demand(300, 100), 0.05)
    assert err.value.status == 429 and "Retry-After" in err.value.headers()
    assert adm.queue_depth == 0


async def test_full_queue_rejects_immediately():
    b = backend("a", kv=512)
    adm = make([b], queue_size=1)
    await adm.admit(demand(300, 100), 1.0)
    waiting = asyncio.create_task(adm.admit(demand(300, 100), 5.0))
    await asyncio.sleep(0)
    with pytest.raises(Saturated):
        await adm.admit(demand(300, 100), 5.0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert adm.queue_depth == 0


async def test_later_arrivals_cannot_take_a_backend_an_earlier_waiter_claims():
    small = backend("s", kv=1024)
    adm = make([small])
    hold = await adm.admit(demand(600, 100), 1.0)
    big = asyncio.create_task(adm.admit(demand(900, 100), 5.0))
    await asyncio.sleep(0)
    # 304 more tokens would fit next to `hold`, but the big waiter came first.
    little = asyncio.create_task(adm.admit(demand(200, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    adm.release(hold)
    r_big = await big
    assert r_big.tokens == 1008 and not little.done()
    adm.release(r_big)
    r_little = await little
    adm.release(r_little)
    assert small.reserved_tokens == 0


async def test_waiter_does_not_block_requests_for_backends_it_cannot_use():
    small = backend("s", kv=1024, max_model_len=1024)
    large = backend("l", kv=8192, max_model_len=8192, tier_index=1, tier="large")
    adm = make([small, large])
    hold = await adm.admit(demand(7000, 100), 1.0)
    assert hold.backend is large
    big = asyncio.create_task(adm.admit(demand(5000, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1
    short = await adm.admit(demand(200, 100), 1.0)
    assert short.backend is small
    adm.release(short)
    adm.release(hold)
    adm.release(await big)
    assert large.reserved_tokens == 0


async def test_grant_racing_with_cancellation_is_released():
    b = backend("a", kv=512)
    adm = make([b])
    hold = await adm.admit(demand(300, 100), 1.0)
    task = asyncio.create_task(adm.admit(demand(300, 100), 5.0))
    await asyncio.sleep(0)
    # Grant and cancel in the same loop iteration: the waiter never sees the grant.
    adm.release(hold)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.reserved_tokens == 0 and b.in_flight == 0


async def test_random_cancellations_never_leak():
    rnd = random.Random(7)
    backends = [backend("a", kv=4096, seqs=4), backend("b", kv=4096, seqs=4, tier_index=1)]
    adm = make(backends, queue_size=1000)

    async def one():
        r = await adm.admit(demand(rnd.randint(10, 1500), rnd.randint(1, 500)), 2.0)
        try:
            await asyncio.sleep(rnd.random() * 0.01)
        finally:
            adm.release(r)

    tasks = [asyncio.create_task(one()) for _ in range(300)]
    for _ in range(30):
        await asyncio.sleep(0.002)
        for t in rnd.sample(tasks, 8):
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.queue_depth == 0
    assert not adm.waiting_backends()
    for b in backends:
        assert (b.reserved_tokens, b.reserved_seqs, b.in_flight) == (0, 0, 0)


async def test_waiter_for_gpu_nodes_does_not_claim_the_offload_tier():
    gpu = backend("g", kv=1024, max_model_len=1024)
    off = backend(
        "o", kv=100_000, max_model_len=100_000, tier_index=1, tier="offload", offload=True
    )
    adm = make([gpu, off])
    hold = await adm.admit(demand(700, 100), 1.0)
    assert hold.backend is gpu
    short = asyncio.create_task(adm.admit(demand(500, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1  # waits for the GPU node, not sent to offload
    long = await adm.admit(demand(50_000, 100), 1.0)
    assert long.backend is off  # the short waiter did not block the offload tier
    adm.release(long)
    adm.release(hold)
    adm.release(await short)
    assert (gpu.reserved_tokens, off.reserved_tokens) == (0, 0)


async def test_rebalance_never_pushes_gpu_work_onto_offload():
    # Claims of earlier waiters do not make the GPU tier look down to later ones, which
    # would then be sent to the offload tier although offload_overflow is off.
    gpu = [backend(f"g{i}", kv=1024, max_model_len=1024) for i in range(2)]
    off = backend(
        "o", kv=100_000, max_model_len=100_000, tier_index=1, tier="offload", offload=True
    )
    adm = make([*gpu, off])
    held = [await adm.admit(demand(700, 100), 1.0) for _ in gpu]
    assert {r.backend.name for r in held} == {"g0", "g1"}
    waiters = [asyncio.create_task(adm.admit(demand(500, 100), 5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    adm.rebalance()
    assert adm.queue_depth == 2 and off.reserved_tokens == 0
    for r in held:
        adm.release(r)
    got = [await w for w in waiters]
    assert {r.backend.name for r in got} <= {"g0", "g1"}
    for r in got:
        adm.release(r)


async def test_pause_ending_serves_every_waiter_without_a_new_request():
    # No lost wake-up: a backend paused for preemptions, waiters queued for it;
    # when the cool-down ends, every waiter is served with no new request arriving.
    from kvgateway.core.backends import PauseReason

    clock = [0.0]
    b = backend("a", kv=100_000, seqs=64)
    adm = make([b], clock=clock)
    b.paused, b.pause_reason, b.paused_until = True, PauseReason.PREEMPTING, 5.0
    waiters = [asyncio.create_task(adm.admit(demand(500, 100), 30.0)) for _ in range(13)]
    await asyncio.sleep(0)
    assert adm.queue_depth == 13
    clock[0] = 6.0
    # Reads are pure: the expired pause reads as over but is not ended by reading it.
    assert b.accepting(clock[0]) and b.paused
    assert adm.queue_depth == 13
    assert adm.end_pause(b, clock[0]) is True
    done = await asyncio.gather(*waiters)
    assert len(done) == 13 and all(r.backend is b for r in done)
    assert not paused(b) and adm.queue_depth == 0
    for r in done:
        r.release()
    assert b.reserved_tokens == 0 and b.in_flight == 0


async def test_end_pause_leaves_untimed_and_unexpired_pauses():
    from kvgateway.core.backends import PauseReason

    b = backend("a")
    adm = make([b])
    b.paused, b.pause_reason, b.paused_until = True, PauseReason.PREEMPTING, 10.0
    assert adm.end_pause(b, 9.0) is False and b.paused
    b.pause_reason, b.paused_until = PauseReason.KV_FULL, 0.0
    assert adm.end_pause(b, 100.0) is False and b.paused and not b.accepting(100.0)


async def test_reservation_is_released_on_every_way_out_of_its_block():
    b = backend("a", kv=10_000)
    adm = make([b])
    async with adm.reserve(demand(100, 100), 1.0) as r:
        assert b.in_flight == 1 and r.backend is b
    assert b.in_flight == 0 and b.reserved_tokens == 0
    with pytest.raises(RuntimeError):
        async with adm.reserve(demand(100, 100), 1.0):
            raise RuntimeError("boom")
    assert b.in_flight == 0 and b.reserved_tokens == 0
    task = asyncio.create_task(_hold(adm))
    await asyncio.sleep(0.01)
    assert b.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.in_flight == 0 and b.reserved_tokens == 0


async def _hold(adm):
    async with adm.reserve(demand(100, 100), 1.0):
        await asyncio.sleep(10)


async def test_speculative_lookahead_is_reserved_per_sequence():
    import dataclasses

    b = backend("a", kv=10_000)
    b.config = dataclasses.replace(b.config, num_speculative_tokens=5)
    adm = make([b])
    r = await adm.admit(demand(100, 100, n=2), 1.0)
    # two sequences of 208 tokens, each with one more 16-token block of lookahead slots
    assert r.tokens == b.reserved_tokens == 2 * 208 + 2 * 16
    r.release()
    assert b.reserved_tokens == 0


async def test_release_waits_for_the_kv_connector_and_for_an_abort_to_land():
    import dataclasses

    b = backend("a", kv=10_000)
    b.config = dataclasses.replace(b.config, release_delay_s=0.05)
    adm = make([b])
    async with adm.reserve(demand(100, 100), 1.0):
        pass
    assert b.in_flight == 1  # blocks still being transferred out
    await asyncio.sleep(0.08)
    assert b.in_flight == 0 and b.reserved_tokens == 0
    # A client gone mid-request: held until the node's abort has landed.
    b.config = dataclasses.replace(b.config, release_delay_s=0.0)
    adm = make([b], abort_delay=0.05)
    task = asyncio.create_task(_hold(adm))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.in_flight == 1
    await asyncio.sleep(0.08)
    assert b.in_flight == 0 and b.reserved_tokens == 0


async def test_a_request_that_ran_to_its_bound_holds_its_blocks_while_they_move_out():
    """A projected request whose last report reached its max_tokens has ended; with a
    KV connector's release delay its blocks are still on the node, so a newcomer that
    fits only in their room waits until the delay is over."""
    import dataclasses

    b = backend("a", kv=64 * 16, seqs=64)
    b.config = dataclasses.replace(b.config, release_delay_s=0.05)
    adm = admission_over([b])
    first = adm.try_admit(dataclasses.replace(demand(16 * 40, 20), projected=True))
    assert isinstance(first, Reservation)
    first.progress(20)  # its last chunk: ran to max_tokens
    adm.release_after(first, gone=False)
    assert b.projection.current_blocks(16) >= 41
    later = dataclasses.replace(demand(16 * 40, 20), projected=True)
    assert not isinstance(adm.try_admit(later), Reservation)
    await asyncio.sleep(0.08)
    assert first.released and isinstance(adm.try_admit(later), Reservation)


async def test_a_waiter_that_gives_up_offers_the_room_it_held_back_to_those_behind():
    # A big request waits for room; a small one that fits queues behind it (FIFO). When
    # the big one times out (or its client goes), the small one must be admitted at
    # once, not at some later release or its own timeout.
    b = backend("a", kv=10_000, seqs=64)
    adm = admission_over([b], queue_size=100)
    held = await adm.admit(demand(4900, 100), 1.0)
    big = asyncio.create_task(adm.admit(demand(6900, 100), 0.2))
    await asyncio.sleep(0)
    small = asyncio.create_task(adm.admit(demand(2900, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    with pytest.raises(Saturated):
        await big
    r = await asyncio.wait_for(small, 0.5)
    # The same when the waiter ahead is cancelled.
    big2 = asyncio.create_task(adm.admit(demand(6900, 100), 5.0))
    await asyncio.sleep(0)
    small2 = asyncio.create_task(adm.admit(demand(1000, 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    big2.cancel()
    r2 = await asyncio.wait_for(small2, 0.5)
    for x in (held, r, r2):
        adm.release(x)
    assert b.reserved_tokens == 0 and adm.queue_depth == 0


async def test_a_request_counts_as_unstarted_on_its_node_until_its_first_report() -> None:
    b = backend("a")
    adm = admission_over([b])
    r1 = await adm.admit(demand(100), 1.0)
    r2 = await adm.admit(demand(100), 1.0)
    assert b.unstarted == 2
    r1.progress(1)
    r1.progress(2)
    assert b.unstarted == 1
    adm.release(r1)
    adm.release(r2)  # never reported: released unstarted
    assert b.unstarted == 0


async def test_a_newcomer_projected_past_its_deadline_is_told_the_wait_even_when_full():
    """A newcomer whose soonest projected room is ~8,000 s away gets that wait as its
    Retry-After, whether or not the queue has room for it (not 1 s when it is full)."""
    import dataclasses

    def long_one() -> Demand:
        return dataclasses.replace(demand(1_000, 32_000), projected=True)

    for queue_size in (2, 1):  # room for the newcomer, then none
        node = backend("o1", max_model_len=131_072, kv=40_000)
        node.step_s = 0.25
        adm = admission_over([node], queue_size=queue_size)
        first = await adm.admit(long_one(), 1.0)
        adm.progress(first, 1)  # running: the soonest room is known
        queued = asyncio.create_task(adm.admit(long_one(), 100_000.0))
        await asyncio.sleep(0)
        with pytest.raises(Saturated) as err:
            await adm.admit(long_one(), 5.0)
        assert err.value.retry_after is not None and err.value.retry_after > 1_000
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        adm.release(first)
