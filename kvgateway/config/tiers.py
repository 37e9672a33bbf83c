"""Reading ``tiers[]``: each tier's backends, given by URL or by a DNS name, with their
timeouts and limits."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import SplitResult, urlsplit

from kvgateway.config.model import (
    BackendConfig,
    DnsGroupConfig,
    ModelConfig,
    TierConfig,
    TimeoutConfig,
)
from kvgateway.config.yamlread import Section


def read_timeouts(s: Section, base: TimeoutConfig) -> TimeoutConfig:
    cfg = TimeoutConfig(
        connect_s=s.number("connect_s", base.connect_s),
        first_byte_s=s.number("first_byte_s", base.first_byte_s),
        idle_s=s.number("idle_s", base.idle_s),
        total_s=s.number("total_s", base.total_s),
    )
    s.reject_unknown()
    return cfg


def read_tier(s: Section, models: Mapping[str, ModelConfig], timeouts: TimeoutConfig) -> TierConfig:
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


def _simulated_seqs(s: Section) -> int | None:
    """A simulated node's ``simulate.max_num_seqs``: the node runs with it (vLLM does
    not report its own), so the gateway knows its sequence slots as if configured."""
    sim = s.raw("simulate")
    seqs = sim.get("max_num_seqs") if isinstance(sim, Mapping) else None
    return seqs if isinstance(seqs, int) and not isinstance(seqs, bool) and seqs > 0 else None


def _backend(
    s: Section,
    tier: str,
    offload: bool,
    models: Mapping[str, ModelConfig],
    timeouts: TimeoutConfig,
) -> BackendConfig:
    name = s.raw("name")
    if isinstance(name, str) and "@" in name:
        # DNS groups name their members group@ip:port: a static name of that form could
        # be one of them (two backends under one name).
        s.fail("name", f'"@" is kept for DNS group members (group@ip:port), got "{name}"')
    url = s.text("url").rstrip("/")
    parts = _split(url)
    if not url:
        pass  # already reported
    elif parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        s.fail("url", f'expected an http(s) URL (http://host:port), got "{url}"')
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
    if template.kv_events_bind:
        # A node connects its publisher to one address: one gateway for one node.
        s.fail("kv_events_bind", "a dns group's members publish on their own addresses")
    for key in ("kv_events", "kv_events_replay"):
        endpoint = getattr(template, key)
        if endpoint is not None and urlsplit(endpoint).hostname != dns.lower():
            # One publisher for every member would credit each with the others' caches.
            s.fail(
                key,
                f"a dns group's members publish on their own addresses: give "
                f"tcp://{dns}:PORT (each member's address takes the name's place), got \"{endpoint}\"",
            )
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
    bind = s.flag("kv_events_bind", False)
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
        max_num_seqs=s.opt_int("max_num_seqs") or _simulated_seqs(s),
        kv_cache_tokens=s.opt_int("kv_cache_tokens"),
        capacity=s.mapping("capacity"),
        discover=s.flag("discover", True),
        timeouts=read_timeouts(s.section("timeouts"), timeouts),
        num_speculative_tokens=s.integer("num_speculative_tokens", 0, minimum=0),
        release_delay_s=s.number("release_delay_s", 0.0, exclusive_min=False),
        path=s.path,
        kv_events=_kv_events(s, "kv_events", bind=bind),
        kv_events_replay=_kv_events(s, "kv_events_replay"),
        kv_events_topic=s.opt_str("kv_events_topic") or "",
        kv_events_bind=bind,
    )


def _kv_events(s: Section, key: str, *, bind: bool = False) -> str | None:
    """An endpoint to connect to, or with ``bind`` one to bind (``*`` for every
    interface: the node connects to this gateway's address)."""
    endpoint = s.opt_str(key)
    if endpoint is None:
        if bind:
            s.fail("kv_events_bind", "needs kv_events: the address to bind")
        return None
    parts = _split(endpoint)
    port = parts.port if parts is not None else None
    if (
        parts is None
        or parts.scheme != "tcp"
        or not parts.hostname
        or port is None
        or ("*" in endpoint and not bind)
    ):
        what = "publisher" if key == "kv_events" else "replay socket"
        s.fail(key, f'expected tcp://HOST:PORT (the node\'s {what}), got "{endpoint}"')
        return None
    return endpoint


def _split(url: str) -> SplitResult | None:
    """``url``'s parts, None if it cannot be read (a bracket left open, a port that is
    not a number or past 65535)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # read lazily: a bad one raises here
    except ValueError:
        return None
    return parts
