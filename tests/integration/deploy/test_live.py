"""Against a running gateway: promtool lints its /metrics, a real Prometheus scrapes it and
loads the alert rules, and `gateway top --once` draws it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.known import DEPLOY, gateway_metric_names, promql_metric_names, promtool
from tests.support.live import LiveGateway, free_ports, http_get, stop, wait_until_ok
from tests.support.tools import require_tool


def _metrics_page(gw: LiveGateway) -> str:
    status, body = http_get(gw.url + "/metrics")
    assert status == 200
    return body.decode()


def test_promtool_check_metrics_is_clean(live_gateway: LiveGateway) -> None:
    res = subprocess.run(
        [promtool(), "check", "metrics"],
        input=_metrics_page(live_gateway),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (res.returncode, res.stdout + res.stderr) == (0, "")


def test_live_names_are_the_registry_names(live_gateway: LiveGateway) -> None:
    """The names the static tests check against are what the running app exports, and
    what the dashboard and alerts use shows up once there is traffic."""
    live = {
        s.name
        for fam in text_string_to_metric_families(_metrics_page(live_gateway))
        for s in fam.samples
        if s.name.startswith("gateway_")
    }
    registry = gateway_metric_names()
    assert live <= registry
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "gateway.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    exprs += [r["expr"] for g in rules for r in g["rules"]]
    used = {n for e in exprs for n in promql_metric_names(e) if n.startswith("gateway_")}
    # Only failures and reloads have no series before they first happen.
    not_yet = {
        "gateway_upstream_failures_total",
        "gateway_upstream_retries_total",
        "gateway_config_reloads_total",
    }
    assert used - live <= not_yet


@pytest.fixture(scope="module")
def prometheus(
    live_gateway: LiveGateway, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real Prometheus on loopback scraping the live gateway and node every second.
    (Its scrape manager applies new targets after ~5 s: started once per module.)"""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    binary = require_tool("prometheus")
    (port,) = free_ports(1)
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    node = urllib.parse.urlsplit(live_gateway.node_url).netloc
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {
                "job_name": "gateway",
                "static_configs": [{"targets": [urllib.parse.urlsplit(live_gateway.url).netloc]}],
            },
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [node], "labels": {"backend": "sim-1", "tier": "small"}}
                ],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "prometheus.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_until_ok(url + "/-/ready", [proc], [log])
        yield url
    finally:
        stop([proc])


def _api(prom: str, path: str, deadline_s: float, done: Any) -> Any:
    """Poll a Prometheus API path until ``done(data)`` holds; return that data."""
    deadline = time.monotonic() + deadline_s
    data: Any = None
    while time.monotonic() < deadline:
        status, body = http_get(prom + path)
        assert status == 200, body
        data = json.loads(body)["data"]
        if done(data):
            return data
        time.sleep(0.2)
    raise AssertionError(f"{path}: condition not met in {deadline_s}s; last: {data}")


def test_prometheus_scrapes_gateway_and_node(prometheus: str) -> None:
    query = "/api/v1/query?query=" + urllib.parse.quote("gateway_build_info")
    (series,) = _api(prometheus, query, 20, lambda d: d["result"])["result"]
    assert series["metric"]["job"] == "gateway"
    assert series["metric"]["policy"] == "kv_aware" and series["metric"]["version"]
    budget = "/api/v1/query?query=" + urllib.parse.quote(
        'gateway_backend_kv_budget_tokens{backend="sim-1"} > 0'
    )
    _api(prometheus, budget, 10, lambda d: d["result"])
    node = "/api/v1/query?query=" + urllib.parse.quote(
        'vllm:num_preemptions_total{job="vllm", backend="sim-1"}'
    )
    _api(prometheus, node, 10, lambda d: d["result"])


def test_prometheus_evaluates_every_alert_rule_without_error(prometheus: str) -> None:
    names = {
        r["alert"]
        for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }

    def evaluated(data: Any) -> bool:
        rules = [r for g in data["groups"] for r in g["rules"]]
        return bool(rules) and all(r.get("health") != "unknown" for r in rules)

    # Wait for real data first, so the rules run against real series, not empty ones.
    _api(prometheus, "/api/v1/query?query=gateway_build_info", 20, lambda d: d["result"])
    data = _api(prometheus, "/api/v1/rules?type=alert", 20, evaluated)
    rules = {r["name"]: r for g in data["groups"] for r in g["rules"]}
    assert set(rules) == names
    errors = {n: r.get("lastError") for n, r in rules.items() if r["health"] != "ok"}
    assert errors == {}
    firing = {n for n, r in rules.items() if r["state"] == "firing"}
    assert firing == set(), "a healthy idle fleet must not page anyone"


def _top(
    gw: LiveGateway, *extra: str, key_env: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_API_KEY"}
    if key_env is not None:
        env["GATEWAY_API_KEY"] = key_env
    return subprocess.run(
        [sys.executable, "-m", "kvgateway", "top", "--once", "--url", gw.url, *extra],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )


def test_top_once_against_the_live_gateway(live_gateway: LiveGateway) -> None:
    res = _top(live_gateway, "--api-key", live_gateway.api_key)
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("sim-1 ")]
    assert line.split()[:3] == ["sim-1", "small", "ok"]
    assert "/16" in line  # in flight over the configured max_num_seqs
    assert "policy kv_aware" in res.stdout and "accepting 1/1" in res.stdout
    # The key can come from the environment instead of the command line.
    assert _top(live_gateway, key_env=live_gateway.api_key).returncode == 0


def test_top_once_needs_the_key(live_gateway: LiveGateway) -> None:
    res = _top(live_gateway)
    assert res.returncode == 1 and res.stdout == ""
    assert "HTTP 401" in res.stderr and "--api-key" in res.stderr
