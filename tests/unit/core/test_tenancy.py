"""Classes, fair queuing on KV tokens, tenant gates and displacement (no sockets)."""

import asyncio
import dataclasses
import random
from collections.abc import Callable

import pytest

from kvgateway.config.model import AuthConfig, ClassConfig, TenantConfig, TenantLimits
from kvgateway.core.demand import Demand
from kvgateway.core.reservation import Reservation
from kvgateway.core.tenancy import CLASS_FLOOR, MAX_CONCURRENT, MAX_KV_SHARE, Tenancy
from kvgateway.errors import Saturated
from tests.support.backends import admission_over, backend, demand

CLASSES = (ClassConfig("interactive"), ClassConfig("standard"), ClassConfig("batch"))


def auth(*tenants: TenantConfig, classes=CLASSES, aging_s=5.0) -> AuthConfig:
    return AuthConfig(keys=tenants, classes=classes, aging_s=aging_s)


def tenant(name, klass="standard", weight=1.0, **limits) -> TenantConfig:
    return TenantConfig(name, (f"k-{name}",), klass, weight, TenantLimits(**limits))


def served_tokens(tenancy: Tenancy, sizes: dict[str, list[int]], total: int) -> dict[str, int]:
    """Two always-backlogged tenants served one request at a time in tag order."""
    rng = random.Random(3)
    got = dict.fromkeys(sizes, 0)
    heads = {n: (tenancy.ticket(n, s := rng.choice(sizes[n])), s) for n in sizes}
    while sum(got.values()) < total:
        name = min(heads, key=lambda n: heads[n][0].start)
        ticket, size = heads[name]
        tenancy.granted(ticket, size)
        tenancy.released(ticket, size)
        got[name] += size
        heads[name] = (tenancy.ticket(name, s := rng.choice(sizes[name])), s)
    return got


def test_equal_weights_share_kv_tokens_not_requests():
    t = Tenancy(lambda: auth(tenant("big"), tenant("small")))
    got = served_tokens(t, {"big": [4000, 8000], "small": [100, 300]}, 2_000_000)
    assert abs(got["big"] - got["small"]) <= 0.1 * max(got.values())


def test_weights_set_the_ratio():
    t = Tenancy(lambda: auth(tenant("two", weight=2.0), tenant("one")))
    got = served_tokens(t, {"two": [500, 1500], "one": [500, 1500]}, 2_000_000)
    assert 1.8 <= got["two"] / got["one"] <= 2.2


def test_classes_order_waiters_and_aging_lifts_a_waiter_one_class_per_period():
    t = Tenancy(lambda: auth(tenant("i", "interactive"), tenant("b", "batch")))
    b = t.ticket("b", 100)
    i = t.ticket("i", 100)
    assert i.key(10.0, 10.0, 5.0) < b.key(10.0, 10.0, 5.0)
    assert b.key(0.0, 4.9, 5.0)[0] == 2 and b.key(0.0, 5.0, 5.0)[0] == 1
    # Waiting two periods brings a batch request level with interactive; it arrived first.
    assert b.key(0.0, 10.0, 5.0) < i.key(10.0, 10.0, 5.0)
    # Interactive waiters are never raised (nothing above them): they keep fair queuing.
    assert i.key(0.0, 100.0, 5.0) == i.key(100.0, 100.0, 5.0)


def test_a_raised_waiter_goes_first_even_if_its_tenant_used_far_more():
    t = Tenancy(lambda: auth(tenant("i", "interactive"), tenant("b", "batch")))
    for _ in range(50):  # the batch tenant's tags run far ahead of interactive's
        t.granted(t.ticket("b", 10_000), 10_000)
    b = t.ticket("b", 10_000)
    i = t.ticket("i", 100)
    assert b.start > 100 * i.start + 1000
    assert b.key(0.0, 10.0, 5.0) < i.key(9.0, 10.0, 5.0)


def test_gates_concurrency_kv_share_and_class_floor():
    cfg = auth(
        tenant("c", max_concurrent=1),
        tenant("s", max_kv_share=0.25),
        tenant("i", "interactive"),
        tenant("b", "batch"),
        classes=(ClassConfig("interactive", floor_share=0.3), ClassConfig("batch")),
    )
    t = Tenancy(lambda: cfg)
    assert t.gate("c", 100, 10_000) is None
    t.granted(t.ticket("c", 100), 100)
    assert t.gate("c", 100, 10_000) == MAX_CONCURRENT
    # One request of any size may run; a second may not take the tenant past its share.
    assert t.gate("s", 5000, 10_000) is None
    t.granted(t.ticket("s", 2000), 2000)
    assert t.gate("s", 400, 10_000) is None and t.gate("s", 600, 10_000) == MAX_KV_SHARE
    # 2100 held; interactive reserves 3000 it does not use: batch may take up to 4900 more.
    assert t.gate("b", 4900, 10_000) is None and t.gate("b", 5000, 10_000) == CLASS_FLOOR
    assert t.gate("i", 7900, 10_000) is None  # a class's own floor never holds it back


def make(backends, cfg: AuthConfig, queue_size=100):
    clock = [0.0]
    return admission_over(
        backends,
        queue_size=queue_size,
        clock=lambda: clock[0],
        tenancy=Tenancy(lambda: cfg),
        budget=lambda: sum(b.budget_tokens for b in backends),
    ), clock


