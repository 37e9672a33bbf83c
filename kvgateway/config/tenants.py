"""Reading ``auth:`` (tenants, priority classes, the default tenant) and API keys.

Keys are read the same way everywhere: ``NAME`` (a string or a list), ``NAME_file`` (one
key a line, or ``NAME=key`` lines of an env file; see :func:`key_file_line`) and
``NAME_env`` (a comma-separated environment variable). An empty key is an error naming
where it came from.
"""

from __future__ import annotations

import base64
import binascii
import os
import re

from kvgateway.config.model import (
    DEFAULT_TENANT,
    AuthConfig,
    ClassConfig,
    TenantConfig,
    TenantLimits,
)
from kvgateway.config.yamlread import Section

# Tenant and class names become metric label values: keep them short and plain.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# A key file's ``NAME=value`` line (``export NAME=value`` too, as a shell-sourced env file
# has it): only a variable name before the first ``=`` makes one.
_ENV_LINE = re.compile(r"^(?:export\s+)?[A-Za-z_][A-Za-z0-9_]*\s*=\s*(.*)$")
# A padded base64 key (``openssl rand -base64 16`` prints ``q0H5mV2yZr8x1pQw3kLmNw==``) often
# looks like ``NAME=`` or ``NAME==``; one of at least 16 characters is read as a key.
_PADDED_BASE64 = re.compile(r"^[A-Za-z0-9+/]{14,}={1,2}$")


def read_auth(s: Section, legacy_keys: tuple[str, ...]) -> AuthConfig:
    """``auth:``; ``legacy_keys`` (``server.api_keys*``) are the default tenant's keys."""
    d = AuthConfig()
    classes = tuple(_class(c) for c in s.sections("classes")) or d.classes
    class_names = [c.name for c in classes]
    _unique(s, "classes", class_names)
    if sum(c.floor_share for c in classes) >= 1.0:
        s.fail("classes", "the floor shares add up to 1 or more: nothing would be left to share")
    default = _tenant(s.section("default_tenant"), class_names, default_name=DEFAULT_TENANT)
    default = TenantConfig(
        name=default.name,
        keys=legacy_keys,
        class_name=default.class_name,
        weight=default.weight,
        limits=default.limits,
    )
    tenants = tuple(_tenant(t, class_names) for t in s.sections("keys"))
    for i, t in enumerate(tenants):
        if not t.keys and not s.reading.schema_mode:
            s.fail(f"keys[{i}]", "a tenant needs a key (`key`, `key_file` or `key_env`)")
    _unique(s, "keys", [default.name, *(t.name for t in tenants)])
    owners: dict[str, str] = {}
    for t in (default, *tenants):
        for key in t.keys:
            if owners.setdefault(key, t.name) != t.name:
                s.fail("keys", f"tenants {owners[key]!r} and {t.name!r} share a key")
    cfg = AuthConfig(
        keys=tenants,
        classes=classes,
        default_tenant=default,
        aging_s=s.number("aging_s", d.aging_s),
    )
    s.reject_unknown()
    return cfg


def _class(s: Section) -> ClassConfig:
    cfg = ClassConfig(
        name=_name(s),
        floor_share=s.number(
            "floor_share", ClassConfig("").floor_share, maximum=1.0, exclusive_min=False
        ),
        # Null or absent: admission.queue_timeout_s.
        queue_timeout_s=s.opt_number("queue_timeout_s", exclusive_min=False),
    )
    s.reject_unknown()
    return cfg


