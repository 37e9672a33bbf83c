"""The gateway's configuration: parsed once from YAML into frozen, typed objects.

Nothing downstream reads raw YAML. :func:`load_config` raises
:class:`~gateway.yamlread.ConfigError` naming the YAML path of the first problem.
The annotated reference is ``config/gateway.example.yaml``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.tokens.encoding import PATTERNS, EncodingSpec
from gateway.yamlread import ConfigError, Section

POLICIES = ("kv_aware", "round_robin", "least_loaded", "length_aware")


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    encoding: EncodingSpec = field(default_factory=EncodingSpec)
    # Chat-template overhead: tokens a template adds around each message, for a
    # message's `name`, and to prime the assistant's reply. Defaults follow OpenAI's
    # published accounting; Llama-3 templates add ~5 per message.
    per_message_tokens: int = 4
    per_name_tokens: int = 1
    reply_priming_tokens: int = 3
    # Cost charged per image content part (vision models tokenise images separately).
    image_tokens: int = 765
    # Prompts are scaled by (1 + margin) before admission: covers the gap between
    # tiktoken and the node's own tokenizer until usage reports correct it.
    estimate_margin: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    served_name: str
    aliases: tuple[str, ...]
    tokenizer: TokenizerConfig


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    default_output_tokens: int = 1024
    budget_fraction: float = 0.95
    queue_timeout_s: float = 10.0
    queue_size: int = 1024
    max_body_bytes: int = 32 * 1024 * 1024
    # A chat request without max_tokens may generate up to the rest of the context on
    # vLLM; the gateway caps it at the reserved default so the reservation holds.
    inject_default_output: bool = True


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: str = "kv_aware"
    # Send work that fits a GPU tier to the offload tier when every GPU tier is full
    # (instead of queueing). Off by default: offload nodes are slow.
    offload_overflow: bool = False


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    connect_s: float = 3.0
    first_byte_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 900.0


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    # Consecutive request failures that eject a backend until a probe succeeds.
    eject_after_failures: int = 3
    # Ask healthy nodes for their limits again this often (catches quick restarts).
    rediscover_interval_s: float = 30.0


@dataclass(frozen=True, slots=True)
class LoadFeedbackConfig:
    enabled: bool = True
    interval_s: float = 2.0
    timeout_s: float = 2.0
    # A node above this real KV usage gets no new work until it falls below
    # `kv_low_watermark` (hysteresis keeps it from flapping).
    kv_high_watermark: float = 0.95
    kv_low_watermark: float = 0.85
    # Waiting requests on the node (queued by someone else) that pause new work.
    max_waiting: int = 0
    # Seconds a node stays paused after it reports new preemptions.
    preemption_cooldown_s: float = 5.0
    # A scrape older than this is ignored (the gateway's own accounting still holds).
    stale_after_s: float = 15.0


@dataclass(frozen=True, slots=True)
class BackendConfig:
    name: str
    url: str
    model: str
    tier: str
    offload: bool
    served_model: str
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_tokens: int | None = None
    capacity: Mapping[str, Any] | None = None
    discover: bool = True
    timeouts: TimeoutConfig = TimeoutConfig()
    path: str = ""


@dataclass(frozen=True, slots=True)
class TierConfig:
    name: str
    offload: bool
    backends: tuple[BackendConfig, ...]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    access_log: bool = True
    log_format: str = "text"
    shutdown_grace_s: float = 30.0
    # Seconds /ready fails before the listener closes, so load balancers (a Kubernetes
    # Service) stop sending new connections first.
    drain_delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    server: ServerConfig
    models: tuple[ModelConfig, ...]
    admission: AdmissionConfig
    routing: RoutingConfig
    health: HealthConfig
    load_feedback: LoadFeedbackConfig
    tiers: tuple[TierConfig, ...]
    source: str = "<memory>"
    _model_index: dict[str, ModelConfig] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for model in self.models:
            for name in (model.name, *model.aliases):
                self._model_index[name] = model

    def resolve_model(self, name: str) -> ModelConfig | None:
        return self._model_index.get(name)

    @property
    def backends(self) -> tuple[BackendConfig, ...]:
        return tuple(b for t in self.tiers for b in t.backends)


def load_config(path: str) -> GatewayConfig:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {path!r}: {exc.strerror}") from exc
    return parse_config_text(text, source=path)


def parse_config_text(text: str, *, source: str = "<memory>") -> GatewayConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("", f"{source}: invalid YAML{where}: {exc}") from exc
    return parse_config(data, source=source)


def parse_config(data: Any, *, source: str = "<memory>") -> GatewayConfig:
    root = Section(data)
    server = _server(root.section("server"))
    models = tuple(_model(s) for s in root.sections("models", required=True))
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


def _model(s: Section) -> ModelConfig:
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
