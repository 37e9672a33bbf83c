"""Tenant and class holdings across replicas: ``max_concurrent``, ``max_kv_share`` and
class floors for the whole fleet.

Each replica records in Redis, as absolute values, what it holds per tenant (KV tokens,
requests: ``{ns}:ttok:TENANT``, ``{ns}:treq:TENANT``), per class (KV tokens,
sequences: ``{ns}:ctok:CLASS``, ``{ns}:cseq:CLASS``) and, with floors, per class on each
backend (sequences: ``{ns}:nseq:BACKEND:CLASS``); hashes of replica -> value, summed
over the live leases of the shared ledger as its KV holdings are. A grant that a tenant
limit or a class floor concerns is held there after its KV confirm, in one script: with
it, the tenant must stay within its limits and the other classes' floors must still
fit, in the fleet and on its backend, counting what every live replica holds; else it
is refused and waits, its gate and routing now seeing the others' holdings
(:class:`~kvgateway.core.tenancy.Elsewhere`).
After releases, and every ``REFRESH_S``, the replica writes its holdings again and reads
the others'; waiters they no longer hold back are let through.

While the shared ledger is in its fallback the others are taken to hold all of each
tenant limit, and of the fleet, but this replica's share (``1 / live replicas``); a
failed call fails no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from kvgateway.core.reservation import Reservation
from kvgateway.core.tenancy import Tenancy
from kvgateway.ledger.connect import REDIS_FAILURES
from kvgateway.ledger.fallback import RequestLives, TenantFallback, TenantRecord, over_limit
from kvgateway.ledger.quota_scripts import FLOOR_WAITS, GRANTED, HOLD
from kvgateway.ledger.tenant_order import (
    Waits,
    node_key,
    sharing_tenants,
    take_floor_waits,
    take_grants,
    within_floor,
    write_floor_waits,
    write_grants,
    write_node_seqs,
)
from kvgateway.tasks import stop_tasks

log = logging.getLogger("kvgateway.ledger")

# How often the others' holdings are read (and this replica's written) at the least.
REFRESH_S = 0.25
# ... and at most this often, however often releases come.
REFRESH_GAP_S = 0.05


Caps = tuple[int, int]  # KV tokens, requests (-1: no limit)


@dataclass(frozen=True, slots=True)
class _Held:
    tenant: str
    klass: str
    tokens: int
    seqs: int
    backend: str
    slots: int  # the backend's max_num_seqs


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
        lease_left: Callable[[], float] = lambda: 0.0,
        budget: Callable[[], int],
        slots: Callable[[], int],
        models: Callable[[], list[str]] = list,
        lives: RequestLives | None = None,
    ) -> None:
        self._client = client
        self._ns = namespace
        self._id = replica_id
        self._timeout = timeout_s
        self._shared = shared
        self._live = live
        self._lease_left = lease_left
        self._budget = budget
        self._slots = slots
        self._models = models
        self._tenancy: Tenancy | None = None
        self._reopen: Callable[[str], None] = lambda tenant: None
        # One write at a time: each carries absolute values read when it is sent, and
        # calls on several connections may reach Redis in another order.
        self._lock = asyncio.Lock()
        self._dirty = asyncio.Event()
        self._sha = ""
        # The reservations this replica holds that a limit or floor concerns (recorded,
        # or let through in the fallback, to be recorded once back).
        self._held: dict[int, _Held] = {}
        self._tokens: Counter[str] = Counter()  # per tenant
        self._requests: Counter[str] = Counter()
        self._class_tokens: Counter[str] = Counter()
        self._class_seqs: Counter[str] = Counter()
        self._node_seqs: dict[str, Counter[str]] = {}  # per backend, per class
        self._nodes_dirty: set[str] = set()  # not written since they changed
        self._closing = False
        # What Redis records for this replica, per tenant (KV tokens, requests) and over
        # its classes (KV tokens, sequences), as last written: the fallback keeps within
        # it while this replica's lease may still be live (the others count it so).
        self._recorded: dict[str, tuple[int, int]] = {}
        self._recorded_total = (0, 0)
        # What the other replicas had granted each tenant sharing a class, as last read.
        self._granted_seen: dict[str, int] = {}
        self._granted_sha = self._waits_sha = ""
        self._floor_waits: Callable[[], Waits] = dict
        self._fallback = TenantFallback(lives if lives is not None else RequestLives(lambda: 0.0))

    def _caps(self, tenant: str) -> Caps | None:
        assert self._tenancy is not None
        if not tenant:
            return None
        limits = self._tenancy.tenant(tenant).limits
        if limits.max_concurrent is None and limits.max_kv_share is None:
            return None
        tokens = -1 if limits.max_kv_share is None else int(limits.max_kv_share * self._budget())
        return tokens, -1 if limits.max_concurrent is None else limits.max_concurrent

    def _floor_pairs(self) -> list[tuple[str, str]]:
        """With floors: every (class, model) whose waiters are ordered across replicas."""
        assert self._tenancy is not None
        if not self._floors():
            return []
        return [(c.name, m) for c in self._tenancy.auth.classes for m in self._models()]

    def within_floor(self, r: Reservation) -> bool:
        """``r``'s class holds less than its floor (see :func:`within_floor`)."""
        if self._tenancy is None or r.ticket is None:
            return False
        return within_floor(self._tenancy, r.ticket.klass, self._budget(), self._slots())

    def _floors(self) -> bool:
        assert self._tenancy is not None
        return any(c.floor_share > 0 for c in self._tenancy.auth.classes)

    async def _load(self) -> None:
        if not self._sha:
            self._sha = await self._client.script_load(HOLD)
        if not self._granted_sha:
            self._granted_sha = await self._client.script_load(GRANTED)
        if not self._waits_sha:
            self._waits_sha = await self._client.script_load(FLOOR_WAITS)

    async def _call(self, tenant: str, held: _Held | None) -> list[int]:
        """The script for ``tenant``: this replica's holdings written (``held``, the
        request judged, included), the others' read."""
        await self._load()
        keys, args = self._hold_args(tenant, held)
        got = [int(x) for x in await self._client.evalsha(self._sha, len(keys), *keys, *args)]
        self._written(tenant, held, args, got)
        return got

    def _hold_args(
        self, tenant: str, held: _Held | None
    ) -> tuple[list[str], list[str | int | float]]:
        assert self._tenancy is not None
        classes = self._tenancy.auth.classes
        ns = self._ns
        keys = [f"{{{ns}}}:live", f"{{{ns}}}:ttok:{tenant}", f"{{{ns}}}:treq:{tenant}"]
        budget, slots = self._budget(), self._slots()
        this, seqs = (held.tokens, held.seqs) if held is not None else (0, 0)
        own = next((i + 1 for i, c in enumerate(classes) if held and c.name == held.klass), 0)
        caps = self._caps(tenant) or (-1, -1)
        # The backend's slots are judged for a grant when classes have floors.
        node = held.slots if held is not None and self._floors() else 0
        on_node = self._node_seqs.get(held.backend, Counter()) if held else Counter()
        args: list[str | int | float] = [self._id, 1 if held else 0, this, seqs, own]
        args += [self._tokens[tenant] + this, self._requests[tenant] + (1 if held else 0)]
        args += [*caps, budget, slots, len(classes), node]
        for i, c in enumerate(classes):
            keys += [f"{{{ns}}}:ctok:{c.name}", f"{{{ns}}}:cseq:{c.name}"]
            mine = i + 1 == own
            args += [
                self._class_tokens[c.name] + (this if mine else 0),
                self._class_seqs[c.name] + (seqs if mine else 0),
                int(c.floor_share * budget),
                int(c.floor_share * slots),
                on_node[c.name] + (seqs if mine else 0),
                c.floor_share * node,
            ]
        if node and held is not None:
            keys += [node_key(self._ns, held.backend, c.name) for c in classes]
        return keys, args

    def _written(
        self, tenant: str, held: _Held | None, args: list[str | int | float], got: list[int]
    ) -> None:
        """After a script answered: what Redis now records for this replica, if written
        (a refused hold writes nothing)."""
        if held is None or got[0]:
            this, seqs = (held.tokens, held.seqs) if held is not None else (0, 0)
            self._recorded[tenant] = (int(args[5]), int(args[6]))
            self._recorded_total = (
                sum(self._class_tokens.values()) + this,
                sum(self._class_seqs.values()) + seqs,
            )

    def _add(self, r: Reservation, held: _Held) -> None:
        self._held[r.id] = held
        self._tokens[held.tenant] += held.tokens
        self._requests[held.tenant] += 1
        self._class_tokens[held.klass] += held.tokens
        self._class_seqs[held.klass] += held.seqs
        self._node_seqs.setdefault(held.backend, Counter())[held.klass] += held.seqs
        self._nodes_dirty.add(held.backend)  # its script wrote it, unless in the fallback

    def _seen(self, tenant: str, got: list[int], backend: str = "") -> None:
        """Take in the others' holdings a script answered (on ``backend`` too, if it
        judged one); reopen what fell."""
        assert self._tenancy is not None
        away = self._tenancy.elsewhere
        fell = got[1] < away.tokens[tenant] or got[2] < away.requests[tenant]
        away.tokens[tenant], away.requests[tenant] = got[1], got[2]
        classes = self._tenancy.auth.classes
        node = got[3 + 2 * len(classes) :]
        if backend and len(node) == len(classes):
            away.node_seqs[backend] = Counter(
                {c.name: s for c, s in zip(classes, node, strict=True)}
            )
        for i, c in enumerate(classes):
            tokens, seqs = got[3 + 2 * i], got[4 + 2 * i]
            fell |= tokens < away.class_tokens[c.name] or seqs < away.class_seqs[c.name]
            away.class_tokens[c.name], away.class_seqs[c.name] = tokens, seqs
        fell |= away.unclassed_tokens > 0 or away.unclassed_seqs > 0
        away.unclassed_tokens = away.unclassed_seqs = 0
        if fell:
            self._reopen(tenant)

    async def hold(self, r: Reservation) -> bool:
        """Hold ``r`` for its tenant and class across replicas; False: what the others
        hold leaves it no room (its gate now sees them)."""
        if self._tenancy is None or r.ticket is None:
            return True
        tenant = r.ticket.tenant
        if self._caps(tenant) is None and not self._floors():
            return True
        b = r.backend
        held = _Held(tenant, r.ticket.klass, r.tokens, r.seqs, b.name, b.max_num_seqs)
        if not self._shared():  # the fallback's share limited it; recorded once back
            self._add(r, held)
            return True
        try:
            async with asyncio.timeout(self._timeout):
                async with self._lock:
                    got = await self._call(tenant, held)
                    if got[0]:
                        self._add(r, held)
        except REDIS_FAILURES as exc:
            self._sha = ""
            log.debug("tenant holdings: hold not recorded: %r", exc)
            self._dirty.set()
            # The shared ledger finds Redis gone and falls back on its own; until then
            # this hold is judged as its fallback judges (the lease still live).
            self._fallback_view(self._concerned())
            away = self._tenancy.elsewhere
            others = (away.tokens[tenant], away.requests[tenant])
            mine = (self._tokens[tenant], self._requests[tenant])
            if over_limit(self._caps(tenant), mine, others, held.tokens):
                return False
            self._add(r, held)
            return True
        self._seen(tenant, got, held.backend)
        return bool(got[0])

    def released(self, r: Reservation) -> None:
        held = self._held.pop(r.id, None)
        if held is not None:
            self._tokens[held.tenant] -= held.tokens
            self._requests[held.tenant] -= 1
            self._class_tokens[held.klass] -= held.tokens
            self._class_seqs[held.klass] -= held.seqs
            self._node_seqs[held.backend][held.klass] -= held.seqs
            self._nodes_dirty.add(held.backend)
            self._dirty.set()

    @contextlib.asynccontextmanager
    async def running(
        self,
        tenancy: Tenancy,
        reopen: Callable[[str], None],
        floor_waits: Callable[[], Waits] = dict,
    ) -> AsyncIterator[None]:
        """Keep this replica's holdings written and the others' read until the block
        ends; ``reopen(tenant)``: what the others hold for ``tenant`` (or its class) fell;
        ``floor_waits()``: per class and model, how long the oldest request waiting
        behind the floors here has waited (s)."""
        self._tenancy, self._reopen, self._floor_waits = tenancy, reopen, floor_waits
        self._closing = False
        task = asyncio.create_task(self._loop(), name="tenant-holds")
        try:
            yield
        finally:
            self._closing = True
            await stop_tasks([task], self._timeout * 2 + REFRESH_S, "tenant holds loop", log)

    async def _loop(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REFRESH_S):
                    await self._dirty.wait()
            self._dirty.clear()
            await self.refresh()
            # Releases coming one after another are written together: a refresh after
            # each one would keep the lock busy, and holds waiting for it.
            await asyncio.sleep(REFRESH_GAP_S)

    def _concerned(self) -> list[str]:
        """The tenants whose holdings are refreshed: those with a limit; with floors and
        none of them, one call still refreshes the classes' ("": no tenant's)."""
        assert self._tenancy is not None
        auth = self._tenancy.auth
        names = sorted({t.name for t in (*auth.tenants, auth.default_tenant)})
        limited = [n for n in names if self._caps(n) is not None]
        return limited or ([""] if self._floors() else [])

    async def refresh(self) -> None:
        """Write this replica's holdings and read the others'; in the fallback, take the
        others to hold all but this replica's share."""
        if self._tenancy is None:
            return
        concerned = self._concerned()
        sharing = sharing_tenants(self._tenancy.auth)
        if not concerned and not sharing:
            return
        if not self._shared():
            if concerned:
                self._fallback_view(concerned)
            return
        # One round trip: the lock (which holds wait for) is held as briefly as it can be.
        nodes: set[str] = set()
        try:
            async with asyncio.timeout(self._timeout):
                await self._load()
                async with self._lock:
                    pipe = self._client.pipeline(transaction=False)
                    calls = [self._hold_args(t, None) for t in concerned]
                    for keys, args in calls:
                        pipe.evalsha(self._sha, len(keys), *keys, *args)
                    nodes, self._nodes_dirty = self._nodes_dirty, set()
                    if self._floors():
                        names = [c.name for c in self._tenancy.auth.classes]
                        held = {n: self._node_seqs.get(n, Counter()) for n in nodes}
                        write_node_seqs(pipe, self._ns, self._id, names, held)
                    me = (self._ns, self._id)
                    pairs = self._floor_pairs()
                    if pairs:
                        write_floor_waits(pipe, self._waits_sha, *me, pairs, self._floor_waits())
                    if sharing:
                        write_grants(pipe, self._granted_sha, *me, self._tenancy, sharing)
                    answers = await pipe.execute()
        except REDIS_FAILURES as exc:
            self._nodes_dirty |= nodes  # written at the next refresh
            self._sha = self._granted_sha = self._waits_sha = ""
            log.debug("tenant holdings: refresh failed: %r", exc)
            return
        self._fallback.answered()
        for tenant, (_, args), got in zip(concerned, calls, answers, strict=False):
            values = [int(x) for x in got]
            self._written(tenant, None, args, values)
            self._seen(tenant, values)
        if sharing:
            take_grants(self._tenancy, self._granted_seen, sharing, answers.pop())
        if pairs and take_floor_waits(self._tenancy.elsewhere, pairs, answers[-1]):
            self._reopen("")  # the others' oldest was served: ours ask again

    def _fallback_view(self, concerned: list[str]) -> None:
        """The others taken to hold all but this replica's share (see
        :func:`~kvgateway.ledger.fallback.tenant_fallback`); tenants whose view fell
        ask again."""
        assert self._tenancy is not None
        caps = {t: self._caps(t) or (0, 0) for t in concerned}
        fleet = (self._budget(), self._slots()) if self._floors() else None
        mine = TenantRecord(self._recorded, self._recorded_total, self._lease_left() > 0)
        now = asyncio.get_running_loop().time()
        fell = self._fallback.apply(self._tenancy.elsewhere, caps, fleet, mine, self._live(), now)
        for tenant in fell:
            self._reopen(tenant)
