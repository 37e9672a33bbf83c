"""deploy/kubernetes: manifests parse, reference each other and real files, and the pod
is wired to the config it mounts (probes, ports, non-root, resources)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from kvgateway.cli import build_parser
from kvgateway.config.load import load_config, parse_config_text
from tests.support.known import DEPLOY, REPO

K8S = DEPLOY / "kubernetes"


def _docs() -> dict[str, dict[str, Any]]:
    """kind -> the one manifest of that kind, from the files kustomization.yaml lists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "kustomization.yaml must list every manifest"
    out: dict[str, dict[str, Any]] = {}
    for name in listed:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            assert doc["apiVersion"] and doc["metadata"]["name"], name
            assert doc["kind"] not in out, f"two {doc['kind']} manifests"
            out[doc["kind"]] = doc
    return out


def _pod() -> dict[str, Any]:
    pod: dict[str, Any] = _docs()["Deployment"]["spec"]["template"]
    return pod


def _container(name: str) -> dict[str, Any]:
    return next(c for c in _pod()["spec"]["containers"] if c["name"] == name)


def _config_text() -> str:
    return str(_docs()["ConfigMap"]["data"]["gateway.yaml"])


def test_all_kinds_present() -> None:
    assert set(_docs()) == {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    }
    assert _docs()["ServiceMonitor"]["apiVersion"] == "monitoring.coreos.com/v1"


def test_configmap_is_the_demo_config_and_valid() -> None:
    assert _config_text() == (REPO / "config" / "demo.yaml").read_text(), (
        "deploy/kubernetes/configmap.yaml must embed config/demo.yaml verbatim: re-indent "
        "the file by 4 spaces under `gateway.yaml: |`"
    )
    parse_config_text(_config_text(), source="configmap")


def test_containers_read_the_mounted_config() -> None:
    docs = _docs()
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    parser = build_parser()
    for name, command in (("gateway", "serve"), ("fleet", "simulate")):
        c = _container(name)
        args = parser.parse_args(c["args"])
        assert args.command == command
        mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
        volume = volumes[mount["name"]]
        assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
        key = args.config[len(mount["mountPath"]) + 1 :]
        assert key in docs["ConfigMap"]["data"]


def test_probes_and_ports() -> None:
    c = _container("gateway")
    config = parse_config_text(_config_text())
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    args = build_parser().parse_args(c["args"])
    assert ports["http"] == config.server.port == args.port
    assert args.host == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_sidecar_probe_reaches_the_nodes_it_checks() -> None:
    """The kubelet's httpGet runs outside the pod, so the simulated nodes (bound to the
    pod's 127.0.0.1) are probed with an exec, on a port the config really uses."""
    probe = _container("fleet")["livenessProbe"]
    assert "httpGet" not in probe
    script = probe["exec"]["command"][-1]
    urls = {b.url for b in parse_config_text(_config_text()).backends}
    assert any(f"{url}/health" in script for url in urls), script


def test_pod_runs_as_the_images_non_root_user_with_resources() -> None:
    pod = _pod()["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    user = re.search(r"^USER (\d+)", (REPO / "Dockerfile").read_text(), re.M)
    assert user and int(user.group(1)) == sc["runAsUser"]
    for c in pod["containers"]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]


def test_shutdown_grace_fits_the_drain() -> None:
    config = load_config(str(REPO / "config" / "demo.yaml"))
    (c,) = [c for c in _pod()["spec"]["containers"] if c["name"] == "gateway"]
    args = build_parser().parse_args(c["args"])
    # A non-zero drain delay: load balancers stop sending before the listener closes.
    assert args.drain_delay_s and args.drain_delay_s > 0
    grace = args.drain_delay_s + config.server.shutdown_grace_s
    assert _pod()["spec"]["terminationGracePeriodSeconds"] > grace


def test_selectors_match_the_pod() -> None:
    docs = _docs()
    labels = _pod()["metadata"]["labels"]

    def selects(selector: dict[str, str], target: dict[str, str]) -> bool:
        return bool(selector) and all(target.get(k) == v for k, v in selector.items())

    assert selects(docs["Deployment"]["spec"]["selector"]["matchLabels"], labels)
    assert selects(docs["Service"]["spec"]["selector"], labels)
    assert selects(docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], labels)
    svc = docs["Service"]
    assert selects(
        docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]
    )
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in docs["ServiceMonitor"]["spec"]["endpoints"]} <= port_names
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {
        p["name"] for p in _container("gateway")["ports"]
    }


def test_scaling_and_disruption_budget_agree() -> None:
    docs = _docs()
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["kind"] == "Deployment"
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert docs["PodDisruptionBudget"]["spec"]["minAvailable"] < hpa["minReplicas"]
    assert docs["Deployment"]["spec"]["replicas"] >= hpa["minReplicas"]


def test_prometheus_job_is_the_one_alerts_select() -> None:
    """The Prometheus Operator names the job after the Service; the alerts use job="gateway"."""
    alerts = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    jobs = set(re.findall(r'job="([^"]+)"', alerts))
    assert jobs == {_docs()["Service"]["metadata"]["name"]}
    assert "jobLabel" not in _docs()["ServiceMonitor"]["spec"]


def test_the_optional_redis_ledger_manifests_fit_the_ledger_config() -> None:
    folder = K8S / "redis"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = [
        d
        for name in kustomization["resources"]
        for d in yaml.safe_load_all((folder / name).read_text())
    ]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    pod = kinds["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"] == labels
    # Not selected by the gateway's Service, PDB or ServiceMonitor.
    assert not all(labels.get(k) == v for k, v in _docs()["Service"]["spec"]["selector"].items())
    args = pod["spec"]["containers"][0]["args"]
    port = int(args[args.index("--port") + 1])
    assert kinds["Service"]["spec"]["ports"][0]["port"] == port
    # The URL the comments tell operators to use parses as a ledger config.
    cfg = parse_config_text(_config_text() + f"\nledger: {{url: redis://redis:{port}/0}}\n")
    assert cfg.ledger.shared
