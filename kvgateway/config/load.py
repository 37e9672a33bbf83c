"""Reading the YAML into :mod:`kvgateway.config.model` objects.

:func:`load_config` raises one :class:`~kvgateway.config.yamlread.ConfigError` listing
every problem in the file, each with its YAML path. :func:`config_schema` runs the same
readers over an empty document to describe the format as a JSON Schema.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.estimate import estimate
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.config.document import expand_env, read_document
from kvgateway.config.ledger import LedgerConfig, redis_url_problem
from kvgateway.config.model import (
    POLICIES,
    AdmissionConfig,
    DiscoveryConfig,
    GatewayConfig,
    HealthConfig,
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
from kvgateway.config.tiers import read_tier, read_timeouts
from kvgateway.config.yamlread import ConfigError, Reading, Section
from kvgateway.tokens.chat_template import TemplateError
from kvgateway.tokens.encoding import EncodingCache, EncodingError, spec_problem
from kvgateway.tokens.lookahead_free import PATTERNS
from kvgateway.tokens.modeldir import TokenizerDirError
from kvgateway.tokens.plans import EncodingSpec, TokenizerConfig


def load_config(path: str, *, encodings: EncodingCache | None = None) -> GatewayConfig:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {path!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "", f"config file {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc
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
    default_timeouts = read_timeouts(root.section("timeouts"), TimeoutConfig())
    discovery = _discovery(root.section("discovery"))
    auth = read_auth(root.section("auth"), server.api_keys)
    ledger = _ledger(root.section("ledger"))
    tracing_section = root.section("tracing")
    tracing = TracingConfig(enabled=tracing_section.flag("enabled", TracingConfig().enabled))
    tracing_section.reject_unknown()
    known_models = {m.name: m for m in models}
    tiers = tuple(
        read_tier(s, known_models, default_timeouts) for s in root.sections("tiers", required=True)
    )
    _check_unique(root, [t.name for t in tiers], "tiers")
    members = [b.name for t in tiers for b in (*t.backends, *(g.template for g in t.dns_groups))]
    _check_unique(root, members, "tiers[].backends")
    root.reject_unknown(ignore=("simulation",))
    if not root.reading.schema_mode:
        _check_capacity(root, tiers, source)
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


def _check_capacity(root: Section, tiers: tuple[TierConfig, ...], source: str) -> None:
    """Every backend's ``capacity:`` block is sized now, so its problems are reported
    with the file's others (the fleet derives the limits again from the same maths)."""
    base = Path(source).parent if source and not source.startswith("<") else None
    for tier in tiers:
        for b in (*tier.backends, *(g.template for g in tier.dns_groups)):
            if b.capacity is None:
                continue
            where = f"{b.path}.capacity"
            try:
                estimate(CapacitySpec.from_mapping(b.capacity, where, base_dir=base))
            except CapacityConfigError as exc:
                root.reading.errors.append(ConfigError("", str(exc)))
            except (ValueError, ArithmeticError) as exc:  # a size past what can be computed
                root.reading.errors.append(ConfigError(where, str(exc) or type(exc).__name__))


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
        port=s.integer("port", d.port, minimum=0, maximum=65535),
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
    elif (problem := spec_problem(enc)) is not None:
        tok.fail("file" if enc.file is not None else "encoding", problem)
    elif enc.file is not None:
        try:  # a file's contents and its pattern are only known by loading it
            encodings.get(enc)
        except EncodingError as exc:
            tok.fail("pattern" if tok.has("pattern") else "file", str(exc))
    d = TokenizerConfig()
    transformers = tok.integer("transformers", d.transformers, minimum=4, maximum=5)
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
        chat_template_kwargs=_template_defaults(tok),
        transformers=transformers,
        **_tokenizer_dir(tok, enc, encodings, transformers),
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


def _template_defaults(tok: Section) -> str:
    """``chat_template_kwargs``: what the nodes pass every chat template unless a request
    says otherwise (vLLM's ``--default-chat-template-kwargs``), as canonical JSON."""
    given = tok.mapping("chat_template_kwargs")
    if not given:
        return ""
    try:
        return json.dumps(dict(given), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        tok.fail("chat_template_kwargs", f"expected JSON values: {exc}")
        return ""


def _tokenizer_dir(
    tok: Section, enc: EncodingSpec, encodings: EncodingCache, transformers: int
) -> dict[str, Any]:
    """``path``: the model's tokenizer directory, loaded now so a bad one fails start-up,
    as the nodes' transformers (``transformers``: its major version) loads it."""
    path = tok.opt_str("path")
    if path is None:
        return {}
    pattern = enc.pattern if tok.has("pattern") else None
    try:
        model = encodings.model(path, pattern=pattern, transformers=transformers)
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
        context_overflow=s.choice("context_overflow", ("clamp", "reject"), d.context_overflow),
        node_stream_usage=s.flag("node_stream_usage", d.node_stream_usage),
        prefix_credit=s.flag("prefix_credit", d.prefix_credit),
        kv_projection=s.flag("kv_projection", d.kv_projection),
        output_reservation=s.choice(
            "output_reservation", ("max_tokens", "learned"), d.output_reservation
        ),
        preemption_risk=s.number(
            "preemption_risk", d.preemption_risk, exclusive_min=False, maximum=0.5
        ),
        clamp_risk=s.number("clamp_risk", d.clamp_risk, exclusive_min=False, maximum=0.5),
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
        kv_low_watermark=s.number(
            "kv_low_watermark", min(d.kv_low_watermark, high), maximum=high, fixed_maximum=False
        ),
        max_waiting=s.integer("max_waiting", d.max_waiting, minimum=0),
        preemption_cooldown_s=s.number(
            "preemption_cooldown_s", d.preemption_cooldown_s, exclusive_min=False
        ),
        stale_after_s=s.number("stale_after_s", d.stale_after_s),
    )
    s.reject_unknown()
    return cfg


def _discovery(s: Section) -> DiscoveryConfig:
    nameservers = s.str_list("nameservers")
    for i, server in enumerate(nameservers):
        if not _nameserver(server):
            s.fail(f"nameservers[{i}]", f"expected an IP address, :PORT optional, got {server!r}")
    cfg = DiscoveryConfig(
        nameservers=nameservers,
        timeout_s=s.number("timeout_s", DiscoveryConfig().timeout_s),
    )
    s.reject_unknown()
    return cfg


def _ledger(s: Section) -> LedgerConfig:
    d = LedgerConfig()
    url = s.opt_str("url") or ""
    problem = redis_url_problem(url) if url else None
    if problem is not None:
        s.fail("url", problem)
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
        credit_hold_s=s.number(
            "credit_hold_s",
            d.credit_hold_s,
            maximum=lease / 4,
            exclusive_min=False,
            fixed_maximum=False,
        ),
        credit_max_requests=s.integer("credit_max_requests", d.credit_max_requests),
    )
    s.reject_unknown()
    return cfg


def _nameserver(text: str) -> bool:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT``, as the resolver takes a nameserver."""
    host, port = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            return False
        port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return not port or (port.isdigit() and 1 <= int(port) <= 65535)
