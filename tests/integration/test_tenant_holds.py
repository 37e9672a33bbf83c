"""Tenants across replicas, against a real redis-server: two replicas' tenant holdings
(``kvgateway.ledger.tenant_holds``) in one test process: class floors on each node, and
fair queuing on what every replica grants."""

from __future__ import annotations

from collections.abc import Iterator

from redis.asyncio import Redis

from kvgateway.config.model import AuthConfig, ClassConfig, TenantConfig
from kvgateway.core.reservation import Reservation
from kvgateway.core.routing import RouteReason
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.tenant_holds import TenantHolds
from tests.support.backends import admission_over, backend
from tests.support.redis_server import RedisServer

NS = "holds-test"
CLASSES = (ClassConfig("interactive", floor_share=0.25), ClassConfig("batch"))
AUTH = AuthConfig(
    keys=(
        TenantConfig("i", ("k-i",), class_name="interactive"),
        TenantConfig("b", ("k-b",), class_name="batch"),
    ),
    classes=CLASSES,
)


def _holds(client: Redis, me: str, auth: AuthConfig = AUTH) -> tuple[TenantHolds, Tenancy]:
    nodes = [backend("n1", seqs=8), backend("n2", seqs=8)]
    holds = TenantHolds(
        client,
        NS,
        me,
        1.0,
        shared=lambda: True,
        live=lambda: 2,
        budget=lambda: sum(b.budget_tokens for b in nodes),
        slots=lambda: sum(b.max_num_seqs for b in nodes),
        models=lambda: ["m"],
    )
    return holds, Tenancy(lambda: auth)


def _grants(tenancy: Tenancy, tenant: str, node: str) -> Iterator[Reservation]:
    """Reservations on ``node`` as admission hands them to the ledger (never released
    through their owner here)."""
    b = backend(node, seqs=8)
    owner = admission_over([b])
    while True:
        yield Reservation(b, 100, 1, RouteReason.FIT, owner, ticket=tenancy.ticket(tenant, 100))


async def test_batch_on_two_replicas_leaves_each_nodes_floor_free(
    redis_server: RedisServer,
) -> None:
    """Batch granted on one node by two replicas together stops at that node's 8 slots
    less what the interactive floor (2) keeps there, whichever replica asks; the
    floor's own class is not held back; a release on one replica is room for the
    other; the other node is judged on its own."""
    client = Redis.from_url(redis_server.url)
    try:
        await client.zadd(f"{{{NS}}}:live", {"a": 2**40, "b": 2**40})
        a, ta = _holds(client, "a")
        b, tb = _holds(client, "b")
        async with a.running(ta, lambda t: None), b.running(tb, lambda t: None):
            batch_a, batch_b = _grants(ta, "b", "n1"), _grants(tb, "b", "n1")
            held = [await a.hold(next(batch_a)) for _ in range(3)]
            on_b = [next(batch_b) for _ in range(3)]
            held += [await b.hold(r) for r in on_b]
            assert held == [True] * 6
            assert not await a.hold(next(batch_a))
            assert not await b.hold(next(batch_b))
            # B saw what A holds on n1 in its refusal: its routing keeps the floor too.
            assert tb.elsewhere.node_seqs["n1"]["batch"] == 3
            # Interactive is not held back; holding 1 of its 2 there, 1 stays kept.
            assert await b.hold(next(_grants(tb, "i", "n1")))
            assert not await a.hold(next(batch_a))
            # A batch sequence B releases there is written, and A may take its slot.
            b.released(on_b[0])
            await b.refresh()
            assert await a.hold(next(batch_a))
            assert not await a.hold(next(batch_a))
            # The other node is judged on its own.
            assert await a.hold(next(_grants(ta, "b", "n2")))
    finally:
        await client.aclose()


async def test_what_other_replicas_grant_a_tenant_moves_it_back_in_this_ones_queue(
    redis_server: RedisServer,
) -> None:
    """Fair queuing across replicas: KV tokens another replica granted tenant y advance
    y's tag here, so x (served nowhere) goes first here though y asked first; what was
    granted before this replica first looked does not count."""
    two = AuthConfig(keys=(TenantConfig("x", ("k-x",)), TenantConfig("y", ("k-y",))))
    client = Redis.from_url(redis_server.url)
    try:
        await client.zadd(f"{{{NS}}}:live", {"a": 2**40, "b": 2**40})
        a, ta = _holds(client, "a", two)
        b, tb = _holds(client, "b", two)
        async with a.running(ta, lambda t: None), b.running(tb, lambda t: None):
            tb.granted(tb.ticket("y", 5_000), 5_000)
            await b.refresh()
            await a.refresh()  # first look: y's earlier grants on b set the baseline
            y, x = ta.ticket("y", 100), ta.ticket("x", 100)
            assert y.key(0, 0, 5) < x.key(0, 0, 5)
            tb.granted(tb.ticket("y", 10_000), 10_000)
            await b.refresh()
            await a.refresh()
            y, x = ta.ticket("y", 100), ta.ticket("x", 100)
            assert x.key(0, 0, 5) < y.key(0, 0, 5)
            assert y.start - x.start >= 10_000 - 200
    finally:
        await client.aclose()


async def test_the_oldest_request_behind_the_floors_on_any_replica_goes_first(
    redis_server: RedisServer,
) -> None:
    """A replica reads how long the others' oldest request kept back by the floors has
    waited (per class and model), and lets its own waiters ask again once that one was
    served."""
    client = Redis.from_url(redis_server.url)
    try:
        await client.zadd(f"{{{NS}}}:live", {"a": 2**40, "b": 2**40})
        a, ta = _holds(client, "a")
        b, tb = _holds(client, "b")
        on_b = {("batch", "m"): 2.0}
        reopened: list[str] = []
        async with (
            a.running(ta, reopened.append),
            b.running(tb, lambda t: None, lambda: dict(on_b)),
        ):
            await b.refresh()
            await a.refresh()
            assert list(ta.elsewhere.floor_waits) == [("batch", "m")]
            assert 2.0 <= ta.elsewhere.floor_waits["batch", "m"] < 2.5
            assert tb.elsewhere.floor_waits == {}  # its own are not the others'
            reopened.clear()
            on_b.clear()  # b's waiter was served
            await b.refresh()
            await a.refresh()
            assert ta.elsewhere.floor_waits == {} and "" in reopened
    finally:
        await client.aclose()
