"""`auth:`: tenants, classes, the default tenant; every problem reported with its path."""

import textwrap

import pytest

from kvgateway.config.load import parse_config_text
from kvgateway.config.model import DEFAULT_TENANT
from kvgateway.config.yamlread import ConfigError
from tests.support.config_text import ONE_BACKEND

BASE = ONE_BACKEND


def parse(extra: str):
    return parse_config_text(BASE + textwrap.dedent(extra))


def test_no_auth_is_an_open_gateway_of_one_default_tenant_and_class():
    cfg = parse("")
    assert cfg.auth.open and [c.name for c in cfg.auth.classes] == ["standard"]
    assert cfg.auth.default_tenant.name == DEFAULT_TENANT
    assert cfg.auth.class_of(cfg.auth.default_tenant) == "standard"


def test_server_api_keys_are_the_default_tenants(tmp_path, monkeypatch):
    keys = tmp_path / "keys.env"
    keys.write_text("A=k-file\n")
    monkeypatch.setenv("APP_KEYS", "k-env1,k-env2")
    cfg = parse(
        f"""
        server: {{api_keys: [k-legacy]}}
        auth:
          classes: [{{name: interactive, floor_share: 0.3}}, {{name: batch}}]
          default_tenant: {{name: legacy, limits: {{requests_per_minute: 10}}}}
          keys:
            - {{name: app, key_env: APP_KEYS, key_file: {keys}, class: interactive, weight: 3}}
            - {{name: etl, key: k-etl, limits: {{max_kv_share: 0.5, max_concurrent: 4}}}}
        """
    )
    auth = cfg.auth
    assert not auth.open
    assert auth.default_tenant.keys == ("k-legacy",)
    assert auth.default_tenant.limits.requests_per_minute == 10
    app, etl = auth.keys
    assert set(app.keys) == {"k-env1", "k-env2", "k-file"} and app.weight == 3.0
    assert auth.rank(app) == 0 and auth.class_of(etl) == "batch"  # no class: the lowest
    assert etl.limits.max_kv_share == 0.5 and etl.limits.max_concurrent == 4
    assert auth.classes[0].floor_share == 0.3


def test_every_auth_problem_is_reported_at_once_with_its_path(monkeypatch):
    monkeypatch.setenv("EMPTYISH", "k1,,k2")
    with pytest.raises(ConfigError) as err:
        parse(
            """
            server: {api_keys: [shared]}
            auth:
              classes: [{name: a, floor_share: 0.6}, {name: b, floor_share: 0.5}, {name: a}]
              keys:
                - {name: x, key: shared, class: nope}
                - {name: "bad name"}
                - {name: x, key_env: EMPTYISH, weight: 0, limits: {max_kv_share: 1.5}}
            """
        )
    text = str(err.value)
    for needle in (
        "auth.classes: name 'a' is used twice",
        "auth.classes: the floor shares add up to 1 or more",
        "auth.keys[0].class: unknown class 'nope'",
        "tenants 'default' and 'x' share a key",
        "auth.keys[1].name: expected letters",
        "auth.keys[1]: a tenant needs a key",
        "auth.keys: name 'x' is used twice",
        "an empty API key",
        "auth.keys[2].weight",
        "auth.keys[2].limits.max_kv_share",
    ):
        assert needle in text, (needle, text)
