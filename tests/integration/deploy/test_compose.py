"""deploy/compose.yaml: parses, builds from the real Dockerfile, mounts files that exist,
runs commands the real CLI accepts, and wires ports consistently with config/demo.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvgateway.cli import build_parser
from kvgateway.config.load import load_config
from tests.support.known import DEPLOY, REPO

DEMO = REPO / "config" / "demo.yaml"


def _services() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "compose.yaml").read_text()))
    assert len(docs) == 1
    services: dict[str, Any] = docs[0]["services"]
    return services


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path, for bind mounts (named volumes are skipped)."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (DEPLOY / source).resolve()
    return out


def test_services_and_build_context() -> None:
    services = _services()
    assert set(services) == {"fleet", "gateway", "prometheus", "grafana", "redis"}
    build = services["fleet"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == REPO
    assert (context / build["dockerfile"]).is_file()
    # The gateway runs the image the fleet service builds.
    assert services["gateway"]["image"] == services["fleet"]["image"]


def test_bind_mounts_exist() -> None:
    for name, service in _services().items():
        for target, source in _mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"


def test_commands_are_valid_gateway_cli_and_read_the_demo_config() -> None:
    services = _services()
    parser = build_parser()
    for name, command in (("fleet", "simulate"), ("gateway", "serve")):
        args = parser.parse_args(services[name]["command"])
        assert args.command == command, name
        assert _mounts(services[name])[args.config] == DEMO.resolve(), name


def test_ports_match_the_demo_config() -> None:
    services = _services()
    config = load_config(str(DEMO))
    serve = build_parser().parse_args(services["gateway"]["command"])
    assert serve.port == config.server.port
    assert serve.host == "0.0.0.0"
    # The demo nodes listen on 127.0.0.1, so the gateway and Prometheus share the fleet's
    # network namespace; the fleet service publishes their ports.
    assert services["gateway"]["network_mode"] == "service:fleet"
    published = {p.split(":")[-1] for p in services["fleet"]["ports"]}
    assert {str(config.server.port), "9090"} <= published
    # The fleet's health check probes exactly the demo nodes.
    check = " ".join(services["fleet"]["healthcheck"]["test"])
    ports = sorted(int(urlsplit(b.url).port or 0) for b in config.backends)
    assert all(urlsplit(b.url).hostname == "127.0.0.1" for b in config.backends)
    assert f"for p in {tuple(ports)!r}" in check


def test_prometheus_loads_the_repo_config_and_rules() -> None:
    prom = _services()["prometheus"]
    mounts = _mounts(prom)
    flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    path = flag.split("=", 1)[1]
    directory, filename = path.rsplit("/", 1)
    config_file = mounts[directory] / filename
    assert config_file == DEPLOY / "prometheus" / "prometheus.yml"
    for rule_file in yaml.safe_load(config_file.read_text())["rule_files"]:
        assert (config_file.parent / rule_file).is_file()


def test_the_gateway_workers_share_the_compose_redis() -> None:
    services = _services()
    serve = build_parser().parse_args(services["gateway"]["command"])
    assert serve.workers == 2
    redis = services["redis"]["command"]
    port = redis[redis.index("--port") + 1]
    assert serve.ledger_url == f"redis://127.0.0.1:{port}/0"
    assert services["redis"]["network_mode"] == "service:fleet"
