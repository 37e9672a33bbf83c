"""Input an operator gets wrong is refused at load with the YAML path of the value, never
accepted to fail later (at the first request, on reload, at serve's start) and never a
traceback: malformed URLs and ports, sizes past computing, binary key files, resolvers
that are not addresses, alias bombs."""

from __future__ import annotations

import dataclasses
import textwrap
import time
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # types-jsonschema is not a dev dependency
import pytest
import yaml

from kvgateway.config.ledger import redis_url_problem
from kvgateway.config.load import parse_config_text
from kvgateway.config.model import TracingConfig
from kvgateway.config.schema import config_schema
from kvgateway.config.yamlread import ConfigError
from kvgateway.server.reload import restart_only

BASE = """
models:
  - name: m
tiers:
  - name: t
    backends:
      - name: b
        model: m
"""
URL = '        url: "http://h:8000"\n'


def _problem(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config_text(textwrap.dedent(text))
    return str(err.value)


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ('        url: "http://[::1"\n', "tiers[0].backends[0].url"),
        ('        url: "http://h:99999"\n', "tiers[0].backends[0].url"),
        ('        url: "http://h:abc"\n', "tiers[0].backends[0].url"),
        (URL + '        kv_events: "tcp://[::1:5557"\n', "tiers[0].backends[0].kv_events"),
        (
            URL + "        capacity: {gpu_memory_gib: 1.0e+300, preset: llama-3.1-8b}\n",
            "tiers[0].backends[0].capacity.gpu_memory_gib",
        ),
        (URL + "auth:\n  keys:\n    - {name: x, key_file: /bin/ls}\n", "auth.keys[0].key_file"),
        (URL + "server:\n  api_keys_file: /bin/ls\n", "server.api_keys_file"),
        (URL + 'ledger:\n  url: "redis://h:notaport/0"\n', "ledger.url"),
        (URL + 'discovery:\n  nameservers: ["not an ip"]\n', "discovery.nameservers[0]"),
    ],
    ids=[
        "ipv6-url",
        "port-past-65535",
        "port-not-a-number",
        "ipv6-kv-events",
        "huge-capacity",
        "binary-key-file",
        "binary-api-keys-file",
        "ledger-port",
        "nameserver",
    ],
)
def test_a_bad_value_is_refused_at_load_with_its_path(extra: str, where: str) -> None:
    message = _problem(BASE + extra)
    assert message.startswith(f"{where}: ") or f"\n  {where}: " in message, message


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0", "rediss://h", "redis://[::1]:6380", "redis://:pw@h:6379/2"]
)
def test_a_redis_url_is_read_as_redis_py_reads_it(url: str) -> None:
    assert redis_url_problem(url) is None


@pytest.mark.parametrize("ok", ["10.0.0.2", "10.0.0.2:5353", "::1", "[fd00::1]:53"])
def test_a_nameserver_is_an_address_with_an_optional_port(ok: str) -> None:
    parse_config_text(textwrap.dedent(BASE + URL + f'discovery:\n  nameservers: ["{ok}"]\n'))


def test_a_classs_null_queue_timeout_is_the_admission_default() -> None:
    cfg = parse_config_text(
        textwrap.dedent(BASE + URL + "auth:\n  classes:\n    - {name: a, queue_timeout_s: null}\n")
    )
    assert cfg.auth.queue_timeout("default", 7.0) == 7.0


def test_a_document_of_nested_aliases_is_refused_at_once() -> None:
    """Nine aliases nested eight deep hold 9**8 values: refused before they are expanded
    (expanding them took a minute and more than a gigabyte)."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    started = time.monotonic()
    assert "YAML aliases" in _problem("\n".join(lines) + "\n" + BASE + URL)
    assert time.monotonic() - started < 1.0


def test_a_reload_that_turns_tracing_on_or_off_says_it_needs_a_restart() -> None:
    old = parse_config_text(textwrap.dedent(BASE + URL))
    assert restart_only(old, dataclasses.replace(old, tracing=TracingConfig(enabled=True))) == [
        "tracing"
    ]


@pytest.mark.parametrize(
    "extra",
    [
        "ledger:\n  lease_s: 20\n  credit_hold_s: 4\n",
        "load_feedback:\n  kv_high_watermark: 0.99\n  kv_low_watermark: 0.97\n",
    ],
)
def test_the_schema_takes_bounds_that_follow_other_keys_as_the_loader_does(extra: str) -> None:
    text = textwrap.dedent(BASE + URL + extra)
    parse_config_text(text)
    document: Any = yaml.safe_load(text)
    errors = list(jsonschema.Draft202012Validator(config_schema()).iter_errors(document))
    assert not errors, errors[0].message
