"""Fleet specs from the gateway's YAML, in-process and per-process fleets, the CLI."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.http_exceptions import HttpProcessingError

from kvgateway.simulator.fleet import start_fleet
from kvgateway.simulator.fleetconfig import (
    SimulatorConfigError,
    load_fleet_config,
    node_spec,
    parse_fleet_config,
)
from kvgateway.simulator.profiles import PROFILES
from kvgateway.simulator.settings import SettingsError
from tests.support.eventually import eventually

ROOT = Path(__file__).parents[3]
DEMO = ROOT / "config" / "demo.yaml"
SERVED = "meta-llama/Llama-3.1-8B-Instruct"


def config(**extra: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "llama", "served_name": SERVED}, {"name": "plain"}],
        "tiers": [
            {
                "name": "a",
                "backends": [
                    {"name": "real", "url": "http://10.0.0.1:8000", "model": "llama"},
                    {
                        "name": "a-1",
                        "url": "http://127.0.0.1:9101",
                        "model": "llama",
                        "simulate": {"profile": "gpu24-8b"},
                    },
                ],
            },
            {
                "name": "b",
                "backends": [
                    {
                        "name": "b-1",
                        "url": "http://127.0.0.1:9201",
                        "model": "plain",
                        "simulate": {"profile": "gpu80-8b", "max_num_seqs": 64, "time_scale": 3},
                    }
                ],
            },
        ],
        **extra,
    }


def test_demo_config_describes_six_nodes() -> None:
    specs = load_fleet_config(DEMO)
    assert [(s.name, s.port, s.settings.profile) for s in specs] == [
        ("small-1", 9101, "gpu24-8b"),
        ("small-2", 9102, "gpu24-8b"),
        ("small-3", 9103, "gpu24-8b"),
        ("large-1", 9201, "gpu80-8b"),
        ("large-2", 9202, "gpu80-8b"),
        ("offload-1", 9301, "offload-8b"),
    ]
    assert all(s.host == "127.0.0.1" and s.settings.model == SERVED for s in specs)


def test_profiles_carry_the_documented_numbers() -> None:
    small, large, offload = PROFILES["gpu24-8b"], PROFILES["gpu80-8b"], PROFILES["offload-8b"]
    assert (small.max_model_len, small.max_num_seqs) == (8192, 16)
    assert 28_000 < small.kv_tokens < 34_000
    assert (large.max_model_len, large.max_num_seqs) == (32768, 256)
    assert 380_000 < large.kv_tokens < 420_000
    assert offload.max_model_len == 131_072
    assert 150_000 < offload.kv_tokens < 200_000
    assert offload.kv_tokens >= offload.max_model_len  # vLLM's startup check holds
    # Offloaded weights make every step far slower than on the 24 GB card.
    assert offload.offload_s > 10 * small.weight_read_s


def test_config_precedence_skips_real_nodes_and_maps_models() -> None:
    specs = parse_fleet_config(config(simulation={"time_scale": 10, "seed": 100}))
    assert [s.name for s in specs] == ["a-1", "b-1"]
    a, b = (s.settings for s in specs)
    assert a.model == SERVED and b.model == "plain"  # served_name defaults to name
    assert a.time_scale == 10 and b.time_scale == 3  # backend beats simulation:
    assert (a.seed, b.seed) == (100, 101)  # distinct seeds per node
    assert b.max_num_seqs == 64 and b.max_model_len == 32768
    shifted = parse_fleet_config(config(), port_offset=5, overrides={"time_scale": 50.0})
    assert [s.port for s in shifted] == [9106, 9206]
    assert all(s.settings.time_scale == 50 for s in shifted)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: c["tiers"][0]["backends"][1]["simulate"].update(profile="x"),
            'tiers[0].backends[1].simulate.profile: unknown profile "x"; known: gpu24-8b,',
        ),
        (
            lambda c: c["tiers"][1]["backends"][0]["simulate"].update(max_num_seqs="four"),
            "tiers[1].backends[0].simulate.max_num_seqs: expected an integer, got 'four'",
        ),
        (
            lambda c: c["tiers"][1]["backends"][0]["simulate"].update(colour="red"),
            "tiers[1].backends[0].simulate.colour: unknown setting; known:",
        ),
        (
            lambda c: c["tiers"][0]["backends"][1].update(model="nope"),
            "tiers[0].backends[1].model: unknown model 'nope'; known: llama, plain",
        ),
        (
            lambda c: c["tiers"][0]["backends"][1].update(url="http://127.0.0.1"),
            "tiers[0].backends[1].url: a simulated node needs an http URL with host and port",
        ),
        (
            lambda c: c["tiers"][1]["backends"][0].update(url="http://127.0.0.1:9101"),
            "tiers[1].backends[0].url: 127.0.0.1:9101 is already used by tiers[0].backends[1]",
        ),
        (
            lambda c: c["tiers"][0]["backends"][1]["simulate"].pop("profile"),
            "tiers[0].backends[1].simulate.profile: required",
        ),
        (
            lambda c: c.update(simulation={"time_scale": 0}),
            "simulation.time_scale: expected a positive number, got 0.0",
        ),
        (
            lambda c: c["tiers"][1]["backends"][0]["simulate"].update(num_gpu_blocks=1),
            "tiers[1].backends[0].simulate.num_gpu_blocks: expected at least 2",
        ),
    ],
)
def test_config_errors_name_the_yaml_path(mutate: Any, message: str) -> None:
    data = config()
    mutate(data)
    with pytest.raises(SettingsError) as info:  # SimulatorConfigError is one
        parse_fleet_config(data)
    assert str(info.value).startswith(message), str(info.value)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SimulatorConfigError, match="cannot read"):
        load_fleet_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(SimulatorConfigError, match="invalid YAML"):
        load_fleet_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(config()))
    assert len(load_fleet_config(good)) == 2


async def _get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None) if r.content_length else None


async def test_in_process_fleet_serves_every_node() -> None:
    specs = [
        node_spec("tiny", name="t-1", overrides={"time_scale": 5.0}),
        node_spec("tiny", name="t-2", overrides={"max_model_len": 256, "time_scale": 50.0}),
    ]
    async with start_fleet(specs) as fleet:
        assert len(fleet) == 2 and set(fleet.urls) == {"t-1", "t-2"}
        for node in fleet:
            assert node.port > 0
            status, models = await _get(node.url + "/v1/models")
            assert status == 200
            assert models["data"][0]["max_model_len"] == node.settings.max_model_len
        assert fleet["t-2"].node.settings.max_model_len == 256
        # These runners cancel handlers on disconnect: the abort path must hold there too.
        t1 = fleet["t-1"]
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                t1.url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True},
            )
            await resp.content.readline()
            assert t1.node.driver.core.used_blocks > 0
            resp.close()
        for _ in range(100):
            if t1.node.driver.core.used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        assert t1.node.driver.core.used_blocks == 0
        assert t1.node.driver.finished["abort"] == 1
        url = t1.url
    with pytest.raises(aiohttp.ClientConnectionError):
        await _get(url + "/health")  # stopped on exit


async def test_fleet_in_separate_processes() -> None:
    spec = node_spec("tiny", name="p-1", overrides={"time_scale": 50.0})
    async with start_fleet([spec], processes=True) as fleet:
        (node,) = fleet
        assert node.port > 0
        with pytest.raises(RuntimeError):
            _ = node.node  # internals live in the child
        async with (
            aiohttp.ClientSession() as s,
            s.post(node.url + "/v1/completions", json={"prompt": "hi"}) as r,
        ):
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] >= 1
        url = node.url
    with pytest.raises(aiohttp.ClientConnectionError):
        await _get(url + "/health")


def _free_offset(ports: list[int]) -> int:
    """An offset at which every port is free right now (another run may hold 9101...),
    below the kernel's ephemeral range: a client socket elsewhere in the suite can take
    an ephemeral port between this check and the simulator's bind, never one below it."""
    rng = random.Random()
    low = _ephemeral_low() - max(ports) - 1
    for _ in range(50):
        offset = rng.randrange(1_000, max(2_000, low), 1000)
        try:
            for port in ports:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return offset
    raise AssertionError("no free port range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


async def test_cli_serves_the_demo_config_until_sigint() -> None:
    specs = load_fleet_config(DEMO)
    offset = _free_offset([s.port for s in specs])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgateway",
        "simulate",
        "--config",
        str(DEMO),
        "--port-offset",
        str(offset),
        "--time-scale",
        "20",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        healthy: set[str] = set()
        async with aiohttp.ClientSession() as session:

            async def all_healthy() -> bool:
                assert proc.returncode is None, (await proc.communicate())[1].decode()
                for spec in specs:
                    url = f"http://127.0.0.1:{spec.port + offset}"
                    try:
                        async with session.get(url + "/health") as r:
                            if r.status == 200:
                                healthy.add(spec.name)
                    except (aiohttp.ClientConnectionError, HttpProcessingError):
                        # Not listening yet. A connect to a free port of the ephemeral
                        # range can meet itself (TCP simultaneous open): the request
                        # then comes back as the answer, which does not parse.
                        pass
                assert len(healthy) == len(specs), f"healthy so far: {healthy}"
                return True

            await eventually(all_healthy, timeout=30, interval=0.1)
            async with session.get(f"http://127.0.0.1:{9301 + offset}/v1/models") as r:
                assert (await r.json())["data"][0]["max_model_len"] == 131072
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(15):
            stdout, stderr = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()
    lines = stdout.decode().splitlines()
    for spec in specs:
        (line,) = [x for x in lines if x.startswith(spec.name + " ")]
        assert f"http://127.0.0.1:{spec.port + offset}" in line
        assert f"profile={spec.settings.profile}" in line
        assert f"max_model_len={spec.settings.max_model_len}" in line
        assert f"kv_tokens={spec.settings.kv_tokens}" in line
        assert f"max_num_seqs={spec.settings.max_num_seqs}" in line


async def test_cli_rejects_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    data = config()
    data["tiers"][0]["backends"][1]["simulate"]["profile"] = "gpu999"
    bad.write_text(yaml.safe_dump(data))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgateway", "simulate", "--config", str(bad),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    async with asyncio.timeout(20):
        _, stderr = await proc.communicate()
    assert proc.returncode == 2
    assert 'tiers[0].backends[1].simulate.profile: unknown profile "gpu999"' in stderr.decode()


def test_fleet_config_reads_env_references_and_rejects_duplicate_keys(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("KVGW_NODE_PORT", "9555")
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "models: [{name: m}]\n"
        "tiers: [{name: t, backends: [{name: a, url: 'http://127.0.0.1:${KVGW_NODE_PORT}',"
        " model: m, simulate: {profile: tiny}}]}]\n"
    )
    (spec,) = load_fleet_config(path)
    assert spec.port == 9555
    path.write_text("models: [{name: m}]\nmodels: []\n")
    with pytest.raises(SimulatorConfigError, match=r"models: duplicate key"):
        load_fleet_config(path)
