"""Which members a DNS-discovered backend group gains and loses (pure; no I/O).

A group (``tiers[].backends[]`` with ``dns:``) has one member per address its name
resolves to, named ``pool@10.0.0.5:8000`` (``pool@[fd00::5]:8000`` for IPv6) so a member
keeps its identity, and its reservations and health, across lookups. The resolver loop in
:mod:`kvgateway.upstream.dns` feeds each answer here and hands a non-empty change to the
fleet, which adds the new members and drains the gone ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from kvgateway.config.model import BackendConfig, DnsGroupConfig


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


def diff_members(
    group: DnsGroupConfig, current: Iterable[str], addresses: Iterable[str]
) -> MembershipChange:
    """From the member names the fleet holds and a lookup's addresses, what changes."""
    wanted = {m.name: m for m in (group.member(a) for a in canonical_addresses(addresses))}
    have = set(current)
    return MembershipChange(
        group=group.name,
        added=tuple(wanted[n] for n in sorted(wanted.keys() - have)),
        removed=tuple(sorted(have - wanted.keys())),
        members=tuple(wanted[n] for n in sorted(wanted)),
    )
