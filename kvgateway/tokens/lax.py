"""Request values read as vLLM reads them: its request models are pydantic models in lax
mode, which take ``"true"`` for a boolean and ``1000.0`` or ``"1000"`` for an integer.
The gateway forwards the body unchanged, so it must read such values as the node will
(a 400 where the node answers, or a default where the node sees ``true``, counts wrong).

Pydantic v2's lax conversions (checked against pydantic itself): a boolean from a bool,
the numbers 0 and 1, or the strings 0/1, off/on, f/t, false/true, n/y, no/yes (any case,
no white space); an integer from an int, a bool, a float without a fractional part (below
2**63), or a string holding an integer ("1_000", " 16.0 ")."""

from __future__ import annotations

import math
import re
from typing import Any

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any) -> bool | None:
    """``value`` as a boolean, or None if pydantic would refuse it (strings are taken
    as they are: " true" is refused)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return None


# An integer as pydantic reads one from a string: ASCII digits, "_" between them, and a
# fraction of zeros ("1_000", "16.0"); white space around is dropped.
_INT_TEXT = re.compile(r"([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?")
_FLOAT_INT_LIMIT = 2**63


def lax_int(value: Any) -> int | None:
    """``value`` as an integer, or None if pydantic would refuse it."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < _FLOAT_INT_LIMIT:
            return int(value)
        return None
    if isinstance(value, str):
        match = _INT_TEXT.fullmatch(value.strip())
        if match:
            return int(match.group(1).replace("_", ""))
    return None


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field of a request, with its default when absent, null or not one."""
    value = lax_bool(body.get(key))
    return default if value is None else value
