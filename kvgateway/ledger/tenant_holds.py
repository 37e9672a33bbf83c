"""Tenant holdings across replicas: ``max_concurrent`` and ``max_kv_share`` for the fleet.

Each replica records in Redis what each limited tenant holds through it, as absolute
values (``{ns}:ttok:TENANT`` KV tokens, ``{ns}:treq:TENANT`` requests; hashes of
replica -> value, summed over the live leases of the shared ledger as its KV holdings
are). A limited tenant's grant is held there after its KV confirm, in one script: the
other replicas' holdings plus this replica's (the request included) must stay within
the limits, else it is refused and waits, its tenant's gate now seeing the others'
holdings (:attr:`Tenancy.others_tokens`). After releases, and every ``REFRESH_S``, the
replica writes its holdings again and reads the others'; a tenant they no longer hold
back here is let through.

While the shared ledger is in its fallback the others are taken to hold all of each
limit but this replica's share (``limit // live replicas``), so the replicas together
stay within it; a failed call fails no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvgateway.core.reservation import Reservation
from kvgateway.core.tenancy import Tenancy

log = logging.getLogger("kvgateway.ledger")

_FAILURES = (RedisError, OSError, TimeoutError)
# How often the others' holdings are read (and this replica's written) at the least.
REFRESH_S = 0.25

# KEYS: live, tokens hash, requests hash. ARGV: me, my tokens, my requests (this request
# included), token cap (-1: none), request cap (-1: none), this request's tokens, check
# (1: judge it; 0: only write mine). Returns {held 0/1, others' tokens, others' requests}.
# A tenant holding nothing anywhere may always run one request, however large (as in
# one process).
HOLD = """
local function others(key, livekey, me)
  local all = redis.call('HGETALL', key)
  local sum = 0
  for i = 1, #all, 2 do
    if all[i] ~= me then
      if redis.call('ZSCORE', livekey, all[i]) then
        sum = sum + tonumber(all[i + 1])
      else
        redis.call('HDEL', key, all[i])
      end
    end
  end
  return sum
end
local me = ARGV[1]
local mt, mr = tonumber(ARGV[2]), tonumber(ARGV[3])
local ct, cr, this = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local ot, orq = others(KEYS[2], KEYS[1], me), others(KEYS[3], KEYS[1], me)
if ARGV[7] == '1' then
  if cr >= 0 and orq + mr > cr then return {0, ot, orq} end
  if ct >= 0 and ot + mt - this > 0 and ot + mt > ct then return {0, ot, orq} end
end
for k, v in pairs({[KEYS[2]] = mt, [KEYS[3]] = mr}) do
  if v > 0 then redis.call('HSET', k, me, v) else redis.call('HDEL', k, me) end
