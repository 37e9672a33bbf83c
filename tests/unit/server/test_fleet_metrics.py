"""Per-backend series across reloads: one per backend name."""

from kvgateway.core.fleet import Fleet
from kvgateway.server.collectors import FleetCollector
from tests.unit.core.test_fleet import _config


def test_a_node_replaced_under_its_name_is_one_series_in_metrics():
    # `a` moves to another node (new url) while a request runs on the old one: the old
    # drains beside the new, and /metrics still has each backend series once for `a`
    # (Prometheus rejects a scrape with repeated label sets).
    fleet = Fleet(_config(["a"]))
    old = fleet.get("a")
    assert old is not None
    fleet.adjust(old, 300, 1, 1)
    fleet.apply(_config(["a"], url="http://{}-moved.invalid:9"), {})
    assert old.draining and len([b for b in fleet.backends if b.name == "a"]) == 2
    collector = FleetCollector(lambda: fleet.backends, lambda: 0.0)
    for family in collector.collect():
        labels = [tuple(sorted(s.labels.items())) for s in family.samples]
        assert len(labels) == len(set(labels)), family.name
    reserved = next(f for f in collector.collect() if f.name == "gateway_backend_reserved_tokens")
    assert [s.value for s in reserved.samples] == [0]  # the successor's


def test_two_draining_nodes_of_one_name_are_one_series():
    fleet = Fleet(_config(["x", "y"]))
    first = fleet.get("x")
    assert first is not None
    fleet.adjust(first, 100, 1, 1)
    fleet.apply(_config(["x", "y"], url="http://{}-moved.invalid:9"), {})
    second = fleet.get("x")
    assert second is not None
    fleet.adjust(second, 100, 1, 1)
    fleet.apply(_config(["y"]), {})  # x removed: both x nodes drain
    assert [b.name for b in fleet.backends].count("x") == 2
    for family in FleetCollector(lambda: fleet.backends, lambda: 0.0).collect():
        labels = [tuple(sorted(s.labels.items())) for s in family.samples]
        assert len(labels) == len(set(labels)), family.name


def test_series_of_backends_gone_from_the_fleet_are_dropped() -> None:
    """DNS members (pool@IP:port) come and go: a gone member's series leave /metrics once
    exposed one more time, or they would pile up for good."""
    from prometheus_client import CollectorRegistry

    from kvgateway.server.telemetry import GatewayMetrics

    registry = CollectorRegistry()
    m = GatewayMetrics(registry)
    for n in range(50):
        m.of(m.requests, "llama", "small", f"pool@10.0.0.{n}:8000", "200").inc()
        m.of(m.upstream_failures, f"pool@10.0.0.{n}:8000", "connect").inc()
    m.of(m.requests, "llama", "-", "-", "429").inc()  # answered by the gateway itself

    def backends() -> set[str]:
        samples = [s for f in registry.collect() for s in f.samples if "backend" in s.labels]
        return {s.labels["backend"] for s in samples}

    # Gone, but exposed once more (a draining backend's last requests are counted).
    m.forget_backends({"pool@10.0.0.49:8000"})
    assert len(backends()) == 51
    m.forget_backends({"pool@10.0.0.49:8000"})
    assert backends() == {"pool@10.0.0.49:8000", "-"}  # never the gateway's own answers
    # A backend that comes back counts afresh.
    m.of(m.requests, "llama", "small", "pool@10.0.0.1:8000", "200").inc()
    value = registry.get_sample_value(
        "gateway_requests_total",
        {"model": "llama", "tier": "small", "backend": "pool@10.0.0.1:8000", "status": "200"},
    )
    assert value == 1
