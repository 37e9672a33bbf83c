"""Reading the YAML into :mod:`kvgateway.config.model` objects.

:func:`load_config` raises one :class:`~kvgateway.config.yamlread.ConfigError` listing
every problem in the file, each with its YAML path. :func:`config_schema` runs the same
readers over an empty document to describe the format as a JSON Schema.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from kvgateway.config.document import expand_env, read_document
from kvgateway.config.model import (
    POLICIES,
    AdmissionConfig,
    BackendConfig,
    DiscoveryConfig,
    DnsGroupConfig,
    GatewayConfig,
    HealthConfig,
    LedgerConfig,
    LoadFeedbackConfig,
    ModelConfig,
    Policy,
    RoutingConfig,
    ServerConfig,
    TierConfig,
    TimeoutConfig,
    TracingConfig,
)
from kvgateway.config.tenants import read_auth, read_keys
from kvgateway.config.yamlread import ConfigError, Reading, Section
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
    reading = Reading()
    data = read_document(text, source, reading)
    return _parse(Section(data, "", reading), source, encodings)


def parse_config(
    data: Any, *, source: str = "<memory>", encodings: EncodingCache | None = None
) -> GatewayConfig:
    """From already-parsed data (a dict); ``${VAR}`` references are expanded here too.

    ``encodings``: where model tokenizer directories are loaded (and kept across reloads:
    an unchanged directory is not loaded again); a fresh one if None."""
    reading = Reading()
    env = expand_env(data, "", reading, os.environ)
    return _parse(Section(env, "", reading), source, encodings)


def config_root_section() -> Section:
    """The root section after a schema-mode walk: it knows every key the loader reads."""
    root = Section(None, "", Reading(schema_mode=True))
    _parse(root, "<schema>", None)
    return root


def _parse(root: Section, source: str, encodings: EncodingCache | None) -> GatewayConfig:
    encodings = encodings or EncodingCache()
    server = _server(root.section("server"))
    models = tuple(_model(s, encodings) for s in root.sections("models", required=True))
    _check_unique(root, [m.name for m in models] + [a for m in models for a in m.aliases], "models")
    admission = _admission(root.section("admission"))
    routing = _routing(root.section("routing"))
    health = _health(root.section("health"))
    feedback = _feedback(root.section("load_feedback"))
    default_timeouts = _timeouts(root.section("timeouts"), TimeoutConfig())
    discovery = _discovery(root.section("discovery"))
    auth = read_auth(root.section("auth"), server.api_keys)
    ledger = _ledger(root.section("ledger"))
    tracing_section = root.section("tracing")
    tracing = TracingConfig(enabled=tracing_section.flag("enabled", TracingConfig().enabled))
    tracing_section.reject_unknown()
    known_models = {m.name: m for m in models}
    tiers = tuple(
        _tier(s, known_models, default_timeouts) for s in root.sections("tiers", required=True)
    )
    _check_unique(root, [t.name for t in tiers], "tiers")
    members = [b.name for t in tiers for b in (*t.backends, *(g.template for g in t.dns_groups))]
    _check_unique(root, members, "tiers[].backends")
    root.reject_unknown(ignore=("simulation",))
    if not root.reading.schema_mode:
        root.reading.raise_if_any()
    return GatewayConfig(
        server=server,
        models=models,
        admission=admission,
        routing=routing,
        health=health,
        load_feedback=feedback,
        tiers=tiers,
        discovery=discovery,
        auth=auth,
        ledger=ledger,
        tracing=tracing,
        source=source,
    )


def _check_unique(root: Section, names: list[str], where: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen and name:
            root.reading.fail(where, f"name {name!r} is used twice")
        seen.add(name)


def _server(s: Section) -> ServerConfig:
    keys = read_keys(s, "api_keys")
    admin_keys = read_keys(s, "admin_api_keys")
    d = ServerConfig()
    cfg = ServerConfig(
        host=s.text("host", d.host),
        port=s.integer("port", d.port, minimum=0),
        api_keys=keys,
        admin_api_keys=admin_keys,
        access_log=s.flag("access_log", d.access_log),
        log_format=s.choice("log_format", ("text", "json"), d.log_format),
        shutdown_grace_s=s.number("shutdown_grace_s", d.shutdown_grace_s),
        drain_delay_s=s.number("drain_delay_s", d.drain_delay_s, exclusive_min=False),
        keepalive_timeout_s=s.number("keepalive_timeout_s", d.keepalive_timeout_s),
        body_timeout_s=s.number("body_timeout_s", d.body_timeout_s),
    )
    s.reject_unknown()
    return cfg


def _model(s: Section, encodings: EncodingCache) -> ModelConfig:
    name = s.text("name")
    tok = s.section("tokenizer")
    enc = EncodingSpec(
        name=tok.text("encoding", "cl100k_base"),
        file=tok.opt_str("file"),
        pattern=tok.text("pattern", "cl100k"),
    )
    if enc.file is not None and enc.pattern not in PATTERNS and len(enc.pattern) < 8:
        tok.fail("pattern", f"expected one of {', '.join(PATTERNS)} or a regex")
    d = TokenizerConfig()
    tokenizer = TokenizerConfig(
        encoding=enc,
        per_message_tokens=tok.integer("per_message_tokens", d.per_message_tokens, minimum=0),
        per_name_tokens=tok.integer("per_name_tokens", d.per_name_tokens, minimum=0),
        reply_priming_tokens=tok.integer("reply_priming_tokens", d.reply_priming_tokens, minimum=0),
        image_tokens=tok.integer("image_tokens", d.image_tokens, minimum=0),
        estimate_margin=tok.number(
            "estimate_margin", d.estimate_margin, maximum=1.0, exclusive_min=False
        ),
        upper_bound=tok.flag("upper_bound", d.upper_bound),
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
        tok.fail("path", str(exc))
        return {}
    return {"path": path, "model": model}


def _admission(s: Section) -> AdmissionConfig:
    d = AdmissionConfig()
    cfg = AdmissionConfig(
        default_output_tokens=s.integer("default_output_tokens", d.default_output_tokens),
        budget_fraction=s.number("budget_fraction", d.budget_fraction, maximum=1.0),
        queue_timeout_s=s.number("queue_timeout_s", d.queue_timeout_s, exclusive_min=False),
        queue_size=s.integer("queue_size", d.queue_size, minimum=0),
        max_body_bytes=s.integer("max_body_bytes", d.max_body_bytes),
        abort_release_delay_s=s.number(
            "abort_release_delay_s", d.abort_release_delay_s, exclusive_min=False
        ),
        max_messages=s.integer("max_messages", d.max_messages),
        max_content_parts=s.integer("max_content_parts", d.max_content_parts),
        inject_default_output=s.flag("inject_default_output", d.inject_default_output),
        prefix_credit=s.flag("prefix_credit", d.prefix_credit),
        output_reservation=s.choice(
            "output_reservation", ("max_tokens", "learned"), d.output_reservation
        ),
        preemption_risk=s.number(
            "preemption_risk", d.preemption_risk, exclusive_min=False, maximum=0.5
        ),
    )
    s.reject_unknown()
    return cfg


def _routing(s: Section) -> RoutingConfig:
    d = RoutingConfig()
    cfg = RoutingConfig(
        policy=Policy(s.choice("policy", POLICIES, d.policy.value)),
        offload_overflow=s.flag("offload_overflow", d.offload_overflow),
        prefix_aware=s.flag("prefix_aware", d.prefix_aware),
    )
    s.reject_unknown()
    return cfg


def _health(s: Section) -> HealthConfig:
    d = HealthConfig()
    cfg = HealthConfig(
        interval_s=s.number("interval_s", d.interval_s),
        timeout_s=s.number("timeout_s", d.timeout_s),
        unhealthy_threshold=s.integer("unhealthy_threshold", d.unhealthy_threshold),
        healthy_threshold=s.integer("healthy_threshold", d.healthy_threshold),
        eject_after_failures=s.integer("eject_after_failures", d.eject_after_failures),
        rediscover_interval_s=s.number("rediscover_interval_s", d.rediscover_interval_s),
    )
    s.reject_unknown()
    return cfg


def _feedback(s: Section) -> LoadFeedbackConfig:
    d = LoadFeedbackConfig()
    high = s.number("kv_high_watermark", d.kv_high_watermark, maximum=1.0)
    cfg = LoadFeedbackConfig(
        enabled=s.flag("enabled", d.enabled),
        interval_s=s.number("interval_s", d.interval_s),
        timeout_s=s.number("timeout_s", d.timeout_s),
        kv_high_watermark=high,
        kv_low_watermark=s.number("kv_low_watermark", min(d.kv_low_watermark, high), maximum=high),
        max_waiting=s.integer("max_waiting", d.max_waiting, minimum=0),
        preemption_cooldown_s=s.number(
            "preemption_cooldown_s", d.preemption_cooldown_s, exclusive_min=False
        ),
        stale_after_s=s.number("stale_after_s", d.stale_after_s),
    )
    s.reject_unknown()
    return cfg


def _discovery(s: Section) -> DiscoveryConfig:
    cfg = DiscoveryConfig(
        nameservers=s.str_list("nameservers"),
        timeout_s=s.number("timeout_s", DiscoveryConfig().timeout_s),
    )
    s.reject_unknown()
    return cfg


def _ledger(s: Section) -> LedgerConfig:
    d = LedgerConfig()
    url = s.opt_str("url") or ""
    if url and not url.startswith(("redis://", "rediss://")):
        s.fail("url", f"expected a redis:// or rediss:// URL, got {url!r}")
    lease = s.number("lease_s", d.lease_s)
    timeout = s.number("timeout_s", d.timeout_s)
    if timeout * 3 > lease:
        s.fail("timeout_s", f"must be at most a third of lease_s ({lease:g}), got {timeout:g}")
    cfg = LedgerConfig(
        url=url,
        password_env=s.opt_str("password_env") or "",
        lease_s=lease,
        timeout_s=timeout,
        replica_id=s.opt_str("replica_id") or "",
        namespace=s.text("namespace", d.namespace),
        fallback_replicas=s.integer("fallback_replicas", d.fallback_replicas),
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
    backends: list[BackendConfig] = []
    groups: list[DnsGroupConfig] = []
    for b in s.sections("backends", required=True):
        kinds = list(b.one_of("url", "dns"))  # empty when neither is given (reported)
        for kind in kinds:
            if kind == "url":
                backends.append(_backend(b, name, offload, models, timeouts))
            else:
                groups.append(_dns_group(b, name, offload, models, timeouts))
        if kinds:
            b.reject_unknown(ignore=("simulate",))
    s.reject_unknown()
    return TierConfig(
        name=name, offload=offload, backends=tuple(backends), dns_groups=tuple(groups)
    )


def _backend(
    s: Section,
    tier: str,
    offload: bool,
    models: Mapping[str, ModelConfig],
    timeouts: TimeoutConfig,
) -> BackendConfig:
    url = s.text("url").rstrip("/")
    parts = urlsplit(url)
    if not url:
        pass  # already reported
    elif parts.scheme not in ("http", "https") or not parts.hostname:
        s.fail("url", f'expected an http(s) URL, got "{url}"')
    elif parts.path not in ("", "/"):
        s.fail("url", "give the server root (e.g. http://host:8000), without /v1")
    return _backend_settings(s, url, tier, offload, models, timeouts)


def _dns_group(
    s: Section,
    tier: str,
    offload: bool,
    models: Mapping[str, ModelConfig],
    timeouts: TimeoutConfig,
) -> DnsGroupConfig:
    """A backend entry with ``dns:`` instead of ``url:``: one member per resolved address."""
    dns = s.text("dns").rstrip(".")
    if dns and ("/" in dns or ":" in dns):
        s.fail("dns", f'expected a host name (give the port as `port:`), got "{dns}"')
    lookup = s.choice("lookup", ("address", "srv"), "address")
    if lookup == "srv" and s.has("port"):
        s.fail("port", "an SRV record carries each member's port: leave `port` out")
    port = s.integer("port", 8000)
    if port > 65535:
        s.fail("port", f"expected a TCP port (1-65535), got {port}")
    scheme = s.choice("scheme", ("http", "https"), "http")
    interval = s.number("resolve_interval_s", 10.0)
    template = _backend_settings(s, f"{scheme}://{dns}:{port}", tier, offload, models, timeouts)
    return DnsGroupConfig(
        name=template.name,
        dns=dns,
        port=port,
        scheme=scheme,
        resolve_interval_s=interval,
        template=template,
        lookup=lookup,
    )


def _backend_settings(
    s: Section,
    url: str,
    tier: str,
    offload: bool,
    models: Mapping[str, ModelConfig],
    timeouts: TimeoutConfig,
) -> BackendConfig:
    """What a static backend and a DNS group's members share."""
    model_name = s.text("model")
    model = models.get(model_name)
    if model is None and model_name and not s.reading.schema_mode:
        s.fail("model", f'unknown model "{model_name}"; models: {", ".join(models)}')
    served = model.served_name if model is not None else model_name
    return BackendConfig(
        name=s.text("name"),
        url=url,
        model=model.name if model is not None else model_name,
        tier=tier,
        offload=offload,
        served_model=s.opt_str("served_model") or served,
        max_model_len=s.opt_int("max_model_len"),
        max_num_seqs=s.opt_int("max_num_seqs"),
        kv_cache_tokens=s.opt_int("kv_cache_tokens"),
        capacity=s.mapping("capacity"),
        discover=s.flag("discover", True),
        timeouts=_timeouts(s.section("timeouts"), timeouts),
        num_speculative_tokens=s.integer("num_speculative_tokens", 0, minimum=0),
        release_delay_s=s.number("release_delay_s", 0.0, exclusive_min=False),
        path=s.path,
        kv_events=_kv_events(s),
    )


def _kv_events(s: Section) -> str | None:
    endpoint = s.opt_str("kv_events")
    if endpoint is None:
        return None
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or "*" in endpoint:
        s.fail("kv_events", f'expected tcp://HOST:PORT (the node\'s publisher), got "{endpoint}"')
        return None
    return endpoint
