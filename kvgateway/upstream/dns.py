"""DNS discovery: keep each ``dns:`` backend group's members in step with its A/AAAA records.

A Kubernetes headless Service answers with one address per ready pod. Every
``resolve_interval_s`` the group's name is looked up (A and AAAA together; or, with
``lookup: srv``, its SRV records and their targets' addresses); the answer goes
through :func:`kvgateway.core.membership.diff_members`, and a change is handed to the
:class:`MemberSink` (the fleet), which adds new members and drains the gone ones.

A failed lookup (server down, timeout, refused) changes nothing: a DNS outage must not
empty the fleet. Only an answer, "no such name" or "no records" included, is believed, as
a Service scaled to zero gives exactly that.

Lookups use c-ares through ``aiodns``; ``nameservers`` (``"10.96.0.10"`` or
``"127.0.0.1:5353"``) overrides the system resolver, which the tests use to talk to a
dnsmasq on loopback. Each lookup gets a fresh c-ares channel: a channel keeps a query
cache that also holds negative answers, so a long-lived one would hide a new pod's first
AAAA record behind an earlier "no records". The server's own cache (CoreDNS) still applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

import aiodns
import aiodns.error

from kvgateway.config.model import BackendConfig, DnsGroupConfig
from kvgateway.core.membership import canonical_addresses, canonical_endpoints, diff_members

log = logging.getLogger("kvgateway.upstream.dns")

# c-ares status codes that are answers: the name or the record type does not exist.
_NO_RECORDS = frozenset({aiodns.error.ARES_ENOTFOUND, aiodns.error.ARES_ENODATA})


class DnsLookupError(Exception):
    """The name could not be looked up; unlike an empty answer, this says nothing."""


class MemberSink(Protocol):
    def set_members(self, group: str, members: Sequence[BackendConfig]) -> None:
        """Make ``members`` the group's members: add the new, drain the ones not listed."""


def make_resolver(nameservers: Sequence[str] = (), timeout: float = 2.0) -> aiodns.DNSResolver:
    """A resolver for the running loop; one try per lookup, bounded by ``timeout``."""
    return aiodns.DNSResolver(nameservers=list(nameservers) or None, timeout=timeout, tries=1)


async def resolve_addresses(
    name: str, *, timeout: float, nameservers: Sequence[str] = ()
) -> frozenset[str]:
    """Every A and AAAA address of ``name`` (empty when it has none)."""
    res = make_resolver(nameservers, timeout)
    try:
        async with asyncio.timeout(timeout * 2):
            return await _addresses(res, name)
    except TimeoutError as exc:
        raise DnsLookupError(f"looking up {name} timed out after {timeout * 2:g}s") from exc
    finally:
        await res.close()


async def resolve_group(
    group: DnsGroupConfig, *, timeout: float, nameservers: Sequence[str] = ()
) -> frozenset[tuple[str, int]]:
    """The group's (address, port) endpoints: A/AAAA on its port, or SRV targets' own."""
    if group.lookup == "address":
        found = await resolve_addresses(group.dns, timeout=timeout, nameservers=nameservers)
        return frozenset((a, group.port) for a in found)
    res = make_resolver(nameservers, timeout)
    try:
        async with asyncio.timeout(timeout * 3):
            records = await _srv(res, group.dns)
            targets = sorted({target for target, _ in records})
            resolved = await asyncio.gather(*(_addresses(res, t) for t in targets))
    except TimeoutError as exc:
        raise DnsLookupError(f"looking up {group.dns} timed out") from exc
    finally:
        await res.close()
    by_target = dict(zip(targets, resolved, strict=True))
    return canonical_endpoints((a, port) for target, port in records for a in by_target[target])


async def _addresses(res: aiodns.DNSResolver, name: str) -> frozenset[str]:
    if canonical_addresses([name]):  # an SRV target may be an address already
        return canonical_addresses([name])
    found = await asyncio.gather(_query(res, name, "A"), _query(res, name, "AAAA"))
    return canonical_addresses(str(r.addr) for family in found for r in family)


