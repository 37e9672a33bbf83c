"""The shared ledger's calls to Redis, one method per Lua script of
:mod:`kvgateway.ledger.scripts`, with the keys and arguments in the order the script
takes them. No state here beyond the scripts' hashes: what the calls mean for this
replica's holdings is :class:`kvgateway.ledger.redis_ledger.RedisLedger`'s business.
Unbounded on their own: the caller bounds every call."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from kvgateway.core.backends import Backend
from kvgateway.core.reservation import Amount
from kvgateway.ledger.scripts import HEARTBEAT, MARK, RELEASE, RESERVE, Keys


class LedgerCalls:
    def __init__(
        self,
        client: Redis,
        keys: Keys,
        replica_id: str,
        lease_ms: int,
        stall_ms: int,
        *,
        slots: int = 30,
    ) -> None:
        self._client = client
        # The ledger's epoch as Redis last told it (0: not yet): another one means Redis
        # lost its data, and the scripts stall grants for stall_ms.
        self.epoch = 0
        self._stall_ms = stall_ms
        # Calls wait their turn here, first come first served, for fewer than the pool's
        # connections (the listener holds one): redis-py's blocking pool hands freed
        # connections out unfairly, and with more callers than connections some waited
        # past the call's bound (2 of 6,600 calls at 33 callers, 64 of 12,800 at 64),
        # throwing a healthy replica into its fallback.
        self._slots = asyncio.Semaphore(slots)
        self._keys = keys
        self._id = replica_id
        self._lease_ms = lease_ms
        self._shas: dict[str, str] = {}

    async def load_scripts(self) -> None:
        scripts = {"reserve": RESERVE, "release": RELEASE, "heartbeat": HEARTBEAT, "mark": MARK}
        async with self._slots:
            for name, src in scripts.items():
                self._shas[name] = await self._client.script_load(src)

    async def reserve(
        self, b: Backend, tokens: int, seqs: int, *, queued: bool, still_waiting: bool
    ) -> tuple[int, int, int, int, int, int]:
        """(granted, others' tokens, others' seqs, live replicas, lease had lapsed, ms
        the stall has left)."""
        async with self._slots:
            got = await self._evalsha_reserve(b, tokens, seqs, queued, still_waiting)
        granted, others_t, others_s, live, lapsed, stall, self.epoch = (int(x) for x in got)
        return granted, others_t, others_s, live, lapsed, stall

    async def _evalsha_reserve(
        self, b: Backend, tokens: int, seqs: int, queued: bool, still_waiting: bool
    ) -> list[bytes]:
        return await self._client.evalsha(  # type: ignore[no-any-return]
            self._shas["reserve"],
            5,
            *self._keys.backend(b.name),
            self._keys.waiting(b.name),
            self._keys.epoch,
            self._id,
            tokens,
            seqs,
            b.budget_tokens,
            b.max_num_seqs,
            self._lease_ms,
            int(queued),
            int(still_waiting),
            self._keys.channel,
            b.name,
            self.epoch,
            self._stall_ms,
        )

    async def heartbeat(
        self, names: Sequence[str], own: Sequence[Amount] | None, waiting: set[str]
    ) -> list[int]:
        """Renew the lease, write the wait marks and, with ``own``, this replica's
        holdings as absolute values: [live replicas, lapsed, ms the stall has left, then
        per backend name others' tokens, others' seqs and whether another replica waits
        there]."""
        keys: list[str] = [self._keys.live, self._keys.epoch]
        args: list[int | str] = [
            self._id,
            self._lease_ms,
            int(own is not None),
            self.epoch,
            self._stall_ms,
        ]
        for i, name in enumerate(names):
            keys += [self._keys.tokens(name), self._keys.seqs(name), self._keys.waiting(name)]
            args += [own[i].tokens, own[i].seqs] if own is not None else [0, 0]
            args.append(int(name in waiting))
        async with self._slots:
            got = await self._client.evalsha(self._shas["heartbeat"], len(keys), *keys, *args)
        values = [int(x) for x in got]
        self.epoch = values[3]
        return values[:3] + values[4:]

    async def release(
        self,
        totals: Mapping[str, tuple[int, int]],
        enter: Iterable[str] = (),
        leave: Iterable[str] = (),
    ) -> None:
        """One pipeline: wait marks (entered, left) and releases per backend."""
        marks = [(name, 1) for name in enter] + [(name, 0) for name in leave]
        if not totals and not marks:
            return
        pipe = self._client.pipeline(transaction=False)
        for name, flag in marks:
            pipe.evalsha(
                self._shas["mark"], 1, self._keys.waiting(name), self._id, flag,
                self._keys.channel, name,
            )  # fmt: skip
        for name, (tokens, seqs) in totals.items():
            pipe.evalsha(
                self._shas["release"], 3, *self._keys.backend(name), self._id, tokens, seqs,
                self._keys.channel, name,
            )  # fmt: skip
        async with self._slots:
            await pipe.execute()

    async def ping(self) -> None:
        async with self._slots:
            await self._client.ping()

    async def leave(self) -> None:
        """Drop the lease now (a clean stop)."""
        async with self._slots:
            await self._client.zrem(self._keys.live, self._id)

    def pubsub(self) -> PubSub:
        return self._client.pubsub()

    async def close(self) -> None:
        await self._client.aclose()


def release_totals(batch: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """Releases summed per backend (one script call each)."""
    totals: dict[str, tuple[int, int]] = {}
    for name, tokens, seqs in batch:
        t = totals.get(name, (0, 0))
        totals[name] = (t[0] + tokens, t[1] + seqs)
    return totals
