"""`gateway check`: every limit with its source, and warnings when sources disagree."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.support.fleet import MODEL, SERVED, StartFleet

# Runs `gateway check` as a process against fleets: the slow tier.
pytestmark = pytest.mark.slow


def run_check(path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgateway", "check", "--config", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_check_shows_sources_and_disagreement(start_fleet: StartFleet, tmp_path):
    fleet = await start_fleet([("a", "small", "gpu24-8b", {}), ("b", "large", "gpu80-8b", {})])
    cfg = {
        "models": [{"name": MODEL, "served_name": SERVED}],
        "tiers": [
            {
                "name": "small",
                "backends": [
                    # Configured 32k, but the node says 8k: a warning, config wins.
                    {
                        "name": "a",
                        "url": fleet.nodes["a"].url,
                        "model": MODEL,
                        "max_model_len": 32768,
                        "max_num_seqs": 16,
                    },
                ],
            },
            {
                "name": "large",
                "backends": [
                    {
                        "name": "b",
                        "url": fleet.nodes["b"].url,
                        "model": MODEL,
                        "capacity": {"gpu_memory_gib": 79.2, "preset": "llama-3.1-8b"},
                    },
                    {
                        "name": "c",
                        "url": "http://127.0.0.1:9",
                        "model": MODEL,
                        "capacity": {
                            "gpu_memory_gib": 24,
                            "preset": "llama-3.1-8b",
                            "max_model_len": 8192,
                        },
                    },
                ],
            },
        ],
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # The nodes run in this test's event loop: the CLI runs as a subprocess awaited
    # without blocking the loop.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgateway",
        "check",
        "--config",
        str(path),
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    rows = {r["name"]: r for r in json.loads(out)["backends"]}
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert a["max_model_len"] == {"value": 32768, "source": "config"}
    assert a["kv_cache_tokens"] == {"value": 30704, "source": "discovered"}
    assert any("configured 32768 but the node reports 8192" in w for w in a["warnings"])
    assert b["max_model_len"]["source"] == "discovered"
    assert b["kv_cache_tokens"]["source"] == "discovered"
    assert c["node"].startswith("unreachable")
    assert c["kv_cache_tokens"]["source"] == "derived" and c["kv_cache_tokens"]["value"] > 10000
    assert c["max_model_len"] == {"value": 8192, "source": "derived"}

    text = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgateway",
        "check",
        "--config",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    tout, _ = await text.communicate()
    lines = tout.decode()
    assert "max_model_len    32,768 [config]" in lines
    assert "kv_cache_tokens  30,704 [discovered]" in lines
    assert "WARNING" in lines


def test_check_rejects_invalid_config_with_yaml_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "models: [{name: m}]\n"
        "tiers: [{name: t, backends: [{name: a, url: 'http://h:1', model: m, "
        "capacity: {gpu_memory_gib: 24, preset: llama-3.1-8b, tp: four}}]}]\n"
    )
    r = run_check(path, "--no-discover")
    assert r.returncode == 2
    assert "tiers[0].backends[0].capacity.tp" in r.stderr


def test_check_demo_config_without_nodes_names_every_backend():
    r = run_check("config/demo.yaml", "--no-discover")
    assert r.returncode == 0, r.stderr
    for name in ("small-1", "small-2", "small-3", "large-1", "large-2", "offload-1"):
        assert name in r.stdout
    assert "[derived]" in r.stdout and "[config]" in r.stdout


def _two_models(tmp_path, backend_b: dict[str, Any]) -> object:
    cfg = {
        "models": [{"name": "a-model"}, {"name": "b-model"}],
        "tiers": [
            {
                "name": "t",
                "backends": [
                    {
                        "name": "a",
                        "url": "http://127.0.0.1:9",
                        "model": "a-model",
                        "max_model_len": 4096,
                        "kv_cache_tokens": 20000,
                    },
                    {"name": "b", "url": "http://127.0.0.1:9", "model": "b-model", **backend_b},
                ],
            }
        ],
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_check_fails_when_a_model_has_no_routable_backend(tmp_path):
    # Without asking the nodes: b's limits are unknown and can never be discovered.
    path = _two_models(tmp_path, {"discover": False})
    r = run_check(path, "--no-discover")
    assert r.returncode == 1, r.stdout
    assert "ERROR: model b-model: no routable backend" in r.stdout
    assert "a-model: no routable" not in r.stdout
    # Discoverable limits are not judged without asking.
    assert run_check(_two_models(tmp_path, {}), "--no-discover").returncode == 0


def test_check_asking_the_nodes_fails_when_every_backend_is_unreachable(tmp_path):
    path = _two_models(tmp_path, {"max_model_len": 4096, "kv_cache_tokens": 20000})
    r = run_check(path, "--json", "--timeout", "0.5")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert set(doc["unroutable_models"]) == {"a-model", "b-model"}
    assert "unreachable" in doc["unroutable_models"]["a-model"]


def test_check_says_how_each_model_is_counted(tmp_path, vocab_dirs) -> None:
    directory = vocab_dirs("tekken")
    backend = {"url": "http://127.0.0.1:9", "max_model_len": 8192, "kv_cache_tokens": 100000}
    cfg: dict[str, Any] = {
        "models": [{"name": "exact", "tokenizer": {"path": str(directory)}}, {"name": "plain"}],
        "tiers": [
            {
                "name": "t",
                "backends": [
                    {"name": "a", "model": "exact", **backend},
                    {"name": "b", "model": "plain", **backend},
                ],
            }
        ],
    }
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_check(path, "--no-discover")
    assert proc.returncode == 0, proc.stderr
    assert "model exact: counts exactly with tiktoken:tekken" in proc.stdout
    assert "model plain: counts with the stand-in cl100k_base" in proc.stdout
    models = json.loads(run_check(path, "--no-discover", "--json").stdout)["models"]
    assert models[0]["counting"] == "exact" and models[0]["chat_templates"] == ["default"]
    assert models[1] == {"name": "plain", "counting": "stand-in", "tokenizer": "cl100k_base"}
    cfg["models"][0]["tokenizer"]["path"] = str(tmp_path / "missing")
    path.write_text(yaml.safe_dump(cfg))
    bad = run_check(path, "--no-discover")
    assert bad.returncode == 2 and "models[0].tokenizer.path: " in bad.stderr


@pytest.mark.parametrize("timeout", ["nan", "0", "-1"])
def test_check_refuses_a_timeout_that_is_not_a_positive_number(timeout: str) -> None:
    result = run_check("config/demo.yaml", "--timeout", timeout)
    assert result.returncode == 2 and "--timeout" in result.stderr, result.stderr