async def _srv(res: aiodns.DNSResolver, name: str) -> list[tuple[str, int]]:
    return [(str(r.target).rstrip("."), int(r.port)) for r in await _query(res, name, "SRV")]


async def _query(resolver: aiodns.DNSResolver, name: str, qtype: str) -> list[Any]:
    """The record data of the answer (empty for "no such name" or "no such record")."""
    try:
        result = await resolver.query_dns(name, qtype)
    except aiodns.error.DNSError as exc:
        code = exc.args[0] if exc.args else None
        if code in _NO_RECORDS:
            return []
        detail = exc.args[1] if len(exc.args) > 1 else str(exc)
        raise DnsLookupError(f"looking up {name} ({qtype}) failed: {detail}") from exc
    wanted = {"A": 1, "AAAA": 28, "SRV": 33}[qtype]
    return [r.data for r in result.answer if r.type == wanted]


class DnsDiscovery:
    """Owns one named task per group; ``async with`` starts them and stops them on exit."""

    def __init__(
        self,
        groups: Sequence[DnsGroupConfig],
        sink: MemberSink,
        *,
        nameservers: Sequence[str] = (),
        timeout_s: float = 2.0,
    ) -> None:
        self._groups = {g.name: g for g in groups}
        self._sink = sink
        self._nameservers = tuple(nameservers)
        self._timeout = timeout_s
        self._members: dict[str, tuple[str, ...]] = {g.name: () for g in groups}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopped: set[asyncio.Task[None]] = set()
        self._running = False

    def members(self, group: str) -> tuple[str, ...]:
        """The member names last handed to the sink for ``group``."""
        return self._members[group]

    def update(
        self, groups: Sequence[DnsGroupConfig], members: Callable[[str], Sequence[BackendConfig]]
    ) -> None:
        """Follow a reloaded config. A group that is new or whose settings changed is
        watched afresh from ``members(name)`` (the members the reload kept, rebuilt from
        the new settings); one no longer configured is not watched any more (its members
        left with the config); an unchanged one goes on as it was."""
        wanted = {g.name: g for g in groups}
        for name in list(self._groups):
            if wanted.get(name) != self._groups[name]:
                task = self._tasks.pop(name, None)
                if task is not None:
                    task.cancel("dns group changed by a reload")
                    self._stopped.add(task)
                    task.add_done_callback(self._stopped.discard)
                del self._groups[name], self._members[name]
        for name, group in wanted.items():
            if name not in self._groups:
                self._groups[name] = group
                self._members[name] = tuple(m.name for m in members(name))
                if self._running:
                    self._start(group)

    def _start(self, group: DnsGroupConfig) -> None:
        self._tasks[group.name] = asyncio.create_task(
            self._watch(group), name=f"dns-discovery:{group.name}"
        )

    async def __aenter__(self) -> DnsDiscovery:
        self._running = True
        for g in self._groups.values():
            self._start(g)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *self._stopped]
        for task in tasks:
            task.cancel("gateway shutting down")
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = {}

    async def refresh(self, group: DnsGroupConfig) -> bool:
        """Look the group up once and apply the answer; False if the lookup failed."""
        try:
            endpoints = await resolve_group(
                group, timeout=self._timeout, nameservers=self._nameservers
            )
        except DnsLookupError as exc:
            log.warning(
                "dns group %s: %s; keeping its %d member(s)",
                group.name,
                exc,
                len(self._members[group.name]),
            )
            return False
        change = diff_members(group, self._members[group.name], endpoints)
        if change:
            log.info(
                "dns group %s (%s): +%s -%s",
                group.name,
                group.dns,
                ",".join(m.name for m in change.added) or "none",
                ",".join(change.removed) or "none",
            )
            self._sink.set_members(group.name, change.members)
            self._members[group.name] = tuple(m.name for m in change.members)
        return True

    async def _watch(self, group: DnsGroupConfig) -> None:
        while True:
            try:
                await self.refresh(group)
            except Exception:
                # A failing sink must not end discovery for good: say so, try next round.
                log.exception("dns group %s: applying the lookup failed", group.name)
            await asyncio.sleep(group.resolve_interval_s)
