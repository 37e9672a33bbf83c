"""deploy/grafana: the dashboard is well formed, every query is valid PromQL (checked by
promtool), names only exported metrics, and the provisioning wires it to Prometheus."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.known import (
    DEPLOY,
    gateway_metric_names,
    promql_metric_names,
    promtool,
    unknown_metrics,
    vllm_metric_names,
)

GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gateway.json"
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "30m",
    "$tier": ".*",
    "$namespace": ".*",
    "$instance": ".*",
}


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


def _substituted(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def test_panels_are_well_formed() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels():
        assert p["title"] and p["description"], p["id"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], p["title"]


def test_panels_fit_the_grid_without_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in _dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel query as a recording rule (Grafana variables filled in)."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": _substituted(expr)}
        for i, expr in enumerate(_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run(
        [promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_queries_use_only_exported_metric_names() -> None:
    known = gateway_metric_names() | vllm_metric_names()
    assert unknown_metrics(_exprs(), known) == {}
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\(([\w:]+)(\{[^}]*\})?,\s*(\w+)\)", var["definition"])
            assert m and m.group(1) in known, var["definition"]


# Labels a vLLM node's own series carry wherever Prometheus scrapes it: the node's
# (model_name, engine) and the standard scrape and Kubernetes service-discovery ones.
PORTABLE_NODE_LABELS = {"model_name", "engine", "instance", "job", "namespace", "pod", "service"}
_SELECTOR = re.compile(r"((?:gateway_|vllm:)[\w:]+)\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def test_node_panels_need_no_labels_our_scrape_config_adds() -> None:
    """A stock Prometheus (or a ServiceMonitor) scraping vLLM gives `instance`, `job`,
    `namespace`, never our demo's `backend`/`tier` labels: node queries must not need them."""
    for expr in _exprs():
        for name, matchers in _SELECTOR.findall(expr):
            labels = {
                m.split("=")[0].strip().rstrip("!~") for m in matchers.split(",") if m.strip()
            }
            if name.startswith("vllm:"):
                assert labels <= PORTABLE_NODE_LABELS, (expr, labels)
        if "vllm:" in expr:
            for group in _GROUPING.findall(expr):
                used = {g.strip() for g in group.split(",") if g.strip()}
                assert used <= PORTABLE_NODE_LABELS | {"le"}, (expr, used)


def test_every_query_follows_the_namespace_and_instance_variables() -> None:
    names = [v["name"] for v in _dashboard()["templating"]["list"]]
    assert names[:3] == ["datasource", "namespace", "instance"], names
    for expr in _exprs():
        for name, matchers in _SELECTOR.findall(expr):
            assert 'namespace=~"$namespace"' in matchers, expr
            if name.startswith("gateway_"):
                assert 'instance=~"$instance"' in matchers, expr
        # Every metric reference has a selector (so none escapes the variables).
        bare = re.findall(r"(?:gateway_|vllm:)[\w:]+(?![\w:{])", expr)
        assert not bare, (expr, bare)


def test_dashboard_tells_the_kv_story() -> None:
    """The questions an operator asks first each have a panel."""
    used = set().union(*(promql_metric_names(e) for e in _exprs()))
    assert {
        "gateway_backend_reserved_tokens",
        "gateway_backend_kv_budget_tokens",
        "gateway_backend_scraped_kv_usage_ratio",
        "vllm:kv_cache_usage_perc",
        "gateway_routing_decisions_total",
        "gateway_rejections_total",
        "gateway_queue_depth",
        "gateway_queue_wait_seconds_bucket",
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_request_duration_seconds_bucket",
        "gateway_backend_node_preemptions_total",
        "vllm:num_preemptions_total",
    } <= used
    exprs = _exprs()
    for metric in ("gateway_time_to_first_token_seconds", "gateway_request_duration_seconds"):
        for q in ("0.5", "0.99"):
            assert any(
                f"histogram_quantile({q}," in e and "by (tier, le)" in e and metric in e
                for e in exprs
            ), (metric, q)


def test_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    mounts = dict(_bind(v) for v in compose["grafana"]["volumes"])
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "kvgateway.yml").read_text()
    )["providers"][0]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    home = compose["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name

    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert [d["type"] for d in ds] == ["prometheus"]
    # Prometheus shares the fleet service's network namespace and listens on 9090 there.
    assert ds[0]["url"] == "http://fleet:9090"
    assert compose["prometheus"]["network_mode"] == "service:fleet"
    assert "--web.listen-address=0.0.0.0:9090" in compose["prometheus"]["command"]
    datasource_var = _dashboard()["templating"]["list"][0]
    assert (datasource_var["name"], datasource_var["query"]) == ("datasource", "prometheus")


def _bind(spec: str) -> tuple[str, Path]:
    source, target = spec.split(":")[:2]
    return target, (DEPLOY / source).resolve()