def of(name, prompt, output=100):
    return dataclasses.replace(demand(prompt, output), tenant=name)


async def test_an_interactive_newcomer_passes_queued_batch_but_not_its_own_class():
    b = backend("a", kv=1024)
    cfg = auth(tenant("i", "interactive"), tenant("i2", "interactive"), tenant("b", "batch"))
    adm, _ = make([b], cfg)
    held = await adm.admit(of("b", 300), 1.0)  # 416 tokens
    batch = asyncio.create_task(adm.admit(of("b", 600), 5.0))  # 704: does not fit
    await asyncio.sleep(0)
    assert adm.queue_depth == 1
    # 416 tokens fit beside the held request: batch's claim does not stop interactive.
    fast = await asyncio.wait_for(adm.admit(of("i", 300), 5.0), 0.5)
    adm.release(fast)
    # Same class: a waiting interactive request holds its claim against a later one.
    adm.release(held)
    await batch  # now runs (704)
    first = asyncio.create_task(adm.admit(of("i", 600), 5.0))
    await asyncio.sleep(0)
    second = asyncio.create_task(adm.admit(of("i", 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 2 and not second.done()  # behind its own earlier request
    # A tenant of the class that has used nothing yet is ahead of i's waiter (fair
    # queuing): it takes the room that is left.
    light = await asyncio.wait_for(adm.admit(of("i2", 100), 5.0), 0.5)
    assert not first.done() and not second.done()
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    adm.release(light)
    adm.release(batch.result())
    assert b.reserved_tokens == 0 and adm.queue_depth == 0


async def test_a_full_queue_refuses_the_lowest_class_first():
    b = backend("a", kv=512)
    cfg = auth(tenant("i", "interactive"), tenant("b", "batch"))
    adm, _ = make([b], cfg, queue_size=2)
    held = await adm.admit(of("b", 300), 1.0)
    batch = [asyncio.create_task(adm.admit(of("b", 300), 5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    inter = asyncio.create_task(adm.admit(of("i", 300), 5.0))
    await asyncio.sleep(0)
    # The last batch waiter was displaced with a 429 that says why.
    with pytest.raises(Saturated) as err:
        await batch[1]
    assert err.value.code == "displaced_by_priority" and err.value.status == 429
    assert adm.queue_depth == 2
    # Interactive is served before the earlier batch waiter when room appears.
    adm.release(held)
    r = await asyncio.wait_for(inter, 0.5)
    assert r.ticket is not None and r.ticket.tenant == "i" and not batch[0].done()
    # Interactive cannot displace interactive: a full queue of its own class is a 429 at once.
    more = [asyncio.create_task(adm.admit(of("i", 300), 5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Saturated):
        await batch[0]  # displaced by the second of them
    with pytest.raises(Saturated) as full:
        await asyncio.wait_for(adm.admit(of("i", 300), 5.0), 0.5)
    assert full.value.code == "fleet_saturated"
    for task in more:
        task.cancel()
    await asyncio.gather(*more, return_exceptions=True)
    adm.release(r)
    assert b.reserved_tokens == 0 and adm.queue_depth == 0


async def test_a_waiter_at_its_concurrency_limit_does_not_hold_up_others_and_times_out_named():
    b = backend("a", kv=4096)
    adm, _ = make([b], auth(tenant("c", max_concurrent=1), tenant("o")))
    held = await adm.admit(of("c", 100), 1.0)
    gated = asyncio.create_task(adm.admit(of("c", 100), 0.1))
    await asyncio.sleep(0)
    other = await asyncio.wait_for(adm.admit(of("o", 100), 1.0), 0.5)
    with pytest.raises(Saturated) as err:
        await gated
    assert err.value.code == "tenant_max_concurrent" and "'c'" in err.value.message
    # Once the tenant's request ends its next one is admitted from the queue.
    again = asyncio.create_task(adm.admit(of("c", 100), 5.0))
    await asyncio.sleep(0)
    assert not again.done()
    adm.release(held)
    adm.release(await asyncio.wait_for(again, 0.5))
    adm.release(other)
    assert b.reserved_tokens == 0 and b.in_flight == 0


async def test_a_waiter_held_by_its_own_limit_claims_no_backend_until_the_limit_opens():
    """A request parked by its tenant's own limit claims no backend until the limit
    opens: were it listed as waiting for every backend it could use, a shared ledger
    would put this replica in their wait sets, and every other replica's new requests
    there would queue until the next heartbeat (~2.5 s each), on an idle node."""
    b = backend("a", kv=4096)
    adm, _ = make([b], auth(tenant("c", max_concurrent=1), tenant("o")))
    held = await adm.admit(of("c", 100), 1.0)
    parked = asyncio.create_task(adm.admit(of("c", 100), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1
    assert not adm.waiting_for("a") and adm.waiting_backends() == set()
    adm.release(held)  # the limit opens: it claims, and is admitted on the released node
    r = await asyncio.wait_for(parked, 0.5)
    assert r.backend is b and not adm.waiting_for("a")
    adm.release(r)
    assert b.reserved_tokens == 0 and b.in_flight == 0


async def test_a_limit_that_opens_by_one_lets_one_parked_request_through():
    """Tenant e (max_concurrent 1) has two parked; when its request ends (its room going
    to q's waiter), one is let through and the other stays parked, so another tenant's
    request still queues. Both let through at once would fill the shared queue (3 of 3,
    two of them e's, which can run one at a time): a 429 fleet_saturated for the other."""
    b = backend("a", kv=8192, max_model_len=2048, seqs=1)
    cfg = auth(tenant("e", max_concurrent=1), tenant("q"), tenant("z"))
    adm, _ = make([b], cfg, queue_size=3)
    running = await adm.admit(of("e", 100, 10), 1.0)
    qs = [asyncio.create_task(adm.admit(of("q", 100, 10), 30.0)) for _ in range(2)]
    await asyncio.sleep(0)
    parked = [asyncio.create_task(adm.admit(of("e", 100, 10), 30.0)) for _ in range(2)]
    await asyncio.sleep(0)
    adm.release(running)
    await asyncio.sleep(0)
    # q's first request runs; q's second and one of e's wait for room, one of e's parked.
    assert adm.queue_depth == 3
    assert sum(1 for t in parked if not t.done()) == 2
    z = asyncio.create_task(adm.admit(of("z", 100, 10), 30.0))
    await asyncio.sleep(0.05)
    assert not z.done()  # queued (the shared queue held 2 of 3 before z), not refused
    for t in [*parked, *qs, z]:
        t.cancel()
    for r in await asyncio.gather(*parked, *qs, z, return_exceptions=True):
        if not isinstance(r, BaseException):
            adm.release(r)
    assert b.reserved_tokens == 0 and b.in_flight == 0


async def test_a_request_the_class_floors_can_never_let_through_is_refused_at_once():
    """interactive keeps 30% of 10,000 tokens: a 7,408-token batch request can never
    pass, and is refused at once with no Retry-After, not after its whole queue timeout
    with one (which clients would retry for ever); the same request from an interactive
    tenant runs."""
    b = backend("a", kv=10_000, max_model_len=10_000)
    classes = (ClassConfig("interactive", floor_share=0.3), ClassConfig("batch"))
    adm, _ = make([b], auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes))
    big = b.budget_tokens * 3 // 4
    with pytest.raises(Saturated) as info:
        await asyncio.wait_for(adm.admit(of("b", big - 16, 16), 30.0), 0.5)
    assert info.value.code == "tenant_class_floor" and info.value.retry_after is None
    assert "never" in info.value.message
    r = await adm.admit(of("i", big - 16, 16), 1.0)
    adm.release(r)
    # One that fits beside the floor still waits for it to free.
    small = await adm.admit(of("b", 1000, 16), 1.0)
    adm.release(small)


async def test_a_node_down_for_a_moment_does_not_make_a_request_impossible():
    """ "Never" is judged on the whole fleet, not on the nodes usable at the time: with
    one of two down, a batch request that fits beside the floors on the whole fleet
    waits for the node instead of being refused for good."""
    a, b = backend("a", kv=10_000), backend("b", kv=10_000)
    classes = (ClassConfig("interactive", floor_share=0.3), ClassConfig("batch"))
    cfg = auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes)
    adm = admission_over(
        [a, b],
        queue_size=100,
        tenancy=Tenancy(lambda: cfg),
        budget=lambda: sum(x.budget_tokens for x in (a, b) if x.usable),
        capacity=lambda: a.budget_tokens + b.budget_tokens,
    )
    b.healthy = False
    waiting = asyncio.create_task(adm.admit(of("b", 7000, 16), 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # waits for the node, not refused
    b.healthy = True
    adm.rebalance()
    adm.release(await asyncio.wait_for(waiting, 1.0))


async def test_two_equal_tenants_flooding_one_class_get_kv_tokens_within_ten_percent():
    b = backend("a", kv=8192, seqs=64)
    adm, _ = make([b], auth(tenant("big"), tenant("small")), queue_size=1000)
    served = {"big": 0, "small": 0}
    stop = asyncio.Event()

    async def client(name: str, prompt: int) -> None:
        while not stop.is_set():
            r = await adm.admit(of(name, prompt, 100), 10.0)
            served[name] += r.tokens
            await asyncio.sleep(0.001 * r.tokens / 100)  # the work takes time per token
            adm.release(r)

    tasks = [asyncio.create_task(client("big", 2000)) for _ in range(6)]
    tasks += [asyncio.create_task(client("small", 200)) for _ in range(30)]
    await asyncio.sleep(1.5)
    stop.set()
    await asyncio.gather(*tasks)
    assert abs(served["big"] - served["small"]) <= 0.1 * max(served.values()), served
    assert b.reserved_tokens == 0


async def test_random_cancellations_and_displacements_leave_no_tenant_use_behind():
    rnd = random.Random(11)
    backends = [backend("a", kv=4096, seqs=4), backend("b", kv=4096, seqs=4, tier_index=1)]
    cfg = auth(
        tenant("i", "interactive", max_concurrent=3),
        tenant("s", weight=2.0, max_kv_share=0.4),
        tenant("b", "batch"),
        classes=(
            ClassConfig("interactive", floor_share=0.2),
            ClassConfig("standard"),
            ClassConfig("batch"),
        ),
        aging_s=0.01,
    )
    adm, clock = make(backends, cfg, queue_size=40)
    tenancy = adm._tenancy
    outcomes: dict[str, int] = {}

    async def one():
        name = rnd.choice("isb")
        try:
            r = await adm.admit(of(name, rnd.randint(10, 1500), rnd.randint(1, 500)), 0.5)
        except Saturated as err:
            outcomes[err.code] = outcomes.get(err.code, 0) + 1
            return
        try:
            await asyncio.sleep(rnd.random() * 0.01)
            clock[0] += 0.001
        finally:
            adm.release(r)
        outcomes["ok"] = outcomes.get("ok", 0) + 1

    tasks = [asyncio.create_task(one()) for _ in range(300)]
    for _ in range(30):
        await asyncio.sleep(0.002)
        for t in rnd.sample(tasks, 8):
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # Some were served and some displaced (how many depends on the machine's speed: the
    # waits and cancellations are real time); whatever the mix, nothing is left behind.
    assert outcomes.get("ok", 0) >= 10 and outcomes.get("displaced_by_priority", 0) > 0, outcomes
    assert adm.queue_depth == 0
    assert not adm.waiting_backends()
    assert not +tenancy.tokens and not +tenancy.requests and not +tenancy.class_tokens
    for b in backends:
        assert (b.reserved_tokens, b.reserved_seqs, b.in_flight) == (0, 0, 0)


async def test_aging_serves_a_batch_waiter_despite_a_steady_interactive_stream():
    b = backend("a", kv=1024)
    adm, clock = make([b], auth(tenant("i", "interactive"), tenant("b", "batch"), aging_s=1.0))
    held = [await adm.admit(of("i", 400), 1.0) for _ in range(2)]  # 416 tokens each: full
    batch = asyncio.create_task(adm.admit(of("b", 400), 60.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1
    served_before_batch = 0
    for _ in range(20):
        nxt = asyncio.create_task(adm.admit(of("i", 400), 60.0))
        await asyncio.sleep(0)
        clock[0] += 0.5
        adm.release(held.pop(0))
        await asyncio.sleep(0)
        if batch.done():
            break
        held.append(await asyncio.wait_for(nxt, 0.5))
        served_before_batch += 1
    assert batch.done(), "the batch waiter starved"
    assert 1 <= served_before_batch <= 4  # interactive went first until batch had aged
    nxt.cancel()  # still queued behind the batch request
    await asyncio.gather(nxt, return_exceptions=True)
    for r in (*held, batch.result()):
        adm.release(r)
    assert b.reserved_tokens == 0 and adm.queue_depth == 0


async def test_a_tenant_limit_opened_by_a_release_elsewhere_admits_its_waiter_at_once():
    # The tenant's running request is on the small node; its next one only fits the
    # large node. Its end opens the concurrency limit: the waiter must not wait for some
    # room to appear on the large node (it was idle all along) or time out.
    small = backend("s", max_model_len=2048, kv=8192)
    large = backend("l", tier="large", tier_index=1, max_model_len=32768, kv=65536)
    adm, _ = make([small, large], auth(tenant("c", max_concurrent=1), tenant("o")))
    held = await adm.admit(of("c", 100), 1.0)
    assert held.backend is small
    long = asyncio.create_task(adm.admit(of("c", 10_000), 5.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 1
    adm.release(held)
    r = await asyncio.wait_for(long, 0.5)
    assert r.backend is large and adm.queue_depth == 0
    adm.release(r)
    assert small.reserved_tokens == large.reserved_tokens == 0


async def test_a_storm_of_cancellations_walks_the_queue_once_and_serves_who_fits():
    # 300 big waiters queued ahead of a small one that fits the room left; all 300 are
    # cancelled in one instant (clients gone, or one timeout wave). The small one is
    # served at once, and the 300 clean-ups do not each walk what is left of the queue
    # (every walk reads the clock once: counted).
    b = backend("a", kv=4096, max_model_len=4096, seqs=1000)
    cfg = auth(tenant("x"), tenant("y", "batch"))
    reads = [0]
    adm, clock = make([b], cfg, queue_size=1000)

    def counted() -> float:
        reads[0] += 1
        now: float = clock[0]
        return now

    adm._clock = counted
    held = await adm.admit(of("x", 2500, 100), 1.0)  # 2,600 of 4,096 used
    big = [asyncio.create_task(adm.admit(of("x", 3000, 100), 30.0)) for _ in range(300)]
    await asyncio.sleep(0)
    small = asyncio.create_task(adm.admit(of("y", 1000, 100), 30.0))
    await asyncio.sleep(0)
    assert adm.queue_depth == 301 and not small.done()  # served after x's (class order)
    reads[0] = 0
    for t in big:
        t.cancel()
    await asyncio.gather(*big, return_exceptions=True)
    r = await asyncio.wait_for(small, 0.5)
    assert adm.queue_depth == 0
    assert reads[0] < 20, reads[0]  # one walk per backend, not one per cancelled waiter
    adm.release(r)
    adm.release(held)
    assert b.reserved_tokens == 0


async def test_waiters_held_by_their_own_tenant_limit_do_not_fill_the_shared_queue():
    # queue_size 2. Tenant e (max_concurrent 1) parks two requests behind its own limit;
    # another tenant's request that must wait for room still queues (no 429
    # fleet_saturated), and e's third is refused at once as e's own limit, not the fleet.
    b = backend("a", kv=2048, max_model_len=2048)
    adm, _ = make([b], auth(tenant("e", "batch", max_concurrent=1), tenant("q")), queue_size=2)
    running = await adm.admit(of("e", 1000, 100), 1.0)
    parked = [asyncio.create_task(adm.admit(of("e", 100, 10), 5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    big = await adm.admit(of("q", 800, 100), 1.0)  # the node is nearly full now
    waiting = asyncio.create_task(adm.admit(of("q", 500, 100), 5.0))
    await asyncio.sleep(0)
    assert not waiting.done() and adm.queue_depth == 3
    with pytest.raises(Saturated) as info:
        await adm.admit(of("e", 100, 10), 5.0)
    assert info.value.code == "tenant_max_concurrent"
    adm.release(big)
    q = await asyncio.wait_for(waiting, 0.5)
    adm.release(q)
    adm.release(running)
    for task in parked:  # one at a time: e runs one request at most
        adm.release(await asyncio.wait_for(task, 0.5))
    assert b.reserved_tokens == 0 and adm.queue_depth == 0


async def test_a_full_queue_never_displaces_a_request_parked_behind_its_own_limit():
    # Refusing a parked request frees no place in the queue for room: the newcomer would
    # be queued anyway and the shared queue grow past queue_size (32 with queue_size 2),
    # while every parked request would be needlessly refused as displaced_by_priority.
    b = backend("a", kv=2048, max_model_len=2048)
    cfg = auth(tenant("i", "interactive"), tenant("e", "batch", max_concurrent=1), tenant("q"))
    adm, _ = make([b], cfg, queue_size=2)
    running = await adm.admit(of("e", 100, 10), 1.0)
    big = await adm.admit(of("q", 1700, 100), 1.0)
    waiting = [asyncio.create_task(adm.admit(of("q", 500, 100), 30.0)) for _ in range(2)]
    await asyncio.sleep(0)
    tasks = []
    for _ in range(10):
        tasks.append(asyncio.create_task(adm.admit(of("e", 100, 10), 30.0)))  # parks
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(adm.admit(of("i", 500, 100), 30.0)))  # needs room
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    room = sum(1 for w in adm._queue.waiters if w.gated is None)
    assert room <= 2, room
    parked = [t for t in tasks[0::2] if t.done()]
    assert not any(
        isinstance(exc := t.exception(), Saturated) and exc.code == "displaced_by_priority"
        for t in parked
    )
    for t in tasks + waiting:
        t.cancel()
    await asyncio.gather(*tasks, *waiting, return_exceptions=True)
    adm.release(big)
    adm.release(running)
    assert b.reserved_tokens == 0 and adm.queue_depth == 0


async def test_requests_refused_or_cancelled_do_not_push_their_tenant_back():
    # 50 requests refused at once (the tenant's parking full) do not advance its
    # fair-queuing tag as if served, which would queue its next request behind others'
    # later work.
    b = backend("a", kv=2048, max_model_len=2048, seqs=1)
    t = Tenancy(lambda: auth(tenant("e", max_concurrent=1), tenant("o")))
    adm = admission_over(
        [b], queue_size=1, tenancy=t, budget=lambda: b.budget_tokens, clock=lambda: 0.0
    )
    running = await adm.admit(of("e", 100, 10), 1.0)
    parked = asyncio.create_task(adm.admit(of("e", 100, 10), 30.0))
    await asyncio.sleep(0)
    for _ in range(50):
        with pytest.raises(Saturated):
            await adm.admit(of("e", 1000, 100), 5.0)
    parked.cancel()
    await asyncio.gather(parked, return_exceptions=True)
    adm.release(running)
    # Served: one request of 112 tokens. Its next tag starts there, not at 55,424.
    assert t.ticket("e", 100).start == running.tokens == 112


async def test_a_class_floor_keeps_sequence_slots_free_where_slots_bind_first():
    """Nodes whose max_num_seqs binds before their KV: a flood of batch requests takes
    every slot but the interactive floor's, so an interactive request is admitted at
    once instead of queuing behind batch work."""
    nodes = [backend("a", kv=1_000_000, seqs=4), backend("b", kv=1_000_000, seqs=4)]
    classes = (ClassConfig("interactive", floor_share=0.25), ClassConfig("batch"))
    cfg = auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes)
    adm = admission_over(
        nodes,
        queue_size=100,
        tenancy=Tenancy(lambda: cfg),
        budget=lambda: sum(x.budget_tokens for x in nodes),
        slots=lambda: sum(x.max_num_seqs for x in nodes),
    )
    batch = [await adm.admit(of("b", 100), 1.0) for _ in range(6)]
    flood = asyncio.create_task(adm.admit(of("b", 100), 5.0))
    await asyncio.sleep(0.01)
    assert not flood.done()  # 2 of the 8 slots are the interactive floor's
    interactive = [await asyncio.wait_for(adm.admit(of("i", 100), 1.0), 0.5) for _ in range(2)]
    adm.release(interactive.pop())
    await asyncio.sleep(0.01)
    assert not flood.done()  # interactive holds 1 of its 2: the freed slot stays kept
    adm.release(batch.pop())
    adm.release(await asyncio.wait_for(flood, 1.0))
    for r in batch + interactive:
        adm.release(r)
    assert sum(x.reserved_seqs for x in nodes) == 0


async def test_a_class_floor_keeps_its_share_of_each_nodes_slots():
    """The floor holds on every node, not only in the fleet: batch never fills a node
    past its share less the interactive floor's, so interactive requests can go to
    every node (their prefills do not all queue on the one node batch left free), and
    batch kept off every node waits behind its class's floor, claiming none."""
    nodes = [backend("a", kv=1_000_000, seqs=8), backend("b", kv=1_000_000, seqs=8)]
    classes = (ClassConfig("interactive", floor_share=0.25), ClassConfig("batch"))
    t = Tenancy(lambda: auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes))
    adm = admission_over(
        nodes,
        queue_size=100,
        tenancy=t,
        budget=lambda: sum(x.budget_tokens for x in nodes),
        slots=lambda: sum(x.max_num_seqs for x in nodes),
    )
    # Twelve batch requests: 6 on each node, whatever order routing fills them in.
    batch = [await adm.admit(of("b", 100), 1.0) for _ in range(12)]
    assert sorted(x.reserved_seqs for x in nodes) == [6, 6]
    flood = asyncio.create_task(adm.admit(of("b", 100), 5.0))
    await asyncio.sleep(0.01)
    assert not flood.done()
    # Kept off every node by the floors, it claims none (no waiting mark anywhere).
    assert [w.gated for w in adm._queue.waiters] == [CLASS_FLOOR]
    assert adm.waiting_backends() == set()
    # Interactive gets both nodes' kept slots at once.
    interactive = [await asyncio.wait_for(adm.admit(of("i", 100), 1.0), 0.5) for _ in range(4)]
    assert sorted(r.backend.name for r in interactive) == ["a", "a", "b", "b"]
    # A slot interactive frees on a node stays kept there while it holds less than 2.
    adm.release(interactive.pop())
    await asyncio.sleep(0.01)
    assert not flood.done()
    adm.release(batch.pop())
    adm.release(await asyncio.wait_for(flood, 1.0))
    for r in batch + interactive:
        adm.release(r)
    assert sum(x.reserved_seqs for x in nodes) == 0
    assert all(not any(c.values()) for c in t.node_seqs.values())


async def test_a_request_waits_behind_an_older_one_other_replicas_keep_behind_the_floors():
    """Another replica's request of the same class and model has waited behind the
    floors longer: one here waits behind it (gated, claiming nothing) though there is
    room, until that one is served; other classes and models are not held."""
    nodes = [backend("a", kv=1_000_000, seqs=8)]
    classes = (ClassConfig("interactive", floor_share=0.25), ClassConfig("batch"))
    t = Tenancy(lambda: auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes))
    adm = admission_over(nodes, queue_size=100, tenancy=t, budget=lambda: 10**6, slots=lambda: 8)
    t.elsewhere.floor_waits = {("batch", "m"): 1.5, ("batch", "other-model"): 9.0}
    held = asyncio.create_task(adm.admit(of("b", 100), 5.0))
    await asyncio.sleep(0.01)
    assert not held.done() and [w.gated for w in adm._queue.waiters] == [CLASS_FLOOR]
    assert adm.waiting_backends() == set()
    interactive = await asyncio.wait_for(adm.admit(of("i", 100), 1.0), 0.5)
    t.elsewhere.floor_waits = {}
    adm.reopen("")
    batch = await asyncio.wait_for(held, 1.0)
    adm.release(batch)
    adm.release(interactive)


def test_kept_slots_are_each_floor_less_what_its_class_holds_on_the_node():
    classes = (
        ClassConfig("interactive", floor_share=0.25),
        ClassConfig("standard", floor_share=0.125),
        ClassConfig("batch"),
    )
    t = Tenancy(lambda: auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes))
    kept = t.kept_on("batch")
    assert kept is not None and kept("n", 16) == 6.0  # 4 + 2, nothing held on n yet
    t.granted(t.ticket("i", 10), 10, 3, "n")
    assert kept("n", 16) == 3.0 and kept("m", 16) == 6.0
    t.granted(t.ticket("i", 10), 10, 3, "n")  # above its floor: keeps nothing more
    assert kept("n", 16) == 2.0
    standard_kept = t.kept_on("standard")
    assert standard_kept is not None and standard_kept("n", 16) == 0.0
    lone = Tenancy(lambda: auth(tenant("i", "interactive"), classes=classes[:1]))
    assert lone.kept_on("interactive") is None


def test_what_other_replicas_hold_counts_against_the_tenants_limits():
    """With a shared ledger a tenant's limits are judged on its holdings across
    replicas: this replica's plus what the others hold for it."""
    t = Tenancy(lambda: auth(tenant("a", max_concurrent=3, max_kv_share=0.5)))
    ticket = t.ticket("a", 100)
    t.granted(ticket, 100)
    assert t.gate("a", 100, 1000) is None
    t.elsewhere.requests["a"] = 2
    assert t.gate("a", 100, 1000) == MAX_CONCURRENT
    t.elsewhere.requests["a"] = 1
    t.elsewhere.tokens["a"] = 350
    assert t.gate("a", 100, 1000) == MAX_KV_SHARE
    t.elsewhere.tokens["a"] = 300
    assert t.gate("a", 100, 1000) is None
    # Holding nothing anywhere, one request of any size may run; held elsewhere, not.
    t.released(ticket, 100)
    t.elsewhere.requests["a"] = t.elsewhere.tokens["a"] = 0
    assert t.gate("a", 900, 1000) is None
    t.elsewhere.tokens["a"] = 1
    assert t.gate("a", 900, 1000) == MAX_KV_SHARE


def test_class_floors_count_what_other_replicas_hold_in_each_class():
    """A floor keeps what its class holds nowhere: batch held on another replica eats
    into the room this one may give batch, interactive held there fills the floor."""
    classes = (ClassConfig("interactive", floor_share=0.2), ClassConfig("batch"))
    t = Tenancy(lambda: auth(tenant("i", "interactive"), tenant("b", "batch"), classes=classes))
    # 100 slots: 20 kept for interactive; 70 batch sequences run on another replica.
    t.elsewhere.class_seqs["batch"] = 70
    assert t.gate("b", 1, 10**9, seqs=10, slots=100) is None
    assert t.gate("b", 1, 10**9, seqs=11, slots=100) == CLASS_FLOOR
    # Interactive holding its floor elsewhere: the floor keeps nothing more.
    t.elsewhere.class_seqs["interactive"] = 20
    assert t.gate("b", 1, 10**9, seqs=30, slots=100) is None
    t.elsewhere.class_seqs["interactive"] = 5  # 15 still kept: 70 + 5 + 10 + 15 = 100
    assert t.gate("b", 1, 10**9, seqs=10, slots=100) is None
    assert t.gate("b", 1, 10**9, seqs=11, slots=100) == CLASS_FLOOR
    # In a ledger's fallback the others hold all but this replica's share, unclassed.
    t.elsewhere.class_seqs.clear()
    t.elsewhere.unclassed_seqs = 50
    assert t.gate("b", 1, 10**9, seqs=30, slots=100) is None
    assert t.gate("b", 1, 10**9, seqs=31, slots=100) == CLASS_FLOOR


FLOORED = (ClassConfig("interactive", floor_share=0.25), ClassConfig("batch"))


async def test_sequences_no_node_holds_beside_its_slot_floor_are_refused_at_once():
    """The interactive floor keeps a quarter of each 4-slot node: a batch request of 4
    sequences can never run on either, however idle, and is refused at once with no
    Retry-After (not after its whole queue timeout, with one clients retry for ever)."""
    nodes = [backend("a", kv=100_000, seqs=4), backend("b", kv=100_000, seqs=4)]
    adm, _ = make(nodes, auth(tenant("i", "interactive"), tenant("b", "batch"), classes=FLOORED))
    started = asyncio.get_running_loop().time()
    with pytest.raises(Saturated) as err:
        await adm.admit(dataclasses.replace(demand(100, 100, n=4), tenant="b"), 1.0)
    assert err.value.retry_after is None
    assert asyncio.get_running_loop().time() - started < 0.5


async def test_a_node_down_for_a_moment_leaves_the_slots_it_has_possible():
    """Four batch sequences fit beside the floor only on the 16-slot node: while it is
    down for a moment the request waits for it, and is served when it is back."""
    small, large = backend("a", kv=100_000, seqs=4), backend("b", kv=100_000, seqs=16)
    cfg = auth(tenant("i", "interactive"), tenant("b", "batch"), classes=FLOORED)
    adm = admission_over(  # slots and budget as the gateway reads them: usable nodes'
        [small, large],
        queue_size=100,
        tenancy=Tenancy(lambda: cfg),
        budget=lambda: sum(b.budget_tokens for b in (small, large) if b.usable),
        capacity=lambda: small.budget_tokens + large.budget_tokens,
        slots=lambda: sum(b.max_num_seqs for b in (small, large) if b.usable),
    )
    d = dataclasses.replace(demand(100, 100, n=4), tenant="b")
    large.healthy = False
    waiting = asyncio.create_task(adm.admit(d, 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    large.healthy = True
    adm.rebalance()
    adm.release(await asyncio.wait_for(waiting, 1.0))


async def test_requests_that_all_give_up_leave_their_tenant_where_it_was():
    """Five of x's requests wait behind a full node and all time out, the oldest first:
    served nothing, x's next request is tagged where y's is, not behind the 5 x 1,008
    KV tokens it never held."""
    b = backend("a", kv=2048, max_model_len=2048)
    cfg = auth(tenant("x"), tenant("y"), tenant("z", "batch"), classes=CLASSES)
    tenancy = Tenancy(lambda: cfg)
    adm = admission_over([b], queue_size=100, tenancy=tenancy, budget=lambda: b.budget_tokens)
    hog = await adm.admit(of("z", 1900), 1.0)
    waits = [asyncio.create_task(adm.admit(of("x", 900), 0.05 + 0.01 * i)) for i in range(5)]
    assert all(
        isinstance(r, Saturated) for r in await asyncio.gather(*waits, return_exceptions=True)
    )
    adm.release(hog)
    assert tenancy.ticket("x", 100).start == tenancy.ticket("y", 100).start == 0.0


async def test_a_request_the_floor_holds_is_not_starved_by_smaller_ones_of_its_class():
    """Interactive keeps 30% of a 10k node; batch holds the rest in 512-token requests. A
    2,000-token batch request waits for the floor to let it through; as each small one
    ends another comes: the newcomers queue behind the held one, which is served."""
    node = backend("a", kv=10_000, max_model_len=10_000, seqs=256)
    floored = (ClassConfig("interactive", floor_share=0.3), ClassConfig("batch"))
    cfg = auth(tenant("i", "interactive"), tenant("s", "batch"), tenant("g", "batch"),
               classes=floored)  # fmt: skip
    adm, _ = make([node], cfg)
    held: list[Reservation] = []
    while sum(r.tokens for r in held) + 512 <= 0.7 * node.budget_tokens:
        held.append(await adm.admit(of("s", 400), 1.0))
    big = asyncio.create_task(adm.admit(of("g", 1900), 2.0))
    await asyncio.sleep(0)
    newcomers = []
    for _ in range(len(held)):
        if big.done():
            break
        adm.release(held.pop(0))
        newcomers.append(asyncio.create_task(adm.admit(of("s", 400), 2.0)))
        await asyncio.sleep(0.005)
    assert big.done() and not big.cancelled() and big.exception() is None
    adm.release(big.result())
    for r in held:
        adm.release(r)
    for later in await asyncio.gather(*newcomers, return_exceptions=True):
        assert isinstance(later, Reservation), later  # each served in its turn
        adm.release(later)


async def test_a_batch_waiter_aged_up_does_not_hold_the_interactive_floors_slot():
    """Node a keeps 1 of its 4 slots for interactive; batch holds the other 3, and node b
    is full. A batch request waits (no room it may take); aged past interactive's rank it
    still claims nothing on a, whose only free slot the floor keeps: an interactive chat
    takes that slot at once."""
    a, b = backend("a", kv=100_000, seqs=4), backend("b", kv=4096, seqs=4)
    cfg = auth(tenant("i", "interactive"), tenant("b", "batch"), classes=FLOORED)
    adm, clock = make([a, b], cfg)

    def batch(prompt: int, *exclude: str) -> Demand:
        d: Demand = of("b", prompt)
        return dataclasses.replace(d, exclude=frozenset(exclude))

    held = [await adm.admit(batch(3900, "a"), 1.0)]
    while a.reserved_seqs < 3:
        held.append(await adm.admit(batch(100, "b"), 1.0))
    waiting = asyncio.create_task(adm.admit(batch(2000), 60.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    clock[0] += 11.0  # two aging periods: the batch waiter ranks with interactive
    chat = await asyncio.wait_for(adm.admit(of("i", 100), 0.5), 1.0)
    assert chat.backend is a
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    for r in (chat, *held):
        adm.release(r)


@pytest.mark.parametrize(
    ("tenants", "classes", "reads"),
    [
        ((tenant("a"),), (ClassConfig("standard"),), False),
        ((tenant("a", max_concurrent=4),), CLASSES, False),
        ((tenant("a", max_kv_share=0.5),), CLASSES, True),
        ((tenant("a"),), (ClassConfig("interactive", 0.2), ClassConfig("standard")), True),
        # A class's own floor never holds it back: only the others' are read.
        ((tenant("a", "interactive"),), (ClassConfig("interactive", 0.2), ClassConfig("b")), False),
    ],
)
def test_the_fleets_totals_are_summed_only_for_a_limit_that_reads_them(tenants, classes, reads):
    """The fleet's KV budget and slots (a sum over every backend) are read for a request
    only when a KV share limit or another class's floor can hold it back: without either,
    admission costs the same with 10 backends or 1,000."""
    summed: list[str] = []

    def total(what: str, value: int) -> Callable[[], int]:
        def read() -> int:
            summed.append(what)
            return value

        return read

    backends = [backend(f"b{i}", kv=10_000) for i in range(3)]
    adm = admission_over(
        backends,
        tenancy=Tenancy(lambda: auth(*tenants, classes=classes)),
        budget=total("budget", 30_000),
        slots=total("slots", 48),
    )
    outcome = adm.try_admit(of("a", 1000))
    assert isinstance(outcome, Reservation)
    assert bool(summed) == reads, summed


def test_what_a_node_held_per_class_is_forgotten_once_it_holds_nothing() -> None:
    """Nodes come and go under new names (DNS members): the per-node class counts keep
    only nodes with requests on them, however many names have been seen."""
    t = Tenancy(lambda: auth(tenant("a", "interactive"), tenant("b", "batch")))
    held = []
    for i in range(1_000):
        ticket = t.ticket("a" if i % 2 else "b", 100)
        t.granted(ticket, 100, 2, backend=f"node-{i}")
        held.append((ticket, f"node-{i}"))
    assert len(t.node_seqs) == 1_000
    for ticket, name in held[:-1]:
        t.released(ticket, 100, 2, backend=name)
    assert t.node_seqs == {"node-999": {"interactive": 2}}
