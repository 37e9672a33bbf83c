"""Per-tenant rate limits in tokens and requests per minute: pure, clock passed in.

A limit holds over any sliding minute: the window keeps each charge with its time, so
"at most N per minute" is exact (a token bucket would let a full bucket plus a minute of
refill, twice the limit, through in its first minute). A request is charged at admission
with its counted prompt and its reserved output; :meth:`LocalQuotaLedger.settle` replaces the
reserved output with what was generated, so an unused reservation is given back.

:class:`QuotaLedger` is the seam for a fleet-wide ledger (the same calls over a shared
store); :class:`LocalQuotaLedger` keeps the windows in this process, so without a shared
ledger every gateway replica enforces the limits on its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvgateway.config.model import TenantLimits
from kvgateway.errors import RateLimited

if TYPE_CHECKING:
    from kvgateway.core.tenancy import Tenancy

WINDOW_S = 60.0

# The limit names, as 429 bodies and metrics spell them.
REQUESTS = "requests_per_minute"
PROMPT = "prompt_tokens_per_minute"
OUTPUT = "output_tokens_per_minute"
RATE_LIMITS = (REQUESTS, PROMPT, OUTPUT)

# OpenAI's header names: `tokens` is the prompt (input) token limit; output tokens have
# their own limit here, reported under `output-tokens`.
_HEADER_NAMES = {REQUESTS: "requests", PROMPT: "tokens", OUTPUT: "output-tokens"}


@dataclass(eq=False, slots=True)
class _Entry:
    at: float
    amount: int


@dataclass(slots=True)
class RateWindow:
    """Amounts charged over the last minute."""

    entries: deque[_Entry] = field(default_factory=deque)
    total: int = 0

    def _expire(self, now: float) -> None:
        while self.entries and self.entries[0].at <= now - WINDOW_S:
            self.total -= self.entries.popleft().amount

    def used(self, now: float) -> int:
        self._expire(now)
        return self.total

    def add(self, amount: int, now: float) -> _Entry:
        self._expire(now)
        entry = _Entry(now, amount)
        self.entries.append(entry)
        self.total += amount
        return entry

    def adjust(self, entry: _Entry, amount: int, now: float) -> None:
        """Replace a charge's amount, if it is still in the window."""
        self._expire(now)
        if self.entries and self.entries[0].at <= entry.at:
            self.total += amount - entry.amount
        entry.amount = amount

    def frees_in(self, need: int, limit: int, now: float) -> float:
        """Seconds until ``need`` more fits under ``limit`` (inf if it never can)."""
        self._expire(now)
        if need > limit:
            return float("inf")
        excess = self.total + need - limit
        for e in self.entries:
            if excess <= 0:
                break
            excess -= e.amount
            if excess <= 0:
                return max(0.0, e.at + WINDOW_S - now)
        return 0.0

    def reset_in(self, now: float) -> float:
        """Seconds until everything charged so far has left the window."""
        self._expire(now)
        return self.entries[-1].at + WINDOW_S - now if self.entries else 0.0


@dataclass(frozen=True, slots=True)
class RateLimitHit:
    """Why a request was refused: which limit, its value, and when room frees."""

    limit: str
    value: int
    used: int
    asked: int
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class RateStatus:
    """One limit's state, for the ``x-ratelimit-*`` headers."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(eq=False, slots=True)
class Charge:
    """One admitted request's charges; settled once."""

    tenant: str
    reserved_output: int
    entries: dict[str, _Entry]
    settled: bool = False
    # Its name in a shared ledger's windows ("": kept in this process only).
    ref: str = ""


class QuotaLedger(Protocol):
    async def try_charge(
        self, tenant: str, limits: TenantLimits, prompt: int, output: int, now: float
    ) -> Charge | RateLimitHit: ...

    def settle(
        self,
        charge: Charge,
        output: int,
        now: float,
        *,
        served: bool = True,
        prompt: int | None = None,
    ) -> None:
        """Replace the reserved output with ``output`` (and the prompt charge with
        ``prompt`` when given: known only from the answer); refund it all if not
        ``served``."""

    def status(self, tenant: str, limits: TenantLimits, now: float) -> dict[str, RateStatus]: ...

    def usage(self, tenant: str, now: float) -> dict[str, int]: ...


def _limit_of(limits: TenantLimits, name: str) -> int | None:
    value: int | None = getattr(limits, name)
    return value


