import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvgateway.config.load import load_config, parse_config_text
from kvgateway.config.yamlread import ConfigError

BASE = """
models:
  - name: m
    served_name: org/M
    aliases: [alias]
tiers:
  - name: small
    backends:
      - {name: a, url: "http://127.0.0.1:9000", model: m, max_num_seqs: 8}
"""


def parse(text: str):
    return parse_config_text(textwrap.dedent(text))


def test_example_and_demo_configs_load():
    for path in ("config/demo.yaml", "config/gateway.example.yaml"):
        cfg = load_config(path)
        assert cfg.backends
        assert cfg.resolve_model(cfg.models[0].name) is cfg.models[0]


def test_defaults_and_aliases():
    cfg = parse(BASE)
    assert cfg.routing.policy == "kv_aware"
    assert cfg.resolve_model("alias").served_name == "org/M"
    assert cfg.backends[0].served_model == "org/M"
    assert cfg.backends[0].max_num_seqs == 8


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            ("max_num_seqs: 8", 'max_num_seqs: "four"'),
            'tiers[0].backends[0].max_num_seqs: expected a positive integer, got "four"',
        ),
        (("model: m,", "model: nope,"), 'tiers[0].backends[0].model: unknown model "nope"'),
        (("http://127.0.0.1:9000", "ftp://x"), "tiers[0].backends[0].url: expected an http(s) URL"),
        (
            ("http://127.0.0.1:9000", "http://h:1/v1"),
            "tiers[0].backends[0].url: give the server root",
        ),
        (("max_num_seqs: 8", "max_num_seq: 8"), "tiers[0].backends[0].max_num_seq: unknown key"),
        (
            ("name: small", "name: small\n    offload: maybe"),
            "tiers[0].offload: expected true or false",
        ),
    ],
)
def test_errors_name_the_yaml_path(patch, message):
    with pytest.raises(ConfigError) as err:
        parse(BASE.replace(*patch))
    assert str(err.value).startswith(message), str(err.value)


def test_policy_and_fraction_validation():
    with pytest.raises(ConfigError, match=r"routing.policy: expected one of kv_aware"):
        parse(BASE + "routing: {policy: random}\n")
    with pytest.raises(
        ConfigError, match=r"admission.budget_fraction: expected a number > 0.0 and <= 1.0"
    ):
        parse(BASE + "admission: {budget_fraction: 1.5}\n")


def test_duplicate_backend_names_rejected():
    text = BASE + '      - {name: a, url: "http://127.0.0.1:9001", model: m}\n'
    with pytest.raises(ConfigError, match="name 'a' is used twice"):
        parse(text)


def test_invalid_yaml_names_line():
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        parse("models: [\n")


def test_api_keys_from_file_and_env(tmp_path, monkeypatch):
    keys = tmp_path / "keys.env"
    keys.write_text("# keys\nGATEWAY_KEY=k-file\n\nk-bare\n")
    monkeypatch.setenv("MY_KEYS", "k-env1,k-env2")
    cfg = parse(
        BASE + f"server: {{api_keys: [k-inline], api_keys_file: {keys}, api_keys_env: MY_KEYS}}\n"
    )
    assert set(cfg.server.api_keys) == {"k-inline", "k-file", "k-bare", "k-env1", "k-env2"}


def test_example_config_documents_every_setting():
    import dataclasses
    import re

    from kvgateway import config as c

    text = Path("config/gateway.example.yaml").read_text(encoding="utf-8")
    keys = set(re.findall(r"^\s*#?\s*([a-z_]+):", text, flags=re.M))
    keys |= set(re.findall(r"[{,]\s*([a-z_]+):", text))
    aliases = {"encoding": "encoding"}  # TokenizerConfig.encoding is spelled encoding/file/pattern
    # A tenant's keys are `key`, `key_file`, `key_env`; its class is `class` in YAML.
    aliases |= {"class_name": "class"}
    keyed = {"TenantConfig.keys": "key"}
    # Not YAML keys of their own: a group's name is its backend entry's `- name:`, and its
    # template holds the backend settings checked elsewhere.
    not_keys = {"DnsGroupConfig.name", "DnsGroupConfig.template"}
    missing = []
    for cls in (
        c.ServerConfig,
        c.AdmissionConfig,
        c.RoutingConfig,
        c.HealthConfig,
        c.LoadFeedbackConfig,
        c.TimeoutConfig,
        c.TokenizerConfig,
        c.DiscoveryConfig,
        c.DnsGroupConfig,
        c.AuthConfig,
        c.ClassConfig,
        c.TenantConfig,
        c.TenantLimits,
        c.LedgerConfig,
    ):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue  # derived from the settings, not one
            name = keyed.get(f"{cls.__name__}.{f.name}", aliases.get(f.name, f.name))
            if name not in keys and f"{cls.__name__}.{f.name}" not in not_keys:
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, missing


