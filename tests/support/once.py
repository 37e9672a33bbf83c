"""Work done once per test run, whichever xdist worker asks first."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable

import pytest


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    compute: Callable[[], str],
    timeout: float,
) -> str:
    """``compute()``'s text: the first worker of this run to ask computes it while the
    others wait (at most ``timeout`` seconds), then read it. In a single process it is
    computed. A worker whose computation failed leaves nothing: the next one computes."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    out = shared / f"{name}.out"
    deadline = time.monotonic() + timeout
    with (shared / f"{name}.lock").open("w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: another worker held it {timeout:g}s") from None
                time.sleep(0.2)
        if out.exists():
            return out.read_text()
        text = compute()
        out.write_text(text)
        return text