end
return {1, ot, orq}
"""

Caps = tuple[int, int]  # KV tokens, requests (-1: no limit)


class TenantHolds:
    def __init__(
        self,
        client: Redis,
        namespace: str,
        replica_id: str,
        timeout_s: float,
        *,
        shared: Callable[[], bool],
        live: Callable[[], int],
        budget: Callable[[], int],
    ) -> None:
        self._client = client
        self._ns = namespace
        self._id = replica_id
        self._timeout = timeout_s
        self._shared = shared
        self._live = live
        self._budget = budget
        self._tenancy: Tenancy | None = None
        self._reopen: Callable[[str], None] = lambda tenant: None
        # One write at a time: each carries absolute values read when it is sent, and
        # calls on several connections may reach Redis in another order.
        self._lock = asyncio.Lock()
        self._dirty = asyncio.Event()
        self._sha = ""
        # What this replica holds for limited tenants: the reservations held (recorded,
        # or let through in the fallback, to be recorded once back), per tenant.
        self._held: dict[int, tuple[str, int]] = {}
        self._tokens: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()

    def _keys(self, tenant: str) -> list[str]:
        ns = self._ns
        return [f"{{{ns}}}:live", f"{{{ns}}}:ttok:{tenant}", f"{{{ns}}}:treq:{tenant}"]

    def _caps(self, tenant: str) -> Caps | None:
        if self._tenancy is None:
            return None
        limits = self._tenancy.tenant(tenant).limits
        if limits.max_concurrent is None and limits.max_kv_share is None:
            return None
        tokens = -1 if limits.max_kv_share is None else int(limits.max_kv_share * self._budget())
        return tokens, -1 if limits.max_concurrent is None else limits.max_concurrent

    async def _call(self, tenant: str, caps: Caps, this: int, check: bool) -> list[int]:
        """The script for ``tenant``: this replica's holdings written (plus ``this``
        request's tokens, if ``this``), the others' read."""
        if not self._sha:
            self._sha = await self._client.script_load(HOLD)
        mine = (self._tokens[tenant] + this, self._requests[tenant] + (1 if this else 0))
        args = [self._id, *mine, *caps, this, 1 if check else 0]
        got = await self._client.evalsha(self._sha, 3, *self._keys(tenant), *args)
        return [int(x) for x in got]

    def _add(self, r: Reservation, tenant: str) -> None:
        self._held[r.id] = (tenant, r.tokens)
        self._tokens[tenant] += r.tokens
        self._requests[tenant] += 1

    def _seen(self, tenant: str, tokens: int, requests: int) -> None:
        assert self._tenancy is not None
        t = self._tenancy
        fell = tokens < t.others_tokens[tenant] or requests < t.others_requests[tenant]
        t.others_tokens[tenant], t.others_requests[tenant] = tokens, requests
        if fell:
            self._reopen(tenant)

    async def hold(self, r: Reservation) -> bool:
        """Hold ``r`` for its tenant across replicas; False: the others' holdings leave
        it no room (its gate now sees them)."""
        caps = self._caps(r.ticket.tenant) if r.ticket is not None else None
        if caps is None or r.ticket is None:
            return True
        tenant = r.ticket.tenant
        if not self._shared():  # the fallback's share limited it; recorded once back
            self._add(r, tenant)
            return True
        try:
            async with asyncio.timeout(self._timeout):
                async with self._lock:
                    ok, tokens, requests = await self._call(tenant, caps, r.tokens, True)
                    if ok:
                        self._add(r, tenant)
        except _FAILURES as exc:
            self._sha = ""
            log.debug("tenant holdings: hold not recorded: %r", exc)
            self._add(r, tenant)
            self._dirty.set()
            return True  # the shared ledger finds Redis gone and falls back on its own
        self._seen(tenant, tokens, requests)
        return bool(ok)

    def released(self, r: Reservation) -> None:
        held = self._held.pop(r.id, None)
        if held is not None:
            tenant, tokens = held
            self._tokens[tenant] -= tokens
            self._requests[tenant] -= 1
            self._dirty.set()

    @contextlib.asynccontextmanager
    async def running(self, tenancy: Tenancy, reopen: Callable[[str], None]) -> AsyncIterator[None]:
        """Keep this replica's holdings written and the others' read until the block
        ends; ``reopen(tenant)``: the others' holdings of ``tenant`` fell."""
        self._tenancy, self._reopen = tenancy, reopen
        task = asyncio.create_task(self._loop(), name="tenant-holds")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REFRESH_S):
                    await self._dirty.wait()
            self._dirty.clear()
            await self.refresh()

    def _limited(self) -> list[tuple[str, Caps]]:
        assert self._tenancy is not None
        auth = self._tenancy.auth
        names = {t.name for t in (*auth.tenants, auth.default_tenant)}
        return [(n, caps) for n in sorted(names) if (caps := self._caps(n)) is not None]

    async def refresh(self) -> None:
        """Write this replica's holdings of every limited tenant and read the others';
        in the fallback, take the others to hold all but this replica's share."""
        limited = self._limited()
        if not limited:
            return
        if not self._shared():
            live = max(1, self._live())
            for tenant, (tokens, requests) in limited:
                self._seen(
                    tenant,
                    max(0, tokens - tokens // live),
                    max(0, requests - requests // live),
                )
            return
        try:
            async with asyncio.timeout(self._timeout):
                async with self._lock:
                    answers = [await self._call(t, caps, 0, False) for t, caps in limited]
        except _FAILURES as exc:
            self._sha = ""
            log.debug("tenant holdings: refresh failed: %r", exc)
            return
        for (tenant, _), (_, tokens, requests) in zip(limited, answers, strict=True):
            self._seen(tenant, tokens, requests)