class LocalQuotaLedger:
    """:class:`QuotaLedger` in this process (no sharing between replicas)."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], RateWindow] = {}

    def _window(self, tenant: str, name: str) -> RateWindow:
        w = self._windows.get((tenant, name))
        if w is None:
            w = self._windows[tenant, name] = RateWindow()
        return w

    async def try_charge(
        self, tenant: str, limits: TenantLimits, prompt: int, output: int, now: float
    ) -> Charge | RateLimitHit:
        return self.take(tenant, limits, prompt, output, now)

    def take(
        self, tenant: str, limits: TenantLimits, prompt: int, output: int, now: float
    ) -> Charge | RateLimitHit:
        """:meth:`try_charge`, at once."""
        asks = {REQUESTS: 1, PROMPT: prompt, OUTPUT: output}
        hits = []
        for name, asked in asks.items():
            limit = _limit_of(limits, name)
            if limit is None:
                continue
            w = self._window(tenant, name)
            used = w.used(now)
            if used + asked > limit:
                hits.append(RateLimitHit(name, limit, used, asked, w.frees_in(asked, limit, now)))
        if hits:
            # The one that frees last is the one to report: retrying earlier fails again.
            return max(hits, key=lambda h: h.retry_after_s)
        return self.record(tenant, asks, now)

    def record(self, tenant: str, asks: dict[str, int], now: float) -> Charge:
        """Charge ``asks`` (per limit name) without judging them."""
        entries = {name: self._window(tenant, name).add(asked, now) for name, asked in asks.items()}
        return Charge(tenant, asks[OUTPUT], entries)

    def settle(
        self,
        charge: Charge,
        output: int,
        now: float,
        *,
        served: bool = True,
        prompt: int | None = None,
    ) -> None:
        if charge.settled:
            return
        charge.settled = True
        if not served:  # never admitted (queue full, timed out): it costs nothing
            for name, entry in charge.entries.items():
                self._window(charge.tenant, name).adjust(entry, 0, now)
            return
        if output != charge.reserved_output:
            self._window(charge.tenant, OUTPUT).adjust(charge.entries[OUTPUT], output, now)
        if prompt is not None:
            self._window(charge.tenant, PROMPT).adjust(charge.entries[PROMPT], prompt, now)

    def status(self, tenant: str, limits: TenantLimits, now: float) -> dict[str, RateStatus]:
        out = {}
        for name in RATE_LIMITS:
            limit = _limit_of(limits, name)
            if limit is not None:
                w = self._window(tenant, name)
                used = w.used(now)
                out[name] = RateStatus(limit, max(0, limit - used), w.reset_in(now))
        return out

    def usage(self, tenant: str, now: float) -> dict[str, int]:
        return {name: self._window(tenant, name).used(now) for name in RATE_LIMITS}


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def limit_headers(ledger: QuotaLedger, tenancy: Tenancy, tenant: str, now: float) -> dict[str, str]:
    headers = {}
    for name, status in ledger.status(tenant, tenancy.tenant(tenant).limits, now).items():
        word = _HEADER_NAMES[name]
        headers[f"x-ratelimit-limit-{word}"] = str(status.limit)
        headers[f"x-ratelimit-remaining-{word}"] = str(status.remaining)
        headers[f"x-ratelimit-reset-{word}"] = reset_text(status.reset_s)
    return headers


async def charge(
    ledger: QuotaLedger, tenancy: Tenancy, tenant: str, prompt: int, output: int, now: float
) -> tuple[Charge, dict[str, str]]:
    """Charge one request against the tenant's limits; :class:`RateLimited` names the
    limit that refused it and when it frees."""
    outcome = await ledger.try_charge(tenant, tenancy.tenant(tenant).limits, prompt, output, now)
    headers = limit_headers(ledger, tenancy, tenant, now)
    if isinstance(outcome, RateLimitHit):
        raise _refusal(tenant, outcome, headers)
    return outcome, headers


def _refusal(tenant: str, hit: RateLimitHit, headers: dict[str, str]) -> RateLimited:
    unit = "requests" if hit.limit == REQUESTS else "tokens"
    if math.isinf(hit.retry_after_s):
        never = RateLimited(
            f"Tenant '{tenant}': this request needs {hit.asked} {unit} but the "
            f"{hit.limit} limit is {hit.value}; it can never fit. Reduce the request.",
            param=hit.limit,
            limit_headers=headers,
        )
        never.never_succeeds()
        return never
    return RateLimited(
        f"Tenant '{tenant}' reached its {hit.limit} limit ({hit.value}; {hit.used} used in "
        f"the last minute, this request needs {hit.asked}). Retry in "
        f"{reset_text(hit.retry_after_s)}.",
        param=hit.limit,
        limit_headers=headers,
        retry_after=max(1.0, math.ceil(hit.retry_after_s)),
    )