def _tenant(s: Section, classes: list[str], *, default_name: str | None = None) -> TenantConfig:
    name = _name(s, default_name)
    keys = () if default_name is not None else read_keys(s, "key")
    class_name = s.text("class", classes[-1])
    if class_name not in classes and not s.reading.schema_mode:
        s.fail("class", f"unknown class {class_name!r}; classes: {', '.join(classes)}")
    lim = s.section("limits")
    limits = TenantLimits(
        prompt_tokens_per_minute=lim.opt_int("prompt_tokens_per_minute"),
        output_tokens_per_minute=lim.opt_int("output_tokens_per_minute"),
        requests_per_minute=lim.opt_int("requests_per_minute"),
        max_concurrent=lim.opt_int("max_concurrent"),
        max_kv_share=lim.opt_number("max_kv_share", maximum=1.0),
    )
    lim.reject_unknown()
    cfg = TenantConfig(
        name=name,
        keys=keys,
        class_name=class_name,
        weight=s.number("weight", TenantConfig("").weight),
        limits=limits,
    )
    s.reject_unknown()
    return cfg


def _name(s: Section, default: str | None = None) -> str:
    name = s.text("name", default)
    if name and not _NAME.match(name):
        s.fail("name", f"expected letters, digits, '_', '.' or '-' (at most 64), got {name!r}")
    return name


def _unique(s: Section, where: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name and name in seen:
            s.fail(where, f"name {name!r} is used twice")
        seen.add(name)


def read_keys(s: Section, name: str) -> tuple[str, ...]:
    """Keys from ``NAME``, ``NAME_file`` and ``NAME_env``; an empty or blank key is an
    error naming where it came from (it would otherwise open the gateway to everyone)."""
    found: list[tuple[str, str]] = [
        (s.where(name) + f"[{i}]", k) for i, k in enumerate(s.str_list(name))
    ]
    keys_file = s.opt_str(f"{name}_file")
    if keys_file:
        found.extend(read_keys_file(keys_file, s, f"{name}_file"))
    keys_env = s.opt_str(f"{name}_env")
    if keys_env:
        raw = os.environ.get(keys_env)
        if raw is None:
            s.fail(f"{name}_env", f"environment variable {keys_env} is not set")
        else:
            found.extend(
                (f"{s.where(name + '_env')} (${keys_env} item {i + 1})", k)
                for i, k in enumerate(raw.split(","))
            )
    for where, key in found:
        if not key.strip():
            s.reading.fail(where, "an empty API key would let any request in; remove it")
    return tuple(k.strip() for _, k in found if k.strip())


def key_file_line(line: str) -> str:
    """The key on one (stripped, not blank, not comment) line of a key file.

    A padded base64 key (canonical base64 of 16 characters or more ending in ``=`` or
    ``==``, as ``openssl rand -base64`` prints) is read whole. Otherwise ``NAME=key`` and
    ``export NAME=key`` lines (``NAME`` a variable name: letters, digits and ``_``, not
    starting with a digit) hold the key after the first ``=``, without one pair of
    surrounding quotes (``NAME="key"`` or ``NAME='key'``, as dotenv files have them); any
    other line is the key itself, ``=`` included. ``NAME=`` gives an empty key and
    ``NAME==`` the key ``=``, which the caller refuses."""
    if _is_padded_base64(line):
        return line
    env = _ENV_LINE.match(line)
    if env is None:
        return line
    value = env.group(1).strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return value


def _is_padded_base64(line: str) -> bool:
    if len(line) % 4 or not _PADDED_BASE64.match(line):
        return False
    try:
        return base64.b64encode(base64.b64decode(line, validate=True)).decode() == line
    except binascii.Error:
        return False


def read_keys_file(path: str, s: Section, key: str) -> list[tuple[str, str]]:
    """One key per line (blank lines and # comments ignored), or ``NAME=key`` lines like an
    env file of secrets (see :func:`key_file_line`). Returns (where, key) pairs."""
    where = s.where(key)
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        s.fail(key, f"cannot read {path!r}: {exc.strerror}")
        return []
    except UnicodeDecodeError:
        s.fail(key, f"{path!r} is not a text file (UTF-8)")
        return []
    keys = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        found = key_file_line(line)
        if found and not found.strip("="):
            s.reading.fail(
                f"{where} ({path} line {number})",
                f"{found!r} is not a key (a base64 key's padding left without the key?); fix it",
            )
            continue
        keys.append((f"{where} ({path} line {number})", found))
    return keys
