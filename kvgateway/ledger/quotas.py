"""Tenant rate limits across every replica: the per-minute windows kept in Redis.

With a shared ledger, a tenant limited to N per minute gets N per minute from all the
replicas together: each charge is checked and added in one script
(:mod:`kvgateway.ledger.quota_scripts`), and the ``x-ratelimit-*`` headers report what
Redis answered. Every charge is also kept in this replica's own windows.

Redis unreachable (the shared ledger in its fallback, or a quota call failing): the
replica judges each limit on its own windows against its share, ``limit // live
replicas last seen``, so the replicas together stay within the limit and no request
fails because Redis did. Back in shared mode, what it charged meanwhile is added to
Redis with its age, so it counts until it would have left the window.

A tenant with no per-minute limit costs no Redis call. Settlements (the output
generated, a refund) are sent in batches by :meth:`SharedQuotas.running`'s task.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from kvgateway.config.model import TenantLimits
from kvgateway.core.quota import (
    OUTPUT,
    PROMPT,
    RATE_LIMITS,
    REQUESTS,
    WINDOW_S,
    Charge,
    LocalQuotaLedger,
    RateLimitHit,
    RateStatus,
)
from kvgateway.ledger.connect import REDIS_FAILURES
from kvgateway.ledger.quota_scripts import ADJUST, CHARGE, IMPORT, QuotaKeys
from kvgateway.tasks import stop_tasks

log = logging.getLogger("kvgateway.ledger")

_WINDOW_MS = int(WINDOW_S * 1000)
# After a failed quota call, limits are judged on the local share this long before
# Redis is asked again (the shared ledger's own heartbeat finds it back sooner or later).
RETRY_S = 1.0


@dataclasses.dataclass(slots=True)
class _Seen:
    """What Redis last answered for one tenant: per limit, used and ms to reset."""

    at: float
    used: dict[str, int]
    reset_s: dict[str, float]


def share_of(limits: TenantLimits, live: int) -> TenantLimits:
    """This replica's share of each per-minute limit among ``live`` replicas."""
    n = max(1, live)
    return dataclasses.replace(
        limits,
        **{
            name: value // n for name in RATE_LIMITS if (value := getattr(limits, name)) is not None
        },
    )


def _limited(limits: TenantLimits) -> bool:
    return any(getattr(limits, name) is not None for name in RATE_LIMITS)


