"""Key files (`key_file`, `server.api_keys_file`, `server.admin_api_keys_file`): a padded
base64 key is read whole; a line is `NAME=key` only when NAME is a variable name; any other
line, `=` included, is a key."""

import textwrap

import pytest

from kvgateway.config.load import parse_config_text
from kvgateway.config.model import GatewayConfig
from kvgateway.config.yamlread import ConfigError
from kvgateway.server.edge import is_admin, tenant_for_key
from tests.support.config_text import ONE_BACKEND

BASE = ONE_BACKEND

# `openssl rand -base64 16` and `openssl rand -base64 32`: padded with `==` and `=`; both
# are also a variable name followed by `=`, so NAME= alone cannot tell them from env lines.
B64_16 = "q0H5mV2yZr8x1pQw3kLmNw=="
B64_32 = "Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmE="
B64_WITH_SLASH = "9f+/Qm1x2Lw3Zk4N5p6R7A=="


def parse(extra: str) -> GatewayConfig:
    return parse_config_text(BASE + textwrap.dedent(extra))


def tenant_keys(tmp_path, text: str) -> tuple[str, ...]:
    path = tmp_path / "tenant.keys"
    path.write_text(text)
    cfg = parse(f"auth: {{keys: [{{name: eval, key_file: {path}}}]}}\n")
    return cfg.auth.keys[0].keys


def test_base64_keys_are_read_whole_in_every_key_file(tmp_path):
    path = tmp_path / "eval.keys"
    path.write_text(f"# nightly eval\n{B64_16}\n\n{B64_32}\n")
    other = tmp_path / "default.keys"  # a tenant may not share the default tenant's keys
    other.write_text(f"{B64_WITH_SLASH}\n")
    cfg = parse(
        f"""
        server: {{api_keys_file: {other}, admin_api_keys_file: {path}}}
        auth: {{keys: [{{name: eval, key_file: {path}}}]}}
        """
    )
    assert cfg.auth.keys[0].keys == (B64_16, B64_32)
    assert cfg.server.admin_api_keys == (B64_16, B64_32)
    assert cfg.server.api_keys == (B64_WITH_SLASH,)


def test_a_base64_key_authenticates_and_a_bare_equals_sign_does_not(tmp_path):
    path = tmp_path / "eval.keys"
    path.write_text(f"{B64_16}\n")
    cfg = parse(
        f"""
        server: {{admin_api_keys_file: {path}}}
        auth: {{keys: [{{name: eval, key_file: {path}}}]}}
        """
    )
    assert tenant_for_key(cfg.auth, f"Bearer {B64_16}") == "eval"
    assert tenant_for_key(cfg.auth, "Bearer =") is None
    admin = cfg.server.admin_api_keys
    assert is_admin(f"Bearer {B64_16}", admin)
    assert not is_admin("Bearer =", admin)
    assert "=" not in cfg.auth.keys[0].keys and "=" not in cfg.server.admin_api_keys


@pytest.mark.parametrize(
    "line",
    [
        "NAME=sk-key",
        "export NAME=sk-key",
        "export   CHAT_APP_KEY=sk-key",
        'NAME="sk-key"',
        "NAME='sk-key'",
        "_name9=sk-key",
        "NAME= sk-key",
        "NAME = sk-key",  # dotenv files allow spaces around the =
        'export NAME = "sk-key"',
    ],
)
def test_name_equals_lines_give_the_value_without_its_quotes(tmp_path, line):
    assert tenant_keys(tmp_path, f"{line}\n") == ("sk-key",)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("abc=def==", "def=="),  # NAME= form: the value after the first `=`
        (f"KEY={B64_16}", B64_16),
        (f'export KEY="{B64_32}"', B64_32),
        ("NAME=\"sk-'mixed'\"", "sk-'mixed'"),  # one pair of quotes only
        ("NAME=\"sk-key'", "\"sk-key'"),  # quotes that do not match stay
        ('"sk-key"', '"sk-key"'),  # not NAME= form: the line as it stands
        ("1ABC=def", "1ABC=def"),  # not a variable name
        ("my-key=abc", "my-key=abc"),
        ("=abc", "=abc"),
        ("a b=c", "a b=c"),
        ("sk-abc=", "sk-abc="),
    ],
)
def test_only_a_variable_name_before_the_equals_sign_makes_a_name_line(tmp_path, line, key):
    assert tenant_keys(tmp_path, f"{line}\n") == (key,)


@pytest.mark.parametrize(
    "line",
    [
        "TEAM_B=",
        'TEAM_B=""',
        "TEAM_B=''",
        "export TEAM_B=",
        "KEY=",  # canonical base64, but too short to be read as a base64 key
        "CHAT_APP_KEY_PRODUCTION=",  # `_` is not base64
    ],
)
def test_an_empty_value_is_refused_naming_the_file_line(tmp_path, line):
    path = tmp_path / "keys.env"
    path.write_text(f"# keys\nTEAM_A=sk-a\n{line}\n")
    with pytest.raises(ConfigError, match="empty API key") as err:
        parse(f"server: {{api_keys_file: {path}}}\n")
    assert "server.api_keys_file" in str(err.value) and f"{path} line 3" in str(err.value)
    with pytest.raises(ConfigError, match="empty API key") as err:
        parse(f"auth: {{keys: [{{name: eval, key_file: {path}}}]}}\n")
    assert "auth.keys[0].key_file" in str(err.value) and "line 3" in str(err.value)


@pytest.mark.parametrize("line", ["=", "==", "TEAM_B==", 'TEAM_B="="', "q0H5mV2yZr8x1pQw=="])
def test_a_key_of_only_equals_signs_is_refused_naming_the_file_line(tmp_path, line):
    # "q0H5mV2yZr8x1pQw==" is 18 characters: not base64 (not a multiple of 4), so NAME==.
    path = tmp_path / "keys.env"
    path.write_text(f"TEAM_A=sk-a\n{line}\n")
    for yaml, where in (
        (f"server: {{admin_api_keys_file: {path}}}\n", "server.admin_api_keys_file"),
        (f"auth: {{keys: [{{name: eval, key_file: {path}}}]}}\n", "auth.keys[0].key_file"),
    ):
        with pytest.raises(ConfigError, match="is not a key") as err:
            parse(yaml)
        assert where in str(err.value) and f"{path} line 2" in str(err.value)
