"""Stopping the gateway's background loops, bounded.

A cancel can be lost inside a client library: on Python 3.11 ``asyncio.wait_for``
returns a result that lands together with the cancel and drops the cancel (redis-py
wraps its socket writes in it). A loop that relies on its cancel alone then runs on,
and whoever awaits it waits for good. So a loop also ends at a closing flag its owner
sets, and its owner waits for it within a bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence


async def stop_tasks(
    tasks: Sequence[asyncio.Task[None]], bound_s: float, what: str, log: logging.Logger
) -> None:
    """Cancel ``tasks`` and wait for them at most ``bound_s``; log one that had failed
    and those still running at the bound. The caller's own cancel is not swallowed."""
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=bound_s)
    for t in done:
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.error("%s %s had failed", what, t.get_name(), exc_info=exc)
    if pending:
        log.warning("%s did not stop in time: %s", what, [t.get_name() for t in pending])
