"""Reading the YAML: environment references, every error at once, duplicate keys, schema."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # types-jsonschema is not a dev dependency
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvgateway.config.document import expand_env
from kvgateway.config.load import parse_config_text
from kvgateway.config.schema import config_schema
from kvgateway.config.yamlread import ConfigError, Reading

BASE = """
models:
  - name: m
tiers:
  - name: small
    backends:
      - {name: a, url: "http://127.0.0.1:9000", model: m, max_num_seqs: 8}
"""


def parse(text: str):
    return parse_config_text(textwrap.dedent(text))


def test_env_references_are_expanded_and_typed(monkeypatch):
    monkeypatch.setenv("GW_PORT", "9999")
    monkeypatch.setenv("GW_HOST", "10.1.2.3")
    monkeypatch.setenv("GW_EMPTY", "")
    monkeypatch.delenv("GW_UNSET", raising=False)
    cfg = parse(
        BASE.replace("http://127.0.0.1:9000", "http://${GW_HOST}:${GW_NODE_PORT:-9001}")
        + "server: {port: '${GW_PORT}', host: '${GW_EMPTY:-0.0.0.0}', "
        "access_log: '${GW_UNSET:-false}'}\n"
        "admission: {budget_fraction: '${GW_UNSET:-0.5}'}\n"
    )
    assert cfg.server.port == 9999
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.access_log is False
    assert cfg.admission.budget_fraction == 0.5
    assert cfg.backends[0].url == "http://10.1.2.3:9001"


def test_a_number_written_as_a_plain_string_is_still_rejected():
    # Only strings that came from ${...} are read as YAML: "8" in quotes stays a string.
    with pytest.raises(ConfigError, match=r'max_num_seqs: expected a positive integer, got "8"'):
        parse(BASE.replace("max_num_seqs: 8", 'max_num_seqs: "8"'))


def test_unset_variable_and_bad_reference_name_the_path(monkeypatch):
    monkeypatch.delenv("GW_NOPE", raising=False)
    with pytest.raises(ConfigError) as err:
        parse(BASE + "server: {host: '${GW_NOPE}', port: '${bad'}\n")
    problems = {(e.path, e.problem.split(" (")[0]) for e in err.value.errors}
    assert ("server.host", "environment variable GW_NOPE is not set") in problems
    assert any(p == "server.port" and "unterminated" in m for p, m in problems)


def test_dollar_dollar_is_a_literal_dollar():
    reading = Reading()
    assert expand_env({"k": ["a$$b", "${X:-$}"]}, "", reading, {}) == {"k": ["a$b", "$"]}
    assert not reading.errors


def test_every_error_is_reported_at_once_with_its_path():
    text = BASE.replace("max_num_seqs: 8", 'max_num_seqs: "four", bogus: 1') + (
        "routing: {policy: random}\nadmission: {budget_fraction: 1.5}\nhealth: {interval_s: fast}\n"
    )
    with pytest.raises(ConfigError) as err:
        parse(text)
    paths = [e.path for e in err.value.errors]
    assert paths == [
        "admission.budget_fraction",
        "routing.policy",
        "health.interval_s",
        "tiers[0].backends[0].max_num_seqs",
        "tiers[0].backends[0].bogus",
    ], str(err.value)
    assert str(err.value).startswith("5 problems:\n  admission.budget_fraction: expected")


def test_duplicate_keys_are_rejected_with_path_and_lines():
    text = """\
models:
  - name: m
    served_name: a
    served_name: b
tiers:
  - name: t
    backends:
      - name: x
        url: http://127.0.0.1:9000
        model: m
        url: http://127.0.0.1:9001
