"""Reading the YAML into :mod:`kvgateway.config.model` objects.

:func:`load_config` raises :class:`~kvgateway.config.yamlread.ConfigError` naming the
YAML path of the first problem.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvgateway.config.model import (
    POLICIES,
    AdmissionConfig,
    BackendConfig,
    GatewayConfig,
    HealthConfig,
    LoadFeedbackConfig,
    ModelConfig,
    RoutingConfig,
    ServerConfig,
    TierConfig,
    TimeoutConfig,
)
from kvgateway.config.yamlread import ConfigError, Section
from kvgateway.tokens.chat_template import TemplateError
from kvgateway.tokens.encoding import PATTERNS, EncodingCache, EncodingSpec
from kvgateway.tokens.modeldir import TokenizerDirError
from kvgateway.tokens.spec import TokenizerConfig


def load_config(path: str, *, encodings: EncodingCache | None = None) -> GatewayConfig:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {path!r}: {exc.strerror}") from exc
    return parse_config_text(text, source=path, encodings=encodings)


def parse_config_text(
    text: str, *, source: str = "<memory>", encodings: EncodingCache | None = None
) -> GatewayConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("", f"{source}: invalid YAML{where}: {exc}") from exc
    return parse_config(data, source=source, encodings=encodings)


def parse_config(
    data: Any, *, source: str = "<memory>", encodings: EncodingCache | None = None
) -> GatewayConfig:
    """``encodings``: where model tokenizer directories are loaded (and kept across
    reloads: an unchanged directory is not loaded again); a fresh one if None."""
    encodings = encodings or EncodingCache()
    root = Section(data)
    server = _server(root.section("server"))
    models = tuple(_model(s, encodings) for s in root.sections("models", required=True))
    _check_unique([m.name for m in models] + [a for m in models for a in m.aliases], "models")
    admission = _admission(root.section("admission"))
    routing = _routing(root.section("routing"))
    health = _health(root.section("health"))
    feedback = _feedback(root.section("load_feedback"))
    default_timeouts = _timeouts(root.section("timeouts"), TimeoutConfig())
    known_models = {m.name: m for m in models}
    tiers = tuple(
        _tier(s, known_models, default_timeouts) for s in root.sections("tiers", required=True)
    )
    _check_unique([t.name for t in tiers], "tiers")
    _check_unique([b.name for t in tiers for b in t.backends], "tiers[].backends")
    root.reject_unknown(ignore=("simulation",))
    return GatewayConfig(
        server=server,
        models=models,
        admission=admission,
        routing=routing,
        health=health,
        load_feedback=feedback,
        tiers=tiers,
        source=source,
    )


def _check_unique(names: list[str], where: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(where, f"name {name!r} is used twice")
        seen.add(name)


def _server(s: Section) -> ServerConfig:
    keys = list(s.str_list("api_keys"))
    keys_file = s.opt_str("api_keys_file")
    keys_env = s.opt_str("api_keys_env")
    if keys_file:
        keys.extend(_read_keys_file(keys_file, s.where("api_keys_file")))
    if keys_env:
        keys.extend(k for k in os.environ.get(keys_env, "").split(",") if k.strip())
    cfg = ServerConfig(
        host=s.text("host", "127.0.0.1"),
        port=s.integer("port", 8080, minimum=0),
        api_keys=tuple(k.strip() for k in keys),
        access_log=s.flag("access_log", True),
        log_format=s.choice("log_format", ("text", "json"), "text"),
        shutdown_grace_s=s.number("shutdown_grace_s", 30.0),
        drain_delay_s=s.number("drain_delay_s", 0.0, exclusive_min=False),
    )
    s.reject_unknown()
    return cfg


def _read_keys_file(path: str, where: str) -> list[str]:
    """One key per line (blank lines and # comments ignored), like an env file of secrets."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError(where, f"cannot read {path!r}: {exc.strerror}") from exc
    keys = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keys.append(line.split("=", 1)[1].strip() if "=" in line else line)
    return keys


def _model(s: Section, encodings: EncodingCache) -> ModelConfig:
    name = s.text("name")
    tok = s.section("tokenizer")
    enc = EncodingSpec(
        name=tok.text("encoding", "cl100k_base"),
        file=tok.opt_str("file"),
        pattern=tok.text("pattern", "cl100k"),
    )
    if enc.file is not None and enc.pattern not in PATTERNS and len(enc.pattern) < 8:
        raise ConfigError(tok.where("pattern"), f"expected one of {', '.join(PATTERNS)} or a regex")
    tokenizer = TokenizerConfig(
        encoding=enc,
        per_message_tokens=tok.integer("per_message_tokens", 4, minimum=0),
        per_name_tokens=tok.integer("per_name_tokens", 1, minimum=0),
        reply_priming_tokens=tok.integer("reply_priming_tokens", 3, minimum=0),
        image_tokens=tok.integer("image_tokens", 765, minimum=0),
        estimate_margin=tok.number("estimate_margin", 0.0, maximum=1.0, exclusive_min=False),
        **_tokenizer_dir(tok, enc, encodings),
    )
    tok.reject_unknown()
    cfg = ModelConfig(
        name=name,
        served_name=s.text("served_name", name),
        aliases=s.str_list("aliases"),
        tokenizer=tokenizer,
    )
    s.reject_unknown()
    return cfg


def _tokenizer_dir(tok: Section, enc: EncodingSpec, encodings: EncodingCache) -> dict[str, Any]:
    """``path``: the model's tokenizer directory, loaded now so a bad one fails start-up."""
    path = tok.opt_str("path")
    if path is None:
        return {}
    pattern = enc.pattern if tok.has("pattern") else None
    try:
        model = encodings.model(path, pattern=pattern)
    except (TokenizerDirError, TemplateError) as exc:
        raise ConfigError(tok.where("path"), str(exc)) from exc
    return {"path": path, "model": model}


def _admission(s: Section) -> AdmissionConfig:
    cfg = AdmissionConfig(
        default_output_tokens=s.integer("default_output_tokens", 1024),
        budget_fraction=s.number("budget_fraction", 0.95, maximum=1.0),
        queue_timeout_s=s.number("queue_timeout_s", 10.0, exclusive_min=False),
        queue_size=s.integer("queue_size", 1024, minimum=0),
        max_body_bytes=s.integer("max_body_bytes", 32 * 1024 * 1024),
        inject_default_output=s.flag("inject_default_output", True),
    )
    s.reject_unknown()
    return cfg


def _routing(s: Section) -> RoutingConfig:
    cfg = RoutingConfig(
        policy=s.choice("policy", POLICIES, "kv_aware"),
        offload_overflow=s.flag("offload_overflow", False),
    )
    s.reject_unknown()
    return cfg


def _health(s: Section) -> HealthConfig:
    cfg = HealthConfig(
        interval_s=s.number("interval_s", 5.0),
        timeout_s=s.number("timeout_s", 2.0),
        unhealthy_threshold=s.integer("unhealthy_threshold", 2),
        healthy_threshold=s.integer("healthy_threshold", 1),
        eject_after_failures=s.integer("eject_after_failures", 3),
        rediscover_interval_s=s.number("rediscover_interval_s", 30.0),
    )
    s.reject_unknown()
    return cfg


def _feedback(s: Section) -> LoadFeedbackConfig:
    high = s.number("kv_high_watermark", 0.95, maximum=1.0)
    cfg = LoadFeedbackConfig(
        enabled=s.flag("enabled", True),
        interval_s=s.number("interval_s", 2.0),
        timeout_s=s.number("timeout_s", 2.0),
        kv_high_watermark=high,
        kv_low_watermark=s.number("kv_low_watermark", min(0.85, high), maximum=high),
        max_waiting=s.integer("max_waiting", 0, minimum=0),
        preemption_cooldown_s=s.number("preemption_cooldown_s", 5.0, exclusive_min=False),
        stale_after_s=s.number("stale_after_s", 15.0),
    )
    s.reject_unknown()
    return cfg


def _timeouts(s: Section, base: TimeoutConfig) -> TimeoutConfig:
    cfg = TimeoutConfig(
        connect_s=s.number("connect_s", base.connect_s),
        first_byte_s=s.number("first_byte_s", base.first_byte_s),
        idle_s=s.number("idle_s", base.idle_s),
        total_s=s.number("total_s", base.total_s),
    )
    s.reject_unknown()
    return cfg


def _tier(s: Section, models: Mapping[str, ModelConfig], timeouts: TimeoutConfig) -> TierConfig:
    name = s.text("name")
    offload = s.flag("offload", False)
    backends = tuple(
        _backend(b, name, offload, models, timeouts) for b in s.sections("backends", required=True)
    )
    s.reject_unknown()
    return TierConfig(name=name, offload=offload, backends=backends)


def _backend(
    s: Section,
    tier: str,
    offload: bool,
    models: Mapping[str, ModelConfig],
    timeouts: TimeoutConfig,
) -> BackendConfig:
    url = s.text("url").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(s.where("url"), f'expected an http(s) URL, got "{url}"')
    if parts.path not in ("", "/"):
        raise ConfigError(
            s.where("url"), "give the server root (e.g. http://host:8000), without /v1"
        )
    model_name = s.text("model")
    model = models.get(model_name)
    if model is None:
        raise ConfigError(
            s.where("model"), f'unknown model "{model_name}"; models: {", ".join(models)}'
        )
    cfg = BackendConfig(
        name=s.text("name"),
        url=url,
        model=model.name,
        tier=tier,
        offload=offload,
        served_model=s.text("served_model", model.served_name),
        max_model_len=s.opt_int("max_model_len"),
        max_num_seqs=s.opt_int("max_num_seqs"),
        kv_cache_tokens=s.opt_int("kv_cache_tokens"),
        capacity=s.mapping("capacity"),
        discover=s.flag("discover", True),
        timeouts=_timeouts(s.section("timeouts"), timeouts),
        path=s.path,
    )
    s.reject_unknown(ignore=("simulate",))
    return cfg
