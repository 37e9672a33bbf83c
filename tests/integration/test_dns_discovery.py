"""DNS discovery against a real DNS server (dnsmasq) on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgateway.config.load import parse_config
from kvgateway.config.model import BackendConfig, DnsGroupConfig
from kvgateway.config.yamlread import ConfigError
from kvgateway.core.derived_limits import derive_all
from kvgateway.core.fleet import Fleet
from kvgateway.core.membership import DiscoveredMembers
from kvgateway.upstream.dns import DnsDiscovery, DnsLookupError, resolve_addresses
from tests.support.dnsmasq import DOMAIN, Dnsmasq, run_dnsmasq
from tests.support.eventually import eventually

NAME = f"vllm.{DOMAIN}"


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[Dnsmasq]:
    with run_dnsmasq(tmp_path) as server:
        yield server


def config(dns: Dnsmasq, interval: float = 0.05) -> dict[str, Any]:
    return {
        "models": [{"name": "m"}],
        "discovery": {"nameservers": [dns.nameserver], "timeout_s": 0.5},
        "tiers": [
            {
                "name": "t",
                "backends": [
                    {
                        "name": "pool",
                        "dns": NAME,
                        "port": 8000,
                        "model": "m",
                        "resolve_interval_s": interval,
                        "max_num_seqs": 4,
                    }
                ],
            }
        ],
    }


def group_of(dns: Dnsmasq) -> DnsGroupConfig:
    (group,) = parse_config(config(dns)).dns_groups
    return group


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def set_members(self, group: str, members: Sequence[BackendConfig]) -> None:
        self.calls.append((group, tuple(m.name for m in members)))

    @property
    def current(self) -> set[str]:
        return set(self.calls[-1][1]) if self.calls else set()

    async def wait_for(self, names: set[str], timeout: float = 5.0) -> None:
        await eventually(lambda: self.current == names, timeout=timeout, interval=0.02)


async def test_resolves_a_and_aaaa_and_an_unknown_name_is_empty(dns: Dnsmasq) -> None:
    dns.set_addresses({NAME: ["127.0.0.5", "127.0.0.6", "fd00::5"]})
    found = await resolve_addresses(NAME, timeout=1.0, nameservers=[dns.nameserver])
    assert found == {"127.0.0.5", "127.0.0.6", "fd00::5"}
    assert (
        await resolve_addresses(f"nope.{DOMAIN}", timeout=1.0, nameservers=[dns.nameserver])
        == frozenset()
    )


async def test_a_server_that_does_not_answer_is_a_lookup_error(dns: Dnsmasq) -> None:
    dead = dns.nameserver.rsplit(":", 1)[0] + ":1"
    with pytest.raises(DnsLookupError):
        await resolve_addresses(NAME, timeout=0.3, nameservers=[dead])


async def test_members_appear_and_disappear_as_records_change(dns: Dnsmasq) -> None:
    dns.set_addresses({NAME: ["127.0.0.5", "127.0.0.6"]})
    group = group_of(dns)
    sink = RecordingSink()
    async with DnsDiscovery([group], sink, nameservers=[dns.nameserver], timeout_s=0.5) as disc:
        await sink.wait_for({"pool@127.0.0.5:8000", "pool@127.0.0.6:8000"})
        dns.set_addresses({NAME: ["127.0.0.6", "127.0.0.7", "fd00::7"]})
        await sink.wait_for({"pool@127.0.0.6:8000", "pool@127.0.0.7:8000", "pool@[fd00::7]:8000"})
        dns.set_addresses({})  # the Service scaled to zero: the name is gone
        await sink.wait_for(set())
        dns.set_addresses({NAME: ["127.0.0.8"]})
        await sink.wait_for({"pool@127.0.0.8:8000"})
        assert disc.members("pool") == ("pool@127.0.0.8:8000",)
        calls = len(sink.calls)
        # DNS down: lookups fail, the members stay.
        dns.stop()
        assert not await disc.refresh(group)
        await asyncio.sleep(0.3)
        assert len(sink.calls) == calls and disc.members("pool") == ("pool@127.0.0.8:8000",)
    # Unchanged answers are not passed on: one call per change.
    assert [len(c[1]) for c in sink.calls] == [2, 3, 0, 1]
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("dns-discovery:")]
    assert not tasks


def test_check_lists_the_groups_current_members(dns: Dnsmasq, tmp_path: Path) -> None:
    dns.set_addresses({NAME: ["127.0.0.5"]})
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config(dns)))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgateway",
            "check",
            "--config",
            str(path),
            "--json",
            "--timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    doc = json.loads(res.stdout)
    assert [r["name"] for r in doc["backends"]] == ["pool@127.0.0.5:8000"]
    assert doc["backends"][0]["max_num_seqs"]["value"] == 4
    # Nothing listens there: the model has no routable backend.
    assert res.returncode == 1 and "m" in doc["unroutable_models"]


def fleet_config(dns: Dnsmasq, max_num_seqs: int = 4) -> dict[str, Any]:
    cfg = config(dns)
    group = cfg["tiers"][0]["backends"][0]
    group["max_num_seqs"] = max_num_seqs
    cfg["tiers"][0]["backends"].insert(
        0, {"name": "static", "url": "http://127.0.0.1:9", "model": "m", "max_num_seqs": 2}
    )
    return cfg


async def test_members_join_and_drain_a_real_fleet(dns: Dnsmasq) -> None:
    """The wiring the server needs, end to end but for HTTP: DNS answers become fleet
    members through a config (Fleet.apply), existing members keep their state, removed
    ones drain until their last request ends, and a file reload keeps the members."""
    book = DiscoveredMembers(parse_config(fleet_config(dns)))
    fleet = Fleet(book.config)

    class FleetSink:
        def set_members(self, group: str, members: Sequence[BackendConfig]) -> None:
            cfg = book.set_members(group, members)
            fleet.apply(cfg, derive_all(cfg))

    def active() -> set[str]:
        return {b.name for b in fleet.active}

    async def until(names: set[str]) -> None:
        await eventually(lambda: active() == names, timeout=5, interval=0.02)

    dns.set_addresses({NAME: ["127.0.0.5", "127.0.0.6"]})
    (group,) = book.config.dns_groups
    async with DnsDiscovery([group], FleetSink(), nameservers=[dns.nameserver], timeout_s=0.5):
        await until({"static", "pool@127.0.0.5:8000", "pool@127.0.0.6:8000"})
        leaving, staying = fleet.get("pool@127.0.0.5:8000"), fleet.get("pool@127.0.0.6:8000")
        assert leaving is not None and staying is not None
        assert staying.config.max_num_seqs == 4 and staying.tier == "t"
        fleet.adjust(leaving, 100, 1, 1)  # a request in flight on the member that goes
        dns.set_addresses({NAME: ["127.0.0.6", "127.0.0.7"]})
        await until({"static", "pool@127.0.0.6:8000", "pool@127.0.0.7:8000"})
        assert fleet.get("pool@127.0.0.6:8000") is staying  # same object: state kept
        assert leaving.draining and leaving in fleet.backends
        fleet.adjust(leaving, -100, -1, -1)
        fleet.reap_drained()
        assert leaving not in fleet.backends
    # A file reload (here: the group's max_num_seqs changed) keeps the members.
    cfg = book.rebase(parse_config(fleet_config(dns, max_num_seqs=8)))
    fleet.apply(cfg, derive_all(cfg))
    assert active() == {"static", "pool@127.0.0.6:8000", "pool@127.0.0.7:8000"}
    member = fleet.get("pool@127.0.0.7:8000")
    assert member is not None and member.config.max_num_seqs == 8


async def test_srv_members_each_have_their_own_port(dns: Dnsmasq) -> None:
    """`lookup: srv`: members on one address, told apart by the ports their SRV records give
    (as a headless Service's named port publishes them)."""
    srv_name = f"_http._tcp.vllm.{DOMAIN}"
    dns.set_addresses({f"node-a.{DOMAIN}": ["127.0.0.1"], f"node-b.{DOMAIN}": ["127.0.0.1"]})
    dns.set_srv({srv_name: [(f"node-a.{DOMAIN}", 9001), (f"node-b.{DOMAIN}", 9002)]})
    cfg = config(dns)
    backend = cfg["tiers"][0]["backends"][0]
    backend.update({"dns": srv_name, "lookup": "srv"})
    del backend["port"]
    (group,) = parse_config(cfg).dns_groups
    sink = RecordingSink()
    async with DnsDiscovery([group], sink, nameservers=[dns.nameserver], timeout_s=0.5):
        await sink.wait_for({"pool@127.0.0.1:9001", "pool@127.0.0.1:9002"})
        dns.set_srv({srv_name: [(f"node-b.{DOMAIN}", 9002), (f"node-b.{DOMAIN}", 9003)]})
        await sink.wait_for({"pool@127.0.0.1:9002", "pool@127.0.0.1:9003"})
    with pytest.raises(ConfigError, match="leave `port` out"):
        parse_config({**cfg, "tiers": [{"name": "t", "backends": [{**backend, "port": 1}]}]})


async def test_a_failing_sink_does_not_stop_discovery(
    dns: Dnsmasq, caplog: pytest.LogCaptureFixture
) -> None:
    class FlakySink(RecordingSink):
        def set_members(self, group: str, members: Sequence[BackendConfig]) -> None:
            if not self.calls and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("fleet not ready")
            super().set_members(group, members)

    dns.set_addresses({NAME: ["127.0.0.5"]})
    sink = FlakySink()
    async with DnsDiscovery([group_of(dns)], sink, nameservers=[dns.nameserver], timeout_s=0.5):
        await sink.wait_for({"pool@127.0.0.5:8000"})
    assert "applying the lookup failed" in caplog.text


async def test_members_appear_and_leave_a_running_gateway_under_load(
    dns: Dnsmasq, aiohttp_server
) -> None:
    """The whole path: a gateway whose backend group is a DNS name, real simulated nodes
    behind SRV records, traffic throughout; a member that leaves drains, one that comes
    takes work, and no request fails."""
    import dataclasses

    import aiohttp

    from kvgateway.server.app import STATE, create_app
    from kvgateway.simulator.profiles import get_profile
    from kvgateway.simulator.server import create_node_app
    from tests.support.fleet import ENCODINGS, SERVED

    ports = []
    for name in ("a", "b"):
        settings = dataclasses.replace(
            get_profile("gpu24-8b"), name=name, model=SERVED, time_scale=100.0, seed=1
        )
        node = await aiohttp_server(create_node_app(settings, encodings=ENCODINGS))
        ports.append(node.port)
    srv_name = f"_http._tcp.vllm.{DOMAIN}"
    dns.set_addresses({f"node.{DOMAIN}": ["127.0.0.1"]})
    dns.set_srv({srv_name: [(f"node.{DOMAIN}", ports[0])]})
    cfg = {
        "models": [{"name": "m", "served_name": SERVED}],
        "discovery": {"nameservers": [dns.nameserver], "timeout_s": 0.5},
        "health": {"interval_s": 0.1, "timeout_s": 1},
        "tiers": [
            {
                "name": "t",
                "backends": [
                    {
                        "name": "pool",
                        "dns": srv_name,
                        "lookup": "srv",
                        "model": "m",
                        "resolve_interval_s": 0.1,
                    }
                ],
            }
        ],
    }
    gw = await aiohttp_server(create_app(parse_config(cfg), encodings=ENCODINGS))
    state = gw.app[STATE]
    url = str(gw.make_url("/v1/chat/completions"))
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    statuses: list[int] = []
    served_by: set[str] = set()
    stop = asyncio.Event()

    async def traffic(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with s.post(url, json=body) as r:
                statuses.append(r.status)
                if r.status == 200:
                    served_by.add(r.headers["x-gateway-backend"])
                await r.read()

    def names() -> set[str]:
        return {b.name for b in state.fleet.active if b.usable}

    async def until(pred, timeout: float = 10.0) -> None:
        await eventually(pred, timeout=timeout)

    a, b = f"pool@127.0.0.1:{ports[0]}", f"pool@127.0.0.1:{ports[1]}"
    await until(lambda: names() == {a})
    async with aiohttp.ClientSession() as s:
        workers = [asyncio.create_task(traffic(s)) for _ in range(4)]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(dns.set_srv, {srv_name: [(f"node.{DOMAIN}", ports[1])]})
        await until(lambda: names() == {b})
        served_by.clear()
        await asyncio.sleep(0.5)
        assert served_by == {b}  # the gone member takes no new work
        await until(lambda: all(x.name != a for x in state.fleet.backends))  # drained, removed
        await asyncio.to_thread(dns.set_srv, {srv_name: [(f"node.{DOMAIN}", p) for p in ports]})
        await until(lambda: names() == {a, b})
        served_by.clear()
        await until(lambda: served_by == {a, b})
        stop.set()
        await asyncio.gather(*workers)
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


def gateway_config(
    dns: Dnsmasq, port: int = 8000, kv: int = 100_000, **group: object
) -> dict[str, Any]:
    """A DNS group whose limits are configured (no node needs to answer for them)."""
    cfg = config(dns, interval=0.05)
    cfg["tiers"][0]["backends"][0].update(
        {"port": port, "discover": False, "max_model_len": 4096, "kv_cache_tokens": kv, **group}
    )
    cfg["health"] = {"interval_s": 5}
    return cfg


async def test_reloads_change_a_running_gateways_dns_groups(
    dns: Dnsmasq, aiohttp_server, tmp_path: Path
) -> None:
    """A reload rejected after parsing changes nothing (later DNS changes still apply to
    the members of the config in force); a reload that changes a group's settings is
    looked up with them from then on (the next DNS change keeps the new port and budget);
    a group removed stops, and comes back when configured again. Members' KV events come
    from their own addresses."""
    from kvgateway.config.load import load_config
    from kvgateway.server.app import KV_EVENTS, STATE, create_app
    from kvgateway.server.reload import reload_config

    dns.set_addresses({NAME: ["127.0.0.2"]})
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(gateway_config(dns)))
    gw = await aiohttp_server(create_app(load_config(str(path))))
    app = gw.app
    state = app[STATE]

    def members() -> set[tuple[str, int | None]]:
        return {(b.name, b.kv_cache_tokens) for b in state.fleet.active}

    async def until(want: set[tuple[str, int | None]]) -> None:
        await eventually(lambda: members() == want, timeout=5, interval=0.02)

    await until({("pool@127.0.0.2:8000", 100_000)})
    # Parses, then fails the capacity derivation: rejected, and nothing of it kept.
    bad = gateway_config(dns)
    bad["tiers"][0]["backends"].append(
        {"name": "static", "url": "http://127.0.0.9:1", "model": "m", "capacity": {"nope": 1}}
    )
    path.write_text(yaml.safe_dump(bad))
    assert reload_config(app, str(path)) is False
    await asyncio.to_thread(dns.set_addresses, {NAME: ["127.0.0.2", "127.0.0.3"]})
    await until({("pool@127.0.0.2:8000", 100_000), ("pool@127.0.0.3:8000", 100_000)})

    # New port, smaller budget, KV events: the members now, and the next answer too.
    path.write_text(
        yaml.safe_dump(gateway_config(dns, port=9000, kv=50_000, kv_events=f"tcp://{NAME}:5557"))
    )
    assert reload_config(app, str(path))
    await until({("pool@127.0.0.2:9000", 50_000), ("pool@127.0.0.3:9000", 50_000)})
    await asyncio.to_thread(dns.set_addresses, {NAME: ["127.0.0.3", "127.0.0.4"]})
    await until({("pool@127.0.0.3:9000", 50_000), ("pool@127.0.0.4:9000", 50_000)})
    sub = app[KV_EVENTS].subscriber("pool@127.0.0.4:9000")
    assert sub is not None and sub.source.endpoint == "tcp://127.0.0.4:5557"
    assert app[KV_EVENTS].subscriber("pool@127.0.0.2:9000") is None  # gone with its member

    # The group removed: its members leave and the lookups stop; configured again, back.
    no_group = gateway_config(dns)
    no_group["tiers"][0]["backends"] = [
        {"name": "static", "url": "http://127.0.0.9:1", "model": "m", "discover": False}
        | {"max_model_len": 4096, "kv_cache_tokens": 1000}
    ]
    path.write_text(yaml.safe_dump(no_group))
    assert reload_config(app, str(path))
    await until({("static", 1000)})
    await eventually(
        lambda: not [t for t in asyncio.all_tasks() if t.get_name() == "dns-discovery:pool"],
        timeout=2,
        interval=0.02,
        what="the pool's discovery task ended",
    )
    path.write_text(yaml.safe_dump(gateway_config(dns)))
    assert reload_config(app, str(path))
    await until({("pool@127.0.0.3:8000", 100_000), ("pool@127.0.0.4:8000", 100_000)})


def test_a_dns_groups_kv_events_name_the_group(dns: Dnsmasq) -> None:
    """One publisher for every member would credit each with all the others' caches."""
    cfg = gateway_config(dns, kv_events="tcp://10.0.0.1:5557")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.backends\[0\]\.kv_events: a dns group"):
        parse_config(cfg)
    (group,) = parse_config(gateway_config(dns, kv_events=f"tcp://{NAME}:5557")).dns_groups
    assert group.member("fd00::7").kv_events == "tcp://[fd00::7]:5557"
