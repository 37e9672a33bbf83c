"""The KV budgets' fallback (:class:`FallbackShare`): from the start of a fallback the
others are taken to hold at least what they held then, for as long as this replica's
requests have lived lately, then all but this replica's share."""

from __future__ import annotations

import asyncio
from typing import cast

from kvgateway.core.backends import Backend
from kvgateway.core.fleet import Fleet
from kvgateway.core.reservation import OthersView
from kvgateway.core.routing import ModelIndex
from kvgateway.ledger.fallback import FallbackShare, RequestLives
from kvgateway.ledger.recorded import Recorded
from tests.support.backends import backend


class _Active:
    def __init__(self, backends: list[Backend]) -> None:
        self.active = backends


def _share(b: Backend, lives: RequestLives, offered: list[str]) -> tuple[FallbackShare, OthersView]:
    view = OthersView(ModelIndex([b]).adjust)
    share = FallbackShare(
        10.0,
        cast("Fleet", _Active([b])),
        view,
        Recorded(),
        live=lambda: 2,
        offer=lambda x: offered.append(x.name),
        in_fallback=lambda: True,
        lives=lives,
    )
    return share, view


async def test_what_the_others_held_holds_for_as_long_as_requests_lived_then_the_share() -> None:
    b = backend("a", kv=1000, seqs=16)
    loop = asyncio.get_running_loop()
    lives = RequestLives(lambda: 900.0)
    lives.born(1, loop.time() - 0.2)
    lives.ended(1, loop.time())  # a request here lived 0.2 s
    offered: list[str] = []
    share, view = _share(b, lives, offered)
    view.set(b, 800, 12)  # last seen: the others held 800 tokens, 12 sequences
    share.began()
    share.apply()
    assert (view.others(b).tokens, view.others(b).seqs) == (800, 12)
    await asyncio.sleep(0.3)
    assert (view.others(b).tokens, view.others(b).seqs) == (500, 8)  # the share alone
    assert offered == ["a"]  # its room grew: waiters asked again


async def test_with_no_request_ended_here_the_fallback_is_the_share_alone() -> None:
    b = backend("a", kv=1000, seqs=16)
    share, view = _share(b, RequestLives(lambda: 900.0), [])
    view.set(b, 800, 12)
    share.began()
    share.apply()
    assert (view.others(b).tokens, view.others(b).seqs) == (500, 8)
