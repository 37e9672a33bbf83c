"""Fault injection for gateway resilience tests.

A node holds at most one active :class:`Fault`, set with ``POST /sim/fault`` (JSON body
with the fields below), read with ``GET /sim/fault`` and cleared with
``DELETE /sim/fault``, or through :class:`FaultState` in-process. Completion requests
(``/v1/chat/completions``, ``/v1/completions``) consume it:

- ``status``: answer with this HTTP status and a vLLM-style error body (e.g. 500, 503);
- ``hang_s``: wait this many wall seconds before sending anything (bounded on purpose);
  combined with ``status`` the error comes after the wait, else the request proceeds;
- ``drop_after_chunks``: streaming responses close the connection abruptly after this
  many SSE events; non-streaming ones close it without any response;
- ``remaining``: how many requests the fault affects (null = until cleared).

``health_status`` makes ``GET /health`` answer that status (503 is what vLLM answers when
its engine is dead) and does not count against ``remaining``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_HANG_S = 600.0


@dataclass(frozen=True, slots=True)
class Fault:
    status: int | None = None
    hang_s: float | None = None
    drop_after_chunks: int | None = None
    health_status: int | None = None
    remaining: int | None = None

    def affects_requests(self) -> bool:
        return (
            self.status is not None or self.hang_s is not None or self.drop_after_chunks is not None
        )

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class FaultError(ValueError):
    pass


def parse_fault(body: Mapping[str, Any]) -> Fault:
    known = {f.name for f in dataclasses.fields(Fault)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise FaultError(f"unknown fault fields {unknown}; known: {sorted(known)}")
    status = _opt_int(body, "status", 400, 599)
    health = _opt_int(body, "health_status", 200, 599)
    drop = _opt_int(body, "drop_after_chunks", 0, 1_000_000)
    remaining = _opt_int(body, "remaining", 1, 1_000_000_000)
    hang = body.get("hang_s")
    if hang is not None:
        if isinstance(hang, bool) or not isinstance(hang, int | float):
            raise FaultError("hang_s: expected a number of seconds")
        if not 0 <= hang <= MAX_HANG_S:
            raise FaultError(f"hang_s: expected 0..{MAX_HANG_S:g} seconds, got {hang}")
        hang = float(hang)
    return Fault(
        status=status,
        hang_s=hang,
        drop_after_chunks=drop,
        health_status=health,
        remaining=remaining,
    )


def _opt_int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FaultError(f"{key}: expected an integer in {lo}..{hi}, got {value!r}")
    return value


class FaultState:
    """The node's current fault; requests take it with :meth:`consume`."""

    def __init__(self, fault: Fault | None = None) -> None:
        self.current: Fault | None = fault

    def set(self, fault: Fault | None) -> None:
        self.current = fault if fault is not None and fault != Fault() else None

    def clear(self) -> None:
        self.current = None

    @property
    def health_status(self) -> int | None:
        return None if self.current is None else self.current.health_status

    def consume(self) -> Fault | None:
        """The fault for one completion request, counting it against ``remaining``."""
        fault = self.current
        if fault is None or not fault.affects_requests():
            return None
        if fault.remaining is not None:
            left = fault.remaining - 1
            if left <= 0:
                # Keep a /health fault alive after the request faults are used up.
                self.current = (
                    Fault(health_status=fault.health_status)
                    if fault.health_status is not None
                    else None
                )
            else:
                self.current = dataclasses.replace(fault, remaining=left)
        return fault
