"""Which members a DNS-discovered backend group gains and loses (pure; no I/O).

A group (``tiers[].backends[]`` with ``dns:``) has one member per address its name
resolves to, named ``pool@10.0.0.5:8000`` (``pool@[fd00::5]:8000`` for IPv6) so a member
keeps its identity, and its reservations and health, across lookups. The resolver loop in
:mod:`kvgateway.upstream.dns` feeds each answer here and hands a non-empty change to the
fleet, which adds the new members and drains the gone ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from kvgateway.config.model import BackendConfig, DnsGroupConfig, GatewayConfig


@dataclass(frozen=True, slots=True)
class MembershipChange:
    group: str
    added: tuple[BackendConfig, ...]
    removed: tuple[str, ...]
    # Every member after the change (sorted by name): what the fleet should hold.
    members: tuple[BackendConfig, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def canonical_addresses(addresses: Iterable[str]) -> frozenset[str]:
    """Addresses in one spelling (``fd00::5``, never ``fd00:0::5``); junk dropped."""
    out: set[str] = set()
    for raw in addresses:
        try:
            out.add(ipaddress.ip_address(raw.strip().strip("[]")).compressed)
        except ValueError:
            continue
    return frozenset(out)


def canonical_endpoints(endpoints: Iterable[tuple[str, int]]) -> frozenset[tuple[str, int]]:
    """(address, port) pairs with addresses in one spelling; junk dropped."""
    out: set[tuple[str, int]] = set()
    for address, port in endpoints:
        for canonical in canonical_addresses([address]):
            if 0 < port < 65536:
                out.add((canonical, port))
    return frozenset(out)


def diff_members(
    group: DnsGroupConfig, current: Iterable[str], endpoints: Iterable[str | tuple[str, int]]
) -> MembershipChange:
    """From the member names the fleet holds and a lookup's answer, what changes.

    ``endpoints``: addresses (on the group's port) or (address, port) pairs (SRV)."""
    pairs = [(e, group.port) if isinstance(e, str) else e for e in endpoints]
    wanted = {m.name: m for m in (group.member(a, p) for a, p in canonical_endpoints(pairs))}
    have = set(current)
    return MembershipChange(
        group=group.name,
        added=tuple(wanted[n] for n in sorted(wanted.keys() - have)),
        removed=tuple(sorted(have - wanted.keys())),
        members=tuple(wanted[n] for n in sorted(wanted)),
    )


class DiscoveredMembers:
    """The current members of every DNS group, and the config that lists them.

    The fleet is built from a config, and :meth:`Fleet.apply` already adds what is new,
    keeps what stays (with its reservations) and drains what is gone. So a membership
    change is applied as a config: the file's config with the members spliced in. A file
    reload goes through :meth:`rebase`, which keeps every surviving group's members (made
    again from the new group settings), so a reload does not drain them.
    """

    def __init__(self, base: GatewayConfig) -> None:
        self._base = base
        self._members: dict[str, tuple[BackendConfig, ...]] = {}

    @property
    def config(self) -> GatewayConfig:
        return with_members(self._base, self._members)

    def members(self, group: str) -> tuple[BackendConfig, ...]:
        return self._members.get(group, ())

    def set_members(self, group: str, members: Sequence[BackendConfig]) -> GatewayConfig:
        """Record ``group``'s members; returns the config to apply to the fleet."""
        self._members[group] = tuple(members)
        return self.config

    def preview(self, base: GatewayConfig) -> GatewayConfig:
        """The config a reload to ``base`` would make, changing nothing (so a reload
        rejected after this leaves the members on the config still running)."""
        return with_members(base, self._kept(base))

    def rebase(self, base: GatewayConfig) -> GatewayConfig:
        """A new file config; members of groups that still exist are kept, rebuilt from it."""
        self._base, self._members = base, self._kept(base)
        return self.config

    def _kept(self, base: GatewayConfig) -> dict[str, tuple[BackendConfig, ...]]:
        groups = {g.name: g for g in base.dns_groups}
        kept: dict[str, tuple[BackendConfig, ...]] = {}
        for name, members in self._members.items():
            group = groups.get(name)
            if group is not None:
                parts = [urlsplit(m.url) for m in members]
                pairs = [(u.hostname or "", u.port or group.port) for u in parts]
                if group.lookup == "address":  # the port is the group's, maybe changed
                    pairs = [(a, group.port) for a, _ in pairs]
                rebuilt = (group.member(a, p) for a, p in canonical_endpoints(pairs))
                kept[name] = tuple(sorted(rebuilt, key=lambda m: m.name))
        return kept


def with_members(
    config: GatewayConfig, members: Mapping[str, Sequence[BackendConfig]]
) -> GatewayConfig:
    """``config`` (as read from the file) with each DNS group's ``members`` (by group
    name) listed as backends of its tier, after the tier's own backends."""
    tiers = tuple(
        replace(
            t, backends=(*t.backends, *(m for g in t.dns_groups for m in members.get(g.name, ())))
        )
        for t in config.tiers
    )
    return replace(config, tiers=tiers)
