"""The pure side of the shared ledger: the others' holdings folded into the backends, the
blind local share, and Admission's confirm / refuse / release protocol."""

import asyncio
from typing import cast

import pytest

from kvgateway.config.model import Policy
from kvgateway.core.admission import Admission, Reservation
from kvgateway.core.backends import Backend
from kvgateway.core.reservation import Amount, OthersView, local_share
from kvgateway.core.routing import ModelIndex
from kvgateway.errors import Saturated
from tests.support.backends import backend, demand


class ScriptedLedger:
    """A ledger whose budget is ``room`` tokens held elsewhere too: grants while the
    sum fits, and refreshes the view like the Redis ledger does."""

    def __init__(self, view: OthersView, others: int, budget: int) -> None:
        self.view, self.others, self.budget = view, others, budget
        self.held = 0
        self.released: list[int] = []
        self.delay = 0.0

    @property
    def shared(self) -> bool:
        return True

    async def confirm(self, r: Reservation) -> bool:
        await asyncio.sleep(self.delay)
        ok = self.others + self.held + r.tokens <= self.budget
        if ok:
            self.held += r.tokens
        self.view.set(r.backend, self.others, 0)
        return ok

    async def hold(self, r: Reservation) -> bool:
        return True

    def release(self, r: Reservation, shared: int = 0) -> None:
        self.held -= r.tokens + shared
        self.released.append(r.tokens + shared)

    def release_shared(self, backend: Backend, tokens: int) -> None:
        self.held -= tokens

    def queue_changed(self) -> None:
        return None

    def granted(self, r: Reservation) -> None:
        return None


def make(kv: int, others: int, clock=lambda: 0.0, tenancy=None):
    b = backend("a", kv=kv)
    idx = ModelIndex([b])
    view = OthersView(idx.adjust)
    ledger = ScriptedLedger(view, others, kv)
    adm = Admission(
        index_for=lambda m: idx,
        adjust=idx.adjust,
        policy=lambda: cast(Policy, "kv_aware"),
        offload_overflow=lambda: False,
        queue_size=lambda: 10,
        clock=clock,
        ledger=ledger,
        tenancy=tenancy,
    )
    return b, view, ledger, adm


def test_the_view_folds_others_into_the_counters_and_says_when_room_appeared():
    b = backend("a", kv=1000)
    idx = ModelIndex([b])
    view = OthersView(idx.adjust)
    assert view.set(b, 300, 2) is False and b.reserved_tokens == 300 and b.free_seqs == 14
    idx.adjust(b, 100, 1, 1)  # one of ours
    assert view.own(b).tokens == 100 and view.others(b).tokens == 300
    assert view.set(b, 200, 2) is True and b.reserved_tokens == 300
    assert b.in_flight == 1  # others never count as this replica's requests


def test_fallback_leaves_this_replica_its_share():
    assert local_share(1000, 3) == 333 and local_share(1000, 0) == 1000
    b = backend("a", kv=900, seqs=16)
    idx = ModelIndex([b])
    view = OthersView(idx.adjust)
    view.fall_back([b], 3)
    assert b.free_tokens == 300 and b.free_seqs == 5


def test_blind_mode_takes_the_others_at_what_they_held_when_it_began_if_more():
    """A replica past its share when the ledger went keeps what it holds until its
    requests end: the others count at least that (at most the whole budget)."""
    b = backend("a", kv=900, seqs=16)
    idx = ModelIndex([b])
    view = OthersView(idx.adjust)
    assert not view.fall_back([b], 3, seen={"a": Amount(800, 4)})
    assert b.free_tokens == 100 and b.free_seqs == 5
    view.fall_back([b], 3, seen={"a": Amount(5_000, 40)})
    assert b.free_tokens == 0 and b.free_seqs == 0
    assert view.fall_back([b], 3) == [b]  # what they held then has ended
    assert b.free_tokens == 300 and b.free_seqs == 5


async def test_a_refused_grant_is_not_released_to_the_ledger_and_the_request_waits():
    b, view, ledger, adm = make(kv=1000, others=700)
    # Locally the node looks empty; the ledger knows 700 tokens are held elsewhere.
    with pytest.raises(Saturated):
        await adm.admit(demand(300), 0.05)
    assert ledger.released == [] and ledger.held == 0
    assert b.reserved_tokens == 700 and b.in_flight == 0  # the view now says so
    r = await adm.admit(demand(100), 0.05)
    assert ledger.held == r.tokens
    ledger.others = 0
    assert view.set(b, 0, 0)
    r.release()
    assert ledger.released == [r.tokens] and b.reserved_tokens == 0


async def test_a_waiter_is_confirmed_when_others_release():
    b, view, ledger, adm = make(kv=1000, others=800)
    view.set(b, 800, 0)
    task = asyncio.create_task(adm.admit(demand(300), 2.0))
    await asyncio.sleep(0.01)
    assert adm.queue_depth == 1
    ledger.others = 0
    if view.set(b, 0, 0):
        adm.offer(b)
    r = await task
    assert ledger.held == r.tokens
    r.release()
    assert ledger.held == 0


async def test_cancelled_while_confirming_releases_locally():
    b, _view, ledger, adm = make(kv=1000, others=0)
    ledger.delay = 1.0
    task = asyncio.create_task(adm.admit(demand(300), 2.0))
    await asyncio.sleep(0.01)
    assert b.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.in_flight == 0 and b.reserved_tokens == 0 and ledger.released == []


async def test_a_request_the_ledger_refused_keeps_its_place_in_the_queue():
    """R1 is granted locally and refused by the ledger while R2 arrives and queues. R1
    goes back in with its arrival and fair-queuing tag, not as a newcomer behind R2
    (over a Redis stall, that would happen once per heartbeat): when room for one comes,
    it is R1's."""
    from kvgateway.config.model import AuthConfig
    from kvgateway.core.tenancy import Tenancy

    loop = asyncio.get_running_loop()
    b, view, ledger, adm = make(1000, 0, clock=loop.time, tenancy=Tenancy(AuthConfig))
    ledger.delay = 0.05
    ledger.others = 800  # held elsewhere; this replica's view does not know yet
    r1 = asyncio.create_task(adm.admit(demand(800), 5.0))
    await asyncio.sleep(0.01)  # R1 granted locally, its confirm out
    r2 = asyncio.create_task(adm.admit(demand(300), 5.0))
    await asyncio.sleep(0.01)
    assert adm.queue_depth == 1  # R2 waits for R1's room
    await asyncio.sleep(0.1)  # R1 refused: back in the queue
    assert adm.queue_depth == 2 and not r1.done() and not r2.done()
    ledger.others = 0
    ledger.delay = 0.0
    if view.set(b, 0, 0):
        adm.offer(b)
    got = await r1
    await asyncio.sleep(0.05)
    assert not r2.done()  # 200 left: R2 (300) waits behind R1
    got.release()
    (await r2).release()


async def test_a_refused_request_that_times_out_states_its_whole_queue_timeout():
    """Refused by the ledger, a request waits again for what is left of its timeout; its
    429 states the whole queue timeout, not that remainder (such as "within 3.71204s" of
    a 10 s queue timeout)."""
    _, _, ledger, adm = make(kv=1000, others=0)
    ledger.others = 900  # the view does not know yet: the first grant is refused
    with pytest.raises(Saturated) as err:
        await adm.admit(demand(200, 0), 0.3)
    assert "within 0.3s" in str(err.value)