"""
    with pytest.raises(ConfigError) as err:
        parse_config_text(text)
    messages = [str(e) for e in err.value.errors]
    assert "models[0].served_name: duplicate key (first at line 3, again at line 4)" in messages
    assert "tiers[0].backends[0].url: duplicate key (first at line 9, again at line 11)" in messages


def test_yaml_merge_keys_are_not_duplicates():
    text = BASE + "timeouts: &t {connect_s: 1}\nhealth: {<<: {interval_s: 1}, timeout_s: 1}\n"
    assert parse(text).health.interval_s == 1.0


def test_backend_needs_exactly_one_of_url_and_dns():
    with pytest.raises(ConfigError, match=r"tiers\[0\].backends\[0\]: needs `url` or `dns`"):
        parse(BASE.replace('url: "http://127.0.0.1:9000", ', ""))
    with pytest.raises(ConfigError, match=r"backends\[0\].dns: give either `url` or `dns`"):
        parse(BASE.replace("model: m,", "model: m, dns: vllm.test,"))


def test_dns_group_parses_into_a_member_template():
    cfg = parse(
        BASE + "      - {name: pool, dns: vllm.ns.svc.cluster.local., port: 8001, model: m,\n"
        "         resolve_interval_s: 3, max_num_seqs: 4}\n"
    )
    (group,) = cfg.dns_groups
    assert (group.dns, group.port, group.scheme, group.resolve_interval_s) == (
        "vllm.ns.svc.cluster.local",
        8001,
        "http",
        3.0,
    )
    assert [b.name for b in cfg.backends] == ["a"]
    member = group.member("10.0.0.5")
    assert (member.name, member.url, member.max_num_seqs) == (
        "pool@10.0.0.5:8001",
        "http://10.0.0.5:8001",
        4,
    )
    assert group.member("fd00::5").url == "http://[fd00::5]:8001"


def test_dns_only_keys_are_unknown_on_a_url_backend():
    with pytest.raises(ConfigError, match=r"backends\[0\].port: unknown key"):
        parse(BASE.replace("model: m,", "model: m, port: 1,"))


def _validator() -> jsonschema.Draft202012Validator:
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", ["config/demo.yaml", "config/gateway.example.yaml"])
def test_schema_validates_the_shipped_configs(path):
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    errors = [e.message for e in _validator().iter_errors(data)]
    assert not errors, errors


@pytest.mark.parametrize(
    "bad",
    [
        {"routing": {"policy": "random"}},
        {"admission": {"budget_fraction": 0}},
        {"server": {"prot": 1}},
        {"tiers": [{"name": "t", "backends": [{"name": "a", "model": "m"}]}]},
        {
            "tiers": [
                {"name": "t", "backends": [{"name": "a", "model": "m", "url": "h", "dns": "d"}]}
            ]
        },
    ],
)
def test_schema_rejects_what_the_loader_rejects(bad):
    doc = {
        "models": [{"name": "m"}],
        "tiers": [{"name": "t", "backends": [{"name": "a", "url": "http://h:1", "model": "m"}]}],
    }
    assert not list(_validator().iter_errors(doc))
    doc.update(bad)
    assert list(_validator().iter_errors(doc))
    with pytest.raises(ConfigError):
        parse_config_text(yaml.safe_dump(doc))


@pytest.mark.parametrize(
    ("auth", "ok"),
    [
        ({"classes": [{"name": "a", "queue_timeout_s": None}]}, True),
        ({"classes": [{"name": "a", "queue_timeout_s": 0}]}, True),
        ({"classes": [{"name": "a", "queue_timeout_s": -1}]}, False),
        ({"keys": [{"name": "t", "key": "k", "limits": {"max_kv_share": None}}]}, True),
        ({"keys": [{"name": "t", "key": "k", "limits": {"max_kv_share": 0.5}}]}, True),
        ({"keys": [{"name": "t", "key": "k", "limits": {"max_kv_share": 0}}]}, False),
        ({"keys": [{"name": "t", "key": "k", "limits": {"max_kv_share": 1.5}}]}, False),
    ],
)
def test_settings_whose_absence_means_something_agree_in_schema_and_loader(auth, ok):
    """A class's queue timeout (absent or null: admission.queue_timeout_s) and a tenant's
    KV share (absent or null: unlimited) are taken or refused alike by the schema and the
    loader, and the schema shows no default for either (they have none of their own)."""
    doc = {
        "models": [{"name": "m"}],
        "tiers": [{"name": "t", "backends": [{"name": "a", "url": "http://h:1", "model": "m"}]}],
        "auth": auth,
    }
    assert (not list(_validator().iter_errors(doc))) == ok
    if ok:
        parse_config_text(yaml.safe_dump(doc))
    else:
        with pytest.raises(ConfigError):
            parse_config_text(yaml.safe_dump(doc))
    schema = config_schema()
    shares = _all(schema, "max_kv_share")  # the default tenant's and each key's
    assert shares and all("default" not in p for p in shares)
    # admission.queue_timeout_s has its default; a class's has none.
    timeouts = sorted(str(p.get("default")) for p in _all(schema, "queue_timeout_s"))
    assert timeouts == ["300.0", "None"], timeouts


def _all(node: object, key: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and isinstance(v, dict):
                found.append(v)
            found += _all(v, key)
    elif isinstance(node, list):
        for v in node:
            found += _all(v, key)
    return found


def test_schema_allows_env_references_in_numbers():
    doc = {
        "server": {"port": "${PORT:-8080}"},
        "models": [{"name": "m"}],
        "tiers": [{"name": "t", "backends": [{"name": "a", "url": "http://h:1", "model": "m"}]}],
    }
    assert not list(_validator().iter_errors(doc))


def test_config_schema_command_prints_the_schema():
    out = subprocess.run(
        [sys.executable, "-m", "kvgateway", "config-schema"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out) == config_schema()


no_dollar = st.text(alphabet=st.characters(blacklist_characters="$", codec="utf-8"), max_size=20)
var_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)


@given(no_dollar)
def test_text_without_a_dollar_is_left_alone(text):
    reading = Reading()
    assert expand_env(text, "k", reading, {}) == text
    assert not reading.errors and not reading.expanded


@given(no_dollar, var_names, st.text(max_size=20), no_dollar, no_dollar)
def test_a_reference_is_replaced_by_its_value_or_default(prefix, name, value, default, suffix):
    default = default.replace("}", "")
    reading = Reading()
    text = f"{prefix}${{{name}}}{suffix}"
    assert expand_env(text, "k", reading, {name: value}) == prefix + value + suffix
    with_default = f"{prefix}${{{name}:-{default}}}{suffix}"
    expected = value if value else default
    assert expand_env(with_default, "k", reading, {name: value}) == prefix + expected + suffix
    assert expand_env(with_default, "k", reading, {}) == prefix + default + suffix
    assert not reading.errors


def test_schema_defaults_are_values_the_loader_accepts():
    """`served_name` (the model's name) and a key's `class` (the lowest class) default to
    other keys' values: what the schema advertises for them is never "", which the loader
    refuses."""

    def defaults(node: object) -> list[object]:
        if isinstance(node, dict):
            own = [node["default"]] if "default" in node else []
            return own + [d for v in node.values() for d in defaults(v)]
        if isinstance(node, list):
            return [d for v in node for d in defaults(v)]
        return []

    assert "" not in defaults(config_schema())
