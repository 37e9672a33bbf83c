"""Config of prefix-aware routing, shared-block credit, learned output and KV events."""

import textwrap

import pytest

from kvgateway.config.load import parse_config_text
from kvgateway.config.yamlread import ConfigError

BASE = """
models:
  - {name: m, served_name: org/M}
tiers:
  - name: small
    backends:
      - {name: a, url: "http://127.0.0.1:9000", model: m, max_num_seqs: 8KV}
"""


def parse(backend_extra: str = "", rest: str = ""):
    text = BASE.replace("KV", backend_extra) + textwrap.dedent(rest)
    return parse_config_text(text)


def test_defaults():
    cfg = parse()
    assert cfg.routing.prefix_aware is True
    assert cfg.admission.prefix_credit is True
    assert cfg.admission.output_reservation == "learned"
    assert cfg.admission.preemption_risk == 0.001
    assert cfg.backends[0].kv_events is None


def test_everything_set():
    cfg = parse(
        ', kv_events: "tcp://10.0.0.1:5557", kv_events_replay: "tcp://10.0.0.1:5558"'
        ", kv_events_topic: kv",
        """
        routing: {prefix_aware: true}
        admission: {prefix_credit: false, output_reservation: max_tokens, preemption_risk: 0.05}
        """,
    )
    assert cfg.routing.prefix_aware and not cfg.admission.prefix_credit
    assert cfg.admission.output_reservation == "max_tokens"
    assert cfg.admission.preemption_risk == 0.05
    assert cfg.backends[0].kv_events == "tcp://10.0.0.1:5557"
    # The node's replay socket and topic reach its subscriber: a lost batch is fetched
    # again instead of forgetting the node's cache view.
    from kvgateway.upstream.kv_events import KVEventSource, kv_event_sources

    assert kv_event_sources(cfg) == [
        KVEventSource("a", "tcp://10.0.0.1:5557", "kv", "tcp://10.0.0.1:5558")
    ]


@pytest.mark.parametrize(
    ("extra", "rest", "message"),
    [
        (
            ', kv_events: "http://h:1"',
            "",
            "tiers[0].backends[0].kv_events: expected tcp://HOST:PORT",
        ),
        (', kv_events: "tcp://*:5557"', "", "tiers[0].backends[0].kv_events: expected tcp://"),
        (', kv_events: "tcp://h"', "", "tiers[0].backends[0].kv_events: expected tcp://"),
        (
            ', kv_events: "tcp://h:1", kv_events_replay: "h:2"',
            "",
            "tiers[0].backends[0].kv_events_replay: expected tcp://HOST:PORT (the node's replay",
        ),
        ("", "admission: {output_reservation: half}", "admission.output_reservation"),
        ("", "admission: {preemption_risk: 0.9}", "admission.preemption_risk"),
    ],
)
def test_errors_name_the_path(extra, rest, message):
    with pytest.raises(ConfigError) as err:
        parse(extra, rest)
    assert message in str(err.value)
