"""The membership diff of DNS-discovered groups: names, IPv6 spelling, add/remove sets."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from kvgateway.config.load import parse_config_text
from kvgateway.core.membership import DiscoveredMembers, canonical_addresses, diff_members

CONFIG = """
models: [{name: m}]
tiers:
  - name: t
    backends:
      - {name: pool, dns: vllm.ns.svc.cluster.local, port: 8000, model: m}
"""
GROUP = parse_config_text(CONFIG).dns_groups[0]


def test_first_answer_adds_every_member_named_after_its_address():
    change = diff_members(GROUP, [], ["10.0.0.6", "10.0.0.5", "fd00:0::5"])
    assert [m.name for m in change.added] == [
        "pool@10.0.0.5:8000",
        "pool@10.0.0.6:8000",
        "pool@[fd00::5]:8000",
    ]
    assert change.removed == ()
    assert change.members == change.added
    assert change.added[2].url == "http://[fd00::5]:8000"


def test_same_answer_is_no_change_and_gone_addresses_are_removed():
    first = diff_members(GROUP, [], ["10.0.0.5", "10.0.0.6"])
    names = [m.name for m in first.members]
    assert not diff_members(GROUP, names, ["10.0.0.6", "10.0.0.5"])
    second = diff_members(GROUP, names, ["10.0.0.6", "10.0.0.7"])
    assert [m.name for m in second.added] == ["pool@10.0.0.7:8000"]
    assert second.removed == ("pool@10.0.0.5:8000",)
    assert [m.name for m in second.members] == ["pool@10.0.0.6:8000", "pool@10.0.0.7:8000"]


def test_an_empty_answer_removes_every_member():
    change = diff_members(GROUP, ["pool@10.0.0.5:8000"], [])
    assert change.removed == ("pool@10.0.0.5:8000",) and change.members == ()


def test_junk_addresses_are_dropped():
    assert canonical_addresses(["10.0.0.1", "not-an-ip", "[::1]", ""]) == {"10.0.0.1", "::1"}


addresses = st.lists(st.ip_addresses().map(str), max_size=8)


@given(addresses, addresses)
def test_applying_the_change_gives_exactly_the_answer(before, after):
    current = [m.name for m in diff_members(GROUP, [], before).members]
    change = diff_members(GROUP, current, after)
    held = (set(current) - set(change.removed)) | {m.name for m in change.added}
    assert held == {m.name for m in change.members}
    assert held == {GROUP.member(ipaddress.ip_address(a).compressed).name for a in after}
    assert not set(change.removed) & {m.name for m in change.added}


def test_members_are_spliced_after_the_tiers_own_backends_and_rebased_on_reload():
    text = CONFIG + '      - {name: fixed, url: "http://127.0.0.1:9", model: m}\n'
    book = DiscoveredMembers(parse_config_text(text))
    group = book.config.dns_groups[0]
    cfg = book.set_members("pool", [group.member("10.0.0.6"), group.member("10.0.0.5")])
    assert [b.name for b in cfg.backends] == ["fixed", "pool@10.0.0.6:8000", "pool@10.0.0.5:8000"]
    assert cfg.resolve_model("m") is not None
    # Reload with the group renamed away: its members go; with it kept, they stay.
    assert [
        b.name for b in book.rebase(parse_config_text(text.replace("pool", "other"))).backends
    ] == ["fixed"]
    book.set_members("other", [group.member("10.0.0.7")])
    assert [
        b.name for b in book.rebase(parse_config_text(text.replace("pool", "other"))).backends
    ] == [
        "fixed",
        "other@10.0.0.7:8000",
    ]


def test_srv_endpoints_carry_their_own_ports():
    change = diff_members(
        GROUP, ["pool@10.0.0.5:8000"], [("10.0.0.5", 9001), ("10.0.0.5", 9002), ("10.0.0.5", 0)]
    )
    assert [m.name for m in change.added] == ["pool@10.0.0.5:9001", "pool@10.0.0.5:9002"]
    assert change.removed == ("pool@10.0.0.5:8000",)
    assert change.added[0].url == "http://10.0.0.5:9001"
