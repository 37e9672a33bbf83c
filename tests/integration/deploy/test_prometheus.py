"""deploy/prometheus: promtool accepts the config and rules, the rules fire as their unit
tests say, and every expression names only metrics that the gateway or vLLM export."""

from __future__ import annotations

import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvgateway.config.load import load_config
from tests.support.known import (
    DEPLOY,
    PROMETHEUS_SYNTHETIC,
    REPO,
    gateway_metric_names,
    promql_metric_names,
    promtool,
    unknown_metrics,
    vllm_metric_names,
)
from tests.support.tools import require_tool

PROM = DEPLOY / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=PROM, capture_output=True, text=True, timeout=30, check=False
    )


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_promtool_check_config() -> None:
    res = _promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_rules() -> None:
    res = _promtool("check", "rules", "alerts.yml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(_rules())} rules found" in res.stdout


def test_alert_rules_fire_as_unit_tested() -> None:
    res = _promtool("test", "rules", "alerts_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for group in tests
        for case in group["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert {r["alert"] for r in _rules()} <= fired


def test_alerts_have_runbook_annotations() -> None:
    for rule in _rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        for key in ("summary", "description", "runbook"):
            assert rule["annotations"].get(key, "").strip(), f"{rule['alert']}: no {key}"


def test_alerts_use_only_exported_metric_names() -> None:
    known = gateway_metric_names() | vllm_metric_names() | PROMETHEUS_SYNTHETIC
    assert unknown_metrics([r["expr"] for r in _rules()], known) == {}


def test_preemption_alerts_cover_gateway_and_node_metrics() -> None:
    used = set().union(*(promql_metric_names(r["expr"]) for r in _rules()))
    assert {"gateway_backend_node_preemptions_total", "vllm:num_preemptions_total"} <= used


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (backend) (rate(a_total{tier=~"$tier"}[$__rate_interval]))', {"a_total"}),
        ("x / on (instance, backend) group_left(model) y offset 5m > 0.9", {"x", "y"}),
        ('up{job="gateway"} == 0 or absent(up{job="gateway"})', {"up"}),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m]))) > 1e-3", {"h_bucket"}),
        (
            "vllm:kv_cache_usage_perc > bool 0.9 unless topk(3, z)",
            {"vllm:kv_cache_usage_perc", "z"},
        ),
    ],
)
def test_promql_name_extraction(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_unknown_metric_is_reported() -> None:
    # The checker can fail: a typo in a gateway name is caught.
    known = gateway_metric_names()
    bad = "sum(gateway_backend_reserved_token) / sum(gateway_backend_kv_budget_tokens)"
    assert unknown_metrics([bad], known) == {bad: {"gateway_backend_reserved_token"}}


def test_scrape_targets_are_the_demo_fleet() -> None:
    """The vllm job scrapes exactly the nodes of config/demo.yaml, labelled with the
    gateway's backend and tier names, and the gateway job its listen port."""
    config = load_config(str(REPO / "config" / "demo.yaml"))
    scrape = {
        job["job_name"]: job
        for job in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
    }
    nodes = {
        (t, sc.get("labels", {}).get("backend"), sc.get("labels", {}).get("tier"))
        for sc in scrape["vllm"]["static_configs"]
        for t in sc["targets"]
    }
    expected = {(urlsplit(b.url).netloc, b.name, b.tier) for b in config.backends}
    assert nodes == expected
    gateway_targets = [t for sc in scrape["gateway"]["static_configs"] for t in sc["targets"]]
    assert gateway_targets == [f"127.0.0.1:{config.server.port}"]


def test_install_script_is_valid_and_idempotent() -> None:
    """`make test` runs it before pytest; with every tool present it must be a quiet no-op."""
    require_tool("promtool")
    require_tool("prometheus")
    require_tool("dnsmasq")
    script = REPO / "scripts" / "install-test-tools.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    res = subprocess.run([str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
