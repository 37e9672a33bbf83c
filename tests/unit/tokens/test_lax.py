"""Request values read as vLLM's lax pydantic models read them."""

from __future__ import annotations

import pytest

from kvgateway.tokens.plans import flag, lax_bool, lax_int


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True), (False, False), (1, True), (0, False), (1.0, True),
        ("true", True), ("True", True), ("yes", True), ("on", True), ("t", True), ("1", True),
        (" true ", None), ("on ", None),
        ("false", False), ("OFF", False), ("n", False), ("0", False),
        (2, None), ("maybe", None), ("", None), (None, None), ([], None), (0.5, None),
    ],
)  # fmt: skip
def test_booleans(value: object, expected: bool | None) -> None:
    assert lax_bool(value) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, 7), (-3, -3), (1000.0, 1000), ("1000", 1000), (" 12 ", 12), ("+5", 5), ("-5", -5),
        (True, 1), (False, 0), ("1_000", 1000), ("16.0", 16), (" 8.00 ", 8), ("\t7\n", 7),
        ("00012", 12), (1.5, None), (float("inf"), None), (float("nan"), None), (1e20, None),
        ("1e3", None), ("5.", None), ("1.5", None), ("1 000", None), ("0x10", None),
        ("١٢", None), ("²", None), ("", None), (None, None), ([1], None),
    ],
)  # fmt: skip
def test_integers(value: object, expected: int | None) -> None:
    assert lax_int(value) == expected


def test_flags_take_their_default_when_absent_or_not_booleans() -> None:
    assert flag({}, "x", True) is True
    assert flag({"x": "false"}, "x", True) is False
    assert flag({"x": None}, "x", False) is False
    assert flag({"x": "perhaps"}, "x", True) is True