def test_empty_or_blank_keys_are_start_up_errors_naming_their_source(tmp_path, monkeypatch):
    import pytest as _pytest

    base = "models: [{name: m}]\ntiers: [{name: t, backends: [{name: a, url: 'http://h:1', model: m}]}]\n"
    with _pytest.raises(ConfigError) as err:
        parse_config_text('server: {api_keys: ["  "]}\n' + base)
    assert "server.api_keys[0]" in str(err.value)
    keys = tmp_path / "keys.env"
    keys.write_text("# keys\nTEAM_A=sk-a\nTEAM_B=\n")
    with _pytest.raises(ConfigError) as err:
        parse_config_text(f"server: {{api_keys_file: {keys}}}\n" + base)
    assert "server.api_keys_file" in str(err.value) and "line 3" in str(err.value)
    monkeypatch.setenv("GW_KEYS", "sk-1,,sk-2")
    with _pytest.raises(ConfigError) as err:
        parse_config_text("server: {api_keys_env: GW_KEYS}\n" + base)
    assert "GW_KEYS" in str(err.value)
    monkeypatch.setenv("GW_KEYS", "sk-1, sk-2")
    cfg = parse_config_text("server: {api_keys_env: GW_KEYS, admin_api_keys: [adm]}\n" + base)
    assert cfg.server.api_keys == ("sk-1", "sk-2") and cfg.server.admin_api_keys == ("adm",)


def test_a_models_template_defaults_are_read_and_checked():
    from kvgateway.config.load import parse_config

    backend = {"name": "b", "url": "http://h:1", "model": "m"}

    def cfg(kwargs: object) -> dict[str, Any]:
        return {
            "models": [{"name": "m", "tokenizer": {"chat_template_kwargs": kwargs}}],
            "tiers": [{"name": "t", "backends": [backend]}],
        }

    tok = parse_config(cfg({"enable_thinking": False})).models[0].tokenizer
    assert tok.template_defaults() == {"enable_thinking": False}
    assert parse_config(cfg(None)).models[0].tokenizer.template_defaults() == {}
    with pytest.raises(ConfigError, match=r"models\[0\]\.tokenizer\.chat_template_kwargs"):
        parse_config(cfg(["enable_thinking"]))


def test_an_unknown_keys_error_lists_the_optional_keys_left_unset():
    """The hint lists the optional keys left unset as well as those read: a misspelt
    `served_modle` is told of `served_model`, which the keys read alone would leave out."""
    with pytest.raises(ConfigError) as err:
        parse(BASE.replace("max_num_seqs: 8", "served_modle: x"))
    known = str(err.value).split("known keys here: ")[1]
    assert "served_model" in known and "kv_events" in known, str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Each would pass `check` and then crash or misbehave in `serve`.
        ("ledger: {lease_s: .inf}\n", "ledger.lease_s: expected a finite number"),
        ("admission: {queue_timeout_s: " + "1" * 400 + "}\n", "below 2**53"),
        ("server: {port: 89537}\n", "server.port: expected an integer from 0 to 65535"),
    ],
)
def test_numbers_past_what_the_gateway_can_use_name_the_yaml_path(extra, message):
    with pytest.raises(ConfigError) as err:
        parse(BASE + extra)
    assert message in str(err.value)
    assert len(str(err.value)) < 400  # the 400-digit value is not echoed whole


def test_a_static_backend_cannot_take_a_dns_members_name():
    text = BASE.replace("name: a,", 'name: "pool@127.0.0.1:24201",')
    with pytest.raises(ConfigError, match=r'tiers\[0\].backends\[0\].name: "@" is kept for DNS'):
        parse(text)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path):
    path = tmp_path / "g.yaml"
    path.write_bytes(BASE.encode() + b"# \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(str(path))
    path.write_text("admission: {queue_timeout_s: " + "9" * 5000 + "}\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(path))


def test_a_reload_names_the_settings_only_a_restart_applies():
    from kvgateway.server.reload import restart_only

    old = parse(BASE)
    new = parse(
        BASE + "server: {keepalive_timeout_s: 1, log_format: json}\n"
        "discovery: {nameservers: ['127.0.0.1:5353']}\n"
    )
    assert restart_only(old, new) == [
        "server.keepalive_timeout_s",
        "server.log_format",
        "discovery",
    ]
    assert restart_only(old, parse(BASE)) == []


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        ("{encoding: cl999k}", "models[0].tokenizer.encoding: unknown tiktoken encoding"),
        ("{file: /no/such.tiktoken}", "models[0].tokenizer.file: tokenizer file"),
    ],
)
def test_an_encoding_that_cannot_load_fails_the_config_not_the_start(tokenizer, message):
    """Refused when the config is read, with its path: else it would pass `gateway check`
    and crash `serve` with a traceback naming no path."""
    with pytest.raises(ConfigError) as err:
        parse(BASE.replace("aliases: [alias]", f"aliases: [alias]\n    tokenizer: {tokenizer}"))
    assert str(err.value).startswith(message), str(err.value)


