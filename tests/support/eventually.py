"""``await eventually(check)``: poll a condition until it holds, within a bound.

One helper for every "wait until the system shows X" in the suite: ``check`` is a plain
or async callable returning a truthy value (returned to the caller) or raising
AssertionError; the last failure is re-raised when the time is up, so a test fails with
what it last saw rather than a bare timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = ...,
    interval: float = ...,
    what: str = ...,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T],
    *,
    timeout: float = ...,
    interval: float = ...,
    what: str = ...,
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "",
) -> Any:
    deadline = time.monotonic() + timeout
    last: AssertionError | None = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            last = AssertionError(
                f"{what or getattr(check, '__name__', 'condition')}: got {value!r}"
            )
        except AssertionError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout} s: {last}") from last
        await asyncio.sleep(interval)