class SharedQuotas:
    """:class:`~kvgateway.core.quota.QuotaLedger` over Redis, with a local-share fallback."""

    def __init__(
        self,
        client: Redis,
        namespace: str,
        replica_id: str,
        timeout_s: float,
        *,
        shared: Callable[[], bool],
        live: Callable[[], int],
        clock: Callable[[], float],
        on_fallback: Callable[[bool], None] | None = None,
    ) -> None:
        self._client = client
        self._keys = QuotaKeys(namespace)
        self._id = replica_id
        self._timeout = timeout_s
        self._shared = shared
        self._live = live
        self._clock = clock  # the clock the callers' `now` comes from
        self._on_fallback = on_fallback
        self._local = LocalQuotaLedger()
        self._ids = itertools.count(1)
        self._seen: dict[str, _Seen] = {}
        self._retry_at = 0.0
        # The most replicas seen live within the last minute, and when: any of them may
        # have charged the window (a count seen low for a moment, as right after Redis
        # restarted, must not hand this replica a larger share).
        self._most_live = (1, float("-inf"))
        self._in_fallback = False
        # Every charge of a limited tenant in the last minute, oldest first: back from a
        # fallback, those Redis lacks (charged on the share, or lost with Redis's data)
        # are added to it.
        self._recent: deque[tuple[str, Charge]] = deque()
        self._unsent = False
        self._adjust: list[tuple[str, str, dict[str, int]]] = []  # tenant, ref, amounts
        self._flush = asyncio.Event()
        self._closing = False
        self._shas: dict[str, str] = {}

    def _set_fallback(self, on: bool, reason: str = "") -> None:
        if on == self._in_fallback:
            return
        self._in_fallback = on
        if on:
            log.warning(
                "tenant rate limits: Redis unavailable (%s); each limit is judged on this "
                "replica's share (1/%d) until it is back",
                reason,
                self._most_live[0],
            )
        else:
            log.info("tenant rate limits: shared across replicas again")
        if self._on_fallback is not None:
            self._on_fallback(on)

    def _replicas(self, now: float) -> int:
        live, at = max(1, self._live()), self._most_live[1]
        if live >= self._most_live[0] or now - at > WINDOW_S:
            self._most_live = (live, now)
        return self._most_live[0]

    def _lost(self) -> None:
        """Redis failed or restarted: its scripts may be gone (loaded again at the next
        call) and its data too (the last minute's charges are sent again: charges it
        holds already are left as they are)."""
        self._shas.clear()
        self._unsent = True

    def _use_redis(self, now: float) -> bool:
        return self._shared() and now >= self._retry_at

    async def _eval(self, name: str, src: str, keys: list[str], args: list[str | int]) -> list[int]:
        sha = self._shas.get(name)
        if sha is None:
            sha = self._shas[name] = await self._client.script_load(src)
        try:
            got = await self._client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis lost its scripts (redis-py raises this for the NOSCRIPT reply): it
            # restarted between two calls, maybe without its data. The script did not
            # run; the last minute's charges go to Redis again before it does.
            self._lost()
            if name != "import":
                await self._send_recent(self._clock())
            self._shas[name] = await self._client.script_load(src)
            got = await self._client.evalsha(self._shas[name], len(keys), *keys, *args)
        return [int(x) for x in got] if isinstance(got, list) else [int(got)]

    async def try_charge(
        self, tenant: str, limits: TenantLimits, prompt: int, output: int, now: float
    ) -> Charge | RateLimitHit:
        if not _limited(limits):
            return self._local.take(tenant, limits, prompt, output, now)
        share = share_of(limits, self._replicas(now))
        if self._use_redis(now):
            try:
                async with asyncio.timeout(self._timeout):
                    if self._unsent:
                        await self._send_recent(now)
                    got = await self._charge_shared(tenant, limits, prompt, output, now)
                self._keep(tenant, got, now)
                return got
            except REDIS_FAILURES as exc:
                self._lost()
                self._retry_at = now + RETRY_S
                self._set_fallback(True, repr(exc))
        else:
            self._set_fallback(True, "the shared ledger is in its fallback")
        got = self._local.take(tenant, share, prompt, output, now)
        self._keep(tenant, got, now)
        self._unsent = True
        return got

    def _keep(self, tenant: str, got: Charge | RateLimitHit, now: float) -> None:
        while self._recent and self._recent[0][1].entries[REQUESTS].at <= now - WINDOW_S:
            self._recent.popleft()
        if isinstance(got, Charge):
            self._recent.append((tenant, got))

    async def _charge_shared(
        self, tenant: str, limits: TenantLimits, prompt: int, output: int, now: float
    ) -> Charge | RateLimitHit:
        asks = {REQUESTS: 1, PROMPT: prompt, OUTPUT: output}
        keys: list[str] = []
        args: list[str | int] = [_WINDOW_MS, ref := f"{self._id}:{next(self._ids)}"]
        for name in RATE_LIMITS:
            keys += self._keys.window(name, tenant)
            value = getattr(limits, name)
            args += [-1 if value is None else value, asks[name]]
        got = await self._eval("charge", CHARGE, keys, args)
        self._set_fallback(False)
        granted, hit, wait_ms = got[0], got[1], got[2]
        used = {name: got[3 + 2 * i] for i, name in enumerate(RATE_LIMITS)}
        reset = {name: got[4 + 2 * i] / 1000 for i, name in enumerate(RATE_LIMITS)}
        self._seen[tenant] = _Seen(now, used, reset)
        if not granted:
            name = RATE_LIMITS[hit - 1]
            retry = float("inf") if wait_ms < 0 else wait_ms / 1000
            return RateLimitHit(name, getattr(limits, name), used[name], asks[name], retry)
        # Kept here too: the replica's own minute, for its metrics and its fallback.
        charge = self._local.record(tenant, asks, now)
        charge.ref = ref
        return charge

    async def _send_recent(self, now: float) -> None:
        """Add the last minute's charges to Redis with their age (those it holds already
        are left as they are). A charge made on the local share while this runs marks
        the minute unsent again: it is in neither the batch sent nor Redis."""
        self._unsent = False
        by_window: dict[tuple[str, str], list[str | int]] = {}
        for tenant, c in self._recent:
            age = int((now - c.entries[REQUESTS].at) * 1000)
            if age >= _WINDOW_MS or not any(e.amount for e in c.entries.values()):
                continue  # gone from the window, or refunded
            if not c.ref:  # its later settlement goes to Redis as a shared charge's does
                c.ref = f"{self._id}:{next(self._ids)}"
            for name, entry in c.entries.items():
                by_window.setdefault((name, tenant), []).extend([c.ref, age, entry.amount])
        try:
            for (name, tenant), triples in by_window.items():
                keys = list(self._keys.window(name, tenant))
                await self._eval("import", IMPORT, keys, [_WINDOW_MS, *triples])
        except BaseException:
            self._unsent = True
            raise

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
        self._local.settle(charge, output, now, served=served, prompt=prompt)
        if charge.ref:
            amounts = {name: e.amount for name, e in charge.entries.items()}
            self._adjust.append((charge.tenant, charge.ref, amounts))
            self._flush.set()

    def status(self, tenant: str, limits: TenantLimits, now: float) -> dict[str, RateStatus]:
        seen = self._seen.get(tenant)
        if self._in_fallback or seen is None or not _limited(limits):
            return self._local.status(
                tenant, share_of(limits, self._replicas(now)) if self._in_fallback else limits, now
            )
        out = {}
        for name in RATE_LIMITS:
            limit = getattr(limits, name)
            if limit is not None:
                left = max(0.0, seen.reset_s[name] - (now - seen.at))
                out[name] = RateStatus(limit, max(0, limit - seen.used[name]), left)
        return out

    def usage(self, tenant: str, now: float) -> dict[str, int]:
        return self._local.usage(tenant, now)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Send settlements until the block ends (then what is left, bounded)."""
        self._closing = False
        task = asyncio.create_task(self._flush_loop(), name="quota-settle")
        try:
            yield
        finally:
            self._closing = True
            self._flush.set()
            await stop_tasks([task], self._timeout * 2 + RETRY_S, "quota settle loop", log)
            with contextlib.suppress(*REDIS_FAILURES):
                async with asyncio.timeout(self._timeout):
                    await self._send_adjustments()

    async def _flush_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_S / 4):
                    await self._flush.wait()
            if self._closing:
                return  # what is left is sent once the block ends
            self._flush.clear()
            now = self._clock()
            self._replicas(now)
            try:
                async with asyncio.timeout(self._timeout):
                    if self._unsent and self._use_redis(now):
                        # Back from a fallback: the others see what was charged here
                        # without waiting for this replica's next limited request.
                        await self._send_recent(now)
                        self._set_fallback(False)
                    await self._send_adjustments()
            except REDIS_FAILURES as exc:
                self._lost()
                # Settlements lost: the window keeps what was reserved, never less than
                # was used, except a passthrough's prompt known only from its answer.
                log.debug("tenant rate limits: settlements not sent: %r", exc)

    async def _send_adjustments(self) -> None:
        batch, self._adjust = self._adjust, []
        if not batch:
            return
        sha = self._shas.get("adjust") or await self._client.script_load(ADJUST)
        self._shas["adjust"] = sha
        async with self._client.pipeline(transaction=False) as pipe:
            for tenant, ref, amounts in batch:
                keys = [k for name in RATE_LIMITS for k in self._keys.window(name, tenant)]
                pipe.evalsha(sha, len(keys), *keys, ref, *(amounts[n] for n in RATE_LIMITS))
            await pipe.execute()
