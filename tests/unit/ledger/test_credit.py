"""Ledger credit: what is kept, what a request takes, and when it goes back."""

from __future__ import annotations

import asyncio

from kvgateway.ledger.credit import Credit


def _credit(
    hold_s: float = 0.05, max_requests: int = 2
) -> tuple[Credit, list[tuple[str, int, int]]]:
    given: list[tuple[str, int, int]] = []
    return Credit(hold_s, lambda n, t, s: given.append((n, t, s)), max_requests), given


async def test_a_request_that_fits_takes_it_whole_and_one_that_does_not_takes_a_part():
    c, given = _credit()
    c.keep("n", 2000, 1)
    assert c.take("n", 1500, 1) == (1500, 1) and c.grants == 1
    assert c.take("n", 800, 1) == (500, 0) and c.grants == 1  # the part there is
    assert c.take("other", 10, 1) == (0, 0)
    assert given == []


async def test_at_most_max_requests_releases_worth_is_kept():
    c, given = _credit(max_requests=2)
    c.keep("n", 1000, 1)
    c.keep("n", 1000, 1)
    c.keep("n", 1000, 1)
    assert given == [("n", 1000, 1)]
    c.keep("n", 100, 1)  # a small release: what is over twice its size goes back
    assert given[-1] == ("n", 1900, 1)
    # A burst of releases (one loop turn finishing many answers) is kept up to the cap.
    c, given = _credit(max_requests=8)
    for _ in range(10):
        c.keep("n", 1000, 1)
    assert given == [("n", 1000, 1), ("n", 1000, 1)]
    assert [c.take("n", 1000, 1) for _ in range(9)] == [(1000, 1)] * 8 + [(0, 0)]


async def test_idle_credit_goes_back_after_the_hold_and_used_credit_stays():
    c, given = _credit(0.05)
    c.keep("idle", 1000, 1)
    c.keep("busy", 1000, 1)
    for _ in range(4):  # used every 20 ms: never idle for the hold
        await asyncio.sleep(0.02)
        assert c.take("busy", 10, 0) == (10, 0)
    assert ("idle", 1000, 1) in given
    assert not any(n == "busy" for n, _, _ in given)
    await asyncio.sleep(0.12)
    assert ("busy", 960, 1) in given


async def test_forget_gives_nothing_back_and_drop_all_gives_everything():
    c, given = _credit()
    c.keep("a", 100, 1)
    c.forget()
    c.keep("b", 200, 1)
    c.drop_all()
    await asyncio.sleep(0.08)
    assert given == [("b", 200, 1)]
