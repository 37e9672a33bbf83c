"""Request values read as vLLM reads them: its request models are pydantic models in lax
mode, which take ``"true"`` for a boolean and ``1000.0`` or ``"1000"`` for an integer.
The gateway forwards the body unchanged, so it must read such values as the node will
(a 400 where the node answers, or a default where the node sees ``true``, counts wrong).

Pydantic v2's lax conversions: a boolean from a bool, the numbers 0 and 1, or the strings
0/1, off/on, f/t, false/true, n/y, no/yes (any case); an integer from an int, a float
without a fractional part, or a string holding an integer. Booleans are not integers
here (a bool where a count belongs is refused, as a mistake)."""

from __future__ import annotations

import math
from typing import Any

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any) -> bool | None:
    """``value`` as a boolean, or None if pydantic would refuse it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return None


def lax_int(value: Any) -> int | None:
    """``value`` as an integer, or None if pydantic would refuse it."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in ("+", "-") else text
        if digits.isascii() and digits.isdigit():
            return int(text)
    return None


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field of a request, with its default when absent, null or not one."""
    value = lax_bool(body.get(key))
    return default if value is None else value
