"""External programs the tests drive (promtool, prometheus, dnsmasq, redis-server).

`make test` installs them first (scripts/install-test-tools.sh). Where that is impossible
(no apt-get, not root) a developer's run skips the tests that need them, saying why; in CI
(``CI=true``) a missing tool is a failure, so a green CI always ran them.
"""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_tool(name: str) -> str:
    """The tool's path; skips the test when it is missing (fails in CI)."""
    path = shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )
    if path:
        return path
    reason = (
        f"{name} is not installed (scripts/install-test-tools.sh installs it; make test runs it)"
    )
    if in_ci():
        pytest.fail(f"{reason}; CI must run these tests")
    pytest.skip(reason)
