"""argparse types shared by the commands: values checked where they are typed, with
argparse's own usage error instead of a traceback later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# logging's level names, its aliases WARN and FATAL included.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL")


def _checked(text: str, parse: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    """``text`` parsed, if the value is one ``ok`` takes; else argparse's usage error."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port where a command allows it)."""
    return _checked(text, int, lambda v: 0 <= v <= 65535, "a port from 0 to 65535")


def positive_int(text: str) -> int:
    """An integer of 1 or more."""
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def positive_number(text: str) -> float:
    """A finite number above 0."""
    return _checked(text, float, lambda v: 0 < v < math.inf, "a positive number")


def seconds(text: str) -> float:
    """A duration in seconds: a finite number, 0 or more."""
    return _checked(text, float, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level