def test_a_bad_pattern_for_a_bpe_file_fails_the_config(tmp_path: Path):
    bpe = tmp_path / "v.tiktoken"
    bpe.write_text("YQ== 0\nYg== 1\n")
    text = BASE.replace(
        "aliases: [alias]",
        f"aliases: [alias]\n    tokenizer: {{file: {bpe}, pattern: '[a-z(unclosed'}}",
    )
    with pytest.raises(ConfigError, match=r"models\[0\].tokenizer.pattern: cannot read"):
        parse(text)


def test_references_inside_mappings_are_typed_like_plain_values(monkeypatch, tmp_path: Path):
    """``${VAR}`` in a mapping is typed as the same value written plainly: as strings,
    gpu_memory_gib "79.25" would be refused, and enable_thinking "false" would reach the
    template as a (true) string."""
    monkeypatch.setenv("THINK", "false")
    text = BASE.replace(
        "aliases: [alias]",
        "aliases: [alias]\n    tokenizer: {chat_template_kwargs: {enable_thinking: '${THINK}', "
        "effort: '${EFFORT:-high}'}}",
    ).replace(
        "max_num_seqs: 8}",
        "max_num_seqs: 8, capacity: {gpu_memory_gib: '${GIB:-79.25}', preset: llama-3.1-8b}}",
    )
    cfg = parse(text)
    assert (
        cfg.models[0].tokenizer.chat_template_kwargs == '{"effort":"high","enable_thinking":false}'
    )
    from kvgateway.simulator.fleetconfig import load_fleet_config

    path = tmp_path / "f.yaml"
    path.write_text(
        "simulation: {time_scale: '${TS:-4}'}\n"
        "models: [{name: m}]\n"
        "tiers: [{name: t, backends: [{name: a, url: 'http://127.0.0.1:9', model: m, "
        "simulate: {profile: tiny, max_num_seqs: '${SEQS:-3}'}}]}]\n"
    )
    (spec,) = load_fleet_config(path)
    assert spec.settings.time_scale == 4.0 and spec.settings.max_num_seqs == 3
    # Only the simulation blocks: a name or a label from a reference stays a string
    # (NODE_NAME=7 is a name, not a number).
    monkeypatch.setenv("NODE_NAME", "7")
    path.write_text(
        "models: [{name: m}]\n"
        "tiers: [{name: t, backends: [{name: '${NODE_NAME}', url: 'http://127.0.0.1:9', "
        "model: m, simulate: {profile: tiny, engine_label: '${LABEL:-0}'}}]}]\n"
    )
    (spec,) = load_fleet_config(path)
    assert spec.settings.name == "7" and spec.settings.engine_label == "0"


def test_capacity_problems_are_reported_with_the_files_others():
    """Every backend's capacity-block problem is reported with the file's other problems
    when the config is read: found only when the fleet is built, it would come once every
    other one is fixed, and for the first backend alone."""
    text = BASE.replace(
        "max_num_seqs: 8}",
        "max_num_seqs: 8, capacity: {gpu_memry_gib: 24.0, preset: llama-3.1-8b}}\n"
        '      - {name: b, url: "http://127.0.0.1:9001", model: m, '
        "capacity: {gpu_memory_gib: 2.0, preset: no-such-model}}",
    )
    with pytest.raises(ConfigError) as err:
        parse(text + "routing: {policy: random}\n")
    paths = {e.path or str(e).split(":")[0] for e in err.value.errors}
    assert "routing.policy" in paths
    assert sum("capacity" in p for p in paths) == 2, str(err.value)


def test_a_simulated_nodes_max_num_seqs_is_the_backends_unless_set_there():
    """A `simulate:` block says how the node runs; vLLM does not report --max-num-seqs."""
    cfg = parse(
        """
        models: [{name: m}]
        tiers:
          - name: t
            backends:
              - {name: a, url: "http://127.0.0.1:9000", model: m, simulate: {max_num_seqs: 16}}
              - {name: b, url: "http://127.0.0.1:9001", model: m, max_num_seqs: 8,
                 simulate: {max_num_seqs: 16}}
              - {name: c, url: "http://127.0.0.1:9002", model: m, simulate: {profile: tiny}}
        """
    )
    assert [b.max_num_seqs for b in cfg.backends] == [16, 8, None]
