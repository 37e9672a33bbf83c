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
    not_yet: tuple[type[BaseException], ...] = ...,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T],
    *,
    timeout: float = ...,
    interval: float = ...,
    what: str = ...,
    not_yet: tuple[type[BaseException], ...] = ...,
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "",
    not_yet: tuple[type[BaseException], ...] = (),
) -> Any:
    """``not_yet``: exceptions besides AssertionError that mean "not yet" (a connection
    to a process still starting or just killed)."""
    deadline = time.monotonic() + timeout
    last: AssertionError | None = None
    label = what or getattr(check, "__name__", "condition")
    while True:
        # A check that never answers fails like one that answers no.
        bound = asyncio.timeout(max(deadline - time.monotonic(), interval))
        try:
            value = check()
            if inspect.isawaitable(value):
                async with bound:
                    value = await value
            if value:
                return value
            last = AssertionError(f"{label}: got {value!r}")
        except AssertionError as exc:
            last = exc
        except not_yet as exc:
            last = AssertionError(f"{label}: {exc!r}")
        except TimeoutError:
            if not bound.expired():
                raise
            last = AssertionError(f"{label}: no answer")
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout} s: {last}") from last
        await asyncio.sleep(interval)
