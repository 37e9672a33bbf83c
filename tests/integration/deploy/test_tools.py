"""A test's missing external tool: a skip on a developer's machine, a failure in CI."""

from __future__ import annotations

import pytest

from tests.support.tools import require_tool


def test_missing_tool_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-tool-kvgw is not installed"):
        require_tool("no-such-tool-kvgw")


def test_missing_tool_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run these tests"):
        require_tool("no-such-tool-kvgw")


def test_present_tool_is_found_in_sbin() -> None:
    assert require_tool("dnsmasq").endswith("/dnsmasq")
