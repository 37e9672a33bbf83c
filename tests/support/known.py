"""What the deploy artefacts may refer to: repository paths, metric names, PromQL names.

Metric names come from the real sources: the gateway's own registry
(:class:`GatewayMetrics` + :class:`FleetCollector`, as ``create_app`` builds it) and a
vLLM node's /metrics page (tests/data/vllm_metrics_sample.txt).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvgateway.config.model import AuthConfig
from kvgateway.core.quota import LocalQuotaLedger
from kvgateway.core.tenancy import Tenancy
from kvgateway.server.collectors import FleetCollector, TenantCollector
from kvgateway.server.ledger_view import LedgerMetrics
from kvgateway.server.telemetry import GatewayMetrics
from tests.support.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VLLM_SAMPLE = REPO / "tests" / "data" / "vllm_metrics_sample.txt"

# Series Prometheus itself attaches to every target.
PROMETHEUS_SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def sample_names(families: Iterable[tuple[str, str]]) -> frozenset[str]:
    """Every series name a family of each (name, type) puts on a /metrics page."""
    return frozenset(name + suffix for name, kind in families for suffix in _SUFFIXES[kind])


def gateway_metric_names() -> frozenset[str]:
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    LedgerMetrics(registry)
    registry.register(FleetCollector(lambda: [], lambda: 0.0))
    registry.register(TenantCollector(Tenancy(AuthConfig), LocalQuotaLedger(), lambda: 0.0))
    return sample_names((fam.name, fam.type) for fam in registry.collect())


def vllm_metric_names() -> frozenset[str]:
    text = VLLM_SAMPLE.read_text(encoding="utf-8")
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
    return frozenset(names)


def promtool() -> str:
    """promtool's path; missing skips the test (fails in CI, where `make test` installs it)."""
    return require_tool("promtool")


# --- PromQL -------------------------------------------------------------------------------

# Aggregation operators, keywords and modifiers: identifiers that are not metric names even
# when not followed by "(".
PROMQL_WORDS = frozenset(
    {
        *("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"),
        *("bottomk", "topk", "quantile", "limitk", "limit_ratio"),
        *("by", "without", "on", "ignoring", "group_left", "group_right"),
        *("bool", "and", "or", "unless", "offset", "atan2", "inf", "nan", "start", "end"),
    }
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_OFFSET = re.compile(r"\boffset\s+-?[\w$]+", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)", re.I)
_IDENT = re.compile(r"(?<![\w:$])([A-Za-z_:][\w:]*)(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions (followed by
    "("), aggregation words, label names inside {}/by()/on(), durations or numbers."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in PROMQL_WORDS:
            continue
        names.add(name)
    return names


def unknown_metrics(exprs: Iterable[str], known: frozenset[str]) -> dict[str, set[str]]:
    """Expression -> metric names it uses that nobody exports (empty when all is well)."""
    out = {}
    for expr in exprs:
        missing = promql_metric_names(expr) - known
        if missing:
            out[expr] = missing
    return out
